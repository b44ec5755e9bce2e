"""Tiled Hopper GEMM for large M (prefill): ``C[M, N] = A[M, K] @ W[N, K]^T``.

The prefill path behind ``gemm.compile_gemm`` (read gemm.py first: constraints and dispatch).
TMA loads A and W tiles into 128-byte-swizzled shared memory through a ``stages``-deep mbarrier
pipeline (``PipelineTmaAsync``); one or two consumer warpgroups run wgmma (bf16 in, fp32
accumulate); the epilogue converts to the output dtype, stages sub-tiles in shared memory and
stores them with TMA. TMA bounds handle every tail: rows >= M and columns >= N (or >= K) read as
zero and are never written.

Layout: A ``[M, K]``, W ``[N, K]``, C ``[M, N]``, all row-major (K-major operands, the "TN" GEMM).
CTA tile ``(tile_m, tile_n, 64)`` = (128, 128) or (128, 256); grid = one CTA per output tile,
launched 1-D and rasterized in groups of ``GROUP_M`` M-tiles so a wave's A and W tiles stay in L2.
"""

import cuda.bindings.driver as cuda

import cutlass_kernels._common  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)

# isort: split
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

BK = 64  # K per pipeline stage: one 128-byte swizzle atom of bf16
SMEM_CAPACITY = 232448  # sm_90 dynamic shared memory per CTA (227 KiB)
MBAR_RESERVE = 1024  # mbarriers and alignment slack
GROUP_M = 8  # rasterization: CTAs walk GROUP_M M-tiles down one N column before moving on


@cute.jit
def tma_wgmma_mainloop(
    ab_pipeline: pipeline.PipelineTmaAsync,
    tma_atom_a: cute.CopyAtom,
    tAgA: cute.Tensor,
    tAsA: cute.Tensor,
    tma_atom_b: cute.CopyAtom,
    tBgB: cute.Tensor,
    tBsB: cute.Tensor,
    tiled_mma: cute.TiledMma,
    tCrA: cute.Tensor,
    tCrB: cute.Tensor,
    acc: cute.Tensor,
    k_begin: cutlass.Int32,
    k_count: cutlass.Int32,
    stages: cutlass.Constexpr,
    is_producer: cutlass.Boolean,
    a_before_grid_wait: cutlass.Constexpr = False,
    sq_src: cute.Tensor = None,
    sq_acc: cute.Tensor = None,
    sq_pass: cutlass.Constexpr = None,
):
    """acc = sum over K tiles [k_begin, k_begin + k_count) of A_tile @ B_tile^T (k_count may be 0).

    Not warp-specialized: warp 0 of the consumers issues the TMA loads. It prefetches ``stages``
    tiles, then refills the slot that the consumers released in the same iteration (the release
    of tile kt-1 happens once ``wait_group(1)`` proves its wgmma retired). Every loaded tile is
    consumed, so no TMA write is in flight when this returns and the smem may be reused.

    ``a_before_grid_wait`` (kernels launched with programmatic dependent launch, where A is a
    weight no kernel writes): the prefetch of A's first ``stages`` tiles is issued before
    ``griddepcontrol.wait``, i.e. while the previous kernel in the stream may still run; B's tiles
    and everything after wait for it. Every thread executes the wait (their later global
    writes depend on it too).

    ``sq_src`` / ``sq_acc`` (the skinny GEMM's fused RMSNorm): ``sq_pass(sq_src, sq_acc,
    stage)`` (gemm_skinny.py) adds the squares of this thread's elements of B's tile in that
    stage's shared memory into ``sq_acc``, while the stage's wgmma runs, after the refill of the
    slot before it.
    """
    acc.fill(0.0)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    if cutlass.const_expr(a_before_grid_wait):
        if is_producer:
            for _ in cutlass.range(cutlass.min(stages, k_count), unroll=1):
                ab_pipeline.producer_acquire(prod)  # expects A + B bytes on this stage
                cute.copy(tma_atom_a, tAgA[(None, k_begin + prod.count)],
                          tAsA[(None, prod.index)],
                          tma_bar_ptr=ab_pipeline.producer_get_barrier(prod))
                prod.advance()
        cute.arch.griddepcontrol_wait()
        if is_producer:
            pre = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            for _ in cutlass.range(cutlass.min(stages, k_count), unroll=1):
                cute.copy(tma_atom_b, tBgB[(None, k_begin + pre.count)],
                          tBsB[(None, pre.index)],
                          tma_bar_ptr=ab_pipeline.producer_get_barrier(pre))
                pre.advance()
    else:
        if is_producer:
            for _ in cutlass.range(cutlass.min(stages, k_count), unroll=1):
                ab_pipeline.producer_acquire(prod)
                bar = ab_pipeline.producer_get_barrier(prod)
                cute.copy(tma_atom_a, tAgA[(None, k_begin + prod.count)],
                          tAsA[(None, prod.index)], tma_bar_ptr=bar)
                cute.copy(tma_atom_b, tBgB[(None, k_begin + prod.count)],
                          tBsB[(None, prod.index)], tma_bar_ptr=bar)
                prod.advance()

    read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    num_k_blocks = cute.size(tCrA, mode=[2])
    for kt in cutlass.range(k_count, unroll=1):
        ab_pipeline.consumer_wait(read)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(num_k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)],
                      tCrB[(None, None, kb, read.index)], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(1)  # tile kt-1's wgmma has retired: its slot may be refilled
        if kt > 0:
            ab_pipeline.consumer_release(release)
            release.advance()
            if is_producer and prod.count < k_count:
                ab_pipeline.producer_acquire(prod)
                bar = ab_pipeline.producer_get_barrier(prod)
                cute.copy(tma_atom_a, tAgA[(None, k_begin + prod.count)],
                          tAsA[(None, prod.index)], tma_bar_ptr=bar)
                cute.copy(tma_atom_b, tBgB[(None, k_begin + prod.count)],
                          tBsB[(None, prod.index)], tma_bar_ptr=bar)
                prod.advance()
        if cutlass.const_expr(sq_src is not None):  # after the refill: it waits for nothing
            sq_pass(sq_src, sq_acc, read.index)
        read.advance()
    warpgroup.wait_group(0)


def swap_ab_operands(a: cute.Pointer, w: cute.Pointer, c: cute.Pointer, n: int, k: int,
                     m: cutlass.Int32, m_load: cutlass.Int32, ab_dtype: type, acc_dtype: type,
                     tile_mnk: tuple[int, int, int], stages: int, mma_atoms: tuple[int, int, int],
                     mma_tiler: tuple[int, int], w_rows: int, tile_t: int) -> tuple:
    """The host-side operands of the swap-AB kernels (gemm_skinny.py, gemm_wide.py), traced in
    their ``__call__``: A (m_load x K, row-major; rows m..m_load-1 are read, their C columns
    never written), W (N x K), C as float4-sized vectors (4, N/4, M: slices [None, j, t] are
    4-element aligned), the tiled MMA (``mma_atoms`` warpgroups over ``mma_tiler``), the
    shared-memory layouts of the W slab (``w_rows`` x BK) and the token tile (``tile_t`` x BK)
    per stage, and their TMA loads.
    Returns (mC4, tiled_mma, sW_layout, sX_layout, tma_w, tma_mW, tma_x, tma_mX)."""
    mA = cute.make_tensor(a, cute.make_layout((m_load, k), stride=(k, 1)))
    mW = cute.make_tensor(w, cute.make_layout((n, k), stride=(k, 1)))
    mC4 = cute.make_tensor(c, cute.make_layout((4, n // 4, m), stride=(1, 4, n)))
    row = LayoutEnum.ROW_MAJOR
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        ab_dtype, ab_dtype, row.sm90_mma_major_mode(), row.sm90_mma_major_mode(), acc_dtype,
        mma_atoms, tiler_mn=mma_tiler)
    sW_layout = sm90_utils.make_smem_layout_a(row, tile_mnk, ab_dtype, stages)
    sX_layout = sm90_utils.make_smem_layout_b(row, tile_mnk, ab_dtype, stages)
    tma_w, tma_mW = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mW, cute.slice_(sW_layout, (None, None, 0)),
        (w_rows, BK))
    tma_x, tma_mX = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(sX_layout, (None, None, 0)),
        (tile_t, BK))
    return mC4, tiled_mma, sW_layout, sX_layout, tma_w, tma_mW, tma_x, tma_mX


@cute.jit
def cluster_sum(src: cute.Tensor, split_k: cutlass.Constexpr, acc_dtype: cutlass.Constexpr
                ) -> cute.Tensor:
    """Split-K reduction of one small vector of the partial tile (the swap-AB kernels,
    gemm_skinny.py and gemm_wide.py): ``src`` (fp32 in this CTA's shared memory) summed over the
    ``split_k`` CTAs of the cluster in rank order (DSMEM; the same place in each peer's tile),
    returned in registers. The fixed order makes the bits independent of which CTA finished
    first."""
    total = cute.make_rmem_tensor(src.shape, acc_dtype)
    total.fill(0.0)
    part = cute.make_rmem_tensor(src.shape, acc_dtype)
    for peer in cutlass.range_constexpr(split_k):
        peer_src = src
        if cutlass.const_expr(split_k > 1):
            peer_src = cute.make_tensor(cute.arch.map_dsmem_ptr(src.iterator, peer), src.layout)
        cute.autovec_copy(peer_src, part)
        total.store(total.load() + part.load())
    return total


@cute.jit
def cluster_sum_store(src: cute.Tensor, dst: cute.Tensor, split_k: cutlass.Constexpr,
                      acc_dtype: cutlass.Constexpr, c_dtype: cutlass.Constexpr):
    """``cluster_sum`` of one float4 of the partial tile, converted to ``c_dtype`` and copied to
    ``dst`` (4 elements of C)."""
    total = cluster_sum(src, split_k, acc_dtype)
    out = cute.make_rmem_tensor((4,), c_dtype)
    out.store(total.load().to(c_dtype))
    cute.autovec_copy(out, dst)


def make_epilogue_r2s(tiled_mma: cute.TiledMma, c_dtype: type[cutlass.Numeric]) -> cute.TiledCopy:
    """Register -> smem copy for the epilogue, shaped on the accumulator layout.

    The epilogue moves accumulator values by flat index (sub-tile e owns values
    [e * n, (e + 1) * n) of the retiled accumulator), so the copy's source value order must
    equal the accumulator's: (column pair, row half, column block). stmatrix (16-bit) has it;
    for fp32 a 64-bit (two-column) universal store has it, a 32-bit one does not (it orders
    rows first). tests/test_kernels_compile_gemm.py checks this on the layouts.
    """
    if c_dtype.width == 16:
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), c_dtype)
    else:
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), c_dtype, num_bits_per_copy=64)
    return cute.make_tiled_copy_S(atom, cute.make_tiled_copy_C_atom(atom, tiled_mma))


class GemmSm90:
    """Prefill GEMM. Compile-time: N, K, output dtype, CTA tile."""

    def __init__(self, n: int, k: int, c_dtype: type[cutlass.Numeric], tile_m: int = 128,
                 tile_n: int = 256):
        if tile_m != 128 or tile_n not in (128, 256):
            raise ValueError(f"tile (tile_m, tile_n) must be (128, 128) or (128, 256), "
                             f"got ({tile_m}, {tile_n})")
        self.n, self.k = n, k
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.c_dtype = c_dtype
        self.tile_mnk = (tile_m, tile_n, BK)
        # Two consumer warpgroups (each 64 x tile_n) for the wide tile; one warpgroup covering
        # both 64-row halves otherwise (128 fp32 accumulators per thread either way).
        self.atom_layout_mnk = (2, 1, 1) if tile_n > 128 else (1, 1, 1)
        self.num_mma_warps = 4 * self.atom_layout_mnk[0]
        self.threads = 32 * self.num_mma_warps
        cooperative = self.atom_layout_mnk[0] == 2
        self.epi_tile = (128, 32) if cooperative else (64, 32)
        c_bytes = c_dtype.width // 8
        epi_bytes = self.epi_tile[0] * self.epi_tile[1] * c_bytes
        self.epi_stages = 4 if c_bytes == 2 else 2
        stage_bytes = (tile_m + tile_n) * BK * 2
        self.stages = (SMEM_CAPACITY - MBAR_RESERVE - self.epi_stages * epi_bytes) // stage_bytes
        assert self.stages >= 3, self.stages

    def make_tiled_mma(self) -> cute.TiledMma:
        k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        return sm90_utils.make_trivial_tiled_mma(self.ab_dtype, self.ab_dtype, k_major, k_major,
                                                 self.acc_dtype, self.atom_layout_mnk,
                                                 tiler_mn=(64, self.tile_mnk[1]))

    @cute.jit
    def __call__(self, a: cute.Pointer, w: cute.Pointer, c: cute.Pointer, m: cutlass.Int32,
                 stream: cuda.CUstream):
        n, k = self.n, self.k
        mA = cute.make_tensor(a, cute.make_layout((m, k), stride=(k, 1)))
        mW = cute.make_tensor(w, cute.make_layout((n, k), stride=(k, 1)))
        mC = cute.make_tensor(c, cute.make_layout((m, n), stride=(n, 1)))
        row = LayoutEnum.ROW_MAJOR
        tiled_mma = self.make_tiled_mma()
        sA_layout = sm90_utils.make_smem_layout_a(row, self.tile_mnk, self.ab_dtype, self.stages)
        sW_layout = sm90_utils.make_smem_layout_b(row, self.tile_mnk, self.ab_dtype, self.stages)
        sC_layout = sm90_utils.make_smem_layout_epi(self.c_dtype, row, self.epi_tile,
                                                    self.epi_stages)
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mA, cute.slice_(sA_layout, (None, None, 0)),
            (self.tile_mnk[0], BK))
        tma_w, tma_mW = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mW, cute.slice_(sW_layout, (None, None, 0)),
            (self.tile_mnk[1], BK))
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(sC_layout, (None, None, 0)),
            self.epi_tile)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sA_layout)], 1024]
            sW: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sW_layout)], 1024]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(sC_layout)], 1024]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() <= SMEM_CAPACITY, SharedStorage.size_in_bytes()
        m_tiles = (m + self.tile_mnk[0] - 1) // self.tile_mnk[0]
        n_tiles = (n + self.tile_mnk[1] - 1) // self.tile_mnk[1]
        self.kernel(tma_a, tma_mA, tma_w, tma_mW, tma_c, tma_mC, tiled_mma, sA_layout, sW_layout,
                    sC_layout, m_tiles).launch(
            grid=[m_tiles * n_tiles, 1, 1], block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, tma_a: cute.CopyAtom, mA: cute.Tensor, tma_w: cute.CopyAtom, mW: cute.Tensor,
               tma_c: cute.CopyAtom, mC: cute.Tensor, tiled_mma: cute.TiledMma,
               sA_layout: cute.ComposedLayout, sW_layout: cute.ComposedLayout,
               sC_layout: cute.ComposedLayout, m_tiles: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_w)

        # Grouped rasterization: GROUP_M consecutive M-tiles per N column (the last group may
        # be shorter). Consecutive CTAs share a W tile and nearby A tiles.
        group = GROUP_M * ((self.n + self.tile_mnk[1] - 1) // self.tile_mnk[1])
        first_m = (bidx // group) * GROUP_M
        group_m = cutlass.min(m_tiles - first_m, GROUP_M)
        pid_m = first_m + (bidx % group) % group_m
        pid_n = (bidx % group) // group_m

        storage = SmemAllocator().allocate(self.shared_storage)
        tx_bytes = (cute.size_in_bytes(self.ab_dtype, cute.slice_(sA_layout, (None, None, 0)))
                    + cute.size_in_bytes(self.ab_dtype, cute.slice_(sW_layout, (None, None, 0))))
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_warps),
            tx_count=tx_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)

        tile_coord = (pid_m, pid_n, None)
        gA = cute.local_tile(mA, self.tile_mnk, tile_coord, proj=(1, None, 1))  # (bM, bK, kt)
        gW = cute.local_tile(mW, self.tile_mnk, tile_coord, proj=(None, 1, 1))  # (bN, bK, kt)
        gC = cute.local_tile(mC, self.tile_mnk, tile_coord, proj=(1, 1, None))  # (bM, bN)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                           cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tWsW, tWgW = cpasync.tma_partition(tma_w, 0, cute.make_layout(1),
                                           cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.atom_layout_mnk[0], stride=128)(wg_idx))
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrW = tiled_mma.make_fragment_B(thr_mma.partition_B(sW))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape, self.acc_dtype)

        k_tiles = cute.size(gA, mode=[2])
        tma_wgmma_mainloop(ab_pipeline, tma_a, tAgA, tAsA, tma_w, tWgW, tWsW, tiled_mma, tCrA,
                           tCrW, acc, 0, k_tiles, self.stages, warp_idx == 0)

        # Epilogue: per (epi_m x 32) sub-tile: registers -> bf16/f32 -> smem -> TMA store.
        # The TMA store clips at the tensor bounds, so rows >= M and columns >= N are not written.
        tiled_r2s = make_epilogue_r2s(tiled_mma, self.c_dtype)
        thr_r2s = tiled_r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)  # (R2S, R2S_M, R2S_N, EPI_STAGE)
        tRS_rAcc = tiled_r2s.retile(acc)
        rC_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
        tRS_rC = cute.make_rmem_tensor(rC_layout, self.acc_dtype)
        n_epi_vals = cute.size(tRS_rC)

        gC_epi = cute.zipped_divide(gC, self.epi_tile)  # ((epi_m, epi_n), (EPI_M, EPI_N))
        bSG_sC, bSG_gC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1),
                                               cute.group_modes(sC, 0, 2), gC_epi)
        epi_grid = gC_epi.shape[1]
        epi_order = cute.make_layout(epi_grid, stride=(epi_grid[1], 1))
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads))
        for epi_idx in cutlass.range_constexpr(cute.size(epi_grid)):
            for v in cutlass.range_constexpr(n_epi_vals):
                tRS_rC[v] = tRS_rAcc[epi_idx * n_epi_vals + v]
            tRS_rOut = cute.make_rmem_tensor(rC_layout, self.c_dtype)
            tRS_rOut.store(tRS_rC.load().to(self.c_dtype))
            buf = epi_idx % self.epi_stages
            cute.copy(tiled_r2s, tRS_rOut, tRS_sC[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> TMA proxy
            pipeline.sync(barrier_id=1)
            if warp_idx == 0:
                cute.copy(tma_c, bSG_sC[(None, buf)],
                          bSG_gC[(None, epi_order.get_hier_coord(epi_idx))])
                store_pipeline.producer_commit()
                store_pipeline.producer_acquire()  # the buffer reused next is free again
            pipeline.sync(barrier_id=1)
        if warp_idx == 0:
            store_pipeline.producer_tail()
