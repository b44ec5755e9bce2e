"""cutlass_kernels/gemm.py on the GPU: every path against numpy float32, across the path
boundaries, the M tail and N tails, bf16 and fp32 (lm_head) outputs; the wide path's slabs,
splits and bit-identity (two runs, tile_as, graph replay); plus a timing report at qwen3-8b
shapes (printed, not asserted)."""

from __future__ import annotations

import cutlass_kernels._common  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)

# isort: split
import ml_dtypes
import numpy as np
import pytest

from cutlass_kernels.gemm import compile_gemm, wide_options
from engine.cuda.driver import Event, Graph, device_array, to_device
from tests.kernel_refs import ref_fused_gemm, ref_gemm
from tests.tolerances import TOL

BF16 = np.dtype(ml_dtypes.bfloat16)
NP_OUT = {"bf16": BF16, "f32": np.dtype(np.float32)}
TOL_OUT = {"bf16": TOL["gemm"]["rtol_norm"], "f32": TOL["logits"]["rtol_norm"]}

# Crossing the skinny tiles (16 | 17, 32 | 33), the crossover (128 | 129) and the tiled M tile.
M_VALUES = [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 64, 100, 128, 129, 1000, 2048]
# (N, K, out): SmolLM2-135M qkv / o_proj / lm_head, qwen3-0.6b qkv / gate_up / down, a test vocab
SHAPES = [(960, 576, "bf16"), (576, 576, "bf16"), (49152, 576, "f32"), (4096, 1024, "bf16"),
          (6144, 1024, "bf16"), (1024, 3072, "bf16"), (1000, 256, "f32")]
PAD_ROWS = 5  # rows of C past M that must keep their poison


def _rand_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(BF16)


@pytest.fixture(scope="module")
def weights(cuda_ctx) -> dict:
    """Per shape: W (host, device), fresh random each session."""
    rng = np.random.default_rng()
    made: dict = {}

    def get(n: int, k: int):
        if (n, k) not in made:
            w = _rand_bf16(rng, (n, k)) * BF16.type(1.0 / np.sqrt(k))
            made[(n, k)] = (w, to_device(w))
        return made[(n, k)]

    return get


def _run_and_check(launcher, w, w_dev, n: int, k: int, m: int, out: str, stream) -> np.ndarray:
    seed = int(np.random.default_rng().integers(2**31))
    a = _rand_bf16(np.random.default_rng(seed), (m, k))
    a_dev = to_device(a)
    c_dev = device_array((m + PAD_ROWS, n), NP_OUT[out])
    c_dev.fill_bytes(0xFF, stream)  # poison: NaN in bf16 and f32
    launcher(a_dev, w_dev, c_dev, m, stream)
    stream.synchronize()
    c = c_dev.download()
    where = f"N={n} K={k} M={m} out={out} path={launcher.path(m)} seed={seed}"
    assert np.isfinite(c[:m].astype(np.float32)).all(), f"unwritten/NaN outputs: {where}"
    tail = c[m:].view(np.uint8)
    assert (tail == 0xFF).all(), f"rows >= M were written: {where}"
    ref = ref_gemm(a, w)
    err = np.linalg.norm(c[:m].astype(np.float32) - ref) / np.linalg.norm(ref)
    assert err < TOL_OUT[out], f"rel err {err:.2e}: {where}"
    return c


@pytest.mark.parametrize("n,k,out", SHAPES)
@pytest.mark.parametrize("m", M_VALUES)
def test_gemm_matches_numpy(weights, stream, n: int, k: int, out: str, m: int) -> None:
    w, w_dev = weights(n, k)
    _run_and_check(compile_gemm(n, k, out), w, w_dev, n, k, m, out, stream)


@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_skinny_split_k(weights, stream, split_k: int, m: int) -> None:
    """Every cluster size of the split-K reduction (the heuristic picks only one per shape)."""
    n, k = 1024, 2048
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, "bf16", split_k=split_k)
    assert launcher.path(m).startswith("skinny")
    _run_and_check(launcher, w, w_dev, n, k, m, "bf16", stream)


@pytest.mark.parametrize("m", [1, 17, 32, 33, 72, 96, 127])
def test_skinny_reads_rows_past_m_without_using_them(weights, stream, m: int) -> None:
    """A's buffer holds rows past M (NaN poison): the launcher lets the kernel's TMA view span
    M rounded up to the token tile; C must still match numpy and rows >= M stay unwritten."""
    n, k = 4096, 1024
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, "bf16")
    tile = int(launcher.path(m)[6:])
    rng = np.random.default_rng()
    a = _rand_bf16(rng, (m, k))
    a_dev = device_array((-(-m // tile) * tile + 3, k), BF16)
    a_dev.fill_bytes(0xFF, stream)
    a_dev.upload(a, stream)
    assert launcher.load_rows(a_dev, m, tile) == -(-m // tile) * tile
    assert launcher.load_rows(a_dev.ptr, m, tile) == m  # capacity unknown: exactly M
    c_dev = device_array((m + PAD_ROWS, n), BF16)
    c_dev.fill_bytes(0xFF, stream)
    launcher(a_dev, w_dev, c_dev, m, stream)
    stream.synchronize()
    c = c_dev.download()
    assert np.isfinite(c[:m].astype(np.float32)).all(), f"M={m}: NaN rows leaked"
    assert (c[m:].view(np.uint8) == 0xFF).all(), f"M={m}: rows >= M written"
    ref = ref_gemm(a, w)
    err = np.linalg.norm(c[:m].astype(np.float32) - ref) / np.linalg.norm(ref)
    assert err < TOL_OUT["bf16"], f"M={m}: rel err {err:.2e}"


@pytest.mark.parametrize("n,k,out", [(4096, 1024, "bf16"), (1024, 3072, "bf16"),
                                       (49152, 576, "f32")])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 128])
def test_pdl_gemm_waits_for_the_kernel_writing_a(weights, stream, n: int, k: int, out: str,
                                                 m: int) -> None:
    """pdl=True, as in the engine: A is written by the kernel right before the GEMM (the row
    gather, which lets dependents launch at its start), so the GEMM's W prefetch overlaps it and
    only the wait orders the A reads. A starts as NaN poison each round; C must match numpy."""
    _pdl_rounds(weights, stream, compile_gemm(n, k, out, pdl=True), n, k, out, m)


@pytest.mark.parametrize("n,k,out", [(4096, 1024, "bf16"), (1000, 256, "f32")])
@pytest.mark.parametrize("m", [33, 64, 100, 200, 300])
def test_pdl_wide_gemm_waits_for_the_kernel_writing_a(weights, stream, n: int, k: int, out: str,
                                                      m: int) -> None:
    """The same for the wide path (its 64-token tile included)."""
    launcher = compile_gemm(n, k, out, pdl=True, **wide_options(33))
    assert launcher.path(m).startswith("wide")
    _pdl_rounds(weights, stream, launcher, n, k, out, m)


def _pdl_rounds(weights, stream, launcher, n: int, k: int, out: str, m: int) -> None:
    from cutlass_kernels.embedding import compile_embedding

    rng = np.random.default_rng()
    w, w_dev = weights(n, k)
    table = _rand_bf16(rng, (300, k))
    table_dev = to_device(table)
    gather = compile_embedding(k)
    a_dev = device_array((m, k), BF16)
    c_dev = device_array((m + PAD_ROWS, n), NP_OUT[out])
    for rnd in range(4):
        ids = rng.integers(0, 300, m).astype(np.int32)
        ids_dev = to_device(ids)
        a_dev.fill_bytes(0xFF, stream)
        c_dev.fill_bytes(0xFF, stream)
        gather(ids_dev, table_dev, a_dev, 300, m, stream)
        launcher(a_dev, w_dev, c_dev, m, stream)
        stream.synchronize()
        c = c_dev.download()
        where = f"N={n} K={k} M={m} round={rnd} path={launcher.path(m)}"
        assert np.isfinite(c[:m].astype(np.float32)).all(), f"read A before it was written: {where}"
        assert (c[m:].view(np.uint8) == 0xFF).all(), where
        ref = ref_gemm(table[ids], w)
        err = np.linalg.norm(c[:m].astype(np.float32) - ref) / np.linalg.norm(ref)
        assert err < TOL_OUT[out], f"rel err {err:.2e}: {where}"


# The wide path (gemm_wide.py): every token tile, across its tile edges and two token tiles.
WIDE_TILES = (64, 128, 192, 256)
WIDE_M = [1, 63, 65, 127, 129, 191, 200, 255, 256, 257, 511, 512]
# qwen3-0.6b qkv and down, SmolLM2 qkv (N = 7.5 slabs of 128, 3.75 of 256; K = 9 tiles), a test
# vocab (N = 1000, fp32 out, K = 4 tiles)
WIDE_SHAPES = [(4096, 1024, "bf16"), (1024, 3072, "bf16"), (960, 576, "bf16"), (1000, 256, "f32")]


def _wide(n: int, k: int, out: str = "bf16", **kw):
    """The wide path for every M (tiled never runs), its default slabs and splits."""
    return compile_gemm(n, k, out, crossover=0, wide_tiles=WIDE_TILES, wide_range=(1, 1 << 20),
                        **kw)


@pytest.mark.parametrize("n,k,out", WIDE_SHAPES)
@pytest.mark.parametrize("m", WIDE_M)
def test_wide_matches_numpy(weights, stream, n: int, k: int, out: str, m: int) -> None:
    w, w_dev = weights(n, k)
    launcher = _wide(n, k, out)
    assert launcher.path(m).startswith("wide")
    _run_and_check(launcher, w, w_dev, n, k, m, out, stream)


@pytest.mark.parametrize("slab,tile_t", [(128, 64), (256, 64), (128, 128), (256, 128),
                                         (128, 192), (128, 256)])
@pytest.mark.parametrize("split_k", [1, 2, 5, 8])
def test_wide_slab_and_split(weights, stream, slab: int, tile_t: int, split_k: int) -> None:
    """Each slab / tile pair at cluster sizes that do not divide K's 9 tiles (and 1), over one
    token tile and just past it (two)."""
    n, k = 960, 576
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, "bf16", crossover=0, wide_tiles=(tile_t,),
                            wide_range=(1, 1 << 20), wide_slab=slab, wide_split_k=split_k)
    assert launcher.cfg.wide == ((tile_t, slab, split_k),)
    for m in (tile_t - 1, tile_t + 3):
        _run_and_check(launcher, w, w_dev, n, k, m, "bf16", stream)


@pytest.mark.parametrize("m", [64, 65, 128, 129, 256, 300, 512, 513])
def test_wide_engine_options(weights, stream, m: int) -> None:
    """CUTEINFER_GEMM_WIDE=1's launcher at qwen3-8b's qkv: skinny64 | wide 65..512 | tiled."""
    n, k = 6144, 4096
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, "bf16", **wide_options(65))
    assert launcher.path(m).startswith("wide") == (65 <= m <= 512)
    _run_and_check(launcher, w, w_dev, n, k, m, "bf16", stream)


def test_wide_bits_repeat_and_follow_the_kernel(weights, stream) -> None:
    """Deterministic split-K: the same bits from two runs, from a graph replay, and for any row
    computed in another call of the same kernel (tile_as), whichever token tile it falls in."""
    n, k, m = 4096, 1024, 300  # wide256 over two token tiles, split-K > 1
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, "bf16", **wide_options(65))
    assert launcher.path(m) == "wide256" and launcher.cfg.wide[-1][2] > 1
    a = _rand_bf16(np.random.default_rng(), (m, k))
    a_dev = to_device(a)

    def run(rows: np.ndarray | None, count: int, tile_as: int | None = None) -> np.ndarray:
        src = a_dev if rows is None else to_device(rows)
        c_dev = device_array((count + PAD_ROWS, n), BF16)
        c_dev.fill_bytes(0xFF, stream)
        launcher(src, w_dev, c_dev, count, stream, tile_as)
        stream.synchronize()
        return c_dev.download()[:count].view(np.uint16)

    first = run(None, m)
    assert np.isfinite(first.view(BF16).astype(np.float32)).all()
    assert (run(None, m) == first).all(), "two runs differ"
    # rows of the second token tile, now in the first; rows from the middle; a 7-row call
    assert (run(a[256:], m - 256, tile_as=m) == first[256:]).all()
    assert (run(a[5:70], 65, tile_as=200) == first[5:70]).all()
    assert (run(a[290:297], 7, tile_as=257) == first[290:297]).all()

    c_dev = device_array((m + PAD_ROWS, n), BF16)
    graph = Graph.capture(stream, lambda: launcher(a_dev, w_dev, c_dev, m, stream))
    try:
        for _ in range(2):
            c_dev.fill_bytes(0xFF, stream)
            graph.launch(stream)
            stream.synchronize()
            assert (c_dev.download()[:m].view(np.uint16) == first).all(), "graph != eager"
    finally:
        graph.destroy()


@pytest.mark.parametrize("m", [1, 100, 128, 200, 300])
def test_skinny_one_cta_per_sm_tile(weights, stream, m: int) -> None:
    """Token tile 128 (the 1-CTA-per-SM plan) and M > tile (several token tiles)."""
    n, k = 960, 576
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, "bf16", crossover=512, skinny_tiles=(128,))
    assert launcher.path(m) == "skinny128"
    _run_and_check(launcher, w, w_dev, n, k, m, "bf16", stream)


@pytest.mark.parametrize("m", [1, 16, 129])
def test_tiled_path_small_m(weights, stream, m: int) -> None:
    """crossover=0: the tiled path alone, including M far below its 128-row tile."""
    for n, k, out in [(960, 576, "bf16"), (1000, 256, "f32")]:
        w, w_dev = weights(n, k)
        launcher = compile_gemm(n, k, out, crossover=0, tile_n=256)
        assert launcher.path(m) == "tiled"
        _run_and_check(launcher, w, w_dev, n, k, m, out, stream)


# ---- fused skinny GEMMs (the decoder layer's: engine/executor/cuda_model._jobs) -------------

# (N, K, epilogue, norm_size): qwen3-0.6b qkv / o / gate_up / down, SmolLM2 gate_up (K = 576),
# a padded width (norm over the real 300 of 320 columns, the rest zero), qwen3-8b gate_up
FUSED = [(4096, 1024, "store", 1024), (1024, 2048, "residual", 0), (6144, 1024, "silu", 1024),
         (1024, 3072, "residual", 0), (3072, 576, "silu", 576), (768, 320, "silu", 300),
         (640, 320, "store", 300), (24576, 4096, "silu", 4096)]
FUSED_M = [1, 2, 7, 16, 17, 31, 33, 64, 65, 100, 128]


@pytest.mark.parametrize("n,k,epilogue,norm_size", FUSED)
@pytest.mark.parametrize("m", FUSED_M)
def test_fused_skinny_gemm_matches_numpy(weights, stream, n: int, k: int, epilogue: str,
                                         norm_size: int, m: int) -> None:
    """Every skinny tile and its M tail: the norm scale (rows of A with large, varied norms:
    a wrong row's sum of squares shows), the residual add into C, SiLU-and-mul of the 32-row
    gate / up blocks; C past M (and past N/2 for silu) keeps its poison."""
    eps = 1e-6
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, epilogue=epilogue, norm_size=norm_size, eps=eps)
    assert launcher.fuses(m) and not launcher.fuses(129)
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k), dtype=np.float32) * rng.uniform(0.05, 30, (m, 1))
    if norm_size < k:
        a[:, norm_size:] = 0  # padded columns are zero (cuda_shapes.Padded)
    a = a.astype(BF16)
    cols = n // 2 if epilogue == "silu" else n
    c_old = _rand_bf16(rng, (m, cols))
    c_dev = device_array((m + PAD_ROWS, cols), BF16)  # silu: act [M, N/2]
    poison = np.frombuffer(b"\xff" * (PAD_ROWS * cols * 2), BF16).reshape(PAD_ROWS, cols)
    c_dev.upload(np.concatenate([c_old, poison]), stream)  # C = c_old: read by residual only
    launcher(to_device(a), w_dev, c_dev, m, stream)
    stream.synchronize()
    c = c_dev.download()
    where = f"N={n} K={k} {epilogue} norm={norm_size} M={m} path={launcher.path(m)} seed={seed}"
    assert np.isfinite(c[:m].astype(np.float32)).all(), f"unwritten/NaN outputs: {where}"
    assert (c[m:].view(np.uint8) == 0xFF).all(), f"rows >= M were written: {where}"
    ref = ref_fused_gemm(a, w, epilogue, norm_size, eps, c_old)
    err = np.linalg.norm(c[:m].astype(np.float32) - ref) / np.linalg.norm(ref)
    assert err < TOL["gemm"]["rtol_norm"], f"rel err {err:.2e}: {where}"
    row_err = (np.linalg.norm(c[:m].astype(np.float32) - ref, axis=1)
               / np.maximum(np.linalg.norm(ref, axis=1), 1e-30))
    assert row_err.max() < 2 * TOL["gemm"]["rtol_norm"], f"row errs {row_err}: {where}"


@pytest.mark.parametrize("m", [129, 300])
def test_fused_launcher_runs_unfused_above_the_skinny_path(weights, stream, m: int) -> None:
    """A fused launcher's tiled path is the plain GEMM (``unfused``); calling it fused past
    the skinny path, or unfused on it, is a typed error."""
    from cutlass_kernels._common import KernelArgError

    n, k = 6144, 1024
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, epilogue="silu", norm_size=1024, eps=1e-6)
    from graphs.profile import Hooked

    plain = Hooked(launcher, lambda fn, *a, **kw: fn.unfused(*a, **kw))  # .path: the launcher's
    _run_and_check(plain, w, w_dev, n, k, m, "bf16", stream)
    a, c = device_array((m, k), BF16), device_array((m, n), BF16)
    with pytest.raises(KernelArgError, match="unfused"):
        launcher(a, w_dev, c, m, stream)
    with pytest.raises(KernelArgError, match="fused"):
        launcher.unfused(a, w_dev, c, 16, stream)


@pytest.mark.parametrize("m", [65, 100, 128])
def test_fuse_max_rows_runs_plain_skinny_above_it(weights, stream, m: int) -> None:
    """fuse_max_rows=64: M = 65..128 runs the plain 64-token skinny kernel via unfused(), equal
    to numpy; the fused call is refused there."""
    from cutlass_kernels._common import KernelArgError
    from graphs.profile import Hooked

    n, k = 6144, 1024
    w, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, epilogue="silu", norm_size=1024, eps=1e-6, fuse_max_rows=64)
    assert not launcher.fuses(m) and launcher.path(m) == "skinny64"
    plain = Hooked(launcher, lambda fn, *a, **kw: fn.unfused(*a, **kw))
    _run_and_check(plain, w, w_dev, n, k, m, "bf16", stream)
    a, c = device_array((m, k), BF16), device_array((m, n), BF16)
    with pytest.raises(KernelArgError, match="unfused"):
        launcher(a, w_dev, c, m, stream)


def test_fused_bits_repeat_and_equal_the_graph(weights, stream) -> None:
    """The fused norm's sums of squares and the epilogue are in a fixed order: two runs and a
    graph replay give the same bits."""
    n, k, m = 6144, 1024, 33
    _, w_dev = weights(n, k)
    launcher = compile_gemm(n, k, epilogue="silu", norm_size=1024, eps=1e-6)
    a = to_device(_rand_bf16(np.random.default_rng(), (m, k)))
    outs = []
    for _ in range(2):
        c = device_array((m, n // 2), BF16)
        launcher(a, w_dev, c, m, stream)
        stream.synchronize()
        outs.append(c.download())
    c = device_array((m, n // 2), BF16)
    g = Graph.capture(stream, lambda: launcher(a, w_dev, c, m, stream))
    try:
        g.launch(stream)
        stream.synchronize()
        outs.append(c.download())
    finally:
        g.destroy()
    assert outs[0].tobytes() == outs[1].tobytes() == outs[2].tobytes()


def test_timing_report(cuda_ctx, stream, capsys) -> None:
    """qwen3-8b linear layers: median of 20 device-event timings per (shape, M), each run
    behind a 256 MiB memset so the launch is queued and L2 holds no weights (decode-like)."""
    h, q, kv, inter = 4096, 4096, 1024, 12288
    shapes = [("qkv", q + 2 * kv, h), ("o_proj", h, q), ("gate_up", 2 * inter, h),
              ("down", h, inter)]
    m_values = [1, 8, 64, 512, 2048]
    flush = device_array(256 << 20, np.uint8)
    e0, e1 = Event(), Event()
    lines = [f"{'layer':8} {'N':>6} {'K':>6} {'M':>5} {'path':>9} {'us':>9} {'GB/s':>7} "
             f"{'TFLOP/s':>8}"]
    for name, n, k in shapes:
        launcher = compile_gemm(n, k, "bf16")
        w_dev = device_array((n, k), BF16)
        w_dev.fill_bytes(0x3C, stream)  # bf16 0x3C3C ~ 0.0115: finite, no upload needed
        a_dev = device_array((max(m_values), k), BF16)
        a_dev.fill_bytes(0x3C, stream)
        c_dev = device_array((max(m_values), n), BF16)
        for m in m_values:
            launcher(a_dev, w_dev, c_dev, m, stream)  # warm-up (module load)
            times = []
            for _ in range(20):
                flush.fill_bytes(0, stream)
                e0.record(stream)
                launcher(a_dev, w_dev, c_dev, m, stream)
                e1.record(stream)
                e1.synchronize()
                times.append(e0.elapsed_ms(e1) * 1e-3)
            t = float(np.median(times))
            nbytes = 2 * (n * k + m * k + m * n)
            lines.append(f"{name:8} {n:6} {k:6} {m:5} {launcher.path(m):>9} {t * 1e6:9.2f} "
                         f"{nbytes / t / 1e9:7.0f} {2 * m * n * k / t / 1e12:8.1f}")
    with capsys.disabled():
        print("\nGEMM timing (H200 copy ceiling ~4280 GB/s, bf16 dense peak ~989 TFLOP/s)")
        print("\n".join(lines))


@pytest.mark.parametrize("epilogue,norm_size,tile_t,split_k", [
    ("store", 0, 64, 2), ("silu", 1024, 64, 1), ("residual", 0, 16, 4), ("store", 0, 32, 1)])
def test_skinny_smem_plans_give_the_same_bits(weights, stream, epilogue: str, norm_size: int,
                                              tile_t: int, split_k: int) -> None:
    """The one-CTA plan (most stages) and the two-CTA plan of one (tile, split) compute the
    same bits (only the pipeline depth differs), at M across the token tiles, and match numpy."""
    import cutlass

    from cutlass_kernels.gemm import signatures
    from cutlass_kernels.gemm_skinny import GemmSkinnySm90

    n, k = 6144, 1024
    w, w_dev = weights(n, k)
    sig = signatures("bf16")[0]
    fns = []
    for ctas in (1, 2):
        op = GemmSkinnySm90(n, k, cutlass.BFloat16, tile_t, split_k, True, epilogue,
                            norm_size, 1e-6 if norm_size else 0.0, max_ctas=ctas)
        assert op.ctas_per_sm == ctas
        fns.append(sig.compile(op))
    rng = np.random.default_rng()
    n_out = n // 2 if epilogue == "silu" else n
    for m in (1, tile_t - 1, tile_t, tile_t + 1, 2 * tile_t):
        a = _rand_bf16(rng, (2 * tile_t, k))
        a_dev = to_device(a)
        c0 = _rand_bf16(rng, (m, n_out))
        outs = []
        for fn in fns:
            c_dev = to_device(c0) if epilogue == "residual" else device_array((m, n_out), BF16)
            if epilogue != "residual":
                c_dev.fill_bytes(0xFF, stream)
            fn(a_dev, w_dev, c_dev, m, -(-m // tile_t) * tile_t, stream)
            stream.synchronize()
            outs.append(c_dev.download())
        assert outs[0].tobytes() == outs[1].tobytes(), f"plans differ at M={m} {epilogue}"
        got = outs[0].astype(np.float32)
        assert np.isfinite(got).all(), f"unwritten outputs at M={m} {epilogue}"
        if epilogue == "store":
            ref = ref_gemm(a[:m], w)
            err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
            assert err < TOL_OUT["bf16"], f"rel err {err:.2e} at M={m}"
