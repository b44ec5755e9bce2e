"""Linear layers: ``C[M, N] = A[M, K] @ W[N, K]^T`` on Hopper, bf16 in, fp32 accumulate.

Entry point: ``compile_gemm(n, k, out_dtype)`` returns a ``GemmLauncher``; call it as
``launcher(a, w, c, m, stream)``. N and K (the weight's shape) and the output dtype are
compile-time; M (tokens) is a runtime value, 1 .. any.

Layout (docs/kernels.md): A ``bf16[M, K]`` activations, W ``bf16[N, K]`` the checkpoint weight
(``[out_features, in_features]``; QKV and gate_up are concatenated along N), C ``[M, N]`` bf16 or
fp32 (``out_dtype="f32"`` for lm_head logits). All row-major and contiguous; C is rounded once,
from the fp32 accumulator.

Constraints (checked by ``compile_gemm``): N % 8 == 0, K % 64 == 0, N, K > 0; buffers 16-byte
aligned (checked per call). M = 0 is a no-op. A model width that is not such a multiple (a
vocabulary of 32001, an intermediate size of 416) is padded by the engine with zero weight rows /
columns (``engine/executor/cuda_shapes.Padded``): zero columns of K add exactly nothing, and the
extra columns of C are never read.

Up to three paths, chosen per call by M (M stays dynamic inside each compiled kernel):

* ``M <= crossover`` (decode): ``gemm_skinny.GemmSkinnySm90``, swap-AB wgmma + TMA with a
  cluster split-K, built to stream W once at HBM bandwidth. One compile per token tile in
  ``skinny_tiles``; the smallest tile >= M serves the call (above the largest tile, the largest
  one runs ceil(M / tile) token tiles). Each kernel's split-K (``choose_split_k``) and smem
  plan (``choose_skinny_ctas``: one CTA per SM with the most stages, or two) are chosen for
  the M it serves.
* ``M > crossover`` (prefill, big batches): ``gemm_sm90.GemmSm90``, a 128 x ``tile_n`` x 64
  tiled wgmma GEMM with a multistage TMA pipeline and TMA-store epilogue.
* Opt-in, ``wide_tiles`` (default none; ``CUTEINFER_GEMM_WIDE`` in the engine): M in
  ``wide_range`` (default 65..512) goes to ``gemm_wide.GemmWideSm90``, the swap-AB kernel with a
  128- or 256-row W slab per CTA (A's share of the traffic tile_t / slab instead of tile_t / 64)
  and one token tile up to 256 (W streamed once up to M = 256). It takes precedence over both
  other paths inside its range; the smallest wide tile >= M serves the call (above the largest,
  ceil(M / tile) token tiles).

Crossover, reasoned (tune on the GPU): the tiled path launches ceil(M/128) * ceil(N/tile_n)
CTAs, far below one per SM for M <= 128 at the model widths (N = 4096, M = 128: 16 CTAs on 132
SMs), so there it can neither pull W at HBM speed nor use the tensor cores of idle SMs. The
skinny path always spreads W over ~1-2 waves (64-row slabs x split-K; the token tiles of a slab
run side by side and share W through L2) and its wgmma work stays below the W stream while the
arithmetic intensity M FLOP/byte is under H200's ~200 FLOP/byte ridge. Default crossover 128,
token tiles 16 (decode batch <= 16), 32 and 64 (two tiles for M = 65..128). The 32 tile was
measured in (tools/tune_skinny.py): at M = 32 the 64 tile ran 1.1-1.4x slower than the 32 tile
(qwen3-8b gate_up 74 vs 52 us), slower even than the 64 tile at M = 64.
"""

import os
from dataclasses import dataclass
from typing import Any

import cutlass_kernels._common as common  # sets CUTE_DSL_ARCH before cutlass loads

# isort: split
import cutlass

from cutlass_kernels._common import Kernel, Ptr, Scalar, Signature
from cutlass_kernels.gemm_skinny import EPILOGUES, SLAB, GemmSkinnySm90
from cutlass_kernels.gemm_sm90 import BK, GemmSm90
from cutlass_kernels.gemm_wide import SLABS, TILES, GemmWideSm90, max_tile

OUT_DTYPES = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32}
H200_SMS = 132
WIDE_TILES = (128, 192, 256)  # the wide path's tiles for M = 65..512 (wide_options)
WIDE_RANGE = (65, 512)
WIDE_FIXED_K_TILES = 2  # a CTA's fill + reduction, in K tiles of streaming (a guess: tune)


class GemmShapeError(ValueError):
    """compile_gemm got a shape or option this GEMM does not support; the message says why."""


def choose_split_k(n: int, k: int, num_sms: int = H200_SMS, token_tiles: int = 1) -> int:
    """Split-K factor (cluster size, <= 8) for the skinny path; ``token_tiles``: the token
    tiles of the smallest M the kernel serves (its CTAs are slabs x split x token tiles).

    The fewest splits whose CTAs cover 45% of the SMs; then one doubling more while each split
    still streams >= 64 K tiles and the CTAs still fit one per SM. Measured on an H100
    (tools/tune_skinny.py --ctas both, docs/perf.md v26), each layer's split in a graph of
    gathers and GEMMs: more splits only pay where K is long (qwen3-8b o_proj / down: 64 -> 128
    CTAs, -3%); with K short the cluster reduction costs more than the SMs it fills (qwen3-0.6b
    qkv 64 CTAs 6.3 us, 128 CTAs 7.0; o_proj 4 splits 4.5 us, 8 splits 4.9-7.3). (v2's rule,
    CTAs >= 90% of the SMs: ``CUTEINFER_SKINNY_PLAN=v2``.)
    """
    slabs = (n + SLAB - 1) // SLAB
    k_tiles = (k + BK - 1) // BK
    legacy = _legacy_plan()  # (v2: 90% coverage, no token tiles, no doubling)
    ctas = slabs * (1 if legacy else max(token_tiles, 1))
    want = -(-(90 if legacy else 45) * num_sms // 100)
    split = 1
    while split < 8 and 2 * split <= k_tiles and ctas * split < want:
        split *= 2
    if not legacy and split < 8 and k_tiles // split >= 64 and ctas * 2 * split <= num_sms:
        split *= 2
    return split


def choose_skinny_ctas(n: int, split: int, token_tiles: int = 1,
                       num_sms: int = H200_SMS) -> int:
    """The skinny kernel's smem plan (``gemm_skinny.skinny_plan``): 1 (one CTA per SM with the
    most stages) when the CTAs of the largest M it serves (slabs x split x ``token_tiles``)
    fit one per SM, in clusters of <= 4; else 2 (two resident per SM, fewer stages each). H100,
    M = 64 (v26): qwen3-8b o_proj 15.4 us vs 18.6, down 41.3 vs 44.7; with more CTAs than SMs
    the one-CTA plan runs a second wave (qkv at M = 128: 31.2 vs 25.0 us), and clusters of 8
    of whole-SM CTAs are slow to place (qwen3-0.6b o_proj: 7.3 vs 4.9 us)."""
    if _legacy_plan():
        return 2
    slabs = (n + SLAB - 1) // SLAB
    return 1 if split <= 4 and slabs * split * max(token_tiles, 1) <= num_sms else 2


def _legacy_plan() -> bool:
    """``CUTEINFER_SKINNY_PLAN=v2``: v2's split rule and always the two-CTA smem plan (to
    measure against)."""
    return os.environ.get("CUTEINFER_SKINNY_PLAN", "") == "v2"


def choose_wide_slab(tile_t: int) -> int:
    """W rows per CTA of the wide path: 256 (4 consumer warpgroups, A traffic tile_t / 256 of
    W's) where the accumulators fit (tile_t <= 128), else 128."""
    return 256 if tile_t <= max_tile(256) else 128


def choose_wide_split(n: int, k: int, slab: int, num_sms: int = H200_SMS) -> int:
    """Split-K factor (1, 2, 4 or 8) of the wide path, one CTA per SM: the fewest splits that
    minimize waves * (K tiles per split + WIDE_FIXED_K_TILES), counting one token tile. A
    partial second wave costs a whole wave (every CTA of a wave streams the same bytes)."""
    slabs = -(-n // slab)
    k_tiles = k // BK
    best, best_cost = 1, None
    for split in (1, 2, 4, 8):
        if split > k_tiles:
            break
        cost = -(-slabs * split // num_sms) * (-(-k_tiles // split) + WIDE_FIXED_K_TILES)
        if best_cost is None or cost < best_cost:
            best, best_cost = split, cost
    return best


def wide_options(from_m: int) -> dict[str, Any]:
    """compile_gemm keywords that turn the wide path on for M = from_m..512 (0: off, {}).
    from_m <= 64 adds the 64-token tile (to measure it against skinny64)."""
    if not from_m:
        return {}
    tiles = WIDE_TILES if from_m > 64 else (64, *WIDE_TILES)
    return {"wide_tiles": tiles, "wide_range": (from_m, WIDE_RANGE[1])}


def choose_tile_n(n: int) -> int:
    """Tiled path CTA width: 256 (m64n256 wgmma, most FLOPs per smem byte) for wide weights,
    128 when N is small enough that 256 would leave too few CTAs per M-tile row."""
    return 256 if n >= 4096 else 128


@dataclass(frozen=True)
class GemmConfig:
    n: int
    k: int
    out_dtype: str
    crossover: int
    skinny: tuple[tuple[int, int, int], ...]  # (tile_t, split_k, ctas per SM), ascending
    tile_n: int
    pdl: bool = False
    wide: tuple[tuple[int, int, int], ...] = ()  # (tile_t, slab, split_k), ascending tile_t
    wide_range: tuple[int, int] = WIDE_RANGE  # M served by the wide path (when it has tiles)
    epilogue: str = "store"  # the skinny kernels' fused epilogue (gemm_skinny.EPILOGUES)
    norm_size: int = 0  # > 0: the skinny kernels fuse an RMSNorm of A's rows (its divisor)
    eps: float = 0.0  # that norm's epsilon
    fuse_max_rows: int = 1 << 30  # fused skinny kernels serve M <= this; plain ones above
    plain: tuple[tuple[int, int, int], ...] = ()  # (tile_t, split_k, ctas): those plain ones

    @property
    def fused(self) -> bool:
        return self.epilogue != "store" or self.norm_size > 0


def signatures(out_dtype: str) -> tuple[Signature, Signature]:
    """(skinny, tiled): the skinny kernel also takes the rows its TMA view of A spans."""
    abc = (Ptr("a", "bf16"), Ptr("w", "bf16"), Ptr("c", out_dtype), Scalar("m", cutlass.Int32))
    return Signature(*abc, Scalar("m_load", cutlass.Int32)), Signature(*abc)


class GemmLauncher:
    """Typed entry to the compiled kernels of one (N, K, out_dtype).

    ``launcher(a, w, c, m, stream)``: a, w, c are device buffers (objects with ``.ptr``) or
    integer addresses; m is a Python int; stream a ``cuda.bindings.driver.CUstream`` (or an
    object with ``.handle``, e.g. engine.cuda.driver.Stream).
    """

    def __init__(self, cfg: GemmConfig, skinny: list[tuple[int, Kernel]], tiled: Kernel,
                 wide: list[tuple[int, Kernel]] | None = None,
                 plain: dict[int, Kernel] | None = None) -> None:
        self.cfg = cfg
        self._plain = plain or {}  # tile_t -> plain skinny kernel (M > cfg.fuse_max_rows)
        self._skinny = skinny  # [(tile_t, kernel)] ascending
        self._tiled = tiled
        self._wide = wide or []  # [(tile_t, kernel)] ascending

    def fuses(self, m: int) -> bool:
        """Whether a call of M rows runs the fused skinny kernel (a fused launcher); otherwise
        the caller runs the unfused sequence through ``unfused``."""
        return self._fused_kind(self._pick(m)[0], m)

    def _fused_kind(self, kind: str, m: int) -> bool:
        return self.cfg.fused and kind == "skinny" and m <= self.cfg.fuse_max_rows

    def tile_for(self, m: int) -> int:
        """The token tile (skinny or wide) serving M rows, 0 for the tiled path."""
        return self._pick(m)[1]

    def path(self, m: int) -> str:
        """Which kernel serves M: 'skinny<tile_t>', 'wide<tile_t>' or 'tiled'."""
        kind, tile_t, _ = self._pick(m)
        return f"{kind}{tile_t}" if tile_t else kind

    def _pick(self, m: int) -> tuple[str, int, Kernel]:
        """(path, token tile, kernel); the tiled path has token tile 0."""
        lo, hi = self.cfg.wide_range
        if self._wide and lo <= m <= hi:
            for tile_t, fn in self._wide:
                if m <= tile_t:
                    return "wide", tile_t, fn
            return ("wide", *self._wide[-1])
        if m <= self.cfg.crossover:
            for tile_t, fn in self._skinny:
                if m <= tile_t:
                    return "skinny", tile_t, fn
            if self._skinny:
                return ("skinny", *self._skinny[-1])
        return "tiled", 0, self._tiled

    def compiled(self) -> list[Any]:
        """Every compiled function (to load modules, ``f.to()``, before graph capture)."""
        return ([k.compiled for _, k in self._skinny] + [k.compiled for _, k in self._wide]
                + [k.compiled for k in self._plain.values()] + [self._tiled.compiled])

    def __call__(self, a: Any, w: Any, c: Any, m: int, stream: Any,
                 tile_as: int | None = None) -> None:
        """``tile_as``: run the kernel (token tile, split-K) that a call of ``tile_as`` rows
        would run, over ``m`` rows (default: ``m``'s own). Each row of C is then the same bits
        as in that call: the K order and the split-K reduction of a row depend only on the
        kernel, not on M or on the row's token tile. Speculative verify rows use it to compute
        exactly what plain decoding of the step's sequences computes (engine/speculative.py).

        A fused launcher (``compile_gemm(epilogue=, norm_size=)``) runs only its fused skinny
        kernels here (``fuses``); the other paths through ``unfused``."""
        self._launch(a, w, c, m, stream, tile_as, fused=True)

    def unfused(self, a: Any, w: Any, c: Any, m: int, stream: Any,
                tile_as: int | None = None) -> None:
        """The plain GEMM of a fused launcher's non-skinny paths (where ``fuses`` is False)."""
        self._launch(a, w, c, m, stream, tile_as, fused=False)

    def _launch(self, a: Any, w: Any, c: Any, m: int, stream: Any, tile_as: int | None,
                fused: bool) -> None:
        if not isinstance(m, int) or isinstance(m, bool) or m < 0:
            raise common.KernelArgError(f"m must be a non-negative Python int, got {m!r}")
        if tile_as is not None and (not isinstance(tile_as, int) or tile_as < 1):
            raise common.KernelArgError(f"tile_as must be a positive int, got {tile_as!r}")
        if m == 0:
            return
        m_eff = m if tile_as is None else tile_as
        kind, tile_t, fn = self._pick(m_eff)
        if self.cfg.fused and fused != self._fused_kind(kind, m_eff):
            raise common.KernelArgError(
                f"m={m}: this fused GEMM runs its {kind}{tile_t or ''} path "
                f"{'through unfused()' if fused else 'fused: call it directly'}")
        # The swap-AB kernels index C with Int32; TMA (tiled path) takes 32-bit coordinates.
        if m * self.cfg.k >= 2**31 or (tile_t and m * self.cfg.n >= 2**31):
            raise common.KernelArgError(f"m={m}: M x K or M x N passes 2^31 elements")
        if kind == "skinny" and self.cfg.fused and not fused:  # above fuse_max_rows
            fn = self._plain[tile_t]
        if tile_t:
            fn(a, w, c, m, self.load_rows(a, m, tile_t), stream)
        else:
            fn(a, w, c, m, stream)

    def load_rows(self, a: Any, m: int, tile_t: int) -> int:
        """Rows of A the skinny kernel's TMA view spans: M rounded up to the token tile when A's
        buffer is known (``.nbytes``) to hold them, else M. Measured on the H200: a token tile
        whose box reaches 32 or more rows past the view (zero-filled by TMA) streams W up to 1.4x
        slower; reading real (ignored) rows instead costs nothing."""
        full = -(-m // tile_t) * tile_t
        nbytes = getattr(a, "nbytes", None)
        if nbytes is None or nbytes < full * self.cfg.k * 2:
            return m
        return full


def _check(n: int, k: int, out_dtype: str, crossover: int, skinny_tiles: tuple[int, ...],
           tile_n: int) -> None:
    if out_dtype not in OUT_DTYPES:
        raise GemmShapeError(f"out_dtype must be one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")
    if n <= 0 or n % 8:
        raise GemmShapeError(f"N={n}: must be a positive multiple of 8 (16-byte rows of C)")
    if k <= 0 or k % 64:
        raise GemmShapeError(f"K={k}: must be a positive multiple of 64 (the K tile)")
    if crossover < 0:
        raise GemmShapeError(f"crossover={crossover}: must be >= 0 (0 = tiled path only)")
    if crossover > 0 and not skinny_tiles:
        raise GemmShapeError("crossover > 0 needs at least one skinny tile")
    for t in skinny_tiles:
        if t % 8 or not 8 <= t <= 256:
            raise GemmShapeError(f"skinny tile {t}: must be a multiple of 8 in [8, 256]")
    if tile_n not in (128, 256):
        raise GemmShapeError(f"tile_n={tile_n}: must be 128 or 256")


def _check_fused(n: int, k: int, out_dtype: str, epilogue: str, norm_size: int,
                 skinny: tuple[tuple[int, int, int], ...]) -> None:
    if epilogue not in EPILOGUES:
        raise GemmShapeError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
    if epilogue == "store" and not norm_size:
        return
    if out_dtype != "bf16":
        raise GemmShapeError(f"a fused GEMM writes bf16, got out_dtype={out_dtype!r}")
    if epilogue == "silu" and n % SLAB:
        raise GemmShapeError(f"N={n}: the silu epilogue needs whole {SLAB}-row slabs")
    if not 0 <= norm_size <= k:
        raise GemmShapeError(f"norm_size={norm_size}: must be in [0, K={k}]")
    if norm_size and any(t > 128 for t, *_ in skinny):
        raise GemmShapeError("the fused norm needs skinny tiles <= 128")


def _check_wide(k: int, tiles: tuple[int, ...], wide_range: tuple[int, int], slab: int | None,
                split_k: int | None) -> None:
    lo, hi = wide_range
    if not 1 <= lo <= hi:
        raise GemmShapeError(f"wide_range={wide_range}: must be (lo, hi) with 1 <= lo <= hi")
    if slab is not None and slab not in SLABS:
        raise GemmShapeError(f"wide_slab={slab}: must be one of {SLABS}")
    for t in tiles:
        s = choose_wide_slab(t) if slab is None else slab
        if t not in TILES or t > max_tile(s):
            raise GemmShapeError(f"wide tile {t}: must be one of {TILES}, <= {max_tile(s)} "
                                 f"with slab {s}")
    if split_k is not None and not 1 <= split_k <= min(8, k // BK):
        raise GemmShapeError(f"wide_split_k={split_k}: must be in 1..8 and <= K/64 = {k // BK}")


def compile_gemm(n: int, k: int, out_dtype: str = "bf16", *, crossover: int = 128,
                 skinny_tiles: tuple[int, ...] = (16, 32, 64), split_k: int | None = None,
                 tile_n: int | None = None, num_sms: int = H200_SMS,
                 pdl: bool = False, wide_tiles: tuple[int, ...] = (),
                 wide_range: tuple[int, int] = WIDE_RANGE, wide_slab: int | None = None,
                 wide_split_k: int | None = None, epilogue: str = "store",
                 norm_size: int = 0, eps: float = 0.0,
                 fuse_max_rows: int | None = None) -> GemmLauncher:
    """Compile (once per key) the kernels for ``C[M, n] = A[M, k] @ W[n, k]^T``.

    crossover: largest M served by the skinny (decode) path; 0 disables it.
    skinny_tiles: token tiles compiled for the skinny path (only those needed for M <=
        crossover are compiled). split_k: force the skinny split-K factor (1..8; default from
        ``choose_split_k``). tile_n: tiled-path CTA width (default ``choose_tile_n``).
    num_sms: SM count the split-K heuristic plans for.
    pdl: launch the skinny (and wide) kernels with programmatic dependent launch, prefetching W
        while the previous kernel finishes (gemm_skinny.py); same results.
    wide_tiles: token tiles of the wide path (gemm_wide.py; default none: path off), serving
        M in ``wide_range`` (lo, hi) ahead of the other paths. wide_slab: force its W rows
        per CTA (128 or 256; default ``choose_wide_slab``); wide_split_k: force its split-K
        factor (1..8; default ``choose_wide_split``). ``wide_options``: the engine's choice.
    epilogue / norm_size / eps: fused skinny kernels (gemm_skinny.py, bf16 C): ``"residual"``
        adds the product into C (``C = bf16(C + bf16(A @ W^T))``), ``"silu"`` writes
        ``silu(gate) * up`` of W's 32-row gate / up blocks into C ``[M, N/2]``; ``norm_size``
        > 0 scales row t of the product by ``rsqrt(sum(A[t]^2) / norm_size + eps)`` (an
        RMSNorm of A whose weight the caller folded into W). The skinny path then runs only
        fused (``launcher(...)``), the other paths plain (``launcher.unfused(...)``).
    fuse_max_rows: a fused launcher's skinny path serves M above this many rows with plain
        kernels, through ``unfused`` (default: every skinny M fused).
    """
    tile_n = choose_tile_n(n) if tile_n is None else tile_n
    tiles = tuple(sorted(set(skinny_tiles)))
    _check(n, k, out_dtype, crossover, tiles, tile_n)
    needed: list[int] = []
    for t in tiles:
        if crossover > 0 and (not needed or needed[-1] < crossover):
            needed.append(t)
    if split_k is not None and (split_k not in (1, 2, 4, 8) or split_k > k // BK):
        raise GemmShapeError(f"split_k={split_k}: must be 1, 2, 4 or 8 and <= K/64 = {k // BK}")
    fuse_rows = 1 << 30 if fuse_max_rows is None else int(fuse_max_rows)
    fused = epilogue != "store" or norm_size > 0
    skinny_list, plain_list = [], []
    for i, t in enumerate(needed):
        lo = needed[i - 1] + 1 if i else 1  # the M this tile serves: lo..hi
        hi = t if i < len(needed) - 1 else max(crossover, t)
        parts = [(lo, min(hi, fuse_rows))] if fused else [(lo, hi)]
        if fused and fuse_rows < hi:
            parts.append((max(lo, fuse_rows + 1), hi))
        for j, (a, b) in enumerate(parts):
            if a > b:  # (a fused kernel no M reaches: compiled all the same, as one tile)
                a = b = t
            s_k = split_k or choose_split_k(n, k, num_sms, -(-a // t))
            plan = (t, s_k, choose_skinny_ctas(n, s_k, -(-b // t), num_sms))
            (plain_list if j else skinny_list).append(plan)
    skinny = tuple(skinny_list)
    wtiles = tuple(sorted(set(wide_tiles)))
    wide_range = (int(wide_range[0]), int(wide_range[1]))
    _check_wide(k, wtiles, wide_range, wide_slab, wide_split_k)
    wide = []
    for t in wtiles:
        slab = wide_slab or choose_wide_slab(t)
        wide.append((t, slab, wide_split_k or choose_wide_split(n, k, slab, num_sms)))
    _check_fused(n, k, out_dtype, epilogue, norm_size, skinny)
    cfg = GemmConfig(n, k, out_dtype, crossover, skinny, tile_n, bool(pdl), tuple(wide),
                     wide_range if wide else WIDE_RANGE, epilogue, int(norm_size), float(eps),
                     fuse_rows, tuple(plain_list))
    return common.cached_compile(("gemm", cfg), lambda: _build(cfg))


def _build(cfg: GemmConfig) -> GemmLauncher:
    c_dtype = OUT_DTYPES[cfg.out_dtype]
    skinny_sig, tiled_sig = signatures(cfg.out_dtype)
    skinny = [(t, skinny_sig.compile(GemmSkinnySm90(cfg.n, cfg.k, c_dtype, t, s, cfg.pdl,
                                                    cfg.epilogue, cfg.norm_size, cfg.eps,
                                                    max_ctas=ctas)))
              for t, s, ctas in cfg.skinny]
    # a fused launcher's M above fuse_max_rows (up to the crossover): plain kernels of the
    # tiles that serve those M
    plain = {t: skinny_sig.compile(GemmSkinnySm90(cfg.n, cfg.k, c_dtype, t, s, cfg.pdl,
                                                  max_ctas=ctas))
             for t, s, ctas in cfg.plain}
    wide = [(t, skinny_sig.compile(GemmWideSm90(cfg.n, cfg.k, c_dtype, slab, t, s, cfg.pdl)))
            for t, slab, s in cfg.wide]
    tiled = tiled_sig.compile(GemmSm90(cfg.n, cfg.k, c_dtype, tile_n=cfg.tile_n))
    return GemmLauncher(cfg, skinny, tiled, wide, plain)
