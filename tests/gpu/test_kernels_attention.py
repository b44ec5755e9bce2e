"""GPU: paged decode attention and causal varlen prefill attention against float64 numpy.

Fresh random inputs per case, pages assigned at random (non-contiguous, with gaps), outputs and
the split workspace poisoned with NaN, and NaN planted wherever a kernel must not look: the cache
slots past each sequence's context in its last page, and a poison page that every unused
page-table entry points at. A kernel that reads past a context or past the valid page-table
entries turns the result NaN instead of crashing the context.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.kernel_refs import ref_paged_decode_attention, ref_prefill_attention
from tests.tolerances import TOL

BF16 = ml_dtypes.bfloat16
PAGE = 16
RTOL = TOL["attention"]["rtol_norm"]

# (nq, nkv, head_dim): GQA 1..4, head_dim 64 and 128, the supported models' shapes among them
SHAPES = [(4, 4, 128), (16, 8, 128), (9, 3, 64), (32, 8, 128), (8, 2, 64)]


def _shape_id(s: tuple[int, int, int]) -> str:
    return f"{s[0]}q{s[1]}kv_hd{s[2]}"


class PagedKV:
    """Random K/V caches for a batch of contexts, pages scattered through a larger pool."""

    def __init__(self, rng: np.random.Generator, ctx_lens: list[int], nkv: int, hd: int,
                 padding_rows: tuple[int, ...] = ()):
        n_pages = [-(-c // PAGE) for c in ctx_lens]
        need = sum(n for b, n in enumerate(n_pages) if b not in padding_rows)
        self.num_pages = need + need // 2 + 2  # page 0: padding page; last: poison page
        self.poison = self.num_pages - 1
        free = rng.permutation(np.arange(1, self.poison))
        self.stride = max(n_pages) + 3
        self.table = np.full((len(ctx_lens), self.stride), self.poison, np.int32)
        used = 0
        for b, n in enumerate(n_pages):
            if b in padding_rows:  # the engine's padding rows: context 1 on page 0
                assert ctx_lens[b] == 1
                self.table[b, 0] = 0
            else:
                self.table[b, :n] = free[used:used + n]
                used += n
        shape = (self.num_pages, nkv, PAGE, hd)
        self.k = rng.standard_normal(shape, np.float32).astype(BF16)
        self.v = rng.standard_normal(shape, np.float32).astype(BF16)
        for cache in (self.k, self.v):
            cache[self.poison] = np.nan
            for b, c in enumerate(ctx_lens):
                if c % PAGE:
                    cache[self.table[b, (c - 1) // PAGE], :, c % PAGE:] = np.nan
        self.ctx = np.asarray(ctx_lens, np.int32)


def _check(got: np.ndarray, want: np.ndarray, hd: int, what: str) -> None:
    got = got.astype(np.float32)
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite"
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    g = got.reshape(-1, hd)
    w = want.reshape(-1, hd)
    per_head = np.linalg.norm(g - w, axis=1) / np.maximum(np.linalg.norm(w, axis=1), 1e-6)
    worst = int(np.argmax(per_head))
    assert rel <= RTOL and per_head[worst] <= RTOL, (
        f"{what}: rel err {rel:.2e}, worst (row, head) vector #{worst} {per_head[worst]:.2e}")


# ---- decode --------------------------------------------------------------------------------

# (name, context lengths, num_splits, padding rows). Split j of a sequence covers pages
# [j * pps, (j + 1) * pps), pps = max(ceil(pages / splits), MIN_PAGES_PER_SPLIT = 8): short
# contexts leave most splits empty.
DECODE_CASES = [
    ("ctx1", [1], 1, ()),
    ("one_page", [16], 1, ()),
    ("ctx17", [17], 1, ()),
    ("b3_edges", [1, 16, 17], 1, ()),
    ("b3_padding_row", [33, 1, 250], 1, (1,)),
    ("b3_nonmult", [5, 47, 100], 1, ()),
    ("split2_ctx1", [1], 2, ()),
    ("split5_b4_edges", [1, 15, 16, 17], 5, ()),  # one or two pages: 3-4 of 5 splits empty
    ("split8_b1_ctx1024", [1024], 8, ()),  # qwen3-8b's batch-1 plan at context 1024
    ("split33_b1_ctx1024", [1024], 33, ()),  # max_model_len 40960's plan: 8 full, 25 empty
    ("split16_floor_b2", [200, 1000], 16, ()),  # 13 pages: 8 + 5; 63 pages: 7 x 8 + 7
    ("split7_mid_page", [4001], 7, ()),
    ("split5_empty_splits", [4133, 17, 1], 5, ()),
    ("split16_b3", [40, 3000, 16], 16, ()),
    ("split3_b3_padding_row", [33, 1, 250], 3, (1,)),
    ("long_split32", [9001], 32, ()),
    ("split64_max", [2100, 15, 1025], 64, ()),  # MAX_SPLITS: lanes own splits j and j + 32
    ("b64", None, 1, ()),
    ("b64_split3", None, 3, ()),
    ("b64_split8", None, 8, ()),
]


# the decode kernel's main loops (decode_attention.py): the CUDA-core one, and the tensor-core
# one at its default (4 warps, 2 pages a warp) and at the edges of its warps x stages space
DECODE_VARIANTS = [
    ("simt", {}),
    ("mma", {"mma": True}),
    ("mma_w2_s4", {"mma": True, "warps": 2, "num_stages": 4}),
    ("mma_w1_s1", {"mma": True, "warps": 1, "num_stages": 1}),
]


def _random_contexts(rng: np.random.Generator, batch: int) -> list[int]:
    """Random contexts in [1, 700), the page edges among them."""
    ctx = [int(c) for c in rng.integers(1, 700, batch)]
    ctx[:4] = [1, 15, 16, 17]
    return ctx


def _decode_problem(rng: np.random.Generator, shape: tuple[int, int, int], ctx_lens: list[int],
                    padding: tuple[int, ...] = ()):
    """(PagedKV, device inputs [q, k, v, page table, contexts], float64 reference, scale)."""
    from engine.cuda.driver import to_device

    nq, nkv, hd = shape
    kv = PagedKV(rng, ctx_lens, nkv, hd, padding)
    q = (2.0 * rng.standard_normal((len(ctx_lens), nq * hd))).astype(BF16)
    scale = hd ** -0.5
    want = ref_paged_decode_attention(q.astype(np.float32), kv.k.astype(np.float32),
                                      kv.v.astype(np.float32), kv.table, kv.ctx, scale)
    bufs = [to_device(a) for a in (q, kv.k, kv.v, kv.table, kv.ctx)]
    return kv, bufs, want, scale


def _counter_region(ws):
    """The workspace's split counters (its tail, decode_plan.split_counters_offset)."""
    from cutlass_kernels.decode_attention import split_counters_offset
    from engine.cuda.driver import DeviceBuffer

    off = split_counters_offset(ws.nbytes)
    return DeviceBuffer(ws.ptr + off, ws.nbytes - off, np.int32, ((ws.nbytes - off) // 4,))


def _workspace(batch: int, shape: tuple[int, int, int], num_splits: int, stream):
    """A split workspace as the executor keeps it: zero counters, the rest poisoned (NaN)."""
    from cutlass_kernels.decode_attention import decode_workspace_bytes
    from engine.cuda.driver import device_array

    if num_splits <= 1:
        return None
    ws = device_array(decode_workspace_bytes(batch, shape[0], shape[2], num_splits) // 4,
                      np.float32)
    ws.fill_bytes(0xFF, stream)
    _counter_region(ws).fill_bytes(0, stream)
    return ws


def _counters(ws, stream) -> np.ndarray:
    stream.synchronize()
    return _counter_region(ws).download()


def _decode_once(launcher, bufs, out, ws, batch, stride, num_splits, scale, stream) -> np.ndarray:
    """One launch into a poisoned output; its bits (uint16)."""
    out.fill_bytes(0xFF, stream)
    launcher(*bufs, out, ws, batch, stride, num_splits, scale, stream.handle)
    stream.synchronize()
    return out.download().view(np.uint16).copy()


@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=lambda v: v[0])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c[0])
def test_decode_attention_matches_reference(cuda_ctx, stream, shape, case, variant):
    """Against float64 numpy; then, with splits: every counter back at 0, a second launch on the
    same workspace gives the same bits, and so does the separate combine kernel (fused=False,
    the design the fused combine replaced: same fp32 merge, same order)."""
    from cutlass_kernels.decode_attention import compile_decode_attention
    from engine.cuda.driver import device_array

    nq, nkv, hd = shape
    name, ctx_lens, num_splits, padding = case
    rng = np.random.default_rng()
    if ctx_lens is None:
        ctx_lens = _random_contexts(rng, 64)
    batch = len(ctx_lens)
    kv, bufs, want, scale = _decode_problem(rng, shape, ctx_lens, padding)
    opts = variant[1]
    launcher = compile_decode_attention(nq, nkv, hd, **opts)
    out = device_array((batch, nq * hd), BF16)
    ws = _workspace(batch, shape, num_splits, stream)
    args = (batch, kv.stride, num_splits, scale, stream)
    first = _decode_once(launcher, bufs, out, ws, *args)
    what = f"decode {variant[0]} {name} splits={num_splits}"
    _check(first.view(BF16), want, hd, what)
    if ws is None:
        return
    assert not _counters(ws, stream).any(), f"{what}: split counters not reset"
    again = _decode_once(launcher, bufs, out, ws, *args)
    assert np.array_equal(first, again), f"{what}: second launch differs"
    separate = compile_decode_attention(nq, nkv, hd, fused=False, **opts)
    ws_sep = _workspace(batch, shape, num_splits, stream)
    old = _decode_once(separate, bufs, out, ws_sep, *args)
    diff = np.count_nonzero(first != old)
    assert diff == 0, f"{what}: {diff} outputs differ from the separate combine kernel"


# (shape, contexts, splits): one split, splits with empty ones, qwen3-8b's batch-1 plan
PDL_CASES = [((32, 8, 128), [1024], 16), ((16, 8, 128), None, 1),
             ((32, 8, 128), [1, 15, 16, 17, 300], 5), ((8, 2, 64), [40, 3000, 16], 3)]


@pytest.mark.parametrize("variant", DECODE_VARIANTS[:2], ids=lambda v: v[0])
@pytest.mark.parametrize("case", PDL_CASES, ids=lambda c: f"{c[0][0]}q{c[0][1]}kv_s{c[2]}")
def test_pdl_rope_then_decode_waits_for_their_inputs(cuda_ctx, stream, variant, case):
    """The engine's chain with programmatic dependent launch: a row gather writes qkv (NaN
    before it each round), the rope kernel (pdl) writes q and the new token's K / V into its
    slot (NaN at first), the decode attention (pdl) reads them. Both read their host-written
    inputs before ``griddepcontrol.wait``; the bits must equal the same chain without PDL on a
    second copy of the caches, four rounds with fresh qkv (a read of the last round's q or
    K / V differs), and be finite."""
    from cutlass_kernels.decode_attention import compile_decode_attention
    from cutlass_kernels.embedding import compile_embedding
    from cutlass_kernels.rope_kv import compile_rope_kv
    from engine.cuda.driver import device_array, to_device
    from tests.kernel_refs import ref_cos_sin

    shape, ctx_lens, splits = case
    nq, nkv, hd = shape
    rng = np.random.default_rng()
    if ctx_lens is None:
        ctx_lens = _random_contexts(rng, 64)
    batch, width, max_pos = len(ctx_lens), (nq + 2 * nkv) * hd, 4096
    kv = PagedKV(rng, ctx_lens, nkv, hd)
    ctx = kv.ctx
    pos = (ctx - 1).astype(np.int32)
    slots = (kv.table[np.arange(batch), pos // PAGE].astype(np.int64) * PAGE + pos % PAGE)
    for cache in (kv.k, kv.v):  # the new token's slot: the rope must write it first
        cache[slots // PAGE, :, slots % PAGE] = np.nan
    rows = 300
    table = (2.0 * rng.standard_normal((rows, width))).astype(BF16)
    qw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(BF16)
    kw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(BF16)
    common = [to_device(a) for a in (pos, slots, qw, kw, ref_cos_sin(max_pos, hd, 1e6))]
    dev_table, dev_pt, dev_ctx = to_device(table), to_device(kv.table), to_device(kv.ctx)
    gather = compile_embedding(width)
    chains = []
    for pdl in (True, False):
        chains.append(dict(
            rope=compile_rope_kv(nq, nkv, hd, PAGE, True, pdl=pdl),
            attn=compile_decode_attention(nq, nkv, hd, pdl=pdl, **variant[1]),
            qkv=device_array((batch, width), BF16), q=device_array((batch, nq * hd), BF16),
            k=to_device(kv.k), v=to_device(kv.v), out=device_array((batch, nq * hd), BF16),
            ws=_workspace(batch, shape, splits, stream)))
    scale = hd ** -0.5
    for rnd in range(4):
        ids = to_device(rng.integers(0, rows, batch).astype(np.int32))
        got = []
        for c in chains:
            c["qkv"].fill_bytes(0xFF, stream)
            c["q"].fill_bytes(0xFF, stream)
            c["out"].fill_bytes(0xFF, stream)
            gather(ids, dev_table, c["qkv"], rows, batch, stream)
            c["rope"](c["qkv"], *common[:2], *common[2:4], common[4], c["q"], c["k"], c["v"],
                      batch, max_pos, 1e-6, stream)
            c["attn"](c["q"], c["k"], c["v"], dev_pt, dev_ctx, c["out"], c["ws"], batch,
                      kv.stride, splits, scale, stream.handle)
            stream.synchronize()
            got.append(c["out"].download().view(np.uint16).copy())
        what = f"pdl chain {variant[0]} {shape} B={batch} splits={splits} round={rnd}"
        assert np.isfinite(got[0].view(BF16).astype(np.float32)).all(), f"{what}: non-finite"
        diff = np.count_nonzero(got[0] != got[1])
        assert diff == 0, f"{what}: {diff} outputs differ from the chain without PDL"


# (name, shape, qk_norm, contexts, splits, padding rows): page edges, one and many splits
# (empty ones too), the writer split in the middle of a warp's prologue, a padding row, GQA 1..4
# and head_dim 64
ROPE_CASES = [
    ("ctx1", (32, 8, 128), True, [1], 1, ()),
    ("b4_edges", (32, 8, 128), True, [15, 16, 17, 32], 1, ()),
    ("b1_ctx1024_s16", (32, 8, 128), True, [1024], 16, ()),
    ("b1_ctx1000_s8", (16, 8, 128), True, [1000], 8, ()),
    ("b3_s5_empty", (32, 8, 128), True, [4133, 17, 1], 5, ()),
    ("b3_padding", (16, 8, 128), True, [33, 1, 250], 3, (1,)),
    ("b64", (16, 8, 128), True, None, 1, ()),
    ("smollm_b5", (9, 3, 64), False, [1, 15, 16, 17, 300], 1, ()),
    ("gqa1_s4", (4, 4, 128), True, [700, 64], 4, ()),
    ("hd64_s33", (8, 2, 64), True, [3000], 33, ()),
]


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c[0])
def test_decode_rope_attention_equals_rope_then_decode(cuda_ctx, stream, case, pdl):
    """The decode attention with the rope / KV-write prologue against the two kernels it
    replaces (rope_kv, then the mma decode attention), from the same inputs on two copies of
    the caches: the output bits equal, the caches equal bit for bit afterwards (the new
    token's K / V written once, at its slot, by the split holding it; nothing else touched;
    no write for a padding row), the output finite (the new slots start as NaN, so a page
    loaded before its write shows). Then against float64 numpy from the separate kernels' q."""
    from cutlass_kernels.decode_attention import (
        compile_decode_attention,
        compile_decode_rope_attention,
    )
    from cutlass_kernels.rope_kv import compile_rope_kv
    from engine.cuda.driver import device_array, to_device
    from tests.kernel_refs import ref_cos_sin

    name, shape, qk, ctx_lens, splits, padding = case
    nq, nkv, hd = shape
    rng = np.random.default_rng()
    if ctx_lens is None:
        ctx_lens = _random_contexts(rng, 64)
    batch, width, max_pos = len(ctx_lens), (nq + 2 * nkv) * hd, 8192
    kv = PagedKV(rng, ctx_lens, nkv, hd, padding)
    pos = (kv.ctx - 1).astype(np.int32)
    slots = (kv.table[np.arange(batch), pos // PAGE].astype(np.int64) * PAGE + pos % PAGE)
    for b in padding:
        slots[b], pos[b] = -1, 0
    for cache in (kv.k, kv.v):
        live = slots[slots >= 0]
        cache[live // PAGE, :, live % PAGE] = np.nan
    qkv = (2.0 * rng.standard_normal((batch, width))).astype(BF16)
    qw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(BF16) if qk else None
    kw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(BF16) if qk else None
    d_qkv, d_pos, d_slots = to_device(qkv), to_device(pos), to_device(slots)
    d_qw, d_kw = (to_device(qw), to_device(kw)) if qk else (None, None)
    d_cs = to_device(ref_cos_sin(max_pos, hd, 1e6))
    d_pt, d_ctx = to_device(kv.table), to_device(kv.ctx)
    scale, eps = hd ** -0.5, 1e-6

    # the separate kernels
    k1, v1 = to_device(kv.k), to_device(kv.v)
    q1 = device_array((batch, nq * hd), BF16)
    out1 = device_array((batch, nq * hd), BF16)
    out1.fill_bytes(0xFF, stream)
    compile_rope_kv(nq, nkv, hd, PAGE, qk)(d_qkv, d_pos, d_slots, d_qw, d_kw, d_cs, q1, k1, v1,
                                          batch, max_pos, eps, stream)
    compile_decode_attention(nq, nkv, hd, mma=True)(
        q1, k1, v1, d_pt, d_ctx, out1, _workspace(batch, shape, splits, stream), batch,
        kv.stride, splits, scale, stream.handle)
    # the fused one, twice on the same workspace (the counters it leaves are the next start)
    fused = compile_decode_rope_attention(nq, nkv, hd, PAGE, qk, pdl=pdl)
    k2, v2 = to_device(kv.k), to_device(kv.v)
    out2 = device_array((batch, nq * hd), BF16)
    ws = _workspace(batch, shape, splits, stream)
    got = []
    for _ in range(2):
        out2.fill_bytes(0xFF, stream)
        fused(d_qkv, d_pos, d_slots, d_qw, d_kw, d_cs, k2, v2, d_pt, d_ctx, out2, ws, batch,
              kv.stride, splits, scale, max_pos, eps, stream.handle)
        stream.synchronize()
        got.append(out2.download().view(np.uint16).copy())
    want = out1.download().view(np.uint16)
    what = f"decode+rope {name} pdl={pdl}"
    assert np.isfinite(got[0].view(BF16).astype(np.float32)).all(), f"{what}: non-finite"
    for i, g in enumerate(got):
        diff = np.count_nonzero(g != want)
        assert diff == 0, f"{what}: launch {i}: {diff} outputs differ from rope_kv + decode"
    for nm, a, b in (("k", k1, k2), ("v", v1, v2)):
        x, y = a.download().view(np.uint16), b.download().view(np.uint16)
        assert np.array_equal(x, y), f"{what}: {nm} cache differs ({np.count_nonzero(x != y)})"
    if ws is not None:
        assert not _counters(ws, stream).any(), f"{what}: split counters not reset"
    q = q1.download().astype(np.float32)
    ref = ref_paged_decode_attention(q, k1.download().astype(np.float32),
                                     v1.download().astype(np.float32), kv.table, kv.ctx, scale)
    _check(got[0].view(BF16), ref, hd, what)


@pytest.mark.parametrize("variant", DECODE_VARIANTS[:2], ids=lambda v: v[0])
def test_decode_workspace_reused_across_plans(cuda_ctx, stream, variant):
    """One workspace, zeroed once, serves launches of other batch sizes and split counts in any
    order (the executor's buckets, mixed and verify steps): the counters sit where no launch
    writes partials, and each launch leaves them at 0."""
    from cutlass_kernels.decode_attention import compile_decode_attention, decode_workspace_bytes
    from engine.cuda.driver import device_array

    shape = (32, 8, 128)
    nq, nkv, hd = shape
    plans = [(1, 33), (8, 5), (64, 3), (1, 8), (3, 64), (128, 2), (8, 5), (1, 33)]
    need = max(decode_workspace_bytes(b, nq, hd, s) for b, s in plans)
    ws = device_array(need // 4, np.float32)
    ws.fill_bytes(0, stream)
    launcher = compile_decode_attention(nq, nkv, hd, **variant[1])
    rng = np.random.default_rng()
    for batch, splits in plans:
        kv, bufs, want, scale = _decode_problem(rng, shape, _random_contexts(rng, batch)
                                                if batch >= 4 else [1024, 17, 1][:batch])
        out = device_array((batch, nq * hd), BF16)
        got = _decode_once(launcher, bufs, out, ws, batch, kv.stride, splits, scale, stream)
        _check(got.view(BF16), want, hd, f"decode B={batch} splits={splits} (shared workspace)")
        assert not _counters(ws, stream).any(), f"B={batch} splits={splits}: counters not reset"


@pytest.mark.parametrize("variant", DECODE_VARIANTS[:2], ids=lambda v: v[0])
def test_decode_graph_replay_matches_eager(cuda_ctx, stream, variant):
    """A captured split launch replayed (the counters it leaves at 0 are the ones the next
    replay starts from) gives the eager launch's bits, whichever CTA finishes last."""
    from cutlass_kernels.decode_attention import compile_decode_attention
    from engine.cuda.driver import Graph, device_array

    shape = (32, 8, 128)
    nq, nkv, hd = shape
    launcher = compile_decode_attention(nq, nkv, hd, **variant[1])
    rng = np.random.default_rng()
    for ctx_lens, splits in (([1024], 8), ([1, 15, 16, 17, 300], 5), ([3000] * 3, 16)):
        batch = len(ctx_lens)
        kv, bufs, want, scale = _decode_problem(rng, shape, ctx_lens)
        out = device_array((batch, nq * hd), BF16)
        ws = _workspace(batch, shape, splits, stream)
        eager = _decode_once(launcher, bufs, out, ws, batch, kv.stride, splits, scale, stream)
        _check(eager.view(BF16), want, hd, f"decode eager B={batch} splits={splits}")
        call = (*bufs, out, ws, batch, kv.stride, splits, scale, stream.handle)
        graph = Graph.capture(stream, lambda call=call: launcher(*call))
        try:
            for rep in range(3):
                out.fill_bytes(0xFF, stream)
                graph.launch(stream)
                stream.synchronize()
                got = out.download().view(np.uint16)
                assert np.array_equal(got, eager), f"B={batch} splits={splits}: replay {rep}"
                assert not _counters(ws, stream).any(), f"replay {rep}: counters not reset"
        finally:
            graph.destroy()


# ---- prefill -------------------------------------------------------------------------------

# (name, new tokens per sequence, cached tokens before them per sequence)
PREFILL_CASES = [
    ("single_1", [1], [0]),
    ("single_100", [100], [0]),
    ("single_64", [64], [0]),
    ("mixed", [1, 5, 16, 17, 100, 600], [0, 0, 0, 0, 0, 0]),
    ("chunked", [64, 37, 130], [200, 500, 77]),
    ("prefix_cached", [50, 30, 1], [128, 35, 1000]),
    ("long_chunk", [700], [1500]),
]


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: c[0])
def test_prefill_attention_matches_reference(cuda_ctx, stream, shape, case):
    from cutlass_kernels.prefill_attention import compile_prefill_attention
    from engine.cuda.driver import device_array, to_device

    nq, nkv, hd = shape
    name, q_lens, cached = case
    rng = np.random.default_rng()
    ctx_lens = [n + c for n, c in zip(q_lens, cached, strict=True)]
    kv = PagedKV(rng, ctx_lens, nkv, hd)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total = int(cu[-1])
    q = (2.0 * rng.standard_normal((total, nq * hd))).astype(BF16)
    scale = hd ** -0.5
    want = ref_prefill_attention(q.astype(np.float32), kv.k.astype(np.float32),
                                 kv.v.astype(np.float32), cu, kv.ctx, kv.table, scale)

    launcher = compile_prefill_attention(nq, nkv, hd)
    out = device_array((total, nq * hd), BF16)
    out.fill_bytes(0xFF, stream)
    launcher(to_device(q), to_device(kv.k), to_device(kv.v), to_device(cu), to_device(kv.ctx),
             to_device(kv.table), out, total, len(q_lens), kv.stride, max(q_lens), scale,
             stream.handle)
    stream.synchronize()
    _check(out.download(), want, hd, f"prefill {name}")


# ---- timing (printed, not asserted) ---------------------------------------------------------


def _time_ms(stream, fn, *args, reps: int = 20) -> tuple[float, str]:
    """Device time per call: `reps` calls captured into one CUDA graph (as decode runs in the
    engine), replayed between events; eager launches (host-bound for small kernels) if the
    capture fails."""
    from cuda.bindings import driver as cu

    from engine.cuda.driver import Event, check

    fn(*args)  # warm up (loads the module) outside the capture
    stream.synchronize()
    start, end = Event(), Event()
    graph = exe = None
    try:
        check(cu.cuStreamBeginCapture(
            stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture")
        try:
            for _ in range(reps):
                fn(*args)
        finally:
            graph = check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
        exe = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        check(cu.cuGraphLaunch(exe, stream.handle), "cuGraphLaunch")
        start.record(stream)
        check(cu.cuGraphLaunch(exe, stream.handle), "cuGraphLaunch")
        end.record(stream)
        how = "graph"
    except Exception:  # timing is informational: fall back to eager launches
        stream.synchronize()
        start.record(stream)
        for _ in range(reps):
            fn(*args)
        end.record(stream)
        how = "eager"
    end.synchronize()
    if exe is not None:
        check(cu.cuGraphExecDestroy(exe), "cuGraphExecDestroy")
    if graph is not None:
        check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
    return start.elapsed_ms(end) / reps, how


def test_attention_timing(cuda_ctx, stream, capsys):
    from cutlass_kernels.decode_attention import (
        DEFAULT_STAGES,
        choose_num_splits,
        compile_decode_attention,
        decode_workspace_bytes,
    )
    from cutlass_kernels.prefill_attention import compile_prefill_attention
    from engine.cuda.driver import device_array, to_device

    nq, nkv, hd = 32, 8, 128  # Qwen3-8B attention
    scale = hd ** -0.5
    rng = np.random.default_rng(0)
    lines = []
    for batch in (1, 8, 64):
        ctx = 1024
        kv = PagedKV(rng, [ctx] * batch, nkv, hd)
        picked = choose_num_splits(batch, nkv, ctx, cuda_ctx.num_sms)
        q = to_device(rng.standard_normal((batch, nq * hd)).astype(BF16))
        args = [q, to_device(kv.k), to_device(kv.v), to_device(kv.table), to_device(kv.ctx)]
        out = device_array((batch, nq * hd), BF16)
        kv_bytes = 2 * batch * ctx * nkv * hd * 2
        # the plan's split count; at batch 1 also the neighbours and deeper rings (proposals:
        # more, shorter splits now that the combine costs no graph node; every page in flight)
        runs = [(picked, DEFAULT_STAGES, True), (picked, DEFAULT_STAGES, False)]
        if batch == 1:
            runs += [(s, st, True) for st in (DEFAULT_STAGES, 8) for s in (4, 8, 16, 32)
                     if (s, st) != (picked, DEFAULT_STAGES)]
        for splits, stages, fused in runs:
            if splits == 1 and not fused:
                continue
            kern = compile_decode_attention(nq, nkv, hd, num_stages=stages, fused=fused)
            ws = device_array(max(1, decode_workspace_bytes(batch, nq, hd, splits) // 4),
                              np.float32)
            ws.fill_bytes(0, stream)  # the split counters start at zero
            ms, how = _time_ms(stream, kern, *args, out, ws, batch, kv.stride, splits, scale,
                               stream.handle)
            tag = "fused" if fused else "separate combine"
            tag += " (plan)" if splits == picked and stages == DEFAULT_STAGES else ""
            lines.append(f"decode B={batch:3d} ctx={ctx} splits={splits:2d} stages={stages:2d} "
                         f"{tag:23s}: {ms * 1e3:8.1f} us "
                         f"(KV {kv_bytes / ms / 1e6:7.1f} GB/s, {how})")
    total = 2048
    kv = PagedKV(rng, [total], nkv, hd)
    pre = compile_prefill_attention(nq, nkv, hd)
    cu = to_device(np.array([0, total], np.int32))
    q = to_device(rng.standard_normal((total, nq * hd)).astype(BF16))
    out = device_array((total, nq * hd), BF16)
    args = [q, to_device(kv.k), to_device(kv.v), cu, to_device(kv.ctx), to_device(kv.table)]
    ms, how = _time_ms(stream, pre, *args, out, total, 1, kv.stride, total, scale,
                       stream.handle)
    flops = 4 * nq * hd * total * (total + 1) / 2  # causal QK^T + PV
    lines.append(f"prefill T={total} causal: {ms:.3f} ms ({flops / ms / 1e9:.1f} TFLOP/s, "
                 f"{how})")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
