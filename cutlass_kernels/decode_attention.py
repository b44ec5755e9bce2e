"""Paged decode attention: one query token per sequence, GQA, split-KV with a fused log-sum-exp
combine.

    out[b, qh] = softmax_t(q[b, qh] . K[b, kvh, t] * scale) @ V[b, kvh, t],  t < context_lens[b]

with kvh = qh // (nq / nkv). Scores, softmax and P.V are fp32; the output is rounded to bf16.

Grid: one CTA per (kv head, split, sequence), 128 threads. The CTA loads each (page, kv head)
tile of K and V once and serves all nq/nkv query heads that share it. Split j of a sequence covers
pages [j * pps, min((j + 1) * pps, n_pages)) with n_pages = ceil(ctx / page_size) and
pps = max(ceil(n_pages / num_splits), MIN_PAGES_PER_SPLIT), computed on the device from
context_lens, so the grid depends only on (B, num_splits), both frozen per CUDA-graph bucket. A
split with no pages writes m = -inf, l = 0, o = 0; the combine skips it (splits
j >= ceil(n_pages / pps) are the empty ones). The bucket's num_splits comes from max_model_len
(decode_plan.py); the floor of MIN_PAGES_PER_SPLIT pages keeps a shorter context on fewer, fuller
splits (qwen3-8b shape, batch 1, context 1024: 8 splits of 8 pages 5.29 us, 16 of 4 5.60 us,
docs/perf.md v22), the rest of the grid exiting empty.

KV cache, per layer, K and V separately (docs/kernels.md):

    cache[num_pages, nkv, page_size, head_dim] bf16; the (page, kv head) tile is contiguous:
    +-------------------- page_size x head_dim bf16 ------------------+
    | token 0: d0 .. d7 | d8 .. d15 | ... |   (16-byte chunks)         |
    | token 1: ...                                                    |

Per page, thread t owns chunk c = t % (head_dim / 8) of token rows r, r + R, ... where
r = t // (head_dim / 8) and R = 128 / (head_dim / 8) (8 rows for hd 128, 16 for hd 64). It copies
exactly these 16-byte chunks with cp.async into a ring of `num_stages` shared-memory page buffers
and later reads only them, so the main loop needs no block barrier. Each row group (the threads
of one r) keeps its own online-softmax state (m, l, o[8] per query head); the groups merge through
shared memory at the end.

Two main loops, chosen at compile time (``mma=``): the one above (CUDA cores, ``simt``) and a
tensor-core one (``mma``, the engine's default; ``mma_main`` describes it): ``warps`` warps per CTA,
each streaming pages w, w + warps, ... through its own ``num_stages``-page ring, S and O on
mma.sync. Both leave (m, l, o) per group in shared memory for the same merge below.

Outputs: num_splits == 1: out bf16[B, nq * hd] directly. num_splits > 1, one kernel (one graph
node): the workspace (`decode_workspace_bytes`) holds

    o_partial f32[B, nq, S, hd] (unnormalized) | ml f32[B, nq, S, 2] (running max in log2
    units, sum of exponentials) | ... | counters int32[B * nkv] (index b * nkv + kvh) at
    split_counters_offset(workspace bytes): a place fixed per buffer, past every launch's partials

Each split CTA writes its partials, fences (release, gpu scope) and adds 1 to its (b, kvh)
counter (acq_rel); the CTA that reads S - 1, the last to arrive, fences (acquire), merges the
non-empty splits in split order 0, 1, ... (so the bits do not depend on which CTA came last: graph
replay and eager agree), writes out and sets the counter back to 0. The counters must be zero
before the first launch (the executor zeroes the workspace once); every launch leaves them zero.
No CTA waits for another, so PDL successors sharing the SMs cannot deadlock it. The merge is the
same fp32 arithmetic as the separate combine kernel it replaced (`fused=False`, kept for
comparison): max of m, the sum of l * 2^(m - max) per lane (splits j, j + 32) then a butterfly,
o summed over splits in order, times 1 / l.
Padding rows (context 1, page 0) compute garbage-free results like any other row. Constraints:
head_dim in {64, 128}, page_size 16, nq % nkv == 0, nq / nkv <= 8, context_lens >= 1,
num_splits <= MAX_SPLITS, a split launch's workspace a buffer with .nbytes, pointers 16-byte
aligned.

    launch = compile_decode_attention(nq, nkv, hd)
    launch(q, k_cache, v_cache, page_indices, context_lens, out, workspace,   # buffers / addrs
           batch, page_stride, num_splits, scale, stream)    # workspace may be None at 1 split
"""

import cutlass_kernels._common as _common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
import math
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp

from cutlass_kernels._common import Ptr, Scalar, Signature, Unused
from cutlass_kernels._mma import mn_view, quad_max, quad_sum, swizzled_rows
from cutlass_kernels.rope_kv import norm_rope
from cutlass_kernels.decode_plan import (  # noqa: F401  (re-exported: the plan's home)
    MAX_SPLITS,
    MIN_PAGES_PER_SPLIT,
    choose_num_splits,
    decode_workspace_bytes,
    split_counters_offset,
)

LOG2_E = 1.4426950408889634
NUM_THREADS = 128
COMBINE_WARPS = 4
DEFAULT_STAGES = 4
MERGE_VEC = 4  # fused merge: fp32 values per thread and step
MMA_STAGES = 2  # the mma variant's pages per warp ring
MMA_ROWS = 16  # the mma variant's S tile rows: the G <= 8 query heads of a kv head, zero-padded


class DecodeAttention:
    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
                 split: bool = False, num_stages: int = DEFAULT_STAGES, fused: bool = True,
                 mma: bool = False, warps: int = 4, pdl: bool = False, rope: bool = False,
                 qk_norm: bool = False):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if page_size != 16:
            raise ValueError(f"page_size must be 16, got {page_size}")
        if num_q_heads % num_kv_heads or num_q_heads // num_kv_heads > 8:
            raise ValueError(f"nq={num_q_heads} must be a multiple (at most 8x) of "
                             f"nkv={num_kv_heads}")
        self.nq = num_q_heads
        self.nkv = num_kv_heads
        self.hd = head_dim
        self.ps = page_size
        self.group = num_q_heads // num_kv_heads
        self.split = split
        self.fused = fused  # split only: the combine in this kernel (else a second kernel)
        self.stages = num_stages
        self.chunks = head_dim // 8  # 16-byte chunks per token row = threads per row group
        self.mma = mma
        self.pdl = bool(pdl)
        # rope: the q / k RMSNorm, RoPE and KV-cache write of rope_kv.py in the prologue
        # (DecodeRopeAttention); one lane per (head, 8 + 8 elements) of G q heads, k and v
        self.rope, self.qk_norm = bool(rope), bool(qk_norm)
        self.tpu = head_dim // 16
        if rope and (not mma or 32 * warps < (self.group + 2) * self.tpu):
            raise ValueError(f"rope needs the mma loop with 32 * warps >= (G + 2) * hd / 16 = "
                             f"{(self.group + 2) * self.tpu} threads, got mma={mma}, "
                             f"warps={warps}")
        if mma:
            # `warps` warps, each with its own ring of `num_stages` pages; the warps are the
            # merge's groups
            if warps not in (1, 2, 4) or not 1 <= num_stages <= 8:
                raise ValueError(f"mma: warps in (1, 2, 4), num_stages in [1, 8], got {warps}, "
                                 f"{num_stages}")
            self.threads = 32 * warps
            self.rows = warps
            self.passes = 0
            ring = 2 * warps * num_stages * page_size * head_dim
        else:
            self.threads = NUM_THREADS
            self.rows = NUM_THREADS // self.chunks  # row groups (tokens per pass)
            self.passes = page_size // self.rows
            assert self.passes * self.rows == page_size
            ring = 2 * num_stages * page_size * head_dim
        # bf16 elements of the K/V stage ring, which the merge buffer (rows x group x hd fp32)
        # reuses after the main loop (hd 64 with 8 heads per kv head needs more than the ring)
        self.smem_elems = max(ring, 2 * self.rows * self.group * head_dim)
        assert self.smem_elems >= 2 * self.group * (MAX_SPLITS + 1)  # the fused merge's weights

    @cute.jit
    def __call__(self, q: cute.Pointer, k_cache: cute.Pointer, v_cache: cute.Pointer,
                 page_indices: cute.Pointer, context_lens: cute.Pointer, out: cute.Pointer,
                 workspace: cute.Pointer, counters: cute.Pointer, batch: cutlass.Int32,
                 page_stride: cutlass.Int32, num_splits: cutlass.Int32, scale: cutlass.Float32,
                 stream: cuda.CUstream):
        self._launch(q, k_cache, v_cache, page_indices, context_lens, out, workspace, counters,
                     batch, page_stride, num_splits, scale, stream, None)

    def _launch(self, q, k_cache, v_cache, page_indices, context_lens, out, workspace, counters,
                batch, page_stride, num_splits, scale, stream, rope):
        """The host side of both signatures (traced inside their @cute.jit ``__call__``).
        ``rope``: None, or (qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, max_pos,
        eps) of DecodeRopeAttention; then ``q`` is qkv (never read as q)."""
        nq, hd, ch = self.nq, self.hd, self.chunks
        # (b, qh, chunk, 8) views of q and out: 16-byte vectors per (row, chunk)
        mQ = cute.make_tensor(q, cute.make_layout((batch, nq, ch, 8),
                                                  stride=(nq * hd, hd, 8, 1)))
        mO = cute.make_tensor(out, cute.make_layout((batch, nq, ch, 8),
                                                    stride=(nq * hd, hd, 8, 1)))
        mPT = cute.make_tensor(page_indices, cute.make_layout((batch, page_stride),
                                                              stride=(page_stride, 1)))
        mCtx = cute.make_tensor(context_lens, cute.make_layout(batch))
        # workspace: o_partial[B, nq, S, hd], ml[B, nq, S, 2]; the counters[B, nkv] elsewhere
        mCnt = cute.make_tensor(counters, cute.make_layout((batch, self.nkv),
                                                           stride=(self.nkv, 1)))
        s_hd = cute.assume(num_splits * hd, divby=hd)  # 16-byte rows: vector loads / stores
        b_hd = cute.assume(nq * num_splits * hd, divby=nq * hd)
        mWo = cute.make_tensor(workspace, cute.make_layout(
            (batch, nq, num_splits, ch, 8), stride=(b_hd, s_hd, hd, 8, 1)))
        nv = hd // MERGE_VEC
        mWo4 = cute.make_tensor(workspace, cute.make_layout(
            (batch, nq, num_splits, nv, MERGE_VEC), stride=(b_hd, s_hd, hd, MERGE_VEC, 1)))
        mO4 = cute.make_tensor(out, cute.make_layout((batch, nq, nv, MERGE_VEC),
                                                     stride=(nq * hd, hd, MERGE_VEC, 1)))
        ml_off = cute.assume(batch * nq * num_splits * hd, divby=8)
        mWml = cute.make_tensor(workspace + ml_off, cute.make_layout(
            (batch, nq, num_splits, 2), stride=(cute.assume(nq * num_splits * 2, divby=2),
                                                cute.assume(num_splits * 2, divby=2), 2, 1)))

        copy_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), cutlass.BFloat16,
            num_bits_per_copy=128)

        # the mma variant: swizzled Q tile and per-warp K / V rings, cp.async tiled copies (a
        # warp's for its pages, the CTA's for Q), S = Q K^T and O^T = V^T P^T on mma.sync
        ring_pages = self.rows * self.stages if self.mma else 1
        sQ_layout = swizzled_rows((MMA_ROWS, hd))
        ring_layout = swizzled_rows((self.ps, hd, ring_pages))
        bf16 = cutlass.BFloat16
        g2s_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL), bf16,
            num_bits_per_copy=128)
        g2s_warp = cute.make_tiled_copy_tv(g2s_atom, cute.make_layout((4, 8), stride=(8, 1)),
                                           cute.make_layout((1, 8)))
        g2s_cta = cute.make_tiled_copy_tv(
            g2s_atom, cute.make_layout((self.threads // 8, 8), stride=(8, 1)),
            cute.make_layout((1, 8)))
        mma_op = warp.MmaF16BF16Op(bf16, cutlass.Float32, (16, 8, 16))
        mma_s = cute.make_tiled_mma(mma_op, (1, 1, 1), permutation_mnk=(16, 16, 16))
        mma_o = cute.make_tiled_mma(mma_op, (1, 1, 1), permutation_mnk=(16, 8, 16))

        @cute.struct
        class SharedStorage:
            # K ring then V ring; reused as the fp32 merge buffer after the main loop
            sKV: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, self.smem_elems], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[
                cutlass.BFloat16, cute.cosize(sQ_layout) if self.mma else 8], 1024]
            sML: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.rows * self.group * 2], 16]
            sFlag: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 4], 16]

        if rope is None:  # placeholders, dead under const_expr(self.rope)
            mQKV, mPos, mSlot, mWq, mWk, mCS = mQ, mCtx, mCtx, mQ, mQ, mQ
            max_pos, eps = cutlass.Int32(1), cutlass.Float32(0.0)
        else:
            qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, max_pos, eps = rope
            half, tpu = hd // 2, self.tpu
            units = nq + 2 * self.nkv
            # (row, head, half, lane, 8) as rope_kv.py
            mQKV = cute.make_tensor(qkv, cute.make_layout((batch, units, 2, tpu, 8),
                                                          stride=(units * hd, hd, half, 8, 1)))
            mCS = cute.make_tensor(cos_sin, cute.make_layout((max_pos, 2, tpu, 8),
                                                             stride=(hd, half, 8, 1)))
            wl = cute.make_layout((2, tpu, 8), stride=(half, 8, 1))
            mWq = cute.make_tensor(q_norm_w, wl)
            mWk = cute.make_tensor(k_norm_w, wl)
            mPos = cute.make_tensor(positions, cute.make_layout(batch))
            mSlot = cute.make_tensor(slot_mapping, cute.make_layout(batch))
        self.kernel(mQ, k_cache, v_cache, mPT, mCtx, mO, mWo, mWml, mCnt, mWo4, mO4,
                    num_splits, scale * LOG2_E, copy_atom, SharedStorage, sQ_layout,
                    ring_layout, g2s_warp, g2s_cta, mma_s, mma_o, mQKV, mPos, mSlot, mWq, mWk,
                    mCS, max_pos, eps).launch(
            grid=[self.nkv, num_splits, batch], block=[self.threads, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream, use_pdl=self.pdl)
        if cutlass.const_expr(self.split and not self.fused):
            units = batch * nq
            vpl = hd // 32  # combine: lane owns dims [lane * vpl, lane * vpl + vpl)
            mWo_c = cute.make_tensor(workspace, cute.make_layout(
                (batch, nq, num_splits, 32, vpl),
                stride=(nq * num_splits * hd, num_splits * hd, hd, vpl, 1)))
            mO_c = cute.make_tensor(out, cute.make_layout((batch, nq, 32, vpl),
                                                          stride=(nq * hd, hd, vpl, 1)))
            self.combine_kernel(mWo_c, mWml, mO_c, units, num_splits).launch(
                grid=[(units + COMBINE_WARPS - 1) // COMBINE_WARPS, 1, 1],
                block=[32 * COMBINE_WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, k_cache: cute.Pointer, v_cache: cute.Pointer,
               mPT: cute.Tensor, mCtx: cute.Tensor, mO: cute.Tensor, mWo: cute.Tensor,
               mWml: cute.Tensor, mCnt: cute.Tensor, mWo4: cute.Tensor, mO4: cute.Tensor,
               num_splits: cutlass.Int32, scale_log2: cutlass.Float32,
               copy_atom: cute.CopyAtom, SharedStorage: cutlass.Constexpr,
               sQ_layout: cute.ComposedLayout, ring_layout: cute.ComposedLayout,
               g2s_warp: cute.TiledCopy, g2s_cta: cute.TiledCopy, mma_s: cute.TiledMma,
               mma_o: cute.TiledMma, mQKV: cute.Tensor, mPos: cute.Tensor, mSlot: cute.Tensor,
               mWq: cute.Tensor, mWk: cute.Tensor, mCS: cute.Tensor, max_pos: cutlass.Int32,
               eps: cutlass.Float32):
        cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        G, ch, rows, ps, hd = self.group, self.chunks, self.rows, self.ps, self.hd
        f32 = cutlass.Float32
        neg_inf = -cutlass.Float32.inf
        tidx, _, _ = cute.arch.thread_idx()
        kvh, split, b = cute.arch.block_idx()
        c = tidx % ch
        r = tidx // ch

        ctx = mCtx[b]
        n_pages = (ctx + ps - 1) // ps
        pps = cutlass.max((n_pages + num_splits - 1) // num_splits, MIN_PAGES_PER_SPLIT)
        p_begin = split * pps
        p_end = cutlass.min(p_begin + pps, n_pages)
        n_iter = cutlass.max(p_end - p_begin, 0)

        # ---- shared memory: K ring, V ring (reused as the fp32 merge buffer), (m, l) per group
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        kv_elems = self.stages * ps * hd
        sKV = storage.sKV.get_tensor(cute.make_layout(self.smem_elems))
        sML = storage.sML.get_tensor(cute.make_layout((rows, G, 2), stride=(G * 2, 2, 1)))
        sFlag = storage.sFlag.get_tensor(cute.make_layout(4))
        stage_layout = cute.make_layout((self.stages, ps, ch, 8),
                                        stride=(ps * hd, hd, 8, 1))
        sK = cute.make_tensor(sKV.iterator, stage_layout)
        sV = cute.make_tensor(sKV.iterator + kv_elems, stage_layout)

        # the fp32 merge buffer (row group / warp, head, dims) over the K/V ring, after the loop
        sAcc = cute.make_tensor(cute.recast_ptr(sKV.iterator, dtype=f32),
                                cute.make_layout((rows, G, ch, 8),
                                                 stride=(G * hd, hd, 8, 1)))
        if cutlass.const_expr(self.mma):
            self.mma_main(mQ, k_cache, v_cache, mPT, sKV, storage.sQ, sAcc, sML, sQ_layout,
                          ring_layout, g2s_warp, g2s_cta, mma_s, mma_o, b, kvh, ctx, p_begin,
                          n_iter, scale_log2, tidx, mQKV, mPos, mSlot, mWq, mWk, mCS, max_pos,
                          eps)
        else:
            # cp.async ring: group g <-> page p_begin + g. The ring's first page indices are
            # loaded together, unpredicated (clamped to a valid column, also for an empty split),
            # so their latencies overlap instead of chaining before each issue; later ones are
            # loaded one iteration ahead, so their latency hides behind a page of compute.
            # Loaded before griddepcontrol.wait (PDL): host uploads, not the previous kernel's.
            last_col = cutlass.max(n_pages - 1, 0)
            rPg = cute.make_rmem_tensor(self.stages, cutlass.Int32)
            for s in cutlass.range_constexpr(self.stages):
                rPg[s] = mPT[b, cutlass.min(p_begin + s, last_col)]
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()

            # ---- q for the G heads of this kv head, pre-scaled into log2 units
            rQ = cute.make_rmem_tensor((G, 8), f32)
            for h in cutlass.range_constexpr(G):
                qv = mQ[b, kvh * G + h, c, None].load().to(f32)
                rQ[h, None].store(qv * scale_log2)

            # ---- online-softmax state of this row group (replicated over its `ch` threads)
            rM = cute.make_rmem_tensor(G, f32)
            rL = cute.make_rmem_tensor(G, f32)
            rAcc = cute.make_rmem_tensor((G, 8), f32)
            rM.fill(neg_inf)
            rL.fill(0.0)
            rAcc.fill(0.0)
            rS = cute.make_rmem_tensor((G, self.passes), f32)

            for s in cutlass.range_constexpr(self.stages - 1):
                if s < n_iter:
                    self.issue(k_cache, v_cache, sK, sV, copy_atom, rPg[s], kvh, r, c, s)
                cute.arch.cp_async_commit_group()
            next_page = rPg[self.stages - 1]

            for it in cutlass.range(n_iter, unroll=1):
                nxt = it + (self.stages - 1)
                if nxt < n_iter:
                    self.issue(k_cache, v_cache, sK, sV, copy_atom, next_page, kvh, r, c,
                               nxt % self.stages)
                if nxt + 1 < n_iter:
                    next_page = mPT[b, p_begin + nxt + 1]
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(self.stages - 1)
                stage = it % self.stages
                tok0 = (p_begin + it) * ps
                # scores q.k for this thread's rows, reduced over the row group's threads
                for i in cutlass.range_constexpr(self.passes):
                    row = r + i * rows
                    kf = sK[stage, row, c, None].load().to(f32)
                    for h in cutlass.range_constexpr(G):
                        part = (kf * rQ[h, None].load()).reduce(cute.ReductionOp.ADD, 0.0, 0)
                        for sh in cutlass.range_constexpr(int(math.log2(ch))):
                            part = part + cute.arch.shuffle_sync_bfly(part, offset=ch >> (sh + 1))
                        rS[h, i] = part if tok0 + row < ctx else neg_inf
                # online softmax update; invalid rows carry score -inf and a zeroed V
                for h in cutlass.range_constexpr(G):
                    m_new = rM[h]
                    for i in cutlass.range_constexpr(self.passes):
                        m_new = cute.arch.fmax(m_new, rS[h, i])
                    m_use = 0.0 if m_new == neg_inf else m_new
                    alpha = cute.math.exp2(rM[h] - m_use, fastmath=True)
                    rM[h] = m_new
                    rL[h] = rL[h] * alpha
                    rAcc[h, None].store(rAcc[h, None].load() * alpha)
                for i in cutlass.range_constexpr(self.passes):
                    row = r + i * rows
                    vf = sV[stage, row, c, None].load().to(f32)
                    valid = tok0 + row < ctx
                    for h in cutlass.range_constexpr(G):
                        m_use = 0.0 if rM[h] == neg_inf else rM[h]
                        p = cute.math.exp2(rS[h, i] - m_use, fastmath=True)
                        rL[h] = rL[h] + p
                        if valid:
                            rAcc[h, None].store(rAcc[h, None].load() + vf * p)

            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            # ---- merge the row groups through shared memory
            for h in cutlass.range_constexpr(G):
                sAcc[r, h, c, None].store(rAcc[h, None].load())
                if c == 0:
                    sML[r, h, 0] = rM[h]
                    sML[r, h, 1] = rL[h]
        cute.arch.sync_threads()

        for u0 in cutlass.range_constexpr(-(-G * ch // self.threads)):
            u = tidx + u0 * self.threads
            if u < G * ch:
                h = u // ch
                cc = u % ch
                m_all = neg_inf
                for g in cutlass.range_constexpr(rows):
                    m_all = cute.arch.fmax(m_all, sML[g, h, 0])
                m_use = 0.0 if m_all == neg_inf else m_all
                l_all = cutlass.Float32(0.0)
                o = cute.make_rmem_tensor(8, f32)
                o.fill(0.0)
                for g in cutlass.range_constexpr(rows):
                    w = cute.math.exp2(sML[g, h, 0] - m_use, fastmath=True)
                    l_all = l_all + sML[g, h, 1] * w
                    o.store(o.load() + sAcc[g, h, cc, None].load() * w)
                qh = kvh * G + h
                if cutlass.const_expr(self.split):
                    mWo[b, qh, split, cc, None].store(o.load())
                    if cc == 0:
                        mWml[b, qh, split, 0] = m_all
                        mWml[b, qh, split, 1] = l_all
                else:
                    inv = 0.0 if l_all == 0.0 else 1.0 / l_all
                    mO[b, qh, cc, None].store((o.load() * inv).to(cutlass.BFloat16))

        if cutlass.const_expr(self.split and self.fused):
            # release this CTA's partials (each writer fences its own), then count it in
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                sFlag[0] = cute.arch.atomic_add(mCnt.iterator + (b * self.nkv + kvh),
                                                cutlass.Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.sync_threads()
            if sFlag[0] == num_splits - 1:  # the last of the S splits: every partial is out
                cute.arch.fence_acq_rel_gpu()
                n_active = cutlass.max((n_pages + pps - 1) // pps, 1)
                self.merge(mWo4, mWml, mO4, sKV, b, kvh, n_active, tidx)
                if tidx == 0:
                    mCnt[b, kvh] = cutlass.Int32(0)  # ready for the next launch (graph replay)

    @cute.jit
    def mma_main(self, mQ: cute.Tensor, k_cache: cute.Pointer, v_cache: cute.Pointer,
                 mPT: cute.Tensor, sKV: cute.Tensor, sQ_mem: cute.struct.MemRange,
                 sAcc: cute.Tensor, sML: cute.Tensor, sQ_layout: cute.ComposedLayout,
                 ring_layout: cute.ComposedLayout, g2s_warp: cute.TiledCopy,
                 g2s_cta: cute.TiledCopy, mma_s: cute.TiledMma, mma_o: cute.TiledMma,
                 b: cutlass.Int32, kvh: cutlass.Int32, ctx: cutlass.Int32,
                 p_begin: cutlass.Int32, n_iter: cutlass.Int32, scale_log2: cutlass.Float32,
                 tidx: cutlass.Int32, mQKV: cute.Tensor, mPos: cute.Tensor, mSlot: cute.Tensor,
                 mWq: cute.Tensor, mWk: cute.Tensor, mCS: cute.Tensor, max_pos: cutlass.Int32,
                 eps: cutlass.Float32):
        """The tensor-core main loop: warp w takes the split's pages w, w + W, ... through its
        own cp.async ring (no block barrier in the loop) and keeps an online softmax for the
        G heads; on exit sAcc[w] / sML[w] hold its unnormalized O, max (log2 units) and sum.

        S = Q K^T is m16n8k16 with the G heads as rows (zero-padded to 16; lane l holds head
        l // 4), K as B straight from ldmatrix. O^T = V^T P^T puts hd in M (no padded rows):
        A = V^T by ldmatrix.trans, and B = P^T is S's accumulator as it lies (lane l's S values
        (head l // 4, tokens 2 (l % 4) + {0, 1}, + 8) are exactly its B fragment of P^T).
        O^T's lane holds heads 2 (l % 4) + {0, 1}, whose rescale factors come from lanes 8 (l % 4)
        and 8 (l % 4) + 4 by shuffle. Token rows at or past ctx are zero-filled, not loaded,
        so a stale (even NaN) slot meets P = 0 as 0."""
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        neg_inf = -cutlass.Float32.inf
        G, ps, hd, W, S = self.group, self.ps, self.hd, self.rows, self.stages
        warp_i = tidx // 32
        lane = tidx % 32

        sQ = sQ_mem.get_tensor(sQ_layout)
        sK_all = cute.make_tensor(sKV.iterator, ring_layout)
        sV_all = cute.make_tensor(sKV.iterator + cute.cosize(ring_layout), ring_layout)
        # V^T views (hd, tokens) of every ring slot
        sVt_all = cute.composition(sV_all, cute.make_layout((hd, ps, W * S),
                                                            stride=(ps, 1, ps * hd)))

        # ---- this warp's page indices: local index warp_i + W * j of the split (host uploads:
        # loaded before griddepcontrol.wait under PDL, their latency behind the previous kernel)
        n_w = (n_iter - warp_i + W - 1) // W
        last_col = cutlass.max((ctx + ps - 1) // ps - 1, 0)  # a valid column, also when empty
        # S pages for the prologue's ring fill, and the first one the loop issues
        rPg = cute.make_rmem_tensor(S + 1, cutlass.Int32)
        for s in cutlass.range_constexpr(S + 1):
            rPg[s] = mPT[b, cutlass.min(p_begin + warp_i + W * s, last_col)]
        thr_kv = g2s_warp.get_slice(lane)
        tPc = thr_kv.partition_S(cute.make_identity_tensor((ps, hd)))

        if cutlass.const_expr(self.rope):
            # rope prologue: lane tidx < (G + 2) * tpu serves unit u = tidx // tpu (q heads
            # 0..G-1 of this kv head, then its k and v head), elements 8j.. and d/2 + 8j..;
            # the rest repeat the last unit (every lane of a warp is in the norm's butterfly)
            # and store nothing. Host-written inputs before the wait, as in rope_kv.py.
            tpu = self.tpu
            u = cutlass.min(tidx // tpu, G + 1)
            j = tidx % tpu
            pos = mPos[b]
            pos = pos if pos >= 0 else 0
            pos = pos if pos < max_pos else max_pos - 1
            c = mCS[pos, 0, j, None].load().to(bf16).to(f32)
            sn = mCS[pos, 1, j, None].load().to(bf16).to(f32)
            slot_tok = mSlot[b]
            rW = cute.make_rmem_tensor(cute.make_layout((8, 2), stride=(1, 8)), f32)
            if cutlass.const_expr(self.qk_norm):
                if u < G:
                    rW[None, 0].store(mWq[0, j, None].load().to(f32))
                    rW[None, 1].store(mWq[1, j, None].load().to(f32))
                else:
                    rW[None, 0].store(mWk[0, j, None].load().to(f32))
                    rW[None, 1].store(mWk[1, j, None].load().to(f32))
            # This CTA writes the new token's K / V when its split holds the context's last
            # page (the decode invariant: slot_mapping[b] is position ctx - 1's slot there,
            # and nothing else in the step writes the cache), before any warp loads that page:
            # the warp whose prologue would load it issues that prologue after the write and a
            # block barrier; the other warps at once, before the wait (earlier positions were
            # written by earlier steps, whose kernels have completed).
            lp_local = last_col - p_begin
            writer = (lp_local >= 0) & (lp_local < n_iter)
            late = writer & (lp_local % W == warp_i) & (lp_local // W < S)
            if late:
                pass
            else:
                self.mma_prologue(k_cache, v_cache, sK_all, sV_all, g2s_warp, thr_kv, tPc, rPg,
                                  kvh, p_begin, warp_i, ctx, n_w)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # qkv is the previous kernel's
            hh = kvh * G + u  # the head of unit u in qkv's (nq + 2 nkv) heads
            if u == G:
                hh = self.nq + kvh
            if u == G + 1:
                hh = self.nq + self.nkv + kvh
            x1b = mQKV[b, hh, 0, j, None].load()
            x2b = mQKV[b, hh, 1, j, None].load()
            o1b, o2b = norm_rope(x1b.to(f32), x2b.to(f32), rW, c, sn, eps, hd, self.qk_norm)
            rOut = cute.make_rmem_tensor(cute.make_layout((8, 2), stride=(1, 8)), bf16)
            rOut[None, 0].store(o1b)
            rOut[None, 1].store(o2b)
            active = tidx < (G + 2) * tpu
            if active & (u < G):
                for e in cutlass.range_constexpr(8):
                    sQ[u, 8 * j + e] = rOut[e, 0]
                    sQ[u, hd // 2 + 8 * j + e] = rOut[e, 1]
            if active & (u >= G) & writer & (slot_tok >= cutlass.Int64(0)):
                if u == G + 1:
                    rOut[None, 0].store(x1b)
                    rOut[None, 1].store(x2b)
                pg = slot_tok // cutlass.Int64(ps)
                elem = ((pg * cutlass.Int64(self.nkv) + cutlass.Int64(kvh)) * cutlass.Int64(ps)
                        + (slot_tok - pg * cutlass.Int64(ps))) * cutlass.Int64(hd)
                dst = k_cache.toint()
                if u == G + 1:
                    dst = v_cache.toint()
                addr = dst + (elem + cutlass.Int64(8 * j)) * cutlass.Int64(2)
                self._store8(addr, rOut[None, 0].load())
                self._store8(addr + cutlass.Int64(hd), rOut[None, 1].load())
            # Q rows G.. are zero
            n_zero = (MMA_ROWS - G) * hd
            for i in cutlass.range_constexpr(-(-n_zero // self.threads)):
                e = tidx + i * self.threads
                if e < n_zero:
                    sQ[G + e // hd, e % hd] = bf16(0.0)
            cute.arch.sync_threads()  # sQ, and the K / V stores before any load of that page
            if late:
                self.mma_prologue(k_cache, v_cache, sK_all, sV_all, g2s_warp, thr_kv, tPc, rPg,
                                  kvh, p_begin, warp_i, ctx, n_w)
        else:
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()  # q and the new token's K / V are the rope's

            # ---- Q: rows h < G <- q[b, kvh * G + h], rows G.. zero (issued first, waited
            # below)
            thr_q = g2s_cta.get_slice(tidx)
            q_off = cute.assume((b * self.nq + kvh * G) * hd, divby=hd)
            gQ = cute.make_tensor(mQ.iterator + q_off, cute.make_layout((MMA_ROWS, hd),
                                                                         stride=(hd, 1)))
            tQg = thr_q.partition_S(gQ)
            tQs = thr_q.partition_D(sQ)
            tQc = thr_q.partition_S(cute.make_identity_tensor((MMA_ROWS, hd)))
            for mi in cutlass.range_constexpr(cute.size(tQs.shape[1])):
                if tQc[0, mi, 0][0] < G:
                    cute.copy(g2s_cta, tQg[None, mi, None], tQs[None, mi, None])
                else:
                    tQs[None, mi, None].fill(0)
            cute.arch.cp_async_commit_group()
            self.mma_prologue(k_cache, v_cache, sK_all, sV_all, g2s_warp, thr_kv, tPc, rPg,
                              kvh, p_begin, warp_i, ctx, n_w)
        next_page = rPg[S]

        # ---- Q into registers (A fragments of every k block), once for the whole loop
        thr_s = mma_s.get_slice(lane)
        thr_o = mma_o.get_slice(lane)
        cute.arch.cp_async_wait_group(S)  # this thread's Q chunks (the oldest group)
        cute.arch.sync_threads()  # everyone's
        s2r_Q = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16),
            mma_s)
        s2r_K = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), bf16),
            mma_s)
        s2r_Vt = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), bf16),
            mma_o)
        thr_s2r_Q = s2r_Q.get_slice(lane)
        thr_s2r_K = s2r_K.get_slice(lane)
        thr_s2r_Vt = s2r_Vt.get_slice(lane)
        tSrQ = thr_s.make_fragment_A(thr_s.partition_A(sQ))
        cute.copy(s2r_Q, thr_s2r_Q.partition_S(sQ), thr_s2r_Q.retile(tSrQ))
        sK0 = sK_all[None, None, 0]
        sVt0 = sVt_all[None, None, 0]
        tSrK = thr_s.make_fragment_B(thr_s.partition_B(sK0))
        tOrVt = thr_o.make_fragment_A(thr_o.partition_A(sVt0))
        tSrK_v = thr_s2r_K.retile(tSrK)
        tOrVt_v = thr_s2r_Vt.retile(tOrVt)
        tScS = mn_view(thr_s.partition_C(cute.make_identity_tensor((MMA_ROWS, ps))))
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((hd, 8)), f32)
        acc_O.fill(0.0)
        rPt = cute.make_rmem_tensor(thr_o.partition_shape_B((8, ps)), bf16)
        row_max = cute.make_rmem_tensor(1, f32)
        row_sum = cute.make_rmem_tensor(1, f32)
        row_max.fill(neg_inf)
        row_sum.fill(0.0)
        n_k = cute.size(tSrQ.shape[2])
        head_a = 8 * (lane % 4)  # O^T column heads 2 (l % 4) + {0, 1} live in lanes 4 h

        # The prologue filled all S slots (S groups); iteration it waits for page it (S + it
        # groups committed, S - 1 may stay in flight), computes it, then refills its slot with
        # page it + S: the same S - 1 pages in flight during each page's math as issuing before
        # it, and one more page loaded before griddepcontrol.wait (batch 1: all of a split's)
        for it in cutlass.range(n_w, unroll=1):
            cute.arch.cp_async_wait_group(S - 1)
            cute.arch.sync_warp()  # every lane's chunks of this page are in
            slot = warp_i * S + it % S
            tok0 = (p_begin + warp_i + W * it) * ps

            # S = Q K^T (fp32), then log2 units, tokens past ctx masked
            tSsK = thr_s2r_K.partition_S(sK_all[None, None, slot])
            acc_S = cute.make_rmem_tensor(thr_s.partition_shape_C((MMA_ROWS, ps)), f32)
            acc_S.fill(0.0)
            cute.copy(s2r_K, tSsK[None, None, 0], tSrK_v[None, None, 0])
            for k in cutlass.range_constexpr(n_k):
                if cutlass.const_expr(k + 1 < n_k):
                    cute.copy(s2r_K, tSsK[None, None, k + 1], tSrK_v[None, None, k + 1])
                cute.gemm(mma_s, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
            acc_S_mn = mn_view(acc_S)
            for cc in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                sv = acc_S_mn[0, cc] * scale_log2
                acc_S_mn[0, cc] = sv if tok0 + tScS[0, cc][1] < ctx else neg_inf

            # online softmax of head lane // 4 (row 0 of the view; row 1 is padding)
            s_row = acc_S_mn[0, None].load()
            m_new = cute.arch.fmax(row_max[0], quad_max(
                s_row.reduce(cute.ReductionOp.MAX, neg_inf, 0)))
            m_use = 0.0 if m_new == neg_inf else m_new
            p_row = cute.math.exp2(s_row - m_use, fastmath=True)
            alpha = cute.math.exp2(row_max[0] - m_use, fastmath=True)
            row_sum[0] = row_sum[0] * alpha + p_row.reduce(cute.ReductionOp.ADD, 0.0, 0)
            row_max[0] = m_new
            acc_S_mn[0, None] = p_row
            # P^T's B fragment: values (k pair i, k half h) = S (row 0, pair i, n atom h)
            for h in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(2):
                    rPt[i + 2 * h] = acc_S[i + 4 * h].to(bf16)
            # rescale O^T's columns: heads 2 (l % 4) and 2 (l % 4) + 1
            a0 = cute.arch.shuffle_sync(alpha, offset=head_a)
            a1 = cute.arch.shuffle_sync(alpha, offset=head_a + 4)
            acc_O_mn = mn_view(acc_O)
            for rr in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
                acc_O_mn[rr, 0] = acc_O_mn[rr, 0] * a0
                acc_O_mn[rr, 1] = acc_O_mn[rr, 1] * a1

            # O^T += V^T P^T over hd / 16 m blocks (one k block of 16 tokens)
            tOsVt = thr_s2r_Vt.partition_S(sVt_all[None, None, slot])
            cute.copy(s2r_Vt, tOsVt, tOrVt_v)
            cute.gemm(mma_o, acc_O, tOrVt, rPt, acc_O)
            cute.arch.sync_warp()  # every lane is done with this slot before it is refilled
            nxt = it + S
            if nxt < n_w:
                self.mma_issue(k_cache, v_cache, sK_all, sV_all, g2s_warp, thr_kv, tPc,
                               next_page, kvh, (p_begin + warp_i + W * nxt) * ps, ctx, slot)
            if nxt + 1 < n_w:
                next_page = mPT[b, p_begin + warp_i + W * (nxt + 1)]
            cute.arch.cp_async_commit_group()

        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # every warp is out of the ring: sAcc may overwrite it

        # ---- this warp's state into the merge buffer: sum over the quad, O^T by column head
        total = quad_sum(row_sum[0])
        h_row = lane // 4
        if h_row < G and lane % 4 == 0:
            sML[warp_i, h_row, 0] = row_max[0]
            sML[warp_i, h_row, 1] = total
        sAcc_d = cute.make_tensor(sAcc.iterator, cute.make_layout((W, G, hd),
                                                                  stride=(G * hd, hd, 1)))
        tOcO = mn_view(thr_o.partition_C(cute.make_identity_tensor((hd, 8))))
        acc_O_mn = mn_view(acc_O)
        for rr in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
            for cc in cutlass.range_constexpr(cute.size(acc_O_mn.shape[1])):
                if tOcO[rr, cc][1] < G:
                    sAcc_d[warp_i, tOcO[rr, cc][1], tOcO[rr, cc][0]] = acc_O_mn[rr, cc]

    @cute.jit
    def mma_prologue(self, k_cache: cute.Pointer, v_cache: cute.Pointer, sK_all: cute.Tensor,
                     sV_all: cute.Tensor, g2s_warp: cute.TiledCopy, thr_kv: cute.TiledCopy,
                     tPc: cute.Tensor, rPg: cute.Tensor, kvh: cutlass.Int32,
                     p_begin: cutlass.Int32, warp_i: cutlass.Int32, ctx: cutlass.Int32,
                     n_w: cutlass.Int32):
        """This warp's first S pages into its ring (all of it), one cp.async group each."""
        W, S, ps = self.rows, self.stages, self.ps
        for s in cutlass.range_constexpr(S):
            if s < n_w:
                self.mma_issue(k_cache, v_cache, sK_all, sV_all, g2s_warp, thr_kv, tPc, rPg[s],
                               kvh, (p_begin + warp_i + W * s) * ps, ctx, warp_i * S + s)
            cute.arch.cp_async_commit_group()

    @cute.jit
    def _store8(self, addr: cutlass.Int64, vals: cute.TensorSSA):
        """Store 8 bf16 at byte address ``addr`` (16-byte aligned): one 128-bit store."""
        p = cute.make_ptr(cutlass.BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16)
        cute.make_tensor(p, cute.make_layout(8)).store(vals)

    @cute.jit
    def mma_issue(self, k_cache: cute.Pointer, v_cache: cute.Pointer, sK_all: cute.Tensor,
                  sV_all: cute.Tensor, g2s_warp: cute.TiledCopy, thr_kv: cute.TiledCopy,
                  tPc: cute.Tensor, page: cutlass.Int32, kvh: cutlass.Int32,
                  tok0: cutlass.Int32, ctx: cutlass.Int32, slot: cutlass.Int32):
        """cp.async one (page, kvh) tile of K and V into ring slot `slot` by this warp's 32
        lanes; token rows at or past ctx are zero-filled instead."""
        ps, hd = self.ps, self.hd
        off = cute.assume((cutlass.Int64(page) * self.nkv + cutlass.Int64(kvh)) * (ps * hd),
                          divby=ps * hd)
        tile = cute.make_layout((ps, hd), stride=(hd, 1))
        tKg = thr_kv.partition_S(cute.make_tensor(k_cache + off, tile))
        tVg = thr_kv.partition_S(cute.make_tensor(v_cache + off, tile))
        tKs = thr_kv.partition_D(sK_all[None, None, slot])
        tVs = thr_kv.partition_D(sV_all[None, None, slot])
        for i in cutlass.range_constexpr(cute.size(tKs.shape[1])):
            if tok0 + tPc[0, i, 0][0] < ctx:
                cute.copy(g2s_warp, tKg[None, i, None], tKs[None, i, None])
                cute.copy(g2s_warp, tVg[None, i, None], tVs[None, i, None])
            else:
                tKs[None, i, None].fill(0)
                tVs[None, i, None].fill(0)

    @cute.jit
    def merge(self, mWo4: cute.Tensor, mWml: cute.Tensor, mO4: cute.Tensor, sKV: cute.Tensor,
              b: cutlass.Int32, kvh: cutlass.Int32, n_active: cutlass.Int32,
              tidx: cutlass.Int32):
        """The last split CTA of (b, kvh): out[b, qh] for its G heads from splits
        [0, n_active) (the rest are empty: weight 0 in the separate combine, which adds exact
        zeros). The arithmetic and its order are combine_kernel's, element for element."""
        G, hd = self.group, self.hd
        f32 = cutlass.Float32
        neg_inf = -cutlass.Float32.inf
        slots = MAX_SPLITS // 32
        # the K/V ring is free (every thread is past the barriers after the main loop)
        sW = cute.make_tensor(cute.recast_ptr(sKV.iterator, dtype=f32),
                              cute.make_layout((G, MAX_SPLITS), stride=(MAX_SPLITS, 1)))
        sInv = cute.make_tensor(cute.recast_ptr(sKV.iterator, dtype=f32) + G * MAX_SPLITS,
                                cute.make_layout(G))
        warp = tidx // 32
        lane = tidx % 32
        # weights 2^(m_j - max) and 1 / l: one warp per head, lane owns splits lane, lane + 32
        for hw in cutlass.range_constexpr((G + self.threads // 32 - 1) // (self.threads // 32)):
            h = warp + hw * (self.threads // 32)
            if h < G:
                qh = kvh * G + h
                rMj = cute.make_rmem_tensor(slots, f32)
                rLj = cute.make_rmem_tensor(slots, f32)
                m_all = neg_inf
                for s in cutlass.range_constexpr(slots):
                    rMj[s] = neg_inf
                    rLj[s] = 0.0
                    if lane + 32 * s < n_active:
                        rMj[s] = mWml[b, qh, lane + 32 * s, 0]
                        rLj[s] = mWml[b, qh, lane + 32 * s, 1]
                    m_all = cute.arch.fmax(m_all, rMj[s])
                for sh in cutlass.range_constexpr(5):
                    m_all = cute.arch.fmax(m_all, cute.arch.shuffle_sync_bfly(m_all,
                                                                               offset=16 >> sh))
                m_use = 0.0 if m_all == neg_inf else m_all
                l_all = cutlass.Float32(0.0)
                for s in cutlass.range_constexpr(slots):
                    if lane + 32 * s < n_active:
                        w = cute.math.exp2(rMj[s] - m_use, fastmath=True)
                        l_all = l_all + rLj[s] * w
                        sW[h, lane + 32 * s] = w
                for sh in cutlass.range_constexpr(5):
                    l_all = l_all + cute.arch.shuffle_sync_bfly(l_all, offset=16 >> sh)
                if lane == 0:
                    sInv[h] = 0.0 if l_all == 0.0 else 1.0 / l_all
        cute.arch.sync_threads()
        # o: thread owns MERGE_VEC dims of one head, summed over the splits in order
        nv = hd // MERGE_VEC
        units = G * nv
        for i in cutlass.range_constexpr((units + self.threads - 1) // self.threads):
            u = tidx + i * self.threads
            if u < units:
                h = u // nv
                v = u % nv
                qh = kvh * G + h
                acc = cute.make_rmem_tensor(MERGE_VEC, f32)
                acc.fill(0.0)
                # unrolled: the loads of several splits are in flight at once
                for j in cutlass.range(n_active, unroll=8):
                    acc.store(acc.load() + mWo4[b, qh, j, v, None].load() * sW[h, j])
                mO4[b, qh, v, None].store((acc.load() * sInv[h]).to(cutlass.BFloat16))

    @cute.jit
    def issue(self, k_cache: cute.Pointer, v_cache: cute.Pointer, sK: cute.Tensor,
              sV: cute.Tensor, copy_atom: cute.CopyAtom, page: cutlass.Int32,
              kvh: cutlass.Int32, r: cutlass.Int32, c: cutlass.Int32, stage: cutlass.Int32):
        """cp.async this thread's 16-byte chunks of (page, kvh) into ring slot `stage`."""
        ps, hd = self.ps, self.hd
        tile_elems = ps * hd
        # Int64: page * nkv * page_size * head_dim can pass 2^31 elements
        off = cute.assume((cutlass.Int64(page) * self.nkv + cutlass.Int64(kvh)) * tile_elems,
                          divby=tile_elems)
        tile = cute.make_layout((ps, self.chunks, 8), stride=(hd, 8, 1))
        gK = cute.make_tensor(k_cache + off, tile)
        gV = cute.make_tensor(v_cache + off, tile)
        for i in cutlass.range_constexpr(self.passes):
            row = r + i * self.rows
            cute.copy(copy_atom, gK[row, c, None], sK[stage, row, c, None])
            cute.copy(copy_atom, gV[row, c, None], sV[stage, row, c, None])

    @cute.kernel
    def combine_kernel(self, mWo: cute.Tensor, mWml: cute.Tensor, mO: cute.Tensor,
                       units: cutlass.Int32, num_splits: cutlass.Int32):
        cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        f32 = cutlass.Float32
        neg_inf = -cutlass.Float32.inf
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        unit = bidx * COMBINE_WARPS + tidx // 32
        vpl = self.hd // 32  # values per lane
        if unit < units:
            b = unit // self.nq
            qh = unit % self.nq
            m_all = neg_inf
            for j in cutlass.range(lane, num_splits, 32, unroll=1):
                m_all = cute.arch.fmax(m_all, mWml[b, qh, j, 0])
            for sh in cutlass.range_constexpr(5):
                m_all = cute.arch.fmax(m_all, cute.arch.shuffle_sync_bfly(m_all,
                                                                           offset=16 >> sh))
            m_use = 0.0 if m_all == neg_inf else m_all
            l_all = cutlass.Float32(0.0)
            for j in cutlass.range(lane, num_splits, 32, unroll=1):
                l_all = l_all + mWml[b, qh, j, 1] * cute.math.exp2(mWml[b, qh, j, 0] - m_use,
                                                                  fastmath=True)
            for sh in cutlass.range_constexpr(5):
                l_all = l_all + cute.arch.shuffle_sync_bfly(l_all, offset=16 >> sh)
            acc = cute.make_rmem_tensor(vpl, f32)
            acc.fill(0.0)
            for j in cutlass.range(num_splits, unroll=1):
                w = cute.math.exp2(mWml[b, qh, j, 0] - m_use, fastmath=True)
                acc.store(acc.load() + mWo[b, qh, j, lane, None].load() * w)
            inv = 0.0 if l_all == 0.0 else 1.0 / l_all
            mO[b, qh, lane, None].store((acc.load() * inv).to(cutlass.BFloat16))


class DecodeRopeAttention(DecodeAttention):
    """Decode attention with rope_kv.py's work in its prologue (one graph node fewer a layer):
    from qkv[b] = [q heads | k heads | v heads] of one token per sequence at position
    positions[b], each CTA computes its G q heads' (optional) RMSNorm + RoPE into shared
    memory, and the CTA whose split holds the context's last page also writes the k head
    (normed, rotated) and the v head into the caches at slot_mapping[b] (skipped when < 0),
    as RopeKV does, with the same code (``norm_rope``), so the same bits. Only for steps of
    one token per sequence whose slot is position ctx - 1's (plain decode): rows that read
    each other's new K / V (speculative verify) need the separate kernels."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int = 16,
                 split: bool = False, num_stages: int = MMA_STAGES, fused: bool = True,
                 warps: int = 4, pdl: bool = False, qk_norm: bool = True):
        super().__init__(num_q_heads, num_kv_heads, head_dim, page_size, split=split,
                         num_stages=num_stages, fused=fused, mma=True, warps=warps, pdl=pdl,
                         rope=True, qk_norm=qk_norm)

    @cute.jit
    def __call__(self, qkv: cute.Pointer, positions: cute.Pointer, slot_mapping: cute.Pointer,
                 q_norm_w: cute.Pointer, k_norm_w: cute.Pointer, cos_sin: cute.Pointer,
                 k_cache: cute.Pointer, v_cache: cute.Pointer, page_indices: cute.Pointer,
                 context_lens: cute.Pointer, out: cute.Pointer, workspace: cute.Pointer,
                 counters: cute.Pointer, batch: cutlass.Int32, page_stride: cutlass.Int32,
                 num_splits: cutlass.Int32, scale: cutlass.Float32, max_pos: cutlass.Int32,
                 eps: cutlass.Float32, stream: cuda.CUstream):
        self._launch(qkv, k_cache, v_cache, page_indices, context_lens, out, workspace,
                     counters, batch, page_stride, num_splits, scale, stream,
                     (qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, max_pos, eps))


SIGNATURE = Signature(
    Ptr("q", "bf16"), Ptr("k_cache", "bf16"), Ptr("v_cache", "bf16"), Ptr("page_indices", "i32"),
    Ptr("context_lens", "i32"), Ptr("out", "bf16"), Ptr("workspace", "f32"),
    Ptr("counters", "i32"),
    Scalar("batch", cutlass.Int32), Scalar("page_stride", cutlass.Int32),
    Scalar("num_splits", cutlass.Int32), Scalar("scale", cutlass.Float32, fake=1.0))


class DecodeAttentionLauncher:
    """Typed entry point: device buffers (objects with .ptr, or ints), Python ints, the stream."""

    def __init__(self, nq: int, nkv: int, head_dim: int, page_size: int, single, split):
        self.nq, self.nkv, self.hd, self.ps = nq, nkv, head_dim, page_size
        self._single = single
        self._split = split

    def workspace_bytes(self, batch: int, num_splits: int) -> int:
        return decode_workspace_bytes(batch, self.nq, self.hd, num_splits)

    def __call__(self, q, k_cache, v_cache, page_indices, context_lens, out, workspace,
                 batch: int, page_stride: int, num_splits: int, scale: float, stream) -> None:
        kernel, ws, counters = self._plan(out, workspace, batch, page_stride, num_splits)
        kernel(q, k_cache, v_cache, page_indices, context_lens, out, ws, counters, batch,
               page_stride, num_splits, scale, stream)

    def _plan(self, out, workspace, batch: int, page_stride: int, num_splits: int):
        """(kernel, workspace, counters address) of a launch, its arguments checked."""
        for name, v in (("batch", batch), ("page_stride", page_stride),
                        ("num_splits", num_splits)):
            if not isinstance(v, int) or v < 1:
                raise _common.KernelArgError(f"{name} must be a positive int, got {v!r}")
        if num_splits > MAX_SPLITS:
            raise _common.KernelArgError(f"num_splits={num_splits}: at most {MAX_SPLITS}")
        if num_splits == 1:
            unused = Unused(out)
            return self._single, unused, unused
        need = decode_workspace_bytes(batch, self.nq, self.hd, num_splits)
        nbytes = getattr(workspace, "nbytes", None)
        if nbytes is None or nbytes < need:
            raise _common.KernelArgError(
                f"num_splits={num_splits} needs a workspace buffer (.ptr, .nbytes) of {need} "
                f"bytes (decode_workspace_bytes), got {workspace!r}")
        # the counters' place depends on the buffer's size only (decode_plan.py)
        counters = _common.addr(workspace) + split_counters_offset(nbytes)
        return self._split, workspace, counters


ROPE_SIGNATURE = Signature(
    Ptr("qkv", "bf16"), Ptr("positions", "i32", 4), Ptr("slot_mapping", "i64", 8),
    Ptr("q_norm_w", "bf16"), Ptr("k_norm_w", "bf16"), Ptr("cos_sin", "f32"),
    Ptr("k_cache", "bf16"), Ptr("v_cache", "bf16"), Ptr("page_indices", "i32"),
    Ptr("context_lens", "i32"), Ptr("out", "bf16"), Ptr("workspace", "f32"),
    Ptr("counters", "i32"),
    Scalar("batch", cutlass.Int32), Scalar("page_stride", cutlass.Int32),
    Scalar("num_splits", cutlass.Int32), Scalar("scale", cutlass.Float32, fake=1.0),
    Scalar("max_pos", cutlass.Int32), Scalar("eps", cutlass.Float32, fake=1e-6))


class DecodeRopeAttentionLauncher(DecodeAttentionLauncher):
    """``launcher(qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, k_cache, v_cache,
    page_indices, context_lens, out, workspace, batch, page_stride, num_splits, scale, max_pos,
    eps, stream)``: rope_kv's arguments (q_norm_w / k_norm_w None without qk_norm), then the
    decode attention's (DecodeRopeAttention)."""

    def __init__(self, *args, qk_norm: bool):
        super().__init__(*args)
        self.qk_norm = qk_norm

    def __call__(self, qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, k_cache,
                 v_cache, page_indices, context_lens, out, workspace, batch: int,
                 page_stride: int, num_splits: int, scale: float, max_pos: int, eps: float,
                 stream) -> None:
        if (q_norm_w is None or k_norm_w is None) == self.qk_norm:
            raise _common.KernelArgError(
                "q_norm_w and k_norm_w must be given exactly when compiled with qk_norm=True")
        if not isinstance(max_pos, int) or max_pos <= 0:
            raise _common.KernelArgError(f"max_pos={max_pos!r}: the cos/sin table needs rows")
        if not self.qk_norm:  # never read
            q_norm_w = k_norm_w = Unused(qkv)
        kernel, ws, counters = self._plan(out, workspace, batch, page_stride, num_splits)
        kernel(qkv, positions, slot_mapping, q_norm_w, k_norm_w, cos_sin, k_cache, v_cache,
               page_indices, context_lens, out, ws, counters, batch, page_stride, num_splits,
               scale, max_pos, float(eps), stream)


def _compile(nq: int, nkv: int, head_dim: int, page_size: int, split: bool,
             num_stages: int, fused: bool = True, mma: bool = False,
             warps: int = 4, pdl: bool = False) -> _common.Kernel:
    op = DecodeAttention(nq, nkv, head_dim, page_size, split=split, num_stages=num_stages,
                         fused=fused, mma=mma, warps=warps, pdl=pdl)
    return SIGNATURE.compile(op)


def compile_decode_attention(num_q_heads: int, num_kv_heads: int, head_dim: int,
                             page_size: int = 16, num_stages: int | None = None,
                             fused: bool = True, mma: bool = False,
                             warps: int = 4, pdl: bool = False) -> DecodeAttentionLauncher:
    """Compile (once per shape) the single-split and the split variants.
    ``num_stages``: pages in the cp.async ring (``num_stages - 1`` in flight per CTA; mma: per
    warp, default MMA_STAGES). ``fused=False``: the split variant as two kernels (partials, then
    a combine kernel), the design the fused one replaced, for comparison (same bits, one more
    graph node). ``mma``: the tensor-core main loop with ``warps`` warps per CTA. ``pdl``:
    launched with programmatic dependent launch; the context length and the first page indices
    are read before ``griddepcontrol.wait`` (host uploads), q and every K / V page after it."""
    if num_stages is None:
        num_stages = MMA_STAGES if mma else DEFAULT_STAGES
    lo = 1 if mma else 2
    if not lo <= num_stages <= (8 if mma else 16):
        raise ValueError(f"num_stages must be in [{lo}, {8 if mma else 16}], got {num_stages}")
    key = ("decode_attention", num_q_heads, num_kv_heads, head_dim, page_size, num_stages,
           fused) + ((("mma", warps),) if mma else ()) + (("pdl",) if pdl else ())

    def build() -> DecodeAttentionLauncher:
        args = (num_q_heads, num_kv_heads, head_dim, page_size)
        return DecodeAttentionLauncher(
            *args, _compile(*args, False, num_stages, mma=mma, warps=warps, pdl=pdl),
            _compile(*args, True, num_stages, fused, mma=mma, warps=warps, pdl=pdl))

    return _common.cached_compile(key, build)


def compile_decode_rope_attention(num_q_heads: int, num_kv_heads: int, head_dim: int,
                                  page_size: int = 16, qk_norm: bool = True,
                                  num_stages: int = MMA_STAGES, warps: int = 4,
                                  pdl: bool = False) -> DecodeRopeAttentionLauncher:
    """Compile (once per shape) the decode attention with the rope / KV-write prologue
    (DecodeRopeAttention: the mma loop), single-split and fused split variants."""
    key = ("decode_rope_attention", num_q_heads, num_kv_heads, head_dim, page_size,
           bool(qk_norm), num_stages, warps) + (("pdl",) if pdl else ())

    def build() -> DecodeRopeAttentionLauncher:
        args = (num_q_heads, num_kv_heads, head_dim, page_size)
        ops = [DecodeRopeAttention(*args, split=split, num_stages=num_stages, warps=warps,
                                   pdl=pdl, qk_norm=qk_norm) for split in (False, True)]
        return DecodeRopeAttentionLauncher(*args, *(ROPE_SIGNATURE.compile(op) for op in ops),
                                           qk_norm=bool(qk_norm))

    return _common.cached_compile(key, build)
