"""GPU sampler (greedy / temperature / top-k / top-p / min-p, seeded) and logprobs of fp32 logits.

Sampler, per row r of ``logits f32[S, V]`` (the math of ``engine/sampling.py``, bit for bit
where integer, to float rounding elsewhere):
  temperature <= 0: the first index of the max logit.
  otherwise ``z = logits / T`` (IEEE division, as numpy), ``d = z - max(z)`` (fp32); keep v iff
  - top-k (0 < k < V): v is among the k largest d, ties at the k-th value broken by lower index;
  - top-p (p < 1): over the top-k survivors, ordered by (d desc, index asc), v's predecessors'
    mass is < p * (their total mass), with mass ``floor(exp(d) * 2^40)`` in u64 fixed point;
  - min-p (m > 0): ``exp(d) >= m``  (= ``p[v] >= m * max(p)``);
  then ``argmax over kept v of z[v] + g[v]`` (first index on ties), ``g = -log(-log(u))`` with
  ``u = uniform(seed, step, v)`` computed in uint32 exactly as the numpy hash.
How thresholds are found: no sort. A radix select on a monotone u32 key of d (3 passes of 11
bits over the row, histograms in shared memory with integer atomics, so the result does not depend
on thread timing) finds the k-th largest key, and the same select weighted by fixed-point mass
finds the top-p crossing key. When the boundary value is tied, a second select on the index keeps
the lowest indices, as numpy's stable argsort does. Differences from numpy: exp/log are fp32
(numpy: float64 exp for top-p/min-p, float32 log), so decisions within ~1e-6 relative of a
boundary, or Gumbel scores within ~1e-6, may differ. Invalid parameters (top_p <= 0, min_p > 1)
behave as: top_p <= 0 keeps the top token; nothing kept returns token 0 (numpy's argmax of -inf).
Cost: greedy and plain temperature/min-p rows read the row twice; top-k and top-p add 3 passes
each (plus 3 more only when the boundary is tied).

Logprobs, per row of ``logits f32[R, V]`` (raw logits, as ``compute_logprobs``):
``lp = (x - max) - log(sum(exp(x - max)))``, the logprob and 1-based rank (1 + #{lp > lp_tok}) of
``token_ids[r]``, and the top-n ``(id, lp)`` by (lp desc, index asc), n <= max_top_n (compile-time,
default 20). Two passes over the row: an online max/sum, then rank count + per-thread top lists
merged by n block-wide argmax rounds.

Constraints: V compile-time (any V; V % 4 == 0 gets 128-bit loads), S/R and n runtime.
Layout: logits row-major ``[rows, row_stride]``, ``row_stride >= V`` compile-time (default V:
contiguous); only columns ``[0, V)`` are read, so a GEMM whose N is padded past the vocabulary
(zero weight rows) leaves padding logits that no token id, logprob or rank ever sees (128-bit
loads when V and row_stride are both multiples of 4). Per-row params ``temperature f32[S]``,
``top_k i32[S]``, ``top_p f32[S]``, ``min_p f32[S]``, ``seeds u64[S]``, ``steps u32[S]``;
outputs ``tokens i32[S]``; logprobs: ``token_ids i32[R]`` -> ``token_logprob f32[R]``,
``token_rank i32[R]``, ``top_ids i32[R, max_top_n]``, ``top_logprobs f32[R, max_top_n]``
(row stride max_top_n; columns ``[:n]`` written).
Grid ``(rows, 1, 1)``: one CTA per row; block 512 threads (sampler), 256 (logprobs).
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Float64, Int32, Uint32, Uint64

from cutlass_kernels._common import Ptr, Scalar, Signature, Unused
from cutlass_kernels._reduce import add, block_reduce

NBINS = 2048  # 11-bit radix digits: shifts 21, 10, 0 (the last digit overlaps one fixed bit)
MASS_ONE = 2.0**40  # fixed-point scale of exp(d) <= 1: a row's total mass stays below 2^58
G_MAX = 18.0  # > max Gumbel -log(-log(1 - 2^-24)) = 16.6: z + G_MAX bounds any score
INT_MAX = 0x7FFFFFFF
_M1, _M2, _GOLDEN, _SALT = 0x7FEB352D, 0x846CA68B, 0x9E3779B9, 0x632BE5AB


def _mix32(x: Uint32) -> Uint32:
    """lowbias32, as engine.sampling.mix32 (wrapping uint32 arithmetic)."""
    x = x ^ (x >> Uint32(16))
    x = x * Uint32(_M1)
    x = x ^ (x >> Uint32(15))
    x = x * Uint32(_M2)
    return x ^ (x >> Uint32(16))


def _key(d: Float32) -> Uint32:
    """Monotone map of fp32 to u32: a > b  <=>  key(a) > key(b) (for non-NaN values)."""
    bits = d.bitcast(Uint32)
    return bits ^ ((Uint32(0) - (bits >> Uint32(31))) | Uint32(0x80000000))


def _unkey(k: Uint32) -> Float32:
    return (k ^ ((Uint32(0) - ((k >> Uint32(31)) ^ Uint32(1))) | Uint32(0x80000000))).bitcast(
        Float32)


def _mass(d: Float32) -> Uint64:
    return Uint64(cute.math.exp(d) * Float32(MASS_ONE))


def _row_stride(vocab: int, row_stride: int | None) -> int:
    stride = vocab if row_stride is None else row_stride
    if not 0 < vocab <= stride:
        raise ValueError(f"vocab={vocab}, row_stride={row_stride}: need 0 < vocab <= row_stride")
    return stride


def _better(v1: Float32, i1: Int32, v2: Float32, i2: Int32) -> cutlass.Boolean:
    """(value desc, index asc) order: the argmax that returns the first index of the max."""
    return (v1 > v2) | ((v1 == v2) & (i1 < i2))


@cute.jit
def _argmax_op(a: tuple, b: tuple) -> tuple:
    """``block_reduce`` op of (value, index) pairs: keep b when it is better."""
    take = _better(b[0], b[1], a[0], a[1])
    v = b[0] if take else a[0]
    i = b[1] if take else a[1]
    return v, i


def _block_argmax(v: Float32, i: Int32, sF: cute.Tensor, sI: cute.Tensor, nwarps: int):
    """Block-wide (value desc, index asc) best; every thread gets the result; sF / sI may be
    reused right after."""
    return block_reduce((v, i), _argmax_op, (sF, sI), nwarps)


def _lse_op(a: tuple, b: tuple) -> tuple:
    """``block_reduce`` op of online-softmax states (max, sum of exp(x - max))."""
    nm = cute.arch.fmax(a[0], b[0])
    return nm, a[1] * cute.math.exp(a[0] - nm) + b[1] * cute.math.exp(b[0] - nm)


class Sampler:
    """One CTA per row; see the module docstring for the math and the tie rules."""

    def __init__(self, vocab: int, row_stride: int | None = None) -> None:
        self.vocab = vocab
        self.stride = _row_stride(vocab, row_stride)
        self.vec = 4 if vocab % 4 == 0 and self.stride % 4 == 0 else 1
        self.nvec = vocab // self.vec
        self.threads = min(512, max(32, (self.nvec + 31) // 32 * 32))
        self.nwarps = self.threads // 32

    @cute.jit
    def __call__(self, logits: cute.Pointer, temperature: cute.Pointer, top_k: cute.Pointer,
                 top_p: cute.Pointer, min_p: cute.Pointer, seeds: cute.Pointer,
                 steps: cute.Pointer, tokens: cute.Pointer, num_rows: Int32,
                 stream: cuda.CUstream):
        mL = cute.make_tensor(logits, cute.make_layout((num_rows, self.nvec, self.vec),
                                                       stride=(self.stride, self.vec, 1)))
        rows = cute.make_layout(num_rows)
        self.kernel(mL, cute.make_tensor(temperature, rows), cute.make_tensor(top_k, rows),
                    cute.make_tensor(top_p, rows), cute.make_tensor(min_p, rows),
                    cute.make_tensor(seeds, rows), cute.make_tensor(steps, rows),
                    cute.make_tensor(tokens, rows)).launch(
            grid=[num_rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mTemp: cute.Tensor, mTopK: cute.Tensor, mTopP: cute.Tensor,
               mMinP: cute.Tensor, mSeed: cute.Tensor, mStep: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sHist = smem.allocate_tensor(Uint64, cute.make_layout(NBINS), byte_alignment=16)
        sRes = smem.allocate_tensor(Uint64, cute.make_layout(4), byte_alignment=16)
        sF = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
        sI = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)

        # pass 1: max logit, first index of it (the greedy token)
        bv = -Float32.inf
        bi = Int32(INT_MAX)
        for c in range(tidx, self.nvec, self.threads):
            v = mL[r, c, None].load()
            for e in cutlass.range_constexpr(self.vec):
                if v[e] > bv:
                    bv = v[e]
                    bi = c * self.vec + e
        lmax, token = _block_argmax(bv, bi, sF, sI, self.nwarps)
        token = token if token < self.vocab else 0

        temp = mTemp[r]
        if temp > Float32(0.0):
            zmax = lmax / temp
            k = mTopK[r]
            tp = mTopP[r]
            kk = Uint32(0)  # top-k: keep key > kk, or key == kk and ~index >= nk
            nk = Uint32(0)
            kp = Uint32(0)  # top-p: the same rule with kp, np_
            np_ = Uint32(0)
            need = Uint64(0)
            cnt = Uint64(0)
            topk_on = (k > 0) & (k < self.vocab)
            topp_on = tp < Float32(1.0)
            # Four selects, one code path: 0 top-k value, 1 top-k tie index, 2 top-p value,
            # 3 top-p tie index (the tie stages run only when the boundary value is tied).
            for stage in range(4):
                active = topk_on
                want = Uint64(k)
                eq = Uint32(0)
                if stage == 1:
                    active = topk_on & (need < cnt)
                    want = need
                    eq = kk
                elif stage == 2:
                    active = topp_on
                elif stage == 3:
                    active = topp_on & (need < cnt)
                    want = need
                    eq = kp
                if active:
                    by_index = (stage == 1) | (stage == 3)
                    res, need, cnt = self._select(mL, r, temp, zmax, want, tp, kk, nk, eq,
                                                  by_index, stage == 2, sHist, sRes)
                    if stage == 0:
                        kk = res
                    elif stage == 1:
                        nk = res
                    elif stage == 2:
                        kp = res
                        p_t = _mass(_unkey(kp))  # every token with key kp has this mass
                        p_t = p_t if p_t > Uint64(0) else Uint64(1)
                        need = (need + p_t - Uint64(1)) // p_t  # tied tokens to keep
                        cnt = cnt // p_t  # tied tokens
                    else:
                        np_ = res
            mp = mMinP[r]
            mp = mp if mp > Float32(0.0) else Float32(0.0)
            seed = mSeed[r]
            rk = _mix32(Uint32(seed & Uint64(0xFFFFFFFF))
                        ^ _mix32(Uint32(seed >> Uint64(32)) ^ _mix32(mStep[r] ^ Uint32(_GOLDEN))))
            token = self._gumbel(mL, r, temp, zmax, kk, nk, kp, np_, mp, rk, sF, sI)
        if tidx == 0:
            mOut[r] = token

    @cute.jit
    def _select(self, mL: cute.Tensor, r: Int32, temp: Float32, zmax: Float32, need: Uint64,
                frac: Float32, kk: Uint32, nk: Uint32, eq_key: Uint32, by_index: cutlass.Boolean,
                by_mass: cutlass.Boolean, sHist: cute.Tensor, sRes: cute.Tensor):
        """Radix select, descending, among top-k survivors (kk, nk) of the row.

        Selects on ``key(d)`` or, with ``by_index``, on ``~index`` among tokens with key eq_key.
        Weights are 1 or, with ``by_mass``, the fixed-point mass; then ``need`` is
        ``ceil(frac * total)`` of the first pass. Returns (the selected value, the weight still
        needed inside its bin, the bin's total weight).
        """
        tidx, _, _ = cute.arch.thread_idx()
        prefix = Uint32(0)
        pmask = Uint32(0)
        hb = Uint64(0)
        for p in range(3):
            shift = Uint32(21) if p == 0 else (Uint32(10) if p == 1 else Uint32(0))
            for b in range(tidx, NBINS, self.threads):
                sHist[b] = Uint64(0)
            cute.arch.sync_threads()
            for c in range(tidx, self.nvec, self.threads):
                v = mL[r, c, None].load()
                for e in cutlass.range_constexpr(self.vec):
                    idx = c * self.vec + e
                    d = v[e] / temp - zmax
                    key = _key(d)
                    nidx = Uint32(idx) ^ Uint32(0xFFFFFFFF)
                    ok = (key > kk) | ((key == kk) & (nidx >= nk))
                    sel = nidx if by_index else key
                    ok = ok & ((key == eq_key) | (by_index == False))  # noqa: E712
                    ok = ok & ((sel & pmask) == prefix)
                    if ok:
                        w = Uint64(1)
                        if by_mass:
                            w = _mass(d)
                        cute.arch.atomic_add(
                            sHist.iterator + Int32((sel >> shift) & Uint32(NBINS - 1)), w)
            cute.arch.sync_threads()
            if cute.arch.warp_idx() == 0:
                self._scan(sHist, sRes, need, frac, by_mass & (p == 0))
            cute.arch.sync_threads()
            b = Uint32(sRes[0])
            need = sRes[3] - sRes[1]
            hb = sRes[2]
            prefix = prefix | (b << shift)
            pmask = pmask | ~((Uint32(1) << shift) - Uint32(1))
        return prefix, need, hb

    @cute.jit
    def _scan(self, sHist: cute.Tensor, sRes: cute.Tensor, need: Uint64, frac: Float32,
              need_from_total: cutlass.Boolean):
        """Warp 0: the bin where the descending cumulative weight reaches ``need``.

        Lane l owns the 64-bin chunk ``[NBINS - 64(l+1), NBINS - 64l)``; a warp scan over the
        chunk sums finds the chunk, a second one over its bins (two per lane) the bin.
        Writes sRes = (bin, weight of the bins above it, its weight, need used).
        """
        lane = cute.arch.lane_idx()
        per = NBINS // 32
        top = NBINS - per * lane
        tot = Uint64(0)
        for i in range(per):  # rotated start: the 32 lanes hit 32 different banks
            tot = tot + sHist[top - 1 - (i + lane) % per]
        incl = self._warp_scan(tot, lane)
        if need_from_total:  # top-p: need = ceil(frac * total), in [1, total]
            total = cute.arch.shuffle_sync(incl, offset=31)
            f = Float64(frac) * Float64(total)
            need = Uint64(f)
            need = need + Uint64(1) if Float64(need) < f else need
            need = need if need > Uint64(0) else Uint64(1)
            need = need if need < total else total
        hit = ((incl - tot) < need) & (need <= incl)
        mask = Uint32(cute.arch.vote_ballot_sync(hit))
        if mask != Uint32(0):  # exactly one chunk holds the crossing when 1 <= need <= total
            c = Int32(Uint32(31) - cute.arch.clz(mask))
            cum_chunk = cute.arch.shuffle_sync(incl - tot, offset=c)
            b0 = NBINS - per * c - 1 - 2 * lane  # this lane's bins, descending: b0, b0 - 1
            h0 = sHist[b0]
            h1 = sHist[b0 - 1]
            pair = h0 + h1
            above = cum_chunk + self._warp_scan(pair, lane) - pair
            if (above < need) & (need <= above + pair):
                bin_ = b0
                h = h0
                if need > above + h0:
                    bin_ = b0 - 1
                    above = above + h0
                    h = h1
                sRes[0] = Uint64(bin_)
                sRes[1] = above
                sRes[2] = h
                sRes[3] = need

    @cute.jit
    def _warp_scan(self, v: Uint64, lane: Int32) -> Uint64:
        """Inclusive prefix sum over the warp's lanes (lane 0 first)."""
        for s in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(v, offset=1 << s)
            v = v + y if lane >= (1 << s) else v
        return v

    @cute.jit
    def _gumbel(self, mL: cute.Tensor, r: Int32, temp: Float32, zmax: Float32, kk: Uint32,
                nk: Uint32, kp: Uint32, np_: Uint32, mp: Float32, rk: Uint32, sF: cute.Tensor,
                sI: cute.Tensor):
        """argmax over kept tokens of z + Gumbel(seed, step, index); 0 when nothing is kept."""
        tidx, _, _ = cute.arch.thread_idx()
        bs = -Float32.inf
        bi = Int32(INT_MAX)
        for c in range(tidx, self.nvec, self.threads):
            v = mL[r, c, None].load()
            for e in cutlass.range_constexpr(self.vec):
                idx = c * self.vec + e
                z = v[e] / temp
                d = z - zmax
                key = _key(d)
                nidx = Uint32(idx) ^ Uint32(0xFFFFFFFF)
                kept = ((key > kk) | ((key == kk) & (nidx >= nk))) & (
                    (key > kp) | ((key == kp) & (nidx >= np_)))
                kept = kept & (cute.math.exp(d) >= mp)
                # a score is at most z + G_MAX: skip the hash when it cannot beat this thread's best
                if kept & (z + Float32(G_MAX) > bs):
                    h = _mix32(rk ^ _mix32(Uint32(idx) + Uint32(_SALT)))
                    u = (Float32(h >> Uint32(9)) + Float32(0.5)) * Float32(2.0**-23)
                    s = z + (-cute.math.log(-cute.math.log(u)))
                    if s > bs:
                        bs = s
                        bi = idx
        _, best = _block_argmax(bs, bi, sF, sI, self.nwarps)
        return best if best < self.vocab else 0


class LogProbs:
    """One CTA per row: logsumexp, the given token's logprob and rank, the top-n."""

    def __init__(self, vocab: int, max_top_n: int, row_stride: int | None = None) -> None:
        self.vocab = vocab
        self.stride = _row_stride(vocab, row_stride)
        self.kmax = max_top_n
        self.kmax_stride = max(max_top_n, 1)
        self.vec = 4 if vocab % 4 == 0 and self.stride % 4 == 0 else 1
        self.nvec = vocab // self.vec
        self.threads = min(256, max(32, (self.nvec + 31) // 32 * 32))
        self.nwarps = self.threads // 32

    @cute.jit
    def __call__(self, logits: cute.Pointer, token_ids: cute.Pointer, token_logprob: cute.Pointer,
                 token_rank: cute.Pointer, top_ids: cute.Pointer, top_logprobs: cute.Pointer,
                 num_rows: Int32, top_n: Int32, stream: cuda.CUstream):
        mL = cute.make_tensor(logits, cute.make_layout((num_rows, self.nvec, self.vec),
                                                       stride=(self.stride, self.vec, 1)))
        rows = cute.make_layout(num_rows)
        top = cute.make_layout((num_rows, self.kmax_stride), stride=(self.kmax_stride, 1))
        self.kernel(mL, cute.make_tensor(token_ids, rows), cute.make_tensor(token_logprob, rows),
                    cute.make_tensor(token_rank, rows), cute.make_tensor(top_ids, top),
                    cute.make_tensor(top_logprobs, top), top_n).launch(
            grid=[num_rows, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mTok: cute.Tensor, mLp: cute.Tensor, mRank: cute.Tensor,
               mTopI: cute.Tensor, mTopV: cute.Tensor, top_n: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        r, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sF = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
        sG = smem.allocate_tensor(Float32, cute.make_layout(32), byte_alignment=16)
        sI = smem.allocate_tensor(Int32, cute.make_layout(32), byte_alignment=16)

        # pass 1: online max and sum of exp (finite start so exp(m_old - m_new) never sees inf-inf)
        m = Float32(-3.0e38)
        s = Float32(0.0)
        for c in range(tidx, self.nvec, self.threads):
            v = mL[r, c, None].load()
            vm = v[0]
            for e in cutlass.range_constexpr(1, self.vec):
                vm = cute.arch.fmax(vm, v[e])
            if vm > m:
                s = s * cute.math.exp(m - vm)
                m = vm
            for e in cutlass.range_constexpr(self.vec):
                s = s + cute.math.exp(v[e] - m)
        m, s = block_reduce((m, s), _lse_op, (sF, sG), self.nwarps)
        lse = cute.math.log(s)  # relative to m, as numpy's log_softmax

        # pass 2: the token's logprob and rank; per-thread sorted top lists
        tok = mTok[r]
        tok = tok if tok >= 0 else 0
        tok = tok if tok < self.vocab else self.vocab - 1
        lp_tok = (mL[r, tok // self.vec, tok % self.vec] - m) - lse
        rV = cute.make_rmem_tensor(cute.make_layout(max(self.kmax, 1)), Float32)
        rI = cute.make_rmem_tensor(cute.make_layout(max(self.kmax, 1)), Int32)
        rV.fill(-Float32.inf)
        rI.fill(INT_MAX)
        above = Int32(0)
        for c in range(tidx, self.nvec, self.threads):
            v = mL[r, c, None].load()
            for e in cutlass.range_constexpr(self.vec):
                idx = c * self.vec + e
                lp = (v[e] - m) - lse
                above = above + (Int32(1) if lp > lp_tok else Int32(0))
                if cutlass.const_expr(self.kmax > 0):
                    last = self.kmax - 1
                    if _better(lp, idx, rV[last], rI[last]):
                        rV[last] = lp
                        rI[last] = idx
                        for j in cutlass.range_constexpr(last, 0, -1):
                            a, ai, b, bi = rV[j], rI[j], rV[j - 1], rI[j - 1]
                            sw = _better(a, ai, b, bi)
                            rV[j] = b if sw else a
                            rI[j] = bi if sw else ai
                            rV[j - 1] = a if sw else b
                            rI[j - 1] = ai if sw else bi
        (total,) = block_reduce((above,), add, (sI,), self.nwarps)
        if tidx == 0:
            mLp[r] = lp_tok
            mRank[r] = total + 1

        if cutlass.const_expr(self.kmax > 0):
            for n in range(top_n):  # n rounds: pop the block-wide best list head
                bv, bi = _block_argmax(rV[0], rI[0], sF, sI, self.nwarps)
                if tidx == 0:
                    mTopI[r, n] = bi
                    mTopV[r, n] = bv
                if rI[0] == bi:
                    for j in cutlass.range_constexpr(self.kmax - 1):
                        rV[j] = rV[j + 1]
                        rI[j] = rI[j + 1]
                    rV[self.kmax - 1] = -Float32.inf
                    rI[self.kmax - 1] = INT_MAX


# ---------------------------------------------------------------------------------------------
# Host side
# logits: 16-byte aligned (vector loads); per-row arrays: their natural alignment

ROW, LOGITS = ("num_rows",), ("num_rows", "stride")
SAMPLER = Signature(
    Ptr("logits", "f32", shape=LOGITS), Ptr("temperature", "f32", 4, ROW),
    Ptr("top_k", "i32", 4, ROW), Ptr("top_p", "f32", 4, ROW), Ptr("min_p", "f32", 4, ROW),
    Ptr("seeds", "u64", 8, ROW), Ptr("steps", "u32", 4, ROW), Ptr("tokens", "i32", 4, ROW),
    Scalar("num_rows", Int32))
LOGPROBS = Signature(
    Ptr("logits", "f32", shape=LOGITS), Ptr("token_ids", "i32", 4, ROW),
    Ptr("token_logprob", "f32", 4, ROW), Ptr("token_rank", "i32", 4, ROW),
    Ptr("top_ids", "i32", 4, ("num_rows", "kmax")),
    Ptr("top_logprobs", "f32", 4, ("num_rows", "kmax")),
    Scalar("num_rows", Int32), Scalar("top_n", Int32))


class SamplerLauncher:
    """``launcher(logits, temperature, top_k, top_p, min_p, seeds, steps, tokens, num_rows,
    stream)``: logits f32[S, row_stride] (columns [0, V) read); temperature f32[S]; top_k i32[S];
    top_p f32[S]; min_p f32[S]; seeds u64[S]; steps u32[S] -> tokens i32[S] in [0, V). logits
    16-byte aligned; the per-row arrays need their natural alignment only."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.vocab = kernel, kernel.op.vocab

    def __call__(self, logits: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any,
                 seeds: Any, steps: Any, tokens: Any, num_rows: int, stream: Any) -> None:
        s = int(num_rows)
        if s <= 0:
            return
        self.kernel(logits, temperature, top_k, top_p, min_p, seeds, steps, tokens, s, stream)


class LogProbsLauncher:
    """``launcher(logits, token_ids, token_logprob, token_rank, top_ids, top_logprobs, num_rows,
    top_n, stream)``: logits f32[R, row_stride]; token_ids i32[R] -> token_logprob f32[R],
    token_rank i32[R], top_ids i32[R, max_top_n], top_logprobs f32[R, max_top_n] (row stride
    max_top_n, columns [:top_n] written; 0 <= top_n <= min(max_top_n, V); with top_n == 0 the
    top buffers are not touched)."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.vocab, self.max_top_n = kernel, kernel.op.vocab, kernel.op.kmax

    def __call__(self, logits: Any, token_ids: Any, token_logprob: Any, token_rank: Any,
                 top_ids: Any, top_logprobs: Any, num_rows: int, top_n: int,
                 stream: Any) -> None:
        rows, n = int(num_rows), int(top_n)
        if not 0 <= n <= min(self.max_top_n, self.vocab):
            raise common.KernelArgError(
                f"top_n={n}: compiled for 0 <= top_n <= {min(self.max_top_n, self.vocab)}")
        if rows <= 0:
            return
        if not n:
            top_ids, top_logprobs = Unused(token_rank), Unused(token_logprob)
        self.kernel(logits, token_ids, token_logprob, token_rank, top_ids, top_logprobs, rows, n,
                    stream)


def compile_sampler(vocab: int, row_stride: int | None = None) -> SamplerLauncher:
    """Compile (once per (vocab, row_stride)) the sampler over logits rows of ``row_stride``
    (default vocab) floats, ``vocab`` of them real."""
    stride = _row_stride(vocab, row_stride)
    return common.cached_compile(
        ("sampler", vocab, stride),
        lambda: SamplerLauncher(SAMPLER.compile(Sampler(vocab, stride))))


def compile_logprobs(vocab: int, max_top_n: int = 20, *,
                     row_stride: int | None = None) -> LogProbsLauncher:
    """Compile (once per (vocab, max_top_n, row_stride)) the logprobs kernel (rows as
    ``compile_sampler``)."""
    stride = _row_stride(vocab, row_stride)
    return common.cached_compile(
        ("logprobs", vocab, max_top_n, stride),
        lambda: LogProbsLauncher(LOGPROBS.compile(LogProbs(vocab, max_top_n, stride))))
