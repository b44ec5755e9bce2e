"""GPU: embedding, RMSNorm, q/k-norm+RoPE+KV write, SiLU-mul, sampler and logprobs kernels against
the numpy references (tests/kernel_refs.py, engine/sampling.py).

Fresh random inputs per case (the seed is in every failure message); outputs poisoned with 0xFF
bytes (NaN for bf16/f32, -1 for ints), so an element a kernel should write and did not shows up;
bytes a kernel must not write (KV slots of other tokens and of slot < 0, top-n columns past n)
must come back unchanged.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.kernel_refs import (
    ref_cos_sin,
    ref_embedding,
    ref_embedding_from_samples,
    ref_filter_margin,
    ref_gumbel_margin,
    ref_place_tokens,
    ref_rmsnorm,
    ref_rope_kv,
    ref_scale_cols,
    ref_silu_mul,
)
from tests.tolerances import TOL

BF16 = ml_dtypes.bfloat16
TOKENS = [1, 3, 17, 1031]
PAGE = 16


@pytest.fixture
def seed() -> int:
    return int(np.random.default_rng().integers(2**31))


def _poisoned(shape, dtype, stream):
    from engine.cuda.driver import device_array

    buf = device_array(shape, dtype)
    buf.fill_bytes(0xFF, stream)
    return buf


def _dev(a: np.ndarray):
    from engine.cuda.driver import to_device

    return to_device(np.ascontiguousarray(a))


def _assert_bf16_close(got, want, key: str, what: str) -> None:
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    if got.size == 0:  # e.g. no slot written (every slot < 0)
        return
    nan = np.isnan(got)
    assert not nan.any(), f"{what}: {int(nan.sum())} of {got.size} elements not written (NaN)"
    t = TOL[key]
    err = np.abs(got - want)
    excess = err - (t["atol"] + t["rtol"] * np.abs(want))
    worst = np.unravel_index(int(np.argmax(excess)), err.shape)
    assert excess[worst] <= 0, (
        f"{what}: {int((excess > 0).sum())} elements off; worst at {worst}: got {got[worst]}, "
        f"want {want[worst]}")
    rel = float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))
    assert rel <= t["rtol_norm"], f"{what}: relative error {rel:.2e}"


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


# ---- embedding --------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [64, 576, 1024, 4096])
def test_embedding_gathers_rows(cuda_ctx, stream, seed, hidden, tokens):
    from cutlass_kernels.embedding import compile_embedding

    rng = np.random.default_rng(seed)
    rows = 1000
    table = rng.standard_normal((rows, hidden), np.float32).astype(BF16)
    ids = rng.integers(0, rows, tokens).astype(np.int32)
    ids[0] = rows - 1
    if tokens >= 3:  # out of range: a row of zeros, no out-of-bounds read
        ids[1], ids[-1] = -1, rows
    out = _poisoned((tokens, hidden), BF16, stream)
    compile_embedding(hidden)(_dev(ids), _dev(table), out, rows, tokens, stream)
    stream.synchronize()
    np.testing.assert_array_equal(_bits(out.download()), _bits(ref_embedding(ids, table)),
                                  err_msg=f"seed={seed}")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [64, 1024, 4096])
def test_embedding_from_samples_gathers_rows(cuda_ctx, stream, seed, hidden, tokens):
    """Rows whose ``src`` is in [0, num_src) embed (and write back into ids) the sample it
    names; the others embed their own id (out of range: zeros); ids past T are never written."""
    from cutlass_kernels.embedding import compile_embedding_from_samples

    rng = np.random.default_rng(seed)
    rows = 1000
    n_src = int(rng.integers(1, 200))
    table = rng.standard_normal((rows, hidden), np.float32).astype(BF16)
    samples = rng.integers(0, rows, n_src).astype(np.int32)
    ids = rng.integers(0, rows, tokens).astype(np.int32)
    src = rng.integers(-2, n_src + 2, tokens).astype(np.int32)
    src[0] = n_src - 1
    if tokens >= 4:  # kept: no source, a source past the samples; an own id out of range
        src[1], src[2], src[-1] = -1, n_src, -1
        ids[-1] = rows
    ids_dev = _poisoned(tokens + 32, np.int32, stream)
    ids_dev.upload(np.concatenate([ids, np.full(32, -7, np.int32)]), stream)
    out = _poisoned((tokens, hidden), BF16, stream)
    compile_embedding_from_samples(hidden)(ids_dev, _dev(src), _dev(samples), _dev(table), out,
                                           rows, n_src, tokens, stream)
    stream.synchronize()
    want, want_ids = ref_embedding_from_samples(ids, src, samples, table)
    np.testing.assert_array_equal(_bits(out.download()), _bits(want), err_msg=f"seed={seed}")
    got_ids = ids_dev.download()
    np.testing.assert_array_equal(got_ids[:tokens], want_ids, err_msg=f"seed={seed}")
    assert (got_ids[tokens:] == -7).all(), "an id past num_tokens was written"


# ---- draft placement ---------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 2, 127, 128, 129, 1000, 4111])
def test_place_tokens_matches_numpy(cuda_ctx, stream, seed, rows):
    """``ids[t] = tokens[src[t]]`` where ``src[t]`` is a token's index; rows whose source is
    negative or past the tokens keep their (poisoned: 0xFFFFFFFF) id; rows past ``rows`` are
    never written."""
    from cutlass_kernels.place_tokens import compile_place_tokens

    rng = np.random.default_rng(seed)
    n_tok = int(rng.integers(1, 300))
    tokens = rng.integers(0, 151936, n_tok).astype(np.int32)
    src = rng.integers(-3, n_tok + 3, rows).astype(np.int32)
    src[0] = n_tok - 1
    if rows >= 3:
        src[1], src[-1] = -1, n_tok  # kept: no source, out of range
    ids = _poisoned(rows + 64, np.int32, stream)
    compile_place_tokens()(_dev(src), _dev(tokens), ids, n_tok, rows, stream)
    stream.synchronize()
    got = ids.download()
    want = ref_place_tokens(src, tokens, np.full(rows, -1, np.int32))
    np.testing.assert_array_equal(got[:rows], want, err_msg=f"seed={seed}")
    assert (got[rows:] == -1).all(), "a row past num_rows was written"


# ---- RMSNorm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [64, 576, 1024, 2560, 4096])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_rmsnorm_matches_reference(cuda_ctx, stream, seed, fused, hidden, tokens):
    from cutlass_kernels.rmsnorm import compile_rmsnorm

    rng = np.random.default_rng(seed)
    x = (3.0 * rng.standard_normal((tokens, hidden))).astype(BF16)
    res = rng.standard_normal((tokens, hidden)).astype(BF16) if fused else None
    w = (1.0 + 0.2 * rng.standard_normal(hidden)).astype(BF16)
    eps = 1e-6
    want, want_res = ref_rmsnorm(x, w, eps, res)
    launcher = compile_rmsnorm(hidden, fused)
    dx, dw = _dev(x), _dev(w)
    dres = _dev(res) if fused else None
    out = _poisoned((tokens, hidden), BF16, stream)
    launcher(dx, dres, dw, out, tokens, eps, stream)
    stream.synchronize()
    what = f"rmsnorm fused={fused} H={hidden} T={tokens} seed={seed}"
    _assert_bf16_close(out.download(), want, "rmsnorm", what)
    if fused:  # residual <- bf16(x + residual): exact
        np.testing.assert_array_equal(_bits(dres.download()), _bits(want_res.astype(BF16)),
                                      err_msg=what)
    else:  # out may alias x
        launcher(dx, None, dw, dx, tokens, eps, stream.handle)
        stream.synchronize()
        np.testing.assert_array_equal(_bits(dx.download()), _bits(out.download()), err_msg=what)


# ---- SiLU and mul -----------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [64, 1536, 3072, 9728, 12288])
@pytest.mark.parametrize("block", [None, 32])
def test_silu_mul_matches_reference(cuda_ctx, stream, seed, inter, tokens, block):
    from cutlass_kernels.silu_mul import compile_silu_mul

    rng = np.random.default_rng(seed)
    x = (2.0 * rng.standard_normal((tokens, 2 * inter))).astype(BF16)
    out = _poisoned((tokens, inter), BF16, stream)
    compile_silu_mul(inter, block)(_dev(x), out, tokens, stream)
    stream.synchronize()
    _assert_bf16_close(out.download(), ref_silu_mul(x.astype(np.float32), block), "silu_mul",
                       f"silu_mul I={inter} block={block} T={tokens} seed={seed}")


@pytest.mark.parametrize("rows,cols", [(1, 8), (6144, 1024), (3072, 576), (17, 4104),
                                       (24576, 4096)])
def test_scale_cols_is_exact(cuda_ctx, stream, seed, rows, cols):
    """The load-time norm fold, bit for bit: bf16(w * g) per column; in place."""
    from cutlass_kernels.scale_cols import compile_scale_cols

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols), dtype=np.float32).astype(BF16)
    g = rng.uniform(-3, 3, cols).astype(np.float32).astype(BF16)
    w_dev = _dev(w)
    compile_scale_cols(cols)(w_dev, _dev(g), rows, stream)
    stream.synchronize()
    got = w_dev.download()
    assert got.view(np.uint16).tobytes() == ref_scale_cols(w, g).view(np.uint16).tobytes(), (
        f"scale_cols rows={rows} cols={cols} seed={seed}")


# ---- q/k norm + RoPE + KV write ---------------------------------------------------------------

# (nq, nkv, head_dim, qk_norm): GQA 1..4, head_dim 64 and 128, the supported models among them
ROPE_SHAPES = [(4, 4, 64, True), (16, 8, 128, True), (9, 3, 64, False), (32, 8, 128, True),
               (8, 2, 128, True), (6, 2, 128, False), (12, 4, 64, True)]


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("shape", ROPE_SHAPES,
                         ids=lambda s: f"{s[0]}q{s[1]}kv_hd{s[2]}{'_qknorm' if s[3] else ''}")
def test_rope_kv_matches_reference(cuda_ctx, stream, seed, shape, tokens):
    from cutlass_kernels.rope_kv import compile_rope_kv

    nq, nkv, hd, qk = shape
    rng = np.random.default_rng(seed)
    max_pos, eps = 10000, 1e-6
    qkv = (2.0 * rng.standard_normal((tokens, (nq + 2 * nkv) * hd))).astype(BF16)
    positions = rng.integers(0, max_pos, tokens).astype(np.int32)
    positions[0] = max_pos - 1  # beyond 4096
    if tokens > 1:
        positions[1] = 0
    num_pages = 2 * -(-tokens // PAGE) + 3
    slots = rng.permutation(num_pages * PAGE)[:tokens].astype(np.int64)
    slots[rng.random(tokens) < 0.2] = -1
    if tokens >= 3:
        slots[2] = -1
    k_cache = rng.standard_normal((num_pages, nkv, PAGE, hd)).astype(BF16)
    v_cache = rng.standard_normal((num_pages, nkv, PAGE, hd)).astype(BF16)
    cos_sin = ref_cos_sin(max_pos, hd, 1e6)
    qw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(BF16) if qk else None
    kw = (1.0 + 0.2 * rng.standard_normal(hd)).astype(BF16) if qk else None
    want_q, want_k, want_v = ref_rope_kv(qkv, positions, slots, cos_sin, k_cache, v_cache, nq,
                                         nkv, hd, eps, qw, kw)

    dq = _poisoned((tokens, nq * hd), BF16, stream)
    dk, dv = _dev(k_cache), _dev(v_cache)
    compile_rope_kv(nq, nkv, hd, PAGE, qk)(
        _dev(qkv), _dev(positions), _dev(slots), _dev(qw) if qk else None,
        _dev(kw) if qk else None, _dev(cos_sin), dq, dk, dv, tokens, max_pos, eps, stream)
    stream.synchronize()
    got_q, got_k, got_v = dq.download(), dk.download(), dv.download()
    what = f"rope_kv {shape} T={tokens} seed={seed}"

    written = np.zeros(k_cache.shape, bool)
    for s in slots[slots >= 0]:
        written[s // PAGE, :, s % PAGE] = True
    for name, got, old in (("k", got_k, k_cache), ("v", got_v, v_cache)):
        np.testing.assert_array_equal(_bits(got)[~written], _bits(old)[~written],
                                      err_msg=f"{what}: {name} cache changed outside the slots")
    np.testing.assert_array_equal(_bits(got_v)[written], _bits(want_v)[written],
                                  err_msg=f"{what}: v")
    # Not bit-exact even without qk-norm: on the H200 ptxas contracts a bf16 product into the
    # following add (fma), so ~18% of elements differ from HF's op-by-op rounding by 1 ulp, and
    # by many ulps where x1*c and x2*s nearly cancel. The tolerance is absolute + relative.
    _assert_bf16_close(got_q, want_q, "rope_kv", f"{what}: q")
    _assert_bf16_close(got_k[written], want_k[written].astype(np.float32), "rope_kv",
                       f"{what}: k")


# ---- sampler and logprobs ---------------------------------------------------------------------


def _logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Rows of several kinds: spread, heavy ties, tied peaks, -inf entries, extreme values."""
    out = np.empty((rows, vocab), np.float32)
    for r in range(rows):
        kind = r % 5
        if kind == 0:
            x = rng.standard_normal(vocab) * rng.choice([0.5, 2.0, 6.0])
        elif kind == 1:  # ties everywhere, including at top-k / top-p boundaries
            x = rng.integers(0, 6, vocab).astype(np.float64)
        elif kind == 2:  # a few tied maxima over a flat floor
            x = np.zeros(vocab)
            x[rng.integers(0, vocab, 4)] = 4.0
        elif kind == 3:
            x = 3.0 * rng.standard_normal(vocab)
            x[rng.integers(0, vocab, 20)] = -np.inf
        else:  # extreme: one huge logit, very negative tail
            x = 100.0 * rng.standard_normal(vocab)
            x[rng.integers(0, vocab)] = 3.0e4
        out[r] = x
    return out


def _sampling_params(rng: np.random.Generator, rows: int, vocab: int):
    temperature = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5], rows).astype(np.float32)
    temperature[0] = 0.0 if rows > 1 else temperature[0]
    top_k = rng.choice([0, 0, 1, 5, 40, vocab - 1, vocab], rows).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.95, 0.8, 0.3], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.2], rows).astype(np.float32)
    seeds = rng.integers(0, 2**63, rows, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    seeds += rng.integers(0, 2, rows).astype(np.uint64)  # the full 64-bit range
    steps = rng.integers(0, 2**32, rows, dtype=np.int64).astype(np.uint32)
    return temperature, top_k, top_p, min_p, seeds, steps


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize("vocab", [1000, 999, 151936])
def test_sampler_matches_engine_sampling(cuda_ctx, stream, seed, vocab, rows):
    from cutlass_kernels.sampling import compile_sampler
    from engine.sampling import sample

    rng = np.random.default_rng(seed)
    logits = _logits(rng, rows, vocab)
    params = _sampling_params(rng, rows, vocab)
    want = sample(logits, *params)

    launcher = compile_sampler(vocab)
    dl = _dev(logits)
    dparams = [_dev(p) for p in params]
    runs = []
    for _ in range(2):  # reproducible run to run
        out = _poisoned(rows, np.int32, stream)
        launcher(dl, *dparams, out, rows, stream)
        stream.synchronize()
        runs.append(out.download())
    got = runs[0]
    what = f"sampler V={vocab} S={rows} seed={seed}"
    np.testing.assert_array_equal(runs[1], got, err_msg=f"{what}: not reproducible")
    assert ((got >= 0) & (got < vocab)).all(), f"{what}: token out of range {got}"

    temperature, top_k, top_p, min_p, seeds, steps = params
    greedy = temperature <= 0
    np.testing.assert_array_equal(got[greedy], np.argmax(logits[greedy], axis=1),
                                  err_msg=f"{what}: greedy")
    tol = TOL["sampling"]
    clear = np.array([
        greedy[r] or (ref_gumbel_margin(logits[r], temperature[r], top_k[r], top_p[r], min_p[r],
                                        int(seeds[r]), int(steps[r])) > tol["gumbel_gap"]
                      and ref_filter_margin(logits[r], temperature[r], top_k[r], top_p[r],
                                            min_p[r]) > tol["filter_gap"])
        for r in range(rows)])
    match = got == want
    print(f"{what}: {int(match.sum())}/{rows} rows match numpy "
          f"({int(clear.sum())} clear of float boundaries)")
    bad = np.nonzero(clear & ~match)[0]
    assert bad.size == 0, (
        f"{what}: rows {bad.tolist()} differ from engine.sampling: got {got[bad].tolist()}, "
        f"want {want[bad].tolist()}; params T={temperature[bad].tolist()} "
        f"k={top_k[bad].tolist()} p={top_p[bad].tolist()} min_p={min_p[bad].tolist()}")

    # a row's draw does not depend on the rest of the batch; per-row arrays may be offset
    # pointers (natural alignment), the logits row is a buffer of its own (16-byte aligned)
    if rows > 1:
        one = _poisoned(1, np.int32, stream)
        launcher(_dev(logits[-1:]), *[p.ptr + p.dtype.itemsize * (rows - 1) for p in dparams],
                 one, 1, stream)
        stream.synchronize()
        assert int(one.download()[0]) == int(got[-1]), f"{what}: last row alone differs"


@pytest.mark.parametrize("top_n", [0, 1, 5, 20])
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [1000, 999, 151936])
def test_logprobs_match_compute_logprobs(cuda_ctx, stream, seed, vocab, rows, top_n):
    from cutlass_kernels.sampling import compile_logprobs
    from engine.sampling import compute_logprobs, log_softmax

    rng = np.random.default_rng(seed)
    logits = _logits(rng, rows, vocab)
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    tokens[0] = int(np.argmax(logits[0]))  # rank 1
    want = compute_logprobs(logits, tokens, top_n)

    launcher = compile_logprobs(vocab)
    width = launcher.max_top_n
    d_lp = _poisoned(rows, np.float32, stream)
    d_rank = _poisoned(rows, np.int32, stream)
    d_ids = _poisoned((rows, width), np.int32, stream)
    d_top = _poisoned((rows, width), np.float32, stream)
    launcher(_dev(logits), _dev(tokens), d_lp, d_rank, d_ids, d_top, rows, top_n, stream)
    stream.synchronize()
    lp, rank, ids, top = d_lp.download(), d_rank.download(), d_ids.download(), d_top.download()
    what = f"logprobs V={vocab} R={rows} n={top_n} seed={seed}"
    max_abs = TOL["logprobs"]["max_abs"]

    assert not np.isnan(lp).any(), f"{what}: token logprob not written"
    np.testing.assert_allclose(lp, want.token_logprob, rtol=0, atol=max_abs, err_msg=what)
    ref_lp = np.stack([logits[r] - logits[r].max() for r in range(rows)])  # order of lp
    for r in range(rows):
        tok = ref_lp[r, tokens[r]]
        lo = 1 + int((ref_lp[r] > tok + 1e-5).sum())  # fp32 lse can only merge near-ties
        hi = 1 + int((logits[r] > logits[r, tokens[r]]).sum())
        assert lo <= rank[r] <= hi, f"{what}: row {r} rank {rank[r]} not in [{lo}, {hi}]"
    assert rank[0] == 1, f"{what}: the argmax has rank {rank[0]}"

    # columns past top_n are never touched
    assert (ids[:, top_n:] == -1).all() and np.isnan(top[:, top_n:]).all(), f"{what}: wrote > n"
    if top_n == 0:
        return
    assert (ids[:, :top_n] >= 0).all() and not np.isnan(top[:, :top_n]).any(), what
    np.testing.assert_allclose(top[:, :top_n], want.top_logprobs, rtol=0, atol=max_abs,
                               err_msg=what)
    for r in range(rows):
        # ids must match where the order is not decided by float noise: every pair among the
        # top n+1 reference logprobs is either an exact logit tie (index order on both sides) or
        # more than 1e-5 apart; elsewhere the ids' reference logprobs must follow the order
        lp_row = log_softmax(logits[r])
        order = np.argsort(-lp_row, kind="stable")[:top_n + 1]
        lp_gap = np.abs(lp_row[order][:, None] - lp_row[order][None, :])
        x_tie = logits[r, order][:, None] == logits[r, order][None, :]
        assert len(set(ids[r, :top_n].tolist())) == top_n, f"{what}: row {r} repeats an id"
        if (x_tie | (lp_gap > 1e-5)).all():
            np.testing.assert_array_equal(ids[r, :top_n], want.top_ids[r], err_msg=f"{what} {r}")
        else:
            np.testing.assert_allclose(lp_row[ids[r, :top_n]], want.top_logprobs[r], rtol=0,
                                       atol=max_abs, err_msg=f"{what} {r}")
