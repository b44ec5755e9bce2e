"""Hopper GEMM for mid-size M (big decode batches, verify rows): ``C[M, N] = A[M, K] @ W[N, K]^T``,
swap-AB with a wide W slab per CTA and a cluster split-K.

The third path behind ``gemm.compile_gemm`` (read gemm.py first: constraints and dispatch), for
M = 65..512 where the skinny kernel's 64-row slab pulls as many activation bytes per stage as
weight bytes (at M = 64) or re-streams W once per 64-token tile (M > 64). Like the skinny kernel it
computes ``C^T = W @ A^T`` (W rows in wgmma M, tokens in wgmma N), but one CTA owns ``slab`` = 128
or 256 rows of W: ``slab / 64`` consumer warpgroups, each the wgmma M = 64 of its own 64 rows, all
reading the CTA's one ``tile_t`` x 64 token tile (``tile_t`` = 64..256, wgmma N). Per stage a CTA
loads ``slab`` x 64 of W and ``tile_t`` x 64 of A, so A's share of the traffic is tile_t / slab.

Warp-specialized: a producer warp (the last) issues the TMA loads into a ``stages``-deep mbarrier
pipeline as fast as slots free up; the consumer warpgroups wait, issue 4 wgmma k16 steps per
stage and release the previous stage once ``wait_group(1)`` proves it read. One CTA per SM: the
pipeline takes the whole 227 KiB (128-160 KiB of W in flight per SM).

Shared memory after the mainloop: every loaded tile is consumed, so once all consumer warpgroups
have passed a named barrier the (drained) pipeline buffers hold the fp32 partial tile instead,
``[tile_t][slab + 4]`` (token-major, padded: conflict-free accumulator stores, 16-byte rows).
``slab * tile_t`` <= 32 K floats (128 KiB) always fits in the >= 192 KiB of stages.

Split-K without a workspace, deterministic (as in gemm_skinny.py): the ``split_k`` CTAs of one
(slab, token tile) form a (split_k, 1, 1) thread-block cluster, split ``s`` accumulating K tiles
[s * kt // split_k, (s + 1) * kt // split_k) in order. After a cluster barrier each CTA sums its
1/split_k of the tile's float4 vectors over the peers' shared memory (DSMEM) in rank order,
converts and writes coalesced rows of C; a second barrier keeps every CTA alive for its readers.
A row's bits depend only on (slab, tile_t, split_k), never on M or on its token tile.

Registers: a thread holds tile_t / 2 fp32 accumulators. With 4 consumer warpgroups + the producer
warp (544 threads) ptxas has 120 registers per thread, so slab 256 takes tile_t <= 128; slab 128
(288 threads, up to 224 registers) takes every tile up to 256.

``pdl=True``: as gemm_skinny.py, W's first ``stages`` tiles are requested before
``griddepcontrol.wait``; A, the reduction and every global write come after it.

Layout: A ``[M, K]``, W ``[N, K]``, C ``[M, N]`` row-major. Grid ``(split_k, ceil(M / tile_t),
ceil(N / slab))``, cluster ``(split_k, 1, 1)``: the token tiles of one slab are adjacent in launch
order and share W through L2. ``m_load`` (>= M) is A's TMA view, as in gemm_skinny.py. Offsets
into C are Int32 (M * N < 2^31, checked by the launcher).
"""

import cuda.bindings.driver as cuda

import cutlass_kernels._common  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)

# isort: split
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from cutlass_kernels.gemm_sm90 import (
    BK,
    MBAR_RESERVE,
    SMEM_CAPACITY,
    cluster_sum_store,
    swap_ab_operands,
)

SLABS = (128, 256)
TILES = (64, 128, 192, 256)
MAX_STAGES = 12
P_PAD = 4  # fp32 partial row pad: lanes 2 tokens apart land 8 banks apart; rows stay 16B-aligned
CONSUMER_BARRIER = 1  # named barrier id of the consumer warpgroups (0 is __syncthreads)


def max_tile(slab: int) -> int:
    """Largest token tile whose accumulators fit the register file next to the producer warp."""
    return 128 if slab == 256 else 256


def wide_stages(slab: int, tile_t: int) -> int:
    """Pipeline depth: as many (slab + tile_t) x 64 stages as 227 KiB holds."""
    return min(MAX_STAGES, (SMEM_CAPACITY - MBAR_RESERVE) // ((slab + tile_t) * BK * 2))


class GemmWideSm90:
    """Mid-M GEMM. Compile-time: N, K, output dtype, W slab, token tile, split-K factor."""

    def __init__(self, n: int, k: int, c_dtype: type[cutlass.Numeric], slab: int = 128,
                 tile_t: int = 128, split_k: int = 1, pdl: bool = False):
        if slab not in SLABS:
            raise ValueError(f"slab must be one of {SLABS}, got {slab}")
        if tile_t not in TILES or tile_t > max_tile(slab):
            raise ValueError(f"tile_t must be one of {TILES} and <= {max_tile(slab)} for slab "
                             f"{slab}, got {tile_t}")
        k_tiles = (k + BK - 1) // BK
        if not 1 <= split_k <= min(8, k_tiles):
            raise ValueError(f"split_k must be in 1..8 and <= K/64 = {k_tiles}, got {split_k}")
        self.n, self.k = n, k
        self.ab_dtype = cutlass.BFloat16
        self.acc_dtype = cutlass.Float32
        self.c_dtype = c_dtype
        self.slab, self.tile_t, self.split_k, self.pdl = slab, tile_t, split_k, pdl
        self.tile_mnk = (slab, tile_t, BK)  # wgmma (M, N, K) = (W rows, tokens, K)
        self.k_tiles = k_tiles
        self.stages = wide_stages(slab, tile_t)
        self.mma_warpgroups = slab // 64
        self.producer_warp = 4 * self.mma_warpgroups
        self.mma_threads = 128 * self.mma_warpgroups
        self.threads = self.mma_threads + 32
        self.p_stride = slab + P_PAD
        assert tile_t * self.p_stride * 4 <= self.stages * (slab + tile_t) * BK * 2
        # The reduction: the partial tile is slab/4 * tile_t float4 vectors, split_k-way.
        self.vecs = (slab // 4) * tile_t
        self.vecs_per_cta = -(-self.vecs // split_k)

    @cute.jit
    def __call__(self, a: cute.Pointer, w: cute.Pointer, c: cute.Pointer, m: cutlass.Int32,
                 m_load: cutlass.Int32, stream: cuda.CUstream):
        n, k = self.n, self.k
        (mC4, tiled_mma, sW_layout, sX_layout, tma_w, tma_mW, tma_x,
         tma_mX) = swap_ab_operands(a, w, c, n, k, m, m_load, self.ab_dtype, self.acc_dtype,
                                    self.tile_mnk, self.stages, (self.mma_warpgroups, 1, 1),
                                    (64, self.tile_t), self.slab, self.tile_t)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sW: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sW_layout)], 1024]
            sX: cute.struct.Align[
                cute.struct.MemRange[self.ab_dtype, cute.cosize(sX_layout)], 1024]

        self.shared_storage = SharedStorage
        # sX directly follows sW (both 1024-aligned, sW a multiple of 1024 bytes): the partial
        # tile, laid over sW, may run on into sX.
        assert SharedStorage.size_in_bytes() == 1024 + 2 * (cute.cosize(sW_layout)
                                                            + cute.cosize(sX_layout))
        assert SharedStorage.size_in_bytes() <= SMEM_CAPACITY, SharedStorage.size_in_bytes()
        t_tiles = (m + self.tile_t - 1) // self.tile_t
        cluster = [self.split_k, 1, 1] if self.split_k > 1 else None
        self.kernel(tma_w, tma_mW, tma_x, tma_mX, mC4, tiled_mma, sW_layout, sX_layout, m).launch(
            grid=[self.split_k, t_tiles, (n + self.slab - 1) // self.slab],
            block=[self.threads, 1, 1], cluster=cluster, smem=SharedStorage.size_in_bytes(),
            stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, tma_w: cute.CopyAtom, mW: cute.Tensor, tma_x: cute.CopyAtom, mX: cute.Tensor,
               mC4: cute.Tensor, tiled_mma: cute.TiledMma, sW_layout: cute.ComposedLayout,
               sX_layout: cute.ComposedLayout, m: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        split, pid_t, pid_n = cute.arch.block_idx()  # split == rank in the (split_k, 1, 1) cluster
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        is_producer = warp_idx == self.producer_warp
        if is_producer:
            cpasync.prefetch_descriptor(tma_w)
            cpasync.prefetch_descriptor(tma_x)

        storage = SmemAllocator().allocate(self.shared_storage)
        w_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sW_layout, (None, None, 0)))
        x_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(sX_layout, (None, None, 0)))
        # CTA-local pipeline: one producer thread, one arrive per consumer warp (lane 0).
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     4 * self.mma_warpgroups),
            tx_count=w_bytes + x_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
        sW = storage.sW.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        # fp32 partial C^T tile over the drained stages: (W row, token) -> token * p_stride + row
        sP = storage.sW.get_tensor(cute.make_layout((self.slab, self.tile_t),
                                                    stride=(1, self.p_stride)),
                                   dtype=self.acc_dtype)

        tile_coord = (pid_n, pid_t, None)
        gW = cute.local_tile(mW, self.tile_mnk, tile_coord, proj=(1, None, 1))  # (slab, BK, kt)
        gX = cute.local_tile(mX, self.tile_mnk, tile_coord, proj=(None, 1, 1))  # (tile_t, BK, kt)
        tWsW, tWgW = cpasync.tma_partition(tma_w, 0, cute.make_layout(1),
                                           cute.group_modes(sW, 0, 2), cute.group_modes(gW, 0, 2))
        tXsX, tXgX = cpasync.tma_partition(tma_x, 0, cute.make_layout(1),
                                           cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2))

        k_begin = split * self.k_tiles // self.split_k
        k_count = (split + 1) * self.k_tiles // self.split_k - k_begin

        # Producer: with PDL, W's first stages go out before the grid wait (W is a weight that
        # no kernel writes); A's tiles and everything else after it.
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        if cutlass.const_expr(self.pdl):
            if is_producer:
                for _ in cutlass.range(cutlass.min(self.stages, k_count), unroll=1):
                    ab_pipeline.producer_acquire(prod)  # expects W + A bytes on this stage
                    cute.copy(tma_w, tWgW[(None, k_begin + prod.count)], tWsW[(None, prod.index)],
                              tma_bar_ptr=ab_pipeline.producer_get_barrier(prod))
                    prod.advance()
            cute.arch.griddepcontrol_wait()  # every thread: all later global accesses follow it
        if is_producer:
            if cutlass.const_expr(self.pdl):
                pre = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                   self.stages)
                for _ in cutlass.range(cutlass.min(self.stages, k_count), unroll=1):
                    cute.copy(tma_x, tXgX[(None, k_begin + pre.count)], tXsX[(None, pre.index)],
                              tma_bar_ptr=ab_pipeline.producer_get_barrier(pre))
                    pre.advance()
            for _ in cutlass.range(k_count - prod.count, unroll=1):
                ab_pipeline.producer_acquire(prod)
                bar = ab_pipeline.producer_get_barrier(prod)
                cute.copy(tma_w, tWgW[(None, k_begin + prod.count)], tWsW[(None, prod.index)],
                          tma_bar_ptr=bar)
                cute.copy(tma_x, tXgX[(None, k_begin + prod.count)], tXsX[(None, prod.index)],
                          tma_bar_ptr=bar)
                prod.advance()
        else:
            self.consume(ab_pipeline, tiled_mma, sW, sX, sP, tidx, k_count)

        if cutlass.const_expr(self.split_k > 1):
            cute.arch.cluster_arrive()  # release: this CTA's partial is visible to the cluster
            cute.arch.cluster_wait()  # acquire: every peer's partial is complete
        if warp_idx < self.producer_warp:
            if cutlass.const_expr(self.split_k == 1):
                cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.mma_threads)
            self.reduce(sP, mC4, tidx, split, pid_t, pid_n, m)
        if cutlass.const_expr(self.split_k > 1):
            cute.arch.cluster_arrive()  # peers may still read this CTA's partial: stay alive
            cute.arch.cluster_wait()

    @cute.jit
    def consume(self, ab_pipeline: pipeline.PipelineTmaAsync, tiled_mma: cute.TiledMma,
                sW: cute.Tensor, sX: cute.Tensor, sP: cute.Tensor, tidx: cutlass.Int32,
                k_count: cutlass.Int32):
        """Consumer warpgroups: acc = this split's K tiles of W_slab @ A_tile^T, then the fp32
        partial into sP (over the pipeline buffers, once every warpgroup is done with them)."""
        thr_mma = tiled_mma.get_slice(tidx)
        tCrW = tiled_mma.make_fragment_A(thr_mma.partition_A(sW))
        tCrX = tiled_mma.make_fragment_B(thr_mma.partition_B(sX))
        tCsP = thr_mma.partition_C(sP)
        acc = cute.make_rmem_tensor(tCsP.shape, self.acc_dtype)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        for kt in cutlass.range(k_count, unroll=1):
            ab_pipeline.consumer_wait(read)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tCrW, mode=[2])):
                cute.gemm(tiled_mma, acc, tCrW[(None, None, kb, read.index)],
                          tCrX[(None, None, kb, read.index)], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # tile kt-1's wgmma has retired: its slot may be refilled
            if kt > 0:
                ab_pipeline.consumer_release(release)
                release.advance()
            read.advance()
        warpgroup.wait_group(0)
        # Every loaded tile was consumed (no TMA write in flight); once all warpgroups' wgmma
        # reads are done the stages may be overwritten by generic stores.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.mma_threads)
        tCsP.store(acc.load())

    @cute.jit
    def reduce(self, sP: cute.Tensor, mC4: cute.Tensor, tidx: cutlass.Int32, split: cutlass.Int32,
               pid_t: cutlass.Int32, pid_n: cutlass.Int32, m: cutlass.Int32):
        """This CTA's float4 vectors [split * V, (split + 1) * V) of the tile (V = vecs_per_cta;
        vector v: token v // (slab/4), rows 4 * (v % (slab/4)) .. + 3), summed over the
        cluster's partials in rank order, converted, stored to C."""
        rows4 = self.slab // 4
        sP4 = cute.make_tensor(sP.iterator, cute.make_layout((4, rows4, self.tile_t),
                                                             stride=(1, 4, self.p_stride)))
        n_vec = self.n // 4
        for it in cutlass.range_constexpr(-(-self.vecs_per_cta // self.mma_threads)):
            j = it * self.mma_threads + tidx
            v = split * self.vecs_per_cta + j
            t_local = v // rows4
            r4 = v % rows4
            t = pid_t * self.tile_t + t_local
            col4 = pid_n * rows4 + r4
            if j < self.vecs_per_cta and v < self.vecs and t < m and col4 < n_vec:
                cluster_sum_store(sP4[None, r4, t_local], mC4[None, col4, t], self.split_k,
                                  self.acc_dtype, self.c_dtype)
