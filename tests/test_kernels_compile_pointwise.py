"""Pointwise kernels (embedding, rmsnorm, rope_kv, silu_mul, sampling) compile for sm_90a on a
CPU-only machine, their launch geometry covers every element, their launchers check arguments,
and the sampler's select algorithm (mirrored in numpy) reproduces engine.sampling.

The GPU comparison against tests/kernel_refs.py lives in tests/gpu/test_kernels_pointwise.py.
"""

from __future__ import annotations

import numpy as np
import pytest

# Supported models: (hidden, nq, nkv, head_dim, intermediate, vocab, qk_norm)
MODELS = {
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 151936, True),
    "qwen3-1.7b": (2048, 16, 8, 128, 6144, 151936, True),
    "qwen3-4b": (2560, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": (4096, 32, 8, 128, 12288, 151936, True),
    "smollm2-135m": (576, 9, 3, 64, 1536, 49152, False),
}
HIDDEN = sorted({m[0] for m in MODELS.values()} | {64, 256})
INTERMEDIATE = sorted({m[4] for m in MODELS.values()} | {64, 128})
ROPE = sorted({(m[1], m[2], m[3], m[6]) for m in MODELS.values()}
              | {(4, 4, 64, True), (8, 2, 128, True), (9, 3, 64, True), (6, 2, 128, False),
                 (12, 4, 64, True)})
VOCAB = [151936, 49152, 1000, 999]  # 999: not a multiple of 4 (scalar loads)


@pytest.mark.parametrize("hidden", HIDDEN)
def test_embedding_compiles(hidden):
    from cutlass_kernels.embedding import compile_embedding

    launcher = compile_embedding(hidden)
    assert compile_embedding(hidden) is launcher  # cached on the compile-time key


@pytest.mark.parametrize("hidden", HIDDEN)
def test_embedding_from_samples_compiles(hidden):
    from cutlass_kernels.embedding import compile_embedding, compile_embedding_from_samples

    launcher = compile_embedding_from_samples(hidden)
    assert compile_embedding_from_samples(hidden) is launcher
    assert launcher.kernel is not compile_embedding(hidden).kernel  # its own compile key


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rmsnorm_compiles(hidden, fused):
    from cutlass_kernels.rmsnorm import compile_rmsnorm

    launcher = compile_rmsnorm(hidden, fused)
    assert compile_rmsnorm(hidden, fused) is launcher


@pytest.mark.parametrize("inter", INTERMEDIATE)
def test_silu_mul_compiles(inter):
    from cutlass_kernels.silu_mul import compile_silu_mul

    assert compile_silu_mul(inter) is compile_silu_mul(inter)
    blocked = compile_silu_mul(inter, 32)  # the engine's gate_up order (DeviceWeights)
    assert blocked is compile_silu_mul(inter, 32) and blocked is not compile_silu_mul(inter)
    assert compile_silu_mul(inter, inter) is compile_silu_mul(inter)  # the default block


def test_silu_mul_rejects_a_bad_block():
    from cutlass_kernels.silu_mul import SiluMul

    for block in (0, 12, 48):  # not a multiple of 8; not dividing 64
        with pytest.raises(ValueError, match="block"):
            SiluMul(64, block)


@pytest.mark.parametrize("cols", sorted({h for h in (1024, 4096, 576, 2560, 320, 8)}))
def test_scale_cols_compiles_and_checks_rows(cols):
    from cutlass_kernels._common import KernelArgError
    from cutlass_kernels.scale_cols import ScaleCols, compile_scale_cols

    launcher = compile_scale_cols(cols)
    assert launcher is compile_scale_cols(cols) and launcher.cols == cols
    op = ScaleCols(cols)
    assert op.ctas_per_row * op.threads * 8 >= cols and op.threads % 32 == 0
    launcher(16, 16, 0, None)  # no rows: nothing launched
    with pytest.raises(KernelArgError, match="rows"):
        launcher(16, 16, -1, None)
    with pytest.raises(ValueError, match="cols"):
        ScaleCols(12)


@pytest.mark.parametrize("shape", ROPE)
def test_rope_kv_compiles(shape):
    from cutlass_kernels.rope_kv import compile_rope_kv

    nq, nkv, hd, qk = shape
    assert compile_rope_kv(nq, nkv, hd, 16, qk) is compile_rope_kv(nq, nkv, hd, 16, qk)


def test_rope_kv_pdl_ptx(tmp_path, monkeypatch):
    """pdl=True: successors may launch at once; positions, slots, cos/sin and the norm weights
    are read before griddepcontrol.wait, qkv after it (its loads are the b16 vectors), and every
    store after it."""
    import cutlass
    import cutlass.cute as cute

    from cutlass_kernels.rope_kv import SIGNATURE, RopeKV, compile_rope_kv

    assert compile_rope_kv(32, 8, 128, 16, True, pdl=True) is not compile_rope_kv(32, 8, 128,
                                                                                16, True)
    monkeypatch.setattr(cutlass.base_dsl.BaseDSL._get_dsl().envar, "dump_dir", str(tmp_path))
    ptx = cute.compile(RopeKV(32, 8, 128, 16, True, pdl=True), *SIGNATURE.fake_args(),
                       options="--keep-ptx").__ptx__
    assert ptx.count("griddepcontrol.wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") < wait
    assert "ld.global" in ptx[:wait] and "st.global" not in ptx[:wait]


def test_place_tokens_compiles_and_checks_arguments(tmp_path, monkeypatch):
    """The draft placement (cutlass_kernels/place_tokens.py): sm_90a, one guarded load and
    store a thread; no rows launches nothing; no tokens to read is refused."""
    import cutlass
    import cutlass.cute as cute

    from cutlass_kernels._common import KernelArgError
    from cutlass_kernels.place_tokens import PlaceTokens, compile_place_tokens, signature

    launcher = compile_place_tokens()
    assert compile_place_tokens() is launcher
    launcher(16, 16, 16, 0, 0, None)  # no rows: nothing launched
    with pytest.raises(KernelArgError, match="num_tokens"):
        launcher(16, 16, 16, 0, 5, None)
    monkeypatch.setattr(cutlass.base_dsl.BaseDSL._get_dsl().envar, "dump_dir", str(tmp_path))
    ptx = cute.compile(PlaceTokens(), *signature().fake_args(), options="--keep-ptx").__ptx__
    assert ".target sm_90a" in ptx and ptx.count(".entry ") == 1
    assert "st.global" in ptx and "griddepcontrol" not in ptx


def test_ref_place_tokens_keeps_rows_without_a_source():
    from tests.kernel_refs import ref_place_tokens

    ids = np.arange(10, 16, dtype=np.int32)
    got = ref_place_tokens(np.array([-1, 2, 0, 7, -5, 1], np.int32),
                           np.array([100, 101, 102], np.int32), ids)
    assert got.tolist() == [10, 102, 100, 13, 14, 101]
    assert ids.tolist() == list(range(10, 16))  # not changed in place


@pytest.mark.parametrize("vocab", VOCAB)
def test_sampling_compiles(vocab):
    from cutlass_kernels.sampling import compile_logprobs, compile_sampler

    assert compile_sampler(vocab) is compile_sampler(vocab)
    assert compile_logprobs(vocab) is compile_logprobs(vocab)


def test_ptx_is_sm90a_and_vectorized(tmp_path, monkeypatch):
    from cutlass_kernels._common import fake_ptr, fake_stream  # noqa: I001 (before cutlass)
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from cutlass_kernels.rmsnorm import RMSNorm

    # --keep-ptx writes into the DSL's dump dir (the cwd at import): point it at tmp_path
    monkeypatch.setattr(cutlass.base_dsl.BaseDSL._get_dsl().envar, "dump_dir", str(tmp_path))
    p = fake_ptr("bf16")
    compiled = cute.compile(RMSNorm(1024, True), p, p, p, p, Int32(1), Float32(1e-6),
                            fake_stream(), options="--keep-ptx")
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx  # 128-bit loads and stores


# ---- launch geometry: every element is covered exactly once -----------------------------------


def _covered(n_ctas: int, threads: int, index) -> list[int]:
    out = []
    for cta in range(n_ctas):
        for t in range(threads):
            out.extend(index(cta, t))
    return out


@pytest.mark.parametrize("hidden", HIDDEN + [8, 4104])
def test_row_kernels_cover_every_vector(hidden):
    from cutlass_kernels.embedding import Embedding
    from cutlass_kernels.rmsnorm import RMSNorm

    for op in (Embedding(hidden), RMSNorm(hidden, True)):
        iters = getattr(op, "iters", getattr(op, "nv", None))
        got = _covered(1, op.threads, lambda _c, t, op=op, iters=iters: [
            t + i * op.threads for i in range(iters) if t + i * op.threads < op.nvec])
        assert sorted(got) == list(range(hidden // 8))
        assert op.threads % 32 == 0 and op.threads <= 1024


@pytest.mark.parametrize("inter", INTERMEDIATE + [8, 200, 12296])
def test_silu_mul_covers_every_vector(inter):
    from cutlass_kernels.silu_mul import SiluMul

    op = SiluMul(inter)
    got = _covered(op.ctas_per_row, op.threads, lambda c, t: [
        c * op.threads * op.nv + t + i * op.threads for i in range(op.nv)
        if c * op.threads * op.nv + t + i * op.threads < op.nvec])
    assert sorted(got) == list(range(inter // 8))


@pytest.mark.parametrize("shape", ROPE + [(64, 8, 128, True), (40, 40, 64, False)])
def test_rope_kv_covers_every_head_element(shape):
    from cutlass_kernels.rope_kv import RopeKV

    nq, nkv, hd, qk = shape
    op = RopeKV(nq, nkv, hd, 16, qk)
    got = []
    for c in range(op.ctas_per_token):
        for t in range(op.threads):
            lane = c * op.threads + t
            u, j = lane // op.tpu, lane % op.tpu
            if u < op.units:  # lane j owns [8j, 8j+8) of both halves of head u
                got += [u * hd + j * 8 + e for e in range(8)]
                got += [u * hd + hd // 2 + j * 8 + e for e in range(8)]
        assert op.threads % op.tpu == 0  # a head's lanes never straddle two CTAs or warps
    assert sorted(got) == list(range((nq + 2 * nkv) * hd))


def test_sampler_histogram_scan_covers_every_bin():
    from cutlass_kernels.sampling import NBINS

    per = NBINS // 32
    bins = [NBINS - per * lane - 1 - i for lane in range(32) for i in range(per)]
    assert bins == list(range(NBINS - 1, -1, -1))  # descending, lane 0 first


# ---- launchers check their arguments ----------------------------------------------------------


class _Buf:
    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


def test_launchers_reject_bad_arguments():
    from cutlass_kernels._common import KernelArgError
    from cutlass_kernels.embedding import compile_embedding
    from cutlass_kernels.rmsnorm import compile_rmsnorm
    from cutlass_kernels.rope_kv import compile_rope_kv
    from cutlass_kernels.sampling import compile_logprobs
    from cutlass_kernels.silu_mul import compile_silu_mul

    norm = compile_rmsnorm(64, False)
    with pytest.raises(KernelArgError):  # residual given to the plain norm
        norm(16, 16, 16, 16, 4, 1e-6, None)
    with pytest.raises(KernelArgError):  # misaligned pointer
        norm(18, None, 16, 16, 4, 1e-6, None)
    with pytest.raises(KernelArgError):  # fused norm without residual
        compile_rmsnorm(64, True)(16, None, 16, 16, 4, 1e-6, None)
    with pytest.raises(KernelArgError):  # buffer too small for T rows
        compile_silu_mul(64)(_Buf(256, 64), 16, 4, None)
    with pytest.raises(KernelArgError):
        compile_embedding(64)(16, 16, 16, 0, 4, None)
    from cutlass_kernels.embedding import compile_embedding_from_samples

    with pytest.raises(KernelArgError, match="num_src=0"):  # no samples to take from
        compile_embedding_from_samples(64)(16, 16, 16, 16, 16, 10, 0, 4, None)
    with pytest.raises(KernelArgError, match="src: device address"):  # misaligned
        compile_embedding_from_samples(64)(16, 18, 16, 16, 16, 10, 2, 4, None)
    with pytest.raises(KernelArgError):  # qk-norm weights missing
        compile_rope_kv(4, 4, 64, 16, True)(16, 16, 16, None, None, 16, 16, 16, 16, 1, 8,
                                            1e-6, None)
    with pytest.raises(KernelArgError):
        compile_logprobs(1000)(16, 16, 16, 16, 16, 16, 1, 21, None)
    # nothing to do: no launch, no error (a null stream is never touched)
    norm(16, None, 16, 16, 0, 1e-6, None)


def test_signature_checks_name_the_argument():
    from cutlass_kernels._common import KernelArgError, Ptr, Signature
    from cutlass_kernels.rmsnorm import RMSNorm, compile_rmsnorm
    from cutlass_kernels.sampling import compile_sampler

    norm = compile_rmsnorm(64, True)
    with pytest.raises(KernelArgError, match="weight: buffer of 100 B, kernel touches 128 B"):
        norm(_Buf(256, 512), _Buf(768, 512), _Buf(1280, 100), _Buf(1536, 512), 4, 1e-6, None)
    with pytest.raises(KernelArgError, match="residual: no buffer"):
        norm.kernel(16, None, 16, 16, 4, 1e-6, None)
    with pytest.raises(KernelArgError, match="seeds: device address 0xc is not 8-byte aligned"):
        compile_sampler(1000)(16, 4, 4, 4, 4, 12, 4, 4, 2, None)
    with pytest.raises(TypeError, match="Signature"):  # declared names must be the kernel's
        Signature(Ptr("x", "bf16")).compile(RMSNorm(64, False))


# ---- the sampler's algorithm, mirrored in numpy, against engine.sampling ----------------------


def _mirror_sample_row(x, temp, top_k, top_p, min_p, seed, step):
    """numpy mirror of cutlass_kernels/sampling.py: the same keys, radix selects and tie rules
    (numpy's float32 exp where the GPU uses its own)."""
    from engine.sampling import gumbel

    x = np.asarray(x, np.float32)
    v = x.shape[0]
    if temp <= 0:
        return int(np.argmax(x))
    t = np.float32(temp)
    z = x / t
    zmax = np.float32(x.max()) / t
    d = (z - zmax).astype(np.float32)

    def key_of(a):
        bits = a.view(np.uint32)
        return bits ^ np.where(bits >> np.uint32(31) == 1, np.uint32(0xFFFFFFFF),
                               np.uint32(0x80000000))

    key = key_of(d)
    nidx = ~np.arange(v, dtype=np.uint32)
    e = np.exp(d).astype(np.float32)
    mass = np.floor(e.astype(np.float64) * 2.0**40).astype(np.uint64)
    cut = {"kk": np.uint32(0), "nk": np.uint32(0)}

    def topk_ok():
        return (key > cut["kk"]) | ((key == cut["kk"]) & (nidx >= cut["nk"]))

    def select(need, frac, eq, by_index, by_mass):
        prefix, pmask, hb = 0, 0, 0
        sel = nidx if by_index else key
        for p, shift in enumerate((21, 10, 0)):
            ok = topk_ok() & ((key == eq) if by_index else True)
            ok &= (sel & np.uint32(pmask)) == np.uint32(prefix)
            hist = np.zeros(2048, np.uint64)
            np.add.at(hist, ((sel[ok] >> np.uint32(shift)) & np.uint32(2047)).astype(np.int64),
                      mass[ok] if by_mass else np.uint64(1))
            if by_mass and p == 0:
                total = int(hist.sum())
                f = float(np.float32(frac)) * float(total)
                need = min(max(int(np.ceil(f)), 1), total)
            cum = np.cumsum(hist[::-1].astype(object))
            j = int(np.nonzero(cum >= need)[0][0])
            b = 2047 - j
            need -= int(cum[j]) - int(hist[b])
            hb = int(hist[b])
            prefix |= b << shift
            pmask |= ~((1 << shift) - 1) & 0xFFFFFFFF
        return np.uint32(prefix), need, hb

    kp, np_ = np.uint32(0), np.uint32(0)
    if 0 < top_k < v:
        cut["kk"], need, cnt = select(int(top_k), 0.0, 0, False, False)
        if need < cnt:
            cut["nk"], _, _ = select(need, 0.0, cut["kk"], True, False)
    if top_p < 1.0:
        kp, rem, mass_b = select(0, top_p, 0, False, True)
        dk = np.array([kp], np.uint32)
        dk = dk ^ np.where(dk >> np.uint32(31) == 1, np.uint32(0x80000000), np.uint32(0xFFFFFFFF))
        p_t = int(np.floor(float(np.exp(dk.view(np.float32))[0]) * 2.0**40)) or 1
        if (rem + p_t - 1) // p_t < mass_b // p_t:
            np_, _, _ = select((rem + p_t - 1) // p_t, 0.0, kp, True, False)
    kept = topk_ok() & ((key > kp) | ((key == kp) & (nidx >= np_)))
    kept &= e >= np.float32(max(min_p, 0.0))
    if not kept.any():
        return 0
    return int(np.argmax(np.where(kept, z + gumbel(seed, step, v), -np.inf)))


def test_sampler_algorithm_matches_engine_sampling():
    from engine.sampling import sample_row
    from tests.kernel_refs import ref_filter_margin, ref_gumbel_margin

    seed0 = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed0)
    for trial in range(48):
        v = int(rng.choice([64, 512, 1000, 999]))
        kind = trial % 4
        if kind == 0:
            x = (rng.standard_normal(v) * rng.choice([0.5, 2.0, 8.0])).astype(np.float32)
        elif kind == 1:  # heavy ties everywhere, including at the top-k / top-p boundary
            x = rng.integers(0, 6, v).astype(np.float32)
        elif kind == 2:  # a few tied peaks over a flat floor
            x = np.zeros(v, np.float32)
            x[rng.integers(0, v, 5)] = 3.0
        else:
            x = (rng.standard_normal(v) * 3).astype(np.float32)
            x[rng.integers(0, v, 20)] = -np.inf
        temp = float(rng.choice([0.0, 0.5, 1.0, 1.7]))
        k = int(rng.choice([0, 1, 5, 50, v - 1, v, v + 10]))
        p = float(np.float32(rng.choice([1.0, 0.9, 0.5, 0.05, 0.999])))
        m = float(np.float32(rng.choice([0.0, 0.0, 0.05, 0.3])))
        seed, step = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**32))
        got = _mirror_sample_row(x, temp, k, p, m, seed, step)
        want = sample_row(x, temp, k, p, m, seed, step)
        if got != want and temp > 0:  # allowed only at a float boundary
            assert (ref_gumbel_margin(x, temp, k, p, m, seed, step) < 1e-4
                    or ref_filter_margin(x, temp, k, p, m) < 1e-5), (seed0, trial)
        else:
            assert got == want, (seed0, trial)


# ---- references ---------------------------------------------------------------------------------


def test_refs_agree_with_per_element_loops():
    import ml_dtypes

    from tests.kernel_refs import ref_cos_sin, ref_rmsnorm, ref_rope_kv, ref_silu_mul

    rng = np.random.default_rng(0)
    bf = ml_dtypes.bfloat16
    x = rng.standard_normal((3, 16)).astype(bf).astype(np.float32)
    w = rng.standard_normal(16).astype(bf).astype(np.float32)
    out, _ = ref_rmsnorm(x, w, 1e-6)
    for t in range(3):
        rstd = np.float32(1.0 / np.sqrt(np.mean(x[t].astype(np.float64) ** 2) + 1e-6))
        want = ((x[t] * rstd).astype(bf).astype(np.float32) * w).astype(bf).astype(np.float32)
        np.testing.assert_array_equal(out[t], want)
    g = np.float64(x[0, 3])
    act = np.float32(g / (1 + np.exp(-g)))
    np.testing.assert_array_equal(
        ref_silu_mul(x)[0, 3],
        np.float32(bf(np.float32(bf(act)) * np.float32(x[0, 11]))))
    # rope: token 1 of 2, one q head and one kv head of dim 8, slot 17 -> page 1, offset 1
    nq, nkv, hd = 1, 1, 8
    qkv = rng.standard_normal((2, (nq + 2 * nkv) * hd)).astype(bf).astype(np.float32)
    cs = ref_cos_sin(4096 + 8, hd, 1e6)
    kc = np.zeros((3, nkv, 16, hd), bf)
    vc = np.zeros((3, nkv, 16, hd), bf)
    pos, slots = np.array([4097, 5]), np.array([-1, 17])
    q, k2, v2 = ref_rope_kv(qkv, pos, slots, cs, kc, vc, nq, nkv, hd)
    c, s = (cs[5, :4].astype(bf).astype(np.float32), cs[5, 4:].astype(bf).astype(np.float32))
    x1, x2 = qkv[1, :4], qkv[1, 4:8]
    r = lambda a: a.astype(bf).astype(np.float32)  # noqa: E731
    np.testing.assert_array_equal(q[1, :4], r(r(x1 * c) - r(x2 * s)))
    np.testing.assert_array_equal(q[1, 4:], r(r(x2 * c) + r(x1 * s)))
    np.testing.assert_array_equal(v2[1, 0, 1].astype(np.float32), qkv[1, 16:24])
    k1, k2_ = qkv[1, 8:12], qkv[1, 12:16]
    np.testing.assert_array_equal(k2[1, 0, 1, :4].astype(np.float32), r(r(k1 * c) - r(k2_ * s)))
    written = np.zeros(k2.shape, bool)
    written[1, 0, 1] = True
    assert not np.any(k2.astype(np.float32)[~written])  # token 0 (slot -1) wrote nothing


@pytest.mark.parametrize("threads,unroll", [(512, 4), (256, 1)])
def test_read_stream_compiles_with_vector_loads(threads, unroll, tmp_path, monkeypatch):
    """The read-only streaming kernel compiles for sm_90a on the CPU with ``unroll`` 128-bit
    loads in its loop; bad launch parameters are refused before any GPU work."""
    import cutlass
    import cutlass.cute as cute

    from cutlass_kernels._common import KernelArgError, fake_ptr, fake_stream
    from cutlass_kernels.read_stream import MAX_VEC, ReadStream, compile_read_stream

    launcher = compile_read_stream(threads, unroll)
    assert launcher is compile_read_stream(threads, unroll)
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes a .ptx file into the working directory
    ptx = cute.compile(ReadStream(threads, unroll), fake_ptr("u32", 16), fake_ptr("u32", 4),
                       cutlass.Int32(1), cutlass.Int32(1), fake_stream(),
                       options="--keep-ptx").__ptx__
    assert ".target sm_90a" in ptx
    assert ptx.count("ld.global.v4.b32") == unroll
    with pytest.raises(KernelArgError, match="num_vec"):
        launcher(256, 256, MAX_VEC, 1, None)
    with pytest.raises(KernelArgError, match="num_ctas"):
        launcher(256, 256, 1, 0, None)
    with pytest.raises(ValueError, match="threads"):
        ReadStream(100)
