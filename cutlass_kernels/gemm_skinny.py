"""Hopper GEMM for small M (decode): ``C[M, N] = A[M, K] @ W[N, K]^T``, swap-AB with split-K.

The decode path behind ``gemm.compile_gemm`` (read gemm.py first: constraints and dispatch).
With M = 1..64 the GEMM is a stream over W: the goal is to read W once at HBM bandwidth. It
computes ``C^T = W @ A^T`` so that W's rows fill wgmma's M = 64 and the few tokens sit in
wgmma's N (``tile_t`` = 8..256, padded with zero rows by TMA). Each CTA owns 64 rows of W and a
contiguous 1/``split_k`` of K; TMA streams 64 x 64 tiles of W and ``tile_t`` x 64 tiles of A
through a ``stages``-deep mbarrier pipeline (many KiB in flight per SM, which is what HBM needs),
and one warpgroup accumulates in fp32 with wgmma. Tensor cores keep the math off the critical
path (fp32 FMA would be compute-bound at M = 16).

Split-K without a workspace: the ``split_k`` CTAs of one 64-row slab form a thread-block cluster
(``split_k`` <= 8). Each writes its fp32 partial tile to its own shared memory; after a cluster
barrier each CTA sums 1/``split_k`` of the tile over all peers' shared memory (DSMEM) in a fixed
order (deterministic), converts, and writes coalesced rows of C; a second cluster barrier keeps
every CTA alive until its peers have read it.

Programmatic dependent launch (``pdl=True``): the kernel is launched with the PDL attribute, so
it may start while the previous kernel of the stream still runs (once that kernel's CTAs have
executed ``griddepcontrol.launch_dependents``, which the engine's RMSNorm, SiLU-mul, attention and
row-gather kernels do first thing, and so does this kernel when launched with PDL: the fused layer
runs its GEMMs back to back). Its CTAs then fill the pipeline with W (a weight: nothing in
the stream writes it) before ``griddepcontrol.wait``; the activation tiles, the reduction and every
global write come after the wait, which returns once the previous grid has completed and its
writes are visible. The math, and so the result, is the same bits as without PDL.

Layout: A ``[M, K]``, W ``[N, K]``, C ``[M, N]`` row-major. Grid ``(split_k, ceil(M/tile_t),
ceil(N/64))``, cluster ``(split_k, 1, 1)``, 128 threads. M > tile_t works: the token tiles of one
slab are adjacent in launch order, so they run together and W comes from DRAM about once.
Offsets into C are Int32: M * N must stay below 2^31 (the launcher only uses this for small M).

``m_load`` (>= M) is the row count of A's TMA view. The launcher passes M rounded up to the token
tile whenever A's buffer holds those rows: then no TMA box reaches past the view. Rows M..m_load-1
only feed C columns that are never written (a column of C^T depends on its own row of A alone),
so their contents, NaN included, cannot leak. Measured on the H200 (docs/perf.md, v3): boxes that
TMA zero-fills for 32 or more rows stream W up to 1.7x slower (qwen3-8b gate_up at M = 72:
125.7 us with M-row views, 73.0 us with padded ones).
"""

import cuda.bindings.driver as cuda

import cutlass_kernels._common  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)

# isort: split
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from cutlass_kernels.gemm_sm90 import (
    BK,
    MBAR_RESERVE,
    SMEM_CAPACITY,
    cluster_sum,
    cluster_sum_store,
    swap_ab_operands,
    tma_wgmma_mainloop,
)

SLAB = 64  # W rows per CTA = wgmma M of one warpgroup
HALF = SLAB // 2  # the ``silu`` epilogue: a slab's first 32 W rows are gate rows, its last 32 up
EPILOGUES = ("store", "residual", "silu")
SMEM_TWO_PER_SM = 113 * 1024  # per-CTA budget that lets two CTAs share an SM (228 KiB per SM)
P_STRIDE = SLAB + 4  # fp32 partial tile [tile_t][SLAB + 4]: pad keeps accumulator stores
# conflict-free (lanes differ by 2 tokens -> 136 words -> bank +8) and rows 16-byte aligned
MAX_STAGES = 12


def skinny_plan(tile_t: int, norm: bool = False, max_ctas: int = 2) -> tuple[int, int, int]:
    """(pipeline stages, resident CTAs per SM, smem budget per CTA) for a token tile.

    Two CTAs per SM when that still leaves >= 4 stages (8 KiB of W each), else one CTA with
    the whole 227 KiB. ``norm``: the fused RMSNorm's row sums of squares take smem too.
    ``max_ctas`` = 1: always the one-CTA plan (the most stages).
    """
    stage_bytes = (SLAB + tile_t) * BK * 2
    fixed = MBAR_RESERVE + tile_t * P_STRIDE * 4 + (tile_t * 4 + 16 if norm else 0)
    for ctas, budget in ((2, SMEM_TWO_PER_SM), (1, SMEM_CAPACITY)):
        if ctas > max_ctas:
            continue
        stages = min(MAX_STAGES, (budget - fixed) // stage_bytes)
        if stages >= 4 or ctas == 1:
            return stages, ctas, budget
    raise AssertionError("unreachable")


class GemmSkinnySm90:
    """Decode GEMM. Compile-time: N, K, output dtype, token tile, split-K factor; ``max_ctas``
    = 1 takes the one-CTA smem plan (``skinny_plan``: the most stages; same bits)."""

    def __init__(self, n: int, k: int, c_dtype: type[cutlass.Numeric], tile_t: int = 16,
                 split_k: int = 1, pdl: bool = False, epilogue: str = "store",
                 norm_size: int = 0, eps: float = 0.0, max_ctas: int = 2):
        if tile_t % 8 or not 8 <= tile_t <= 256:
            raise ValueError(f"tile_t must be a multiple of 8 in [8, 256], got {tile_t}")
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {epilogue!r}")
        if (epilogue != "store" or norm_size) and c_dtype is not cutlass.BFloat16:
            raise ValueError(f"the {epilogue} epilogue and the fused norm write bf16 C only")
        if epilogue == "silu" and n % SLAB:
            raise ValueError(f"the silu epilogue needs N % {SLAB} == 0 (whole slabs), got {n}")
        if norm_size and (tile_t > 128 or not 0 < norm_size <= k):
            raise ValueError(f"the fused norm needs tile_t <= 128 and 0 < norm_size <= K={k}, "
                             f"got tile_t={tile_t}, norm_size={norm_size}")
        k_tiles = (k + BK - 1) // BK
        if split_k not in (1, 2, 4, 8) or split_k > k_tiles:
            raise ValueError(f"split_k must be 1, 2, 4 or 8 and <= K/64 = {k_tiles}, got {split_k}")
        self.n, self.k = n, k
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.c_dtype = c_dtype
        self.tile_t = tile_t
        self.split_k = split_k
        self.pdl = pdl
        self.tile_mnk = (SLAB, tile_t, BK)  # wgmma (M, N, K) = (W rows, tokens, K)
        self.k_tiles = k_tiles
        self.k_per_split = (k_tiles + split_k - 1) // split_k
        self.stages, self.ctas_per_sm, self.smem_budget = skinny_plan(tile_t, bool(norm_size),
                                                                   max_ctas)
        assert self.stages >= 2, (tile_t, self.stages)
        self.threads = 128
        # The reduction: the partial tile is SLAB/4 * tile_t float4 vectors, split_k-way.
        self.epilogue = epilogue
        self.norm_size, self.eps = int(norm_size), float(eps)
        # A silu CTA writes HALF columns of its act tile from pairs of gate / up vectors
        self.vec_cols = (HALF if epilogue == "silu" else SLAB) // 4
        self.vecs_per_cta = self.vec_cols * tile_t // split_k
        assert self.vec_cols * tile_t % split_k == 0
        # fused norm: each row of the token tile is squared by ``sq_tpr`` threads, ``sq_elems``
        # elements each per stage
        self.sq_tpr = 128 // tile_t if norm_size else 0
        self.sq_elems = BK // self.sq_tpr if norm_size else 0
        self.sq_vecs = max(self.sq_elems // 8, 1)  # 16-byte chunks per thread per stage

    @cute.jit
    def __call__(self, a: cute.Pointer, w: cute.Pointer, c: cute.Pointer, m: cutlass.Int32,
                 m_load: cutlass.Int32, stream: cuda.CUstream):
        n, k = self.n, self.k
        (mC4, tiled_mma, sW_layout, sX_layout, tma_w, tma_mW, tma_x,
         tma_mX) = swap_ab_operands(a, w, c, n, k, m, m_load, self.ab_dtype, self.acc_dtype,
                                    self.tile_mnk, self.stages, (1, 1, 1), (SLAB, self.tile_t),
                                    SLAB, self.tile_t)
        if cutlass.const_expr(self.epilogue == "silu"):  # C is act [M, N/2]
            mC4 = cute.make_tensor(c, cute.make_layout((4, n // 8, m), stride=(1, 4, n // 2)))
        # the fused norm's row sums of squares follow the partial tile (plain kernels: none)
        sq_len = self.tile_t if self.norm_size else 0

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sW: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sW_layout)], 1024]
            sX: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sX_layout)], 1024]
            sP: cute.struct.Align[
                cute.struct.MemRange[self.acc_dtype, self.tile_t * P_STRIDE + sq_len], 16]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= self.smem_budget, SharedStorage.size_in_bytes()
        t_tiles = (m + self.tile_t - 1) // self.tile_t
        cluster = [self.split_k, 1, 1] if self.split_k > 1 else None
        self.kernel(tma_w, tma_mW, tma_x, tma_mX, mC4, tiled_mma, sW_layout, sX_layout, m).launch(
            grid=[self.split_k, t_tiles, (n + SLAB - 1) // SLAB], block=[self.threads, 1, 1],
            cluster=cluster, smem=SharedStorage.size_in_bytes(), stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
               mC4: cute.Tensor, tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout,
               sX_layout: cute.ComposedLayout, m: cutlass.Int32):
        if cutlass.const_expr(self.pdl):
            # the next PDL kernel (the next layer GEMM) may launch now and prefetch its weight
            # into the SMs' free shared memory; it waits for this grid before touching its A
            cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        split, pid_t, pid_n = cute.arch.block_idx()  # split == rank in the (split_k, 1, 1) cluster
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)

        storage = SmemAllocator().allocate(self.shared_storage)
        tx_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(sW_layout, (None, None, 0)))
                    + cute.size_in_bytes(self.ab_dtype, cute.slice_(sX_layout, (None, None, 0))))
        # CTA-local pipeline (cluster size 1 for its barriers): the cluster is only for the
        # split-K reduction, nothing is multicast.
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        # fp32 partial C^T tile: (W row, token) -> token * P_STRIDE + row
        sP = storage.sP.get_tensor(cute.make_layout((SLAB, self.tile_t), stride=(1, P_STRIDE)))

        tile_coord = (pid_n, pid_t, None)
        gW = cute.local_tile(mW, self.tile_mnk, tile_coord, proj=(1, None, 1))  # (64, BK, kt)
        gX = cute.local_tile(mX, self.tile_mnk, tile_coord, proj=(None, 1, 1))  # (tile_t, BK, kt)
        tWsW, tWgW = cpasync.tma_partition(tma_w, 0, cute.make_layout(1),
                                           cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tXsX, tXgX = cpasync.tma_partition(tma_x, 0, cute.make_layout(1),
                                           cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))
        thr_mma = tiled_mma.get_slice(tidx)
        tCrW = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))
        tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
        tCsP = thr_mma.partition_C(sP)
        acc = cute.make_rmem_tensor(tCsP.shape, self.acc_dtype)

        k_begin = split * self.k_per_split
        k_count = cutlass.max(cutlass.min(self.k_per_split, self.k_tiles - k_begin), 0)
        sq_src, sq_acc = None, None
        sQ = cute.make_tensor(storage.sP.data_ptr() + self.tile_t * P_STRIDE,
                              cute.make_layout(max(self.tile_t if self.norm_size else 0, 1)))
        if cutlass.const_expr(self.norm_size):
            # Token row tidx // sq_tpr: the 128-byte swizzle only permutes 16-byte chunks
            # inside a row, so the row's 64 elements of a stage are its 128 bytes. Thread part
            # p of the row takes chunks p + tpr * ((j + row) % V), j < V (V chunks of 8): the
            # rotation by row puts 8 adjacent threads on 8 distinct chunks (bank groups)
            row, part = tidx // self.sq_tpr, tidx % self.sq_tpr
            v, e = self.sq_vecs, min(self.sq_elems, 8)
            sq_src = cute.make_tensor(
                storage.sX.data_ptr() + (row * BK + part * e),
                cute.make_layout((e, v, self.stages), stride=(1, self.sq_tpr * e,
                                                              self.tile_t * BK)))
            sq_acc = cute.make_rmem_tensor((e,), self.acc_dtype)
            sq_acc.fill(0.0)
        tma_wgmma_mainloop(ab_pipeline, tma_w, tWgW, tWsW, tma_x, tXgX, tXsX, tiled_mma, tCrW,
                           tCrX, acc, k_begin, k_count, self.stages, warp_idx == 0, self.pdl,
                           sq_src, sq_acc, self._sq_pass if self.norm_size else None)

        tCsP.store(acc.load())
        if cutlass.const_expr(self.norm_size):
            ss = sq_acc.load().reduce(cute.ReductionOp.ADD, cutlass.Float32(0.0), 0)
            for sh in cutlass.range_constexpr(self.sq_tpr.bit_length() - 2, -1, -1):
                ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1 << sh)
            if part == 0:
                sQ[row] = ss
        if cutlass.const_expr(self.split_k > 1):
            cute.arch.cluster_arrive()  # release: this CTA's partial is visible to the cluster
            cute.arch.cluster_wait()  # acquire: every peer's partial is complete
        else:
            cute.arch.sync_threads()

        # This CTA reduces float4 vectors [split * V, (split + 1) * V) of the tile, V =
        # vecs_per_cta; vector v covers token v // vec_cols, rows 4 * (v % vec_cols) .. + 3
        # (silu: those gate rows and the up rows HALF further).
        sP4 = cute.make_tensor(sP.iterator, cute.make_layout((4, SLAB // 4, self.tile_t),
                                                             stride=(1, 4, P_STRIDE)))
        sQ1 = cute.make_tensor(sQ.iterator, cute.make_layout((1, cute.size(sQ)), stride=(0, 1)))
        n_vec = self.n // 4
        for it in cutlass.range_constexpr((self.vecs_per_cta + 127) // 128):
            j = it * 128 + tidx
            v = split * self.vecs_per_cta + j
            t_local = v // self.vec_cols
            r4 = v % self.vec_cols
            t = pid_t * self.tile_t + t_local
            if cutlass.const_expr(self.epilogue == "store" and not self.norm_size):
                col4 = pid_n * (SLAB // 4) + r4
                if j < self.vecs_per_cta and t < m and col4 < n_vec:
                    cluster_sum_store(sP4[None, r4, t_local], mC4[None, col4, t], self.split_k,
                                      self.acc_dtype, self.c_dtype)
            else:
                col4 = pid_n * self.vec_cols + r4
                if j < self.vecs_per_cta and t < m and col4 < mC4.shape[1]:
                    self._epilogue(sP4, sQ1, mC4, r4, t_local, col4, t)

        if cutlass.const_expr(self.split_k > 1):
            cute.arch.cluster_arrive()  # peers may still read this CTA's partial: stay alive
            cute.arch.cluster_wait()

    @cute.jit
    def _sq_pass(self, sq_src: cute.Tensor, sq_acc: cute.Tensor, stage: cutlass.Int32):
        """``sq_acc += x * x`` over this thread's chunks of ``stage`` (the kernel's map)."""
        row = cute.arch.thread_idx()[0] // self.sq_tpr
        for j in cutlass.range_constexpr(self.sq_vecs):
            x = sq_src[None, (row + j) % self.sq_vecs, stage].load().to(cutlass.Float32)
            sq_acc.store(sq_acc.load() + x * x)

    @cute.jit
    def _epilogue(self, sP4: cute.Tensor, sQ1: cute.Tensor, mC4: cute.Tensor, r4: cutlass.Int32,
                  t_local: cutlass.Int32, col4: cutlass.Int32, t: cutlass.Int32):
        """One float4 of C (silu: of act) from the cluster's partials, through the fused
        epilogue: ``y = acc * rstd`` (fused norm, rstd from the row's sum of squares over the
        cluster), then store bf16(y); residual: C = bf16(C + bf16(y)); silu: act =
        bf16(bf16(silu(bf16(y_gate))) * bf16(y_up)), silu_mul.py's rounding."""
        f32, bf16 = self.acc_dtype, cutlass.BFloat16
        y = cluster_sum(sP4[None, r4, t_local], self.split_k, f32).load()
        scale = f32(1.0)
        if cutlass.const_expr(self.norm_size):
            ss = cluster_sum(sQ1[None, t_local], self.split_k, f32)[0]
            scale = cute.math.rsqrt(ss / f32(self.norm_size) + f32(self.eps))
            y = y * scale
        out = cute.make_rmem_tensor((4,), bf16)
        if cutlass.const_expr(self.epilogue == "silu"):
            u = cluster_sum(sP4[None, r4 + HALF // 4, t_local], self.split_k, f32).load()
            if cutlass.const_expr(self.norm_size):
                u = u * scale
            g = y.to(bf16).to(f32)
            act = (g / (f32(1.0) + cute.math.exp(-g))).to(bf16).to(f32)
            out.store((act * u.to(bf16).to(f32)).to(bf16))
        elif cutlass.const_expr(self.epilogue == "residual"):
            old = cute.make_rmem_tensor((4,), bf16)
            cute.autovec_copy(mC4[None, col4, t], old)
            out.store((old.load().to(f32) + y.to(bf16).to(f32)).to(bf16))
        else:
            out.store(y.to(bf16))
        cute.autovec_copy(out, mC4[None, col4, t])
