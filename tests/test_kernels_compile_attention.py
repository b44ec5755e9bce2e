"""Attention kernels compile for sm_90a on a CPU-only machine; the numpy references are right.

The GPU comparison lives in tests/gpu/test_kernels_attention.py. Here: every supported model's
attention shape (Qwen3 16/8 and 32/8 heads at head_dim 128, SmolLM2 9/3 at 64) and the GPU test's
extra shapes compile, the launch helpers behave, and the references in tests/kernel_refs.py agree
with a naive per-token loop.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tests.kernel_refs import ref_paged_decode_attention, ref_prefill_attention

# (nq, nkv, head_dim): model shapes first, then the GPU test's GQA / head_dim coverage
MODEL_SHAPES = [(16, 8, 128), (32, 8, 128), (9, 3, 64)]
TEST_SHAPES = [(4, 4, 128), (8, 2, 64)]


@pytest.mark.parametrize("shape", MODEL_SHAPES + TEST_SHAPES)
def test_decode_attention_compiles(shape):
    from cutlass_kernels.decode_attention import compile_decode_attention

    launcher = compile_decode_attention(*shape)
    assert launcher._single is not None and launcher._split is not None
    assert compile_decode_attention(*shape) is launcher  # cached on the compile-time key


@pytest.mark.parametrize("shape", MODEL_SHAPES + TEST_SHAPES)
@pytest.mark.parametrize("warps, stages", [(4, 2), (2, 4), (1, 1)])
def test_decode_attention_mma_compiles(shape, warps, stages):
    from cutlass_kernels.decode_attention import compile_decode_attention

    launcher = compile_decode_attention(*shape, mma=True, warps=warps, num_stages=stages)
    assert launcher._single is not None and launcher._split is not None
    assert compile_decode_attention(*shape, mma=True, warps=warps,
                                    num_stages=stages) is launcher
    assert compile_decode_attention(*shape) is not launcher  # its own cache key


@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)])
def test_decode_attention_mma_ptx(tmp_path, monkeypatch, shape):
    """The tensor-core loop: mma.sync and ldmatrix (plain and .trans), cp.async, nothing
    spilled; per page hd / 16 * 2 mma for S = Q K^T and hd / 16 for O^T = V^T P^T."""
    ptx = _decode_ptx(tmp_path, monkeypatch, shape, fused=True, mma=True)
    hd = shape[2]
    assert ".target sm_90a" in ptx and ptx.count(".entry ") == 1
    assert ptx.count("mma.sync.aligned.m16n8k16") == hd // 16 * 3
    assert "ldmatrix.sync.aligned" in ptx and ".trans" in ptx
    assert "cp.async.cg.shared.global" in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx)


@pytest.mark.parametrize("mma", [False, True])
def test_decode_attention_pdl_ptx(tmp_path, monkeypatch, mma):
    """pdl=True: the kernel lets its successor launch first thing, reads the context length and
    page indices (host uploads) before griddepcontrol.wait, and issues no cp.async (q, K / V)
    before it; pdl=False has neither instruction."""
    ptx = _decode_ptx(tmp_path, monkeypatch, (32, 8, 128), fused=True, mma=mma, pdl=True)
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    assert "ld.global" in ptx[:wait] and "cp.async" not in ptx[:wait]
    plain = _decode_ptx(tmp_path, monkeypatch, (32, 8, 128), fused=True, mma=mma)
    assert "griddepcontrol.wait" not in plain


@pytest.mark.parametrize("shape, qk_norm", [((16, 8, 128), True), ((32, 8, 128), True),
                                            ((9, 3, 64), False), ((4, 4, 128), True),
                                            ((8, 2, 64), True)])
def test_decode_rope_attention_compiles(shape, qk_norm):
    from cutlass_kernels.decode_attention import compile_decode_rope_attention

    launcher = compile_decode_rope_attention(*shape, 16, qk_norm)
    assert launcher._single is not None and launcher._split is not None
    assert compile_decode_rope_attention(*shape, 16, qk_norm) is launcher
    assert compile_decode_rope_attention(*shape, 16, qk_norm, pdl=True) is not launcher


def test_decode_rope_attention_refuses_what_it_cannot_do():
    from cutlass_kernels.decode_attention import DecodeAttention, DecodeRopeAttention

    with pytest.raises(ValueError, match="rope needs the mma loop"):
        DecodeAttention(32, 8, 128, rope=True)  # the CUDA-core loop
    with pytest.raises(ValueError, match="rope needs the mma loop"):
        DecodeRopeAttention(32, 8, 128, warps=1)  # 32 lanes < (4 + 2) * 8
    DecodeRopeAttention(32, 8, 128, warps=2)  # 64 >= 48


@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64)])
def test_decode_rope_attention_ptx(tmp_path, monkeypatch, shape):
    """The rope prologue under PDL: the positions / slots / cos-sin / norm weights / page
    indices and the non-writer warps' first pages before griddepcontrol.wait, every global
    store (the new K / V, the partials, the output) after it; mma loop intact, no spills."""
    import cutlass
    import cutlass.cute as cute

    from cutlass_kernels.decode_attention import ROPE_SIGNATURE, DecodeRopeAttention

    monkeypatch.setattr(cutlass.base_dsl.BaseDSL._get_dsl().envar, "dump_dir", str(tmp_path))
    op = DecodeRopeAttention(*shape, split=True, pdl=True, qk_norm=shape[2] == 128)
    ptx = cute.compile(op, *ROPE_SIGNATURE.fake_args(), options="--keep-ptx").__ptx__
    hd = shape[2]
    assert ptx.count(".entry ") == 1 and ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait] and "cp.async.cg.shared.global" in ptx[:wait]
    assert "st.global" not in ptx[:wait] and "st.global.v4" in ptx[wait:]
    assert ptx.count("mma.sync.aligned.m16n8k16") == hd // 16 * 3
    assert not re.search(r"\b(ld|st)\.local", ptx)


def _decode_ptx(tmp_path, monkeypatch, shape, fused: bool, **opts) -> str:
    import cutlass
    import cutlass.cute as cute

    from cutlass_kernels.decode_attention import SIGNATURE, DecodeAttention

    # --keep-ptx writes into the DSL's dump dir: point it at tmp_path
    monkeypatch.setattr(cutlass.base_dsl.BaseDSL._get_dsl().envar, "dump_dir", str(tmp_path))
    op = DecodeAttention(*shape, split=True, fused=fused, **opts)
    return cute.compile(op, *SIGNATURE.fake_args(), options="--keep-ptx").__ptx__


# qwen3-0.6b, qwen3-8b, a head_dim 64 shape (GQA 3); the split count is a runtime argument
@pytest.mark.parametrize("shape", [(16, 8, 128), (32, 8, 128), (9, 3, 64)])
def test_fused_split_decode_is_one_kernel(tmp_path, monkeypatch, shape):
    """The split-KV variant is one kernel (one graph node): partials, a release fence, an
    acq_rel counter increment, the last CTA's acquire fence and merge (vector loads of the
    partials), the counter reset; nothing spilled."""
    ptx = _decode_ptx(tmp_path, monkeypatch, shape, fused=True)
    assert ".target sm_90a" in ptx
    assert ptx.count(".entry ") == 1
    assert len(re.findall(r"atom\.global\.acq_rel(\.gpu)?\.add\.u32", ptx)) == 1
    assert ptx.count("fence.acq_rel.gpu") == 2  # release before the count, acquire after
    assert "ld.global.v4.b32" in ptx  # the merge reads 16-byte vectors of partials
    assert "st.global.b32" in ptx  # the counter reset
    assert not re.search(r"\b(ld|st)\.local", ptx)
    separate = _decode_ptx(tmp_path, monkeypatch, shape, fused=False)
    assert separate.count(".entry ") == 2 and "atom.global" not in separate


@pytest.mark.parametrize("shape", MODEL_SHAPES + TEST_SHAPES)
def test_prefill_attention_compiles(shape):
    from cutlass_kernels.prefill_attention import compile_prefill_attention

    launcher = compile_prefill_attention(*shape)
    assert compile_prefill_attention(*shape) is launcher


def test_decode_helpers():
    from cutlass_kernels.decode_attention import (
        MAX_SPLITS,
        choose_num_splits,
        decode_workspace_bytes,
    )

    assert decode_workspace_bytes(4, 32, 128, 1) == 0
    partials = 4 * 4 * 32 * 3 * 130  # fp32 o and (m, l), then room for the counters
    assert decode_workspace_bytes(4, 32, 128, 3) == -(-(partials * 129 // 128 + 256) // 128) * 128
    for splits in range(2, MAX_SPLITS + 1):
        assert decode_workspace_bytes(1, 16, 64, splits) % 128 == 0
    for batch in (1, 2, 8, 64, 256):
        for ctx in (1, 16, 100, 1024, 4096, 40960):
            s = choose_num_splits(batch, 8, ctx)
            assert 1 <= s <= MAX_SPLITS
            assert s == 1 or -(-ctx // 16) >= 8 * s  # no split shorter than 8 pages
    # about 2 CTAs per SM (measured on the H200, docs/perf.md)
    assert choose_num_splits(256, 8, 4096) == 1  # 2048 CTAs fill the GPU
    assert choose_num_splits(128, 8, 1024) == 2  # 1024 CTAs: two splits measured faster
    assert choose_num_splits(64, 8, 1024) == 1  # 512 CTAs: one split was fastest
    assert choose_num_splits(128, 8, 1024, mma=True) == 1  # the mma loop: one split
    assert choose_num_splits(8, 8, 1024) == 5  # 64 CTAs: 4-5 splits, not 8
    assert choose_num_splits(1, 8, 40960) == 33
    assert choose_num_splits(1, 8, 1024) == 8  # capped at 8 pages per split
    assert choose_num_splits(1, 8, 100) == 1


def test_launchers_reject_bad_arguments():
    from cutlass_kernels._common import KernelArgError
    from cutlass_kernels.decode_attention import (
        MAX_SPLITS,
        compile_decode_attention,
        decode_workspace_bytes,
    )
    from cutlass_kernels.prefill_attention import compile_prefill_attention

    dec = compile_decode_attention(16, 8, 128)
    with pytest.raises(KernelArgError):  # split launch without a workspace
        dec(16, 16, 16, 16, 16, 16, None, 1, 4, 2, 0.1, None)

    class Buf:  # a device buffer's interface, never launched on
        def __init__(self, nbytes):
            self.ptr, self.nbytes = 16, nbytes

    for splits in range(2, MAX_SPLITS + 1):  # a workspace one word short of the plan
        with pytest.raises(KernelArgError, match="workspace"):
            dec(16, 16, 16, 16, 16, 16, Buf(decode_workspace_bytes(3, 16, 128, splits) - 4), 3,
                4, splits, 0.1, None)
    with pytest.raises(KernelArgError, match="workspace buffer"):  # an address: size unknown
        dec(16, 16, 16, 16, 16, 16, 1 << 20, 1, 4, 2, 0.1, None)
    with pytest.raises(KernelArgError, match="at most"):
        dec(16, 16, 16, 16, 16, 16, Buf(1 << 30), 1, 4, MAX_SPLITS + 1, 0.1, None)
    with pytest.raises(KernelArgError):  # misaligned pointer
        dec(18, 16, 16, 16, 16, 16, None, 1, 4, 1, 0.1, None)
    with pytest.raises(KernelArgError):
        dec(16, 16, 16, 16, 16, 16, None, 0, 4, 1, 0.1, None)
    pre = compile_prefill_attention(16, 8, 128)
    with pytest.raises(KernelArgError):
        pre(16, 16, 16, 16, 16, 16, 16, 4, 1, 4, 0, 0.1, None)


def test_split_counters_never_overlap_partials():
    """One workspace serves launches of any batch and split count (the executor's buckets,
    mixed and verify steps): sized for the largest, its counters (at a place fixed by its size)
    lie past every launch's partials, and each launch's B * nkv counters fit."""
    from cutlass_kernels.decode_plan import (
        MAX_SPLITS,
        decode_workspace_bytes,
        split_counters_offset,
    )

    rng = np.random.default_rng(0)
    for _ in range(20000):
        nq = int(rng.choice([1, 3, 8, 9, 16, 32, 64]))
        nkv = int(rng.choice([d for d in range(1, nq + 1) if nq % d == 0]))
        hd = int(rng.choice([64, 128]))
        plans = [(int(rng.integers(1, 4097)), int(rng.integers(2, MAX_SPLITS + 1)))
                 for _ in range(int(rng.integers(1, 5)))]
        nbytes = max(decode_workspace_bytes(b, nq, hd, s) for b, s in plans)
        nbytes += 4 * int(rng.integers(0, 3))  # a larger buffer works too
        off = split_counters_offset(nbytes)
        assert off % 128 == 0
        for b, s in plans:
            assert 4 * b * nq * s * (hd + 2) <= off  # partials end before the counters
            assert off + 4 * b * nkv <= nbytes  # the launch's counters fit


# ---- references against a naive per-token loop ------------------------------------------------


def _naive_one(q_vec, k_cache, v_cache, pages, kvh, n_attend, scale):
    ps = k_cache.shape[2]
    scores, values = [], []
    for t in range(n_attend):
        page, off = int(pages[t // ps]), t % ps
        scores.append(float(np.dot(q_vec, k_cache[page, kvh, off])) * scale)
        values.append(v_cache[page, kvh, off].astype(np.float64))
    m = max(scores)
    w = [math.exp(s - m) for s in scores]
    return sum(wi * vi for wi, vi in zip(w, values, strict=True)) / sum(w)


def _random_cache(rng, num_pages, nkv, hd):
    k = rng.standard_normal((num_pages, nkv, 16, hd)).astype(np.float32)
    v = rng.standard_normal((num_pages, nkv, 16, hd)).astype(np.float32)
    return k, v


def test_ref_decode_matches_naive_loop():
    rng = np.random.default_rng(0)
    nq, nkv, hd = 6, 2, 8
    ctx = np.array([1, 16, 17, 40], np.int32)
    k, v = _random_cache(rng, 12, nkv, hd)
    pt = np.zeros((4, 5), np.int32)
    perm = rng.permutation(np.arange(1, 12))
    used = 0
    for b, c in enumerate(ctx):
        n = -(-int(c) // 16)
        pt[b, :n] = perm[used:used + n]
        used += n
    q = rng.standard_normal((4, nq * hd)).astype(np.float32)
    got = ref_paged_decode_attention(q, k, v, pt, ctx, 0.3)
    for b in range(4):
        for h in range(nq):
            want = _naive_one(q[b, h * hd:(h + 1) * hd].astype(np.float64), k, v, pt[b],
                              h // (nq // nkv), int(ctx[b]), 0.3)
            np.testing.assert_allclose(got[b, h * hd:(h + 1) * hd], want, rtol=1e-5, atol=1e-6)


def test_ref_prefill_matches_naive_loop():
    rng = np.random.default_rng(1)
    nq, nkv, hd = 4, 4, 8
    q_lens = [1, 5, 17, 3]
    ctx = np.array([1, 5, 30, 20], np.int32)  # 3rd: chunked (13 earlier tokens), 4th: prefix
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k, v = _random_cache(rng, 10, nkv, hd)
    pt = np.array([[3, 0], [7, 0], [1, 9], [2, 5]], np.int32)
    q = rng.standard_normal((cu[-1], nq * hd)).astype(np.float32)
    got = ref_prefill_attention(q, k, v, cu, ctx, pt, 0.25)
    for b in range(4):
        for i in range(q_lens[b]):
            t = int(cu[b]) + i
            n_attend = int(ctx[b]) - q_lens[b] + i + 1
            for h in range(nq):
                want = _naive_one(q[t, h * hd:(h + 1) * hd].astype(np.float64), k, v, pt[b],
                                  h // (nq // nkv), n_attend, 0.25)
                np.testing.assert_allclose(got[t, h * hd:(h + 1) * hd], want, rtol=1e-5,
                                           atol=1e-6)


@pytest.mark.parametrize("value, want", [
    (None, {"mma": True}), ("mma", {"mma": True}), ("simt", {}), (" MMA:2x4 ", {
        "mma": True, "warps": 2, "num_stages": 4})])
def test_decode_attention_env_options(monkeypatch, value, want):
    from engine import envs

    if value is None:
        monkeypatch.delenv("CUTEINFER_DECODE_ATTN", raising=False)
    else:
        monkeypatch.setenv("CUTEINFER_DECODE_ATTN", value)
    assert envs.decode_attention_options() == want


@pytest.mark.parametrize("value", ["tc", "mma:4", "mma:ax2", "simt:4"])
def test_decode_attention_env_rejects(monkeypatch, value):
    from engine import envs

    monkeypatch.setenv("CUTEINFER_DECODE_ATTN", value)
    with pytest.raises(ValueError, match="CUTEINFER_DECODE_ATTN"):
        envs.decode_attention_options()


@pytest.mark.parametrize("value, gemm, attention", [
    (None, True, True), ("1", True, True), ("on", True, True), ("gemm", True, False),
    ("0", False, False), ("off", False, False)])
def test_pdl_env(monkeypatch, value, gemm, attention):
    """CUTEINFER_PDL: 1 (default, v23) the GEMMs, rope and decode attention; gemm: the GEMMs
    only (v22's configuration); 0: none."""
    from engine import envs

    if value is None:
        monkeypatch.delenv("CUTEINFER_PDL", raising=False)
    else:
        monkeypatch.setenv("CUTEINFER_PDL", value)
    assert (envs.pdl_enabled(), envs.pdl_attention()) == (gemm, attention)


def test_pdl_env_rejects(monkeypatch):
    from engine import envs

    monkeypatch.setenv("CUTEINFER_PDL", "rope")
    with pytest.raises(ValueError, match="CUTEINFER_PDL"):
        envs.pdl_attention()


def test_cuda_sched_env(monkeypatch):
    """CUTEINFER_CUDA_SCHED: auto by default; spin / yield / blocking (any case); anything else
    is refused naming the variable and the values it takes."""
    from engine import envs

    monkeypatch.delenv("CUTEINFER_CUDA_SCHED", raising=False)
    assert envs.cuda_sched() == "auto"
    for v in ("spin", "yield", "blocking", "auto"):
        monkeypatch.setenv("CUTEINFER_CUDA_SCHED", f" {v.upper()} ")
        assert envs.cuda_sched() == v
    monkeypatch.setenv("CUTEINFER_CUDA_SCHED", "sleep")
    with pytest.raises(ValueError, match="CUTEINFER_CUDA_SCHED must be one of auto, spin"):
        envs.cuda_sched()


def test_fuse_rope_env(monkeypatch):
    """CUTEINFER_FUSE_ROPE: on by default (v23); 0 turns it off; anything else is refused
    naming the variable."""
    from engine import envs

    monkeypatch.delenv("CUTEINFER_FUSE_ROPE", raising=False)
    assert envs.fuse_rope() is True
    monkeypatch.setenv("CUTEINFER_FUSE_ROPE", "0")
    assert envs.fuse_rope() is False
    monkeypatch.setenv("CUTEINFER_FUSE_ROPE", "1")
    assert envs.fuse_rope() is True
    monkeypatch.setenv("CUTEINFER_FUSE_ROPE", "yes")
    with pytest.raises(ValueError, match="CUTEINFER_FUSE_ROPE"):
        envs.fuse_rope()
