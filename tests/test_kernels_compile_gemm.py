"""CPU checks of cutlass_kernels/gemm.py: every model's linear layers compile for sm_90a (every
path, the opt-in wide one at the Qwen3 shapes), the PTX holds what Hopper needs, the epilogue's
register order matches the accumulator, and the launcher validates shapes and arguments. No GPU
needed (CUTE_DSL_ARCH=sm_90a)."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass_kernels._common")  # sets CUTE_DSL_ARCH before cutlass loads

from cutlass_kernels import gemm as G  # noqa: E402  (after the importorskip)
from cutlass_kernels._common import KernelArgError  # noqa: E402

# (hidden, q_size, kv_size, intermediate, vocab) per model; q = heads * head_dim
MODELS = {
    "qwen3-0.6b": (1024, 16 * 128, 8 * 128, 3072, 151936),
    "qwen3-1.7b": (2048, 16 * 128, 8 * 128, 6144, 151936),
    "qwen3-4b": (2560, 32 * 128, 8 * 128, 9728, 151936),
    "qwen3-8b": (4096, 32 * 128, 8 * 128, 12288, 151936),
    "smollm2-135m": (576, 9 * 64, 3 * 64, 1536, 49152),
    # tools/make_checkpoint.py test presets
    "tiny-qwen3": (128, 4 * 64, 2 * 64, 256, 1024),
    "tiny-llama": (256, 4 * 64, 1 * 64, 512, 1000),
    "small-qwen3": (256, 4 * 128, 2 * 128, 768, 151936),
    "small-llama": (192, 3 * 64, 1 * 64, 512, 2048),
}


# Threads whose epilogue mapping is checked: lanes 0-7, 15-17, 31, and the first/last lane of
# each warp; the second group of 22 is the same set in the second warpgroup.
_WG = [0, 1, 2, 3, 4, 5, 6, 7, 15, 16, 17, 31, 32, 63, 64, 65, 95, 96, 97, 126, 127, 100]
THREADS = _WG + [128 + t for t in _WG]


def linear_shapes(h: int, q: int, kv: int, inter: int, vocab: int) -> list[tuple[int, int, str]]:
    """(N, K, out dtype) of qkv, o_proj, gate_up, down, lm_head."""
    return [(q + 2 * kv, h, "bf16"), (h, q, "bf16"), (2 * inter, h, "bf16"), (h, inter, "bf16"),
            (vocab, h, "f32")]


@pytest.mark.parametrize("model", list(MODELS))
def test_compiles_every_linear_layer(model: str) -> None:
    for n, k, out in linear_shapes(*MODELS[model]):
        launcher = G.compile_gemm(n, k, out)
        assert [t for t, _, _ in launcher.cfg.skinny] == [16, 32, 64]
        assert len(launcher.compiled()) == 4
        assert launcher.path(1) == "skinny16" and launcher.path(16) == "skinny16"
        assert launcher.path(17) == "skinny32" and launcher.path(32) == "skinny32"
        assert launcher.path(33) == "skinny64" and launcher.path(128) == "skinny64"
        assert launcher.path(129) == "tiled" and launcher.path(8192) == "tiled"
        assert G.compile_gemm(n, k, out) is launcher  # cached on the key


@pytest.mark.parametrize("model", list(MODELS))
def test_compiles_the_fused_decoder_gemms(model: str) -> None:
    """The engine's fused launchers (cuda_model._jobs): qkv and gate_up with the norm, gate_up
    with SiLU, o and down adding into the residual; the skinny path fused, the rest plain."""
    h, q, kv, inter, _ = MODELS[model]
    for n, k, kw in [(q + 2 * kv, h, {"norm_size": h}), (h, q, {"epilogue": "residual"}),
                     (2 * inter, h, {"norm_size": h, "epilogue": "silu"}),
                     (h, inter, {"epilogue": "residual"})]:
        launcher = G.compile_gemm(n, k, eps=1e-6, **kw)
        assert launcher.cfg.fused and len(launcher.compiled()) == 4
        assert all(launcher.fuses(m) for m in (1, 16, 17, 64, 128))
        assert not launcher.fuses(129) and launcher.path(129) == "tiled"
        assert G.compile_gemm(n, k, eps=1e-6, **kw) is launcher
        assert G.compile_gemm(n, k) is not launcher
    assert not G.compile_gemm(h, q).fuses(1)  # a plain launcher fuses nothing


def test_fuse_max_rows_leaves_the_larger_tiles_plain() -> None:
    """fuse_max_rows=64 (the engine's choice above hidden 2048): tiles 16 / 32 / 64 fused, the
    64-token tile's M = 65..128 plain through unfused(), like the tiled path."""
    launcher = G.compile_gemm(2048, 1024, norm_size=1024, eps=1e-6, fuse_max_rows=64,
                              skinny_tiles=(16, 64))
    assert all(launcher.fuses(m) for m in (1, 16, 17, 64))
    assert not any(launcher.fuses(m) for m in (65, 128, 129))
    assert launcher.path(100) == "skinny64"
    with pytest.raises(KernelArgError, match="unfused"):
        launcher(16, 16, 16, 100, None)
    with pytest.raises(KernelArgError, match="fused"):
        launcher.unfused(16, 16, 16, 64, None)
    assert G.compile_gemm(2048, 1024, norm_size=1024, eps=1e-6,
                          skinny_tiles=(16, 64)) is not launcher


def test_fused_gemm_rejects_what_it_cannot_fuse() -> None:
    from cutlass_kernels.gemm_skinny import GemmSkinnySm90

    with pytest.raises(G.GemmShapeError, match="epilogue"):
        G.compile_gemm(1024, 1024, epilogue="gelu")
    with pytest.raises(G.GemmShapeError, match="bf16"):
        G.compile_gemm(1024, 1024, "f32", norm_size=1024)
    with pytest.raises(G.GemmShapeError, match="slabs"):
        G.compile_gemm(1000, 1024, epilogue="silu")
    with pytest.raises(G.GemmShapeError, match="norm_size"):
        G.compile_gemm(1024, 1024, norm_size=2048)
    with pytest.raises(G.GemmShapeError, match="128"):
        G.compile_gemm(1024, 1024, norm_size=1024, crossover=256, skinny_tiles=(256,))
    with pytest.raises(ValueError, match="bf16"):
        import cutlass

        GemmSkinnySm90(1024, 1024, cutlass.Float32, epilogue="residual")


def test_fused_launcher_refuses_the_wrong_path() -> None:
    launcher = G.compile_gemm(2048, 1024, norm_size=1024, eps=1e-6)
    with pytest.raises(KernelArgError, match="unfused"):
        launcher(16, 16, 16, 129, None)  # the tiled path: through unfused()
    with pytest.raises(KernelArgError, match="fused"):
        launcher.unfused(16, 16, 16, 8, None)  # the skinny path is fused only


@pytest.mark.parametrize("tile_t", [8, 16, 32, 64, 128])
def test_fused_norm_thread_map_covers_each_row_once(tile_t: int) -> None:
    """Each of the 128 threads squares ``sq_elems`` of one row per stage, in 16-byte chunks
    rotated by row (``_sq_pass``); together every element of the tile's 64-column stage, once;
    8 adjacent threads read 8 distinct chunks (no bank conflict); a row's threads are adjacent
    lanes of one warp (their butterfly stays inside the group)."""
    import cutlass

    from cutlass_kernels.gemm_skinny import GemmSkinnySm90

    op = GemmSkinnySm90(4096, 1024, cutlass.BFloat16, tile_t, 2, norm_size=1024, eps=1e-6)
    e, v, tpr = min(op.sq_elems, 8), op.sq_vecs, op.sq_tpr

    def chunk(t: int, j: int) -> int:  # the element offset of thread t's j-th chunk
        row, part = t // tpr, t % tpr
        return row * 64 + (part + tpr * ((row + j) % v)) * e

    seen = sorted(chunk(t, j) + i for t in range(128) for j in range(v) for i in range(e))
    assert seen == list(range(tile_t * 64))
    if e == 8:
        for j in range(v):
            for g in range(0, 128, 8):
                assert len({chunk(t, j) // 8 % 8 for t in range(g, g + 8)}) == 8
    assert 32 % tpr == 0 and tpr & (tpr - 1) == 0


@pytest.mark.parametrize("tile_t,split_k", [(8, 1), (32, 2), (128, 8), (256, 2)])
def test_compiles_other_skinny_configs(tile_t: int, split_k: int) -> None:
    """Token tiles and split factors the lead may tune to (one CTA per SM at 128 and 256)."""
    launcher = G.compile_gemm(4096, 1024, "bf16", crossover=tile_t, skinny_tiles=(tile_t,),
                              split_k=split_k)
    assert [p[:2] for p in launcher.cfg.skinny] == [(tile_t, split_k)]
    assert launcher.path(tile_t) == f"skinny{tile_t}" and launcher.path(tile_t + 1) == "tiled"


def test_compiles_tiled_only_and_tile_n() -> None:
    launcher = G.compile_gemm(960, 576, "bf16", crossover=0, tile_n=256)
    assert launcher.path(1) == "tiled" and launcher.cfg.skinny == ()
    assert len(launcher.compiled()) == 1


def _ptx(kernel) -> str:
    import cutlass
    import cutlass.cute as cute

    from cutlass_kernels._common import fake_ptr, fake_stream
    from cutlass_kernels.gemm_sm90 import GemmSm90

    m_load = () if isinstance(kernel, GemmSm90) else (cutlass.Int32(1),)  # skinny: M, M_load
    f = cute.compile(kernel, fake_ptr("bf16"), fake_ptr("bf16"),
                     fake_ptr("f32" if kernel.c_dtype is cutlass.Float32 else "bf16"),
                     cutlass.Int32(1), *m_load, fake_stream(), options="--keep-ptx")
    return f.__ptx__


def test_ptx_has_hopper_instructions(tmp_path, monkeypatch) -> None:
    import cutlass

    from cutlass_kernels.gemm_skinny import GemmSkinnySm90
    from cutlass_kernels.gemm_sm90 import GemmSm90

    monkeypatch.chdir(tmp_path)  # --keep-ptx also writes a .ptx file into the working directory
    tiled = _ptx(GemmSm90(4096, 4096, cutlass.BFloat16, tile_n=256))
    assert ".target sm_90a" in tiled
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in tiled
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in tiled  # TMA loads
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in tiled  # TMA store epilogue
    assert "stmatrix" in tiled
    assert not re.search(r"\b(ld|st)\.local", tiled)

    skinny = _ptx(GemmSkinnySm90(4096, 4096, cutlass.BFloat16, tile_t=16, split_k=4))
    assert ".target sm_90a" in skinny
    assert "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16" in skinny
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in skinny
    assert "ld.shared::cluster.v4" in skinny and "mapa.shared::cluster" in skinny
    assert skinny.count("barrier.cluster.arrive") == 2
    assert not re.search(r"\b(ld|st)\.local", skinny)


def test_pdl_prefetches_w_before_the_grid_wait(tmp_path, monkeypatch) -> None:
    """pdl=True: launched with the PDL attribute, W's first TMA loads before griddepcontrol.wait
    and nothing written to global memory before it; pdl=False has no wait at all."""
    import cutlass

    from cutlass_kernels.gemm_skinny import GemmSkinnySm90

    monkeypatch.chdir(tmp_path)
    ptx = _ptx(GemmSkinnySm90(4096, 4096, cutlass.BFloat16, tile_t=16, split_k=4, pdl=True))
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx[:wait]  # W prefetch
    assert not re.search(r"\bst\.global|cp\.async\.bulk\.tensor\.\dd\.global\.shared",
                         ptx[:wait])
    assert "griddepcontrol" not in _ptx(GemmSkinnySm90(4096, 4096, cutlass.BFloat16, tile_t=16,
                                                       split_k=4))
    launcher = G.compile_gemm(4096, 4096, "bf16", pdl=True)
    assert launcher.cfg.pdl and launcher is not G.compile_gemm(4096, 4096, "bf16")


def test_no_register_spills(tmp_path, monkeypatch) -> None:
    """Assemble the PTX with a local ptxas (when there is one) and require zero spills."""
    import shutil
    import subprocess

    import cutlass

    from cutlass_kernels.gemm_skinny import GemmSkinnySm90
    from cutlass_kernels.gemm_sm90 import GemmSm90

    ptxas = shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas on PATH")
    monkeypatch.chdir(tmp_path)
    from cutlass_kernels.gemm_wide import GemmWideSm90

    kernels = [GemmSm90(4096, 4096, cutlass.BFloat16, tile_n=256),
               GemmSm90(4096, 4096, cutlass.Float32, tile_n=128),
               GemmSkinnySm90(4096, 4096, cutlass.BFloat16, tile_t=64, split_k=4),
               GemmSkinnySm90(4096, 4096, cutlass.Float32, tile_t=256, split_k=2),
               # the wide path's fullest register files: 4 warpgroups at tile 128 (544 threads,
               # <= 120 registers), 2 at tile 256 (fp32 out), PDL
               GemmWideSm90(6144, 4096, cutlass.BFloat16, slab=256, tile_t=128, split_k=4),
               GemmWideSm90(151936, 4096, cutlass.Float32, slab=128, tile_t=256, split_k=1),
               GemmWideSm90(4096, 12288, cutlass.BFloat16, slab=128, tile_t=192, split_k=4,
                            pdl=True)]
    for i, kernel in enumerate(kernels):
        src = tmp_path / f"k{i}.ptx"
        # The DSL's bundled toolchain may emit a newer PTX ISA than the local ptxas knows; the
        # instructions used here exist in ISA 9.0 (CUDA 13.0).
        src.write_text(re.sub(r"^\.version \S+", ".version 9.0", _ptx(kernel), flags=re.M))
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.o")],
                             capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"local ptxas cannot assemble the PTX: {res.stderr.strip()[:200]}")
        assert "0 bytes spill stores, 0 bytes spill loads" in res.stderr, res.stderr


@pytest.mark.parametrize("tile_n,out", [(256, "bf16"), (256, "f32"), (128, "bf16"),
                                        (128, "f32")])
def test_epilogue_register_order_matches_accumulator(tile_n: int, out: str) -> None:
    """The epilogue copies accumulator values by flat index: sub-tile e takes values
    [e*n, (e+1)*n) of the retiled accumulator as the r2s copy's n source values. Check on the
    layouts that both name the same output element, for every value of a set of threads that
    covers each lane of a quad, both halves of a warp, every warp and warpgroup."""
    import cutlass
    import cutlass.cute as cute

    from cutlass_kernels.gemm_sm90 import GemmSm90, make_epilogue_r2s

    g = GemmSm90(4096, 4096, G.OUT_DTYPES[out], tile_n=tile_n)
    found: list[tuple[int, int, int, int]] = []

    @cute.jit
    def trace():
        tiled_mma = g.make_tiled_mma()
        tiled_r2s = make_epilogue_r2s(tiled_mma, g.c_dtype)
        coords = cute.make_identity_tensor((g.tile_mnk[0], g.tile_mnk[1]))
        epi_coords = cute.make_identity_tensor(g.epi_tile)
        epi_grid = (g.tile_mnk[0] // g.epi_tile[0], g.tile_mnk[1] // g.epi_tile[1])
        epi_order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))
        for t in THREADS[:g.threads // 128 * 22]:
            acc = tiled_r2s.retile(tiled_mma.get_slice(t).partition_C(coords))
            src = tiled_r2s.get_slice(t).partition_S(epi_coords)
            n = cute.size(src)
            for e in cutlass.range_constexpr(cute.size(epi_order)):
                me, ne = epi_order.get_hier_coord(e)
                for v in cutlass.range_constexpr(n):
                    a, s = acc[e * n + v], src[v]
                    found.append((int(a[0]), int(a[1]), me * g.epi_tile[0] + int(s[0]),
                                  ne * g.epi_tile[1] + int(s[1])))

    trace()
    per_thread = g.tile_mnk[0] * g.tile_mnk[1] // g.threads
    assert len(found) == per_thread * len(THREADS[:g.threads // 128 * 22])
    bad = [f for f in found if f[:2] != f[2:]]
    assert not bad, f"{len(bad)} mismatches, e.g. {bad[:4]}"
    assert len({f[:2] for f in found}) == len(found)  # no element twice


def test_split_k_choice() -> None:
    """The fewest splits whose CTAs (slabs x split x token tiles) cover 45% of the 132 SMs
    (>= 60), one more while K per split stays >= 64 tiles and the CTAs fit one per SM; capped
    by 8 and K/64. The measurements behind it are in docs/perf.md (v26)."""
    assert G.choose_split_k(4096, 4096) == 2  # 64 slabs -> 128 CTAs: K 64 tiles (8b o_proj)
    assert G.choose_split_k(4096, 12288) == 2  # down: 192 K tiles, 256 CTAs would not fit
    assert G.choose_split_k(6144, 4096) == 1  # 96 slabs: 192 CTAs would not fit (qkv)
    assert G.choose_split_k(24576, 4096) == 1  # 384 slabs already cover the SMs (gate_up)
    assert G.choose_split_k(151936, 1024) == 1  # lm_head: 2374 slabs
    assert G.choose_split_k(1024, 2048) == 4  # 16 slabs x 4 = 64 (0.6b o_proj; K too short)
    assert G.choose_split_k(4096, 1024) == 1  # 64 slabs (0.6b qkv): K 16 tiles, no doubling
    assert G.choose_split_k(4096, 4096, token_tiles=2) == 1  # M = 65..128: 128 CTAs at 1
    assert G.choose_split_k(512, 128) == 2  # never more splits than K tiles
    assert G.choose_split_k(1024, 2048, num_sms=64) == 2  # 16 x 2 = 32 >= 29
    for model in MODELS:
        for n, k, _ in linear_shapes(*MODELS[model]):
            for tiles in (1, 2):
                s = G.choose_split_k(n, k, token_tiles=tiles)
                assert s in (1, 2, 4, 8) and s <= k // 64
                assert (n + 63) // 64 * s * tiles >= 60 or s == 8 or 2 * s > k // 64


def test_skinny_plan_choice(monkeypatch) -> None:
    """One CTA per SM (the most stages) where the largest M's CTAs fit one per SM in clusters
    of <= 4; else two resident per SM. compile_gemm plans each kernel for the M it serves:
    a fused launcher's plain kernels (above fuse_max_rows) for their own M."""
    from cutlass_kernels.gemm_skinny import skinny_plan

    assert G.choose_skinny_ctas(4096, 2) == 1  # 128 CTAs
    assert G.choose_skinny_ctas(6144, 2) == 2  # 192
    assert G.choose_skinny_ctas(4096, 1, token_tiles=2) == 1  # 128
    assert G.choose_skinny_ctas(6144, 1, token_tiles=2) == 2  # 192
    assert G.choose_skinny_ctas(512, 8) == 2  # 64 CTAs, but clusters of 8
    assert skinny_plan(64, max_ctas=1)[:2] == (12, 1) and skinny_plan(64)[:2] == (5, 2)
    assert skinny_plan(16)[:2] == (10, 2) and skinny_plan(16, max_ctas=1)[:2] == (12, 1)
    monkeypatch.setattr(G.common, "cached_compile", lambda key, build: key[1])
    cfg = G.compile_gemm(4096, 4096, epilogue="residual", fuse_max_rows=64)
    assert cfg.skinny == ((16, 2, 1), (32, 2, 1), (64, 2, 1)) and cfg.plain == ((64, 1, 1),)
    cfg = G.compile_gemm(6144, 1024, epilogue="silu", norm_size=1024, fuse_max_rows=128)
    assert cfg.skinny == ((16, 1, 1), (32, 1, 1), (64, 1, 2)) and cfg.plain == ()
    cfg = G.compile_gemm(4096, 1024, epilogue="residual", fuse_max_rows=20)  # two plain tiles
    assert [p[0] for p in cfg.skinny] == [16, 32, 64] and [p[0] for p in cfg.plain] == [32, 64]
    monkeypatch.setenv("CUTEINFER_SKINNY_PLAN", "v2")  # v2's rule, to measure against
    assert G.choose_split_k(6144, 4096) == 2 and G.choose_skinny_ctas(4096, 2) == 2


@pytest.mark.parametrize("n,k,out,match", [
    (1001, 1024, "bf16", "N=1001"), (0, 1024, "bf16", "N=0"), (1024, 1000, "bf16", "K=1000"),
    (1024, 32, "bf16", "K=32"), (1024, 1024, "f16", "out_dtype"),
])
def test_rejects_unsupported_shapes(n: int, k: int, out: str, match: str) -> None:
    with pytest.raises(G.GemmShapeError, match=match):
        G.compile_gemm(n, k, out)


def test_rejects_bad_options() -> None:
    with pytest.raises(G.GemmShapeError, match="split_k"):
        G.compile_gemm(1024, 128, split_k=4)  # K = 128 has 2 tiles
    with pytest.raises(G.GemmShapeError, match="skinny tile"):
        G.compile_gemm(1024, 128, skinny_tiles=(12,))
    with pytest.raises(G.GemmShapeError, match="tile_n"):
        G.compile_gemm(1024, 128, tile_n=64)


def test_launcher_checks_arguments() -> None:
    launcher = G.compile_gemm(128, 256, "bf16")
    launcher(0, 0, 0, 0, None)  # M = 0: nothing to do, nothing launched
    with pytest.raises(KernelArgError, match="aligned"):
        launcher(0x1008, 0x2000, 0x3000, 4, None)
    with pytest.raises(KernelArgError, match="m must be"):
        launcher(0x1000, 0x2000, 0x3000, 4.0, None)
    with pytest.raises(KernelArgError, match="m must be"):
        launcher(0x1000, 0x2000, 0x3000, -1, None)


# ---------------------------------------------------------------------------------------------
# The wide path (gemm_wide.py): opt-in, M = 65..512 by default


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-0.6b"])
def test_wide_compiles_qwen3_layers(model: str) -> None:
    """The engine's wide options (CUTEINFER_GEMM_WIDE=1) at every linear layer: tiles 128
    (slab 256), 192 and 256 (slab 128) between skinny64 and the tiled path."""
    for n, k, out in linear_shapes(*MODELS[model]):
        launcher = G.compile_gemm(n, k, out, **G.wide_options(65))
        assert [(t, slab) for t, slab, _ in launcher.cfg.wide] == [(128, 256), (192, 128),
                                                                   (256, 128)]
        for _, slab, split in launcher.cfg.wide:
            assert split == G.choose_wide_split(n, k, slab)
        assert len(launcher.compiled()) == 7
        assert launcher.path(64) == "skinny64" and launcher.path(65) == "wide128"
        assert launcher.path(128) == "wide128" and launcher.path(129) == "wide192"
        assert launcher.path(192) == "wide192" and launcher.path(193) == "wide256"
        assert launcher.path(512) == "wide256" and launcher.path(513) == "tiled"
        assert launcher.tile_for(300) == 256 and launcher.tile_for(513) == 0
        assert G.compile_gemm(n, k, out, **G.wide_options(65)) is launcher
        assert launcher is not G.compile_gemm(n, k, out)  # the default stays without it


def test_wide_from_33_adds_the_64_tile() -> None:
    n, k, _ = linear_shapes(*MODELS["qwen3-8b"])[1]  # o_proj 4096 x 4096
    launcher = G.compile_gemm(n, k, **G.wide_options(33))
    assert [t for t, _, _ in launcher.cfg.wide] == [64, 128, 192, 256]
    assert launcher.cfg.wide[0][1] == 256  # slab 256 at tile 64
    assert launcher.path(32) == "skinny32" and launcher.path(33) == "wide64"
    assert launcher.path(64) == "wide64" and launcher.path(65) == "wide128"


@pytest.mark.parametrize("n,k,out,tile_t,slab,split_k", [
    (960, 576, "bf16", 64, 256, 2),  # N = 3.75 slabs of 256; 9 K tiles over 2 splits
    (960, 576, "bf16", 192, 128, 4),  # N = 7.5 slabs of 128; 9 K tiles over 4
    (1000, 256, "f32", 256, 128, 3),  # odd N (fp32 out), a cluster of 3 over 4 K tiles
    (4096, 1024, "bf16", 128, 128, 8),  # slab 128 at tile 128
    (1024, 3072, "bf16", 128, 256, 7),  # 48 K tiles over 7 splits
])
def test_wide_compiles_edge_shapes(n: int, k: int, out: str, tile_t: int, slab: int,
                                   split_k: int) -> None:
    launcher = G.compile_gemm(n, k, out, crossover=0, wide_tiles=(tile_t,), wide_range=(1, 512),
                              wide_slab=slab, wide_split_k=split_k)
    assert launcher.cfg.wide == ((tile_t, slab, split_k),)
    assert launcher.path(1) == f"wide{tile_t}" and launcher.path(512) == f"wide{tile_t}"
    assert launcher.path(513) == "tiled"


def test_wide_ptx(tmp_path, monkeypatch) -> None:
    """wgmma of the token tile, TMA loads, a named barrier for the consumer warpgroups, the
    DSMEM reduction between two cluster barriers, no local memory; with PDL, W's TMA before the
    one griddepcontrol.wait and no global write before it."""
    import cutlass

    from cutlass_kernels.gemm_wide import GemmWideSm90

    monkeypatch.chdir(tmp_path)
    ptx = _ptx(GemmWideSm90(6144, 4096, cutlass.BFloat16, slab=256, tile_t=128, split_k=4))
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx
    assert "ld.shared::cluster.v4" in ptx and "mapa.shared::cluster" in ptx
    assert ptx.count("barrier.cluster.arrive") == 2
    assert re.search(r"bar(rier)?\.sync(\.aligned)?\s+1,\s*512", ptx)  # the consumers' barrier
    assert "griddepcontrol" not in ptx
    assert not re.search(r"\b(ld|st)\.local", ptx)

    ptx = _ptx(GemmWideSm90(4096, 4096, cutlass.BFloat16, slab=128, tile_t=256, split_k=1,
                            pdl=True))
    assert "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16" in ptx
    assert "barrier.cluster" not in ptx and "mapa" not in ptx
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.count("griddepcontrol.wait") == 1
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx[:wait]  # W prefetch
    assert not re.search(r"\bst\.global|cp\.async\.bulk\.tensor\.\dd\.global\.shared",
                         ptx[:wait])


@pytest.mark.parametrize("slab,tile_t", [(128, 64), (128, 192), (256, 128), (128, 256)])
@pytest.mark.parametrize("split_k", [1, 2, 3, 4, 5, 8])
def test_wide_split_covers_k_and_tile_once(slab: int, tile_t: int, split_k: int) -> None:
    """The index arithmetic of the kernel, replayed in Python: the splits' K ranges partition
    the K tiles (none empty), and the CTAs' reduction vectors cover the tile once each."""
    import cutlass

    from cutlass_kernels.gemm_wide import GemmWideSm90

    k_tiles = 9
    g = GemmWideSm90(1024, 64 * k_tiles, cutlass.BFloat16, slab, tile_t, split_k)
    ks = [k for s in range(split_k)
          for k in range(s * k_tiles // split_k, (s + 1) * k_tiles // split_k)]
    assert ks == list(range(k_tiles))
    assert all((s + 1) * k_tiles // split_k > s * k_tiles // split_k for s in range(split_k))
    seen = []
    for split in range(split_k):
        for it in range(-(-g.vecs_per_cta // g.mma_threads)):
            for tidx in range(g.mma_threads):
                j = it * g.mma_threads + tidx
                v = split * g.vecs_per_cta + j
                if j < g.vecs_per_cta and v < g.vecs:
                    seen.append((v // (slab // 4), v % (slab // 4)))
    assert sorted(seen) == [(t, r) for t in range(tile_t) for r in range(slab // 4)]
    # the partial tile fits in the drained pipeline buffers
    assert tile_t * (slab + 4) * 4 <= g.stages * (slab + tile_t) * 64 * 2
    assert g.stages >= 4


def test_wide_split_choice() -> None:
    """Fewest splits minimizing waves * (K tiles per split + 2) at one CTA per SM."""
    assert G.choose_wide_split(4096, 4096, 256) == 8  # 16 slabs x 8 = 128 CTAs (o_proj)
    assert G.choose_wide_split(6144, 4096, 256) == 4  # 24 x 4 = 96: 18 beats 192 CTAs' 20
    assert G.choose_wide_split(24576, 4096, 256) == 4  # 96 x 4 = 384: 3 waves of 16 + 2
    assert G.choose_wide_split(4096, 12288, 128) == 4  # 32 x 4 = 128 (down, slab 128)
    assert G.choose_wide_split(512, 128, 128) == 2  # never more splits than K tiles
    for model in ("qwen3-8b", "qwen3-0.6b", "smollm2-135m", "tiny-qwen3"):
        for n, k, _ in linear_shapes(*MODELS[model]):
            for slab in (128, 256):
                s = G.choose_wide_split(n, k, slab)
                assert s in (1, 2, 4, 8) and s <= k // 64


def test_rejects_bad_wide_options() -> None:
    with pytest.raises(G.GemmShapeError, match="wide tile 96"):
        G.compile_gemm(1024, 1024, wide_tiles=(96,))
    with pytest.raises(G.GemmShapeError, match="wide tile 192"):
        G.compile_gemm(1024, 1024, wide_tiles=(192,), wide_slab=256)  # registers
    with pytest.raises(G.GemmShapeError, match="wide_slab"):
        G.compile_gemm(1024, 1024, wide_tiles=(64,), wide_slab=64)
    with pytest.raises(G.GemmShapeError, match="wide_split_k"):
        G.compile_gemm(1024, 128, wide_tiles=(64,), wide_split_k=4)  # K = 128 has 2 tiles
    with pytest.raises(G.GemmShapeError, match="wide_split_k"):
        G.compile_gemm(1024, 1024, wide_tiles=(64,), wide_split_k=9)
    with pytest.raises(G.GemmShapeError, match="wide_range"):
        G.compile_gemm(1024, 1024, wide_tiles=(64,), wide_range=(100, 50))


def test_wide_options_and_env(monkeypatch) -> None:
    from engine import envs

    assert G.wide_options(0) == {}
    assert G.wide_options(65) == {"wide_tiles": (128, 192, 256), "wide_range": (65, 512)}
    assert G.wide_options(64)["wide_tiles"] == (64, 128, 192, 256)
    for value, want in [("", 0), ("0", 0), ("off", 0), ("1", 65), ("on", 65), ("33", 33),
                        ("100", 100)]:
        monkeypatch.setenv("CUTEINFER_GEMM_WIDE", value)
        assert envs.gemm_wide_from() == want, value
    for bad in ("513", "x", "-3"):
        monkeypatch.setenv("CUTEINFER_GEMM_WIDE", bad)
        with pytest.raises(ValueError, match="CUTEINFER_GEMM_WIDE"):
            envs.gemm_wide_from()
    monkeypatch.delenv("CUTEINFER_GEMM_WIDE")
    assert envs.gemm_wide_from() == 0


def test_engine_gate_up_block_is_the_silu_epilogue_half_slab() -> None:
    """DeviceWeights orders gate_up rows in the blocks the fused SiLU epilogue reads."""
    from cutlass_kernels.gemm_skinny import HALF, SLAB
    from engine.executor.cuda_model import GATE_UP_BLOCK

    assert GATE_UP_BLOCK == HALF == SLAB // 2
