"""Causal variable-length prefill attention over the paged KV cache (FlashAttention-2, mma.sync).

For sequence b with q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b] new tokens and ctx =
context_lens[b] tokens in the cache (the new tokens' K/V already written), query i sits at
position p = ctx - q_len + i and attends to KV positions 0..p (covers plain prompts, chunked
prefill and prefix-cached prompts):

    out[cu[b] + i, qh, :] = softmax_t<=p(q[cu[b] + i, qh] . K[t] * scale) @ V[t],  kvh = qh // G

Tiles: one CTA (4 warps, 128 threads) per (64-query tile, q head, sequence); grid
(ceil(max_q_len / 64), nq, B), tiles past a sequence's q_len exit at once, and the longest
(causal) tiles are scheduled first. KV tiles are 64 tokens = 4 pages gathered through
page_indices with 16-byte cp.async (one tiled-copy pass of 16 rows = one page, so each thread's
four row passes use four page indices). S = Q K^T and O += P V run on tensor cores
(mma.sync m16n8k16 bf16 -> fp32, ldmatrix from 128-byte-swizzled shared memory; V is read
transposed with ldmatrix.trans); online softmax in fp32 (exp2 with the scale folded in).
Only the last one or two KV tiles need the causal / length mask. KV rows at or past the tile's
last needed token are zero-filled instead of loaded, so pages past ceil(ctx / 16) are never
touched and stale cache slots cannot inject NaN through P @ V.

    shared memory (bf16, swizzled rows of head_dim):   sQ [64, hd] | sK [64, hd] | sV [64, hd]
    KV cache (per layer):  cache[num_pages, nkv, 16, hd]; tile rows 16j..16j+15 <- page j

Constraints: head_dim in {64, 128}, page_size 16, nq % nkv == 0, ctx >= q_len for every
sequence, max_q_len >= every q_len, pointers 16-byte aligned, T * nq * head_dim < 2^31.

    launch = compile_prefill_attention(nq, nkv, hd)
    launch(q, k_cache, v_cache, cu_seqlens_q, context_lens, page_indices, out,  # buffers / addrs
           total_q, batch, page_stride, max_q_len, scale, stream)
"""

import cutlass_kernels._common as _common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from cutlass_kernels._common import Ptr, Scalar, Signature
from cutlass_kernels._mma import mn_view, quad_max, quad_sum, swizzled_rows

LOG2_E = 1.4426950408889634
NUM_THREADS = 128
TILE_M = 64
TILE_N = 64


class PrefillAttention:
    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if page_size != 16:
            raise ValueError(f"page_size must be 16, got {page_size}")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"nq={num_q_heads} must be a multiple of nkv={num_kv_heads}")
        self.nq = num_q_heads
        self.nkv = num_kv_heads
        self.hd = head_dim
        self.ps = page_size
        self.group = num_q_heads // num_kv_heads
        self.tm = TILE_M
        self.tn = TILE_N
        self.pages_per_tile = TILE_N // page_size
        # one 128-thread tiled-copy pass covers 16 rows x 64 columns = one page of a KV tile
        assert (NUM_THREADS // 8) == page_size

    @cute.jit
    def __call__(self, q: cute.Pointer, k_cache: cute.Pointer, v_cache: cute.Pointer,
                 cu_seqlens_q: cute.Pointer, context_lens: cute.Pointer,
                 page_indices: cute.Pointer, out: cute.Pointer, total_q: cutlass.Int32,
                 batch: cutlass.Int32, page_stride: cutlass.Int32, max_q_len: cutlass.Int32,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        bf16 = cutlass.BFloat16
        hd, tm, tn, nq = self.hd, self.tm, self.tn, self.nq
        mQ = cute.make_tensor(q, cute.make_layout((total_q, nq, hd), stride=(nq * hd, hd, 1)))
        mO = cute.make_tensor(out, cute.make_layout((total_q, nq, hd), stride=(nq * hd, hd, 1)))
        mCu = cute.make_tensor(cu_seqlens_q, cute.make_layout(batch + 1))
        mCtx = cute.make_tensor(context_lens, cute.make_layout(batch))
        mPT = cute.make_tensor(page_indices, cute.make_layout((batch, page_stride),
                                                              stride=(page_stride, 1)))

        sQ_layout = swizzled_rows((tm, hd))
        sKV_layout = swizzled_rows((tn, hd))

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(sKV_layout)], 1024]

        # gmem <-> smem: thread t moves 16 bytes at (row t // 8, chunk t % 8) of a 16 x 64 pass
        thr_layout = cute.make_layout((NUM_THREADS // 8, 8), stride=(8, 1))
        val_layout = cute.make_layout((1, 8))
        g2s = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
                                bf16, num_bits_per_copy=128),
            thr_layout, val_layout)
        s2g = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), bf16, num_bits_per_copy=128),
            thr_layout, val_layout)
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(bf16, cutlass.Float32, (16, 8, 16)),
            (NUM_THREADS // 32, 1, 1), permutation_mnk=(NUM_THREADS // 32 * 16, 16, 16))

        self.kernel(mQ, k_cache, v_cache, mCu, mCtx, mPT, mO, scale * LOG2_E, sQ_layout,
                    sKV_layout, g2s, s2g, tiled_mma, SharedStorage).launch(
            grid=[(max_q_len + tm - 1) // tm, nq, batch], block=[NUM_THREADS, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, k_cache: cute.Pointer, v_cache: cute.Pointer,
               mCu: cute.Tensor, mCtx: cute.Tensor, mPT: cute.Tensor, mO: cute.Tensor,
               scale_log2: cutlass.Float32, sQ_layout: cute.ComposedLayout,
               sKV_layout: cute.ComposedLayout, g2s: cute.TiledCopy, s2g: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        bf16 = cutlass.BFloat16
        f32 = cutlass.Float32
        hd, tm, tn = self.hd, self.tm, self.tn
        tidx, _, _ = cute.arch.thread_idx()
        mb_rev, head, b = cute.arch.block_idx()
        n_mblocks, _, _ = cute.arch.grid_dim()
        m_block = n_mblocks - 1 - mb_rev  # longest causal tiles first

        q_start = mCu[b]
        q_len = mCu[b + 1] - q_start
        if m_block * tm < q_len:
            kvh = head // self.group
            ctx = mCtx[b]
            pos0 = ctx - q_len + m_block * tm  # position of the tile's first query
            rows_left = q_len - m_block * tm
            kv_end = pos0 + cutlass.min(tm, rows_left)  # KV tokens [0, kv_end) are needed
            n_blocks = (kv_end + tn - 1) // tn
            n_unmasked = pos0 // tn  # KV tiles entirely <= every row's position

            storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sKV_layout)
            sV = storage.sV.get_tensor(sKV_layout)
            sVt = cute.composition(sV, cute.make_layout((hd, tn), stride=(tn, 1)))

            # ---- gmem -> smem partitions
            thr_g2s = g2s.get_slice(tidx)
            q_off = cute.assume(((q_start + m_block * tm) * self.nq + head) * hd, divby=hd)
            gQ = cute.make_tensor(mQ.iterator + q_off,
                                  cute.make_layout((tm, hd), stride=(self.nq * hd, 1)))
            tQgQ = thr_g2s.partition_S(gQ)
            tQsQ = thr_g2s.partition_D(sQ)
            tQcQ = thr_g2s.partition_S(cute.make_identity_tensor((tm, hd)))
            tKsK = thr_g2s.partition_D(sK)
            tVsV = thr_g2s.partition_D(sV)
            tPcP = thr_g2s.partition_S(cute.make_identity_tensor((self.ps, hd)))
            row_in_page = tPcP[0, 0, 0][0]

            # ---- mma partitions and smem -> register copies
            thr_mma = tiled_mma.get_slice(tidx)
            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK))
            tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt))
            acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((tm, hd)), f32)
            acc_O.fill(0.0)
            s2r_Q = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                    bf16), tiled_mma)
            s2r_K = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                    bf16), tiled_mma)
            s2r_V = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4),
                                    bf16), tiled_mma)
            thr_s2r_Q = s2r_Q.get_slice(tidx)
            thr_s2r_K = s2r_K.get_slice(tidx)
            thr_s2r_V = s2r_V.get_slice(tidx)
            tSsQ = thr_s2r_Q.partition_S(sQ)
            tSrQ_v = thr_s2r_Q.retile(tSrQ)
            tSsK = thr_s2r_K.partition_S(sK)
            tSrK_v = thr_s2r_K.retile(tSrK)
            tOsVt = thr_s2r_V.partition_S(sVt)
            tOrVt_v = thr_s2r_V.retile(tOrVt)
            # (row, col) of every S accumulator element, as a (rows, cols) view
            tScS = mn_view(thr_mma.partition_C(cute.make_identity_tensor((tm, tn))))

            # ---- prologue: Q tile (rows past q_len zero-filled) and the last KV tile's K
            for mi in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
                if tQcQ[0, mi, 0][0] < rows_left:
                    cute.copy(g2s, tQgQ[None, mi, None], tQsQ[None, mi, None])
                else:
                    tQsQ[None, mi, None].fill(0)
            self.load_kv(g2s, thr_g2s, tKsK, k_cache, mPT, b, kvh, n_blocks - 1, kv_end,
                         row_in_page)
            cute.arch.cp_async_commit_group()

            n_rows = cute.size(acc_O.shape[0][1]) * cute.size(acc_O.shape[1])  # rows per thread
            row_max = cute.make_rmem_tensor(n_rows, f32)
            row_sum = cute.make_rmem_tensor(n_rows, f32)
            row_max.fill(-cutlass.Float32.inf)
            row_sum.fill(0.0)

            # KV tiles in reverse: the masked ones (1 or 2) first, then the rest unmasked
            ctx_args = (g2s, thr_g2s, tiled_mma, k_cache, v_cache, mPT, b, kvh, kv_end,
                        row_in_page, pos0, scale_log2, tKsK, tVsV, tSrQ, tSrK, tOrVt,
                        s2r_Q, s2r_K, s2r_V, tSsQ, tSrQ_v, tSsK, tSrK_v, tOsVt, tOrVt_v,
                        tScS, acc_O, row_max, row_sum)
            for i in cutlass.range(n_blocks - n_unmasked, unroll=1):
                self.one_kv_tile(n_blocks - 1 - i, True, *ctx_args)
            for i in cutlass.range(n_unmasked, unroll=1):
                self.one_kv_tile(n_unmasked - 1 - i, False, *ctx_args)

            # ---- epilogue: normalize, bf16, registers -> smem (reusing sQ) -> gmem
            acc_O_mn = mn_view(acc_O)
            for r in cutlass.range_constexpr(n_rows):
                total = quad_sum(row_sum[r])
                inv = 0.0 if total == 0.0 else 1.0 / total
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
            rO = cute.make_fragment_like(acc_O, bf16)
            rO.store(acc_O.load().to(bf16))
            sO = cute.make_tensor(sQ.iterator, sQ_layout)
            r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(),
                                                             bf16), tiled_mma)
            thr_r2s = r2s.get_slice(tidx)
            cute.copy(r2s, thr_r2s.retile(rO), thr_r2s.partition_D(sO))
            cute.arch.sync_threads()
            thr_s2g = s2g.get_slice(tidx)
            gO = cute.make_tensor(mO.iterator + q_off,
                                  cute.make_layout((tm, hd), stride=(self.nq * hd, 1)))
            tOsO = thr_s2g.partition_S(sO)
            tOgO = thr_s2g.partition_D(gO)
            tOrO = cute.make_fragment_like(tOgO, bf16)
            cute.copy(s2g, tOsO, tOrO)
            for mi in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
                if tQcQ[0, mi, 0][0] < rows_left:
                    cute.copy(s2g, tOrO[None, mi, None], tOgO[None, mi, None])

    @cute.jit
    def load_kv(self, g2s: cute.TiledCopy, thr_g2s: cute.TiledCopy, tXsX: cute.Tensor,
                cache: cute.Pointer, mPT: cute.Tensor, b: cutlass.Int32, kvh: cutlass.Int32,
                n_block: cutlass.Int32, kv_end: cutlass.Int32, row_in_page: cutlass.Int32):
        """cp.async KV tile n_block (pages 4n .. 4n+3 of sequence b) into smem; zero-fill rows
        at or past kv_end (their page indices are not read)."""
        ps, hd = self.ps, self.hd
        for j in cutlass.range_constexpr(self.pages_per_tile):
            if n_block * self.tn + j * ps + row_in_page < kv_end:
                page = cutlass.Int64(mPT[b, n_block * self.pages_per_tile + j])
                # Int64: page * nkv * page_size * head_dim can pass 2^31 elements
                off = cute.assume((page * self.nkv + cutlass.Int64(kvh)) * (ps * hd),
                                  divby=ps * hd)
                gP = cute.make_tensor(cache + off, cute.make_layout((ps, hd), stride=(hd, 1)))
                tPgP = thr_g2s.partition_S(gP)
                cute.copy(g2s, tPgP[None, 0, None], tXsX[None, j, None])
            else:
                tXsX[None, j, None].fill(0)

    @cute.jit
    def one_kv_tile(self, n_block: cutlass.Int32, masked: cutlass.Constexpr,
                    g2s: cute.TiledCopy, thr_g2s: cute.TiledCopy, tiled_mma: cute.TiledMma,
                    k_cache: cute.Pointer, v_cache: cute.Pointer, mPT: cute.Tensor,
                    b: cutlass.Int32, kvh: cutlass.Int32, kv_end: cutlass.Int32,
                    row_in_page: cutlass.Int32, pos0: cutlass.Int32,
                    scale_log2: cutlass.Float32, tKsK: cute.Tensor, tVsV: cute.Tensor,
                    tSrQ: cute.Tensor, tSrK: cute.Tensor, tOrVt: cute.Tensor,
                    s2r_Q: cute.TiledCopy, s2r_K: cute.TiledCopy, s2r_V: cute.TiledCopy,
                    tSsQ: cute.Tensor, tSrQ_v: cute.Tensor, tSsK: cute.Tensor,
                    tSrK_v: cute.Tensor, tOsVt: cute.Tensor, tOrVt_v: cute.Tensor,
                    tScS: cute.Tensor, acc_O: cute.Tensor, row_max: cute.Tensor,
                    row_sum: cute.Tensor):
        """One KV tile: S = Q K^T, (mask), online softmax, O += P V.

        On entry K(n_block) is in flight; on exit V(n_block) was consumed and K(n_block - 1) is
        in flight (when n_block > 0). The two block barriers order every smem reuse."""
        f32 = cutlass.Float32
        neg_inf = -cutlass.Float32.inf
        acc_S = cute.make_rmem_tensor(tiled_mma.get_slice(0).partition_shape_C(
            (self.tm, self.tn)), f32)
        acc_S.fill(0.0)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # K(n) visible to all; everyone is done reading sV
        self.load_kv(g2s, thr_g2s, tVsV, v_cache, mPT, b, kvh, n_block, kv_end, row_in_page)
        cute.arch.cp_async_commit_group()

        n_k = cute.size(tSsQ.shape[2])
        cute.copy(s2r_Q, tSsQ[None, None, 0], tSrQ_v[None, None, 0])
        cute.copy(s2r_K, tSsK[None, None, 0], tSrK_v[None, None, 0])
        for k in cutlass.range_constexpr(n_k):
            if cutlass.const_expr(k + 1 < n_k):
                cute.copy(s2r_Q, tSsQ[None, None, k + 1], tSrQ_v[None, None, k + 1])
                cute.copy(s2r_K, tSsK[None, None, k + 1], tSrK_v[None, None, k + 1])
            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # V(n) visible to all; everyone is done reading sK
        if n_block > 0:
            self.load_kv(g2s, thr_g2s, tKsK, k_cache, mPT, b, kvh, n_block - 1, kv_end,
                         row_in_page)
            cute.arch.cp_async_commit_group()

        # ---- online softmax over this tile (rows of S are spread over a quad of threads)
        acc_S_mn = mn_view(acc_S)
        acc_O_mn = mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_max)):
            if cutlass.const_expr(masked):
                pos = pos0 + tScS[r, 0][0]
                for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                    col = n_block * self.tn + tScS[0, c][1]
                    if col > pos or col >= kv_end:
                        acc_S_mn[r, c] = neg_inf
            s_row = acc_S_mn[r, None].load()
            m_new = cute.arch.fmax(row_max[r], quad_max(
                s_row.reduce(cute.ReductionOp.MAX, neg_inf, 0)))
            m_use = 0.0 if m_new == neg_inf else m_new  # fully masked so far: keep exp2 finite
            m_scaled = m_use * scale_log2
            p_row = cute.math.exp2(s_row * scale_log2 - m_scaled, fastmath=True)
            alpha = cute.math.exp2(row_max[r] * scale_log2 - m_scaled, fastmath=True)
            row_sum[r] = row_sum[r] * alpha + p_row.reduce(cute.ReductionOp.ADD, 0.0, 0)
            row_max[r] = m_new
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * alpha
            acc_S_mn[r, None] = p_row

        # ---- O += P V: P (bf16) reused in registers as the A operand
        rP = cute.make_fragment_like(acc_S, cutlass.BFloat16)
        rP.store(acc_S.load().to(cutlass.BFloat16))
        # C layout (4, MMA_M, MMA_N) -> A layout ((4, 2), MMA_M, MMA_N / 2): k16 = 2 n8 atoms
        p_div = cute.logical_divide(rP.layout, (None, None, 2))
        tOrP = cute.make_tensor(rP.iterator, cute.make_layout(
            ((p_div.shape[0], p_div.shape[2][0]), p_div.shape[1], p_div.shape[2][1]),
            stride=((p_div.stride[0], p_div.stride[2][0]), p_div.stride[1],
                    p_div.stride[2][1])))
        n_kv = cute.size(tOrP.shape[2])
        cute.copy(s2r_V, tOsVt[None, None, 0], tOrVt_v[None, None, 0])
        for k in cutlass.range_constexpr(n_kv):
            if cutlass.const_expr(k + 1 < n_kv):
                cute.copy(s2r_V, tOsVt[None, None, k + 1], tOrVt_v[None, None, k + 1])
            cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrVt[None, None, k], acc_O)


SIGNATURE = Signature(
    Ptr("q", "bf16"), Ptr("k_cache", "bf16"), Ptr("v_cache", "bf16"), Ptr("cu_seqlens_q", "i32"),
    Ptr("context_lens", "i32"), Ptr("page_indices", "i32"), Ptr("out", "bf16"),
    Scalar("total_q", cutlass.Int32), Scalar("batch", cutlass.Int32),
    Scalar("page_stride", cutlass.Int32), Scalar("max_q_len", cutlass.Int32),
    Scalar("scale", cutlass.Float32, fake=1.0))


class PrefillAttentionLauncher:
    """Typed entry point: device buffers (objects with .ptr, or ints), Python ints, the stream."""

    def __init__(self, nq: int, nkv: int, head_dim: int, page_size: int,
                 kernel: _common.Kernel):
        self.nq, self.nkv, self.hd, self.ps = nq, nkv, head_dim, page_size
        self._fn = kernel

    def __call__(self, q, k_cache, v_cache, cu_seqlens_q, context_lens, page_indices, out,
                 total_q: int, batch: int, page_stride: int, max_q_len: int, scale: float,
                 stream) -> None:
        for name, v in (("total_q", total_q), ("batch", batch), ("page_stride", page_stride),
                        ("max_q_len", max_q_len)):
            if not isinstance(v, int) or v < 1:
                raise _common.KernelArgError(f"{name} must be a positive int, got {v!r}")
        self._fn(q, k_cache, v_cache, cu_seqlens_q, context_lens, page_indices, out, total_q,
                 batch, page_stride, max_q_len, scale, stream)


def compile_prefill_attention(num_q_heads: int, num_kv_heads: int, head_dim: int,
                              page_size: int = 16) -> PrefillAttentionLauncher:
    key = ("prefill_attention", num_q_heads, num_kv_heads, head_dim, page_size)

    def build() -> PrefillAttentionLauncher:
        op = PrefillAttention(num_q_heads, num_kv_heads, head_dim, page_size)
        return PrefillAttentionLauncher(num_q_heads, num_kv_heads, head_dim, page_size,
                                        SIGNATURE.compile(op))

    return _common.cached_compile(key, build)
