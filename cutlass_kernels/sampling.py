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
Layout: logits row-major ``[rows, V]`` contiguous; per-row params ``temperature f32[S]``,
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


def _better(v1: Float32, i1: Int32, v2: Float32, i2: Int32) -> cutlass.Boolean:
    """(value desc, index asc) order: the argmax that returns the first index of the max."""
    return (v1 > v2) | ((v1 == v2) & (i1 < i2))


@cute.jit
def _block_argmax(v: Float32, i: Int32, sF: cute.Tensor, sI: cute.Tensor, nwarps: int):
    """Block-wide (value desc, index asc) best; every thread gets the result."""
    for off in cutlass.range_constexpr(4, -1, -1):
        ov = cute.arch.shuffle_sync_bfly(v, offset=1 << off)
        oi = cute.arch.shuffle_sync_bfly(i, offset=1 << off)
        take = _better(ov, oi, v, i)
        v = ov if take else v
        i = oi if take else i
    # warp_idx() is a warp-wide shuffle: evaluate it with every lane active
    wid = cute.arch.warp_idx()
    if cute.arch.lane_idx() == 0:
        sF[wid] = v
        sI[wid] = i
    cute.arch.sync_threads()
    v = sF[0]
    i = sI[0]
    for w in cutlass.range_constexpr(1, nwarps):
        ov = sF[w]
        oi = sI[w]
        take = _better(ov, oi, v, i)
        v = ov if take else v
        i = oi if take else i
    cute.arch.sync_threads()  # sF / sI may be reused right after
    return v, i


class Sampler:
    """One CTA per row; see the module docstring for the math and the tie rules."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.vec = 4 if vocab % 4 == 0 else 1
        self.nvec = vocab // self.vec
        self.threads = min(512, max(32, (self.nvec + 31) // 32 * 32))
        self.nwarps = self.threads // 32

    @cute.jit
    def __call__(self, logits: cute.Pointer, temperature: cute.Pointer, top_k: cute.Pointer,
                 top_p: cute.Pointer, min_p: cute.Pointer, seeds: cute.Pointer,
                 steps: cute.Pointer, tokens: cute.Pointer, num_rows: Int32,
                 stream: cuda.CUstream):
        mL = cute.make_tensor(logits, cute.make_layout((num_rows, self.nvec, self.vec),
                                                       stride=(self.vocab, self.vec, 1)))
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

    def __init__(self, vocab: int, max_top_n: int) -> None:
        self.vocab = vocab
        self.kmax = max_top_n
        self.kmax_stride = max(max_top_n, 1)
        self.vec = 4 if vocab % 4 == 0 else 1
        self.nvec = vocab // self.vec
        self.threads = min(256, max(32, (self.nvec + 31) // 32 * 32))
        self.nwarps = self.threads // 32

    @cute.jit
    def __call__(self, logits: cute.Pointer, token_ids: cute.Pointer, token_logprob: cute.Pointer,
                 token_rank: cute.Pointer, top_ids: cute.Pointer, top_logprobs: cute.Pointer,
                 num_rows: Int32, top_n: Int32, stream: cuda.CUstream):
        mL = cute.make_tensor(logits, cute.make_layout((num_rows, self.nvec, self.vec),
                                                       stride=(self.vocab, self.vec, 1)))
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
        for off in cutlass.range_constexpr(4, -1, -1):
            om = cute.arch.shuffle_sync_bfly(m, offset=1 << off)
            os_ = cute.arch.shuffle_sync_bfly(s, offset=1 << off)
            nm = cute.arch.fmax(m, om)
            s = s * cute.math.exp(m - nm) + os_ * cute.math.exp(om - nm)
            m = nm
        # warp_idx() is a warp-wide shuffle: evaluate it with every lane active
        wid = cute.arch.warp_idx()
        if cute.arch.lane_idx() == 0:
            sF[wid] = m
            sG[wid] = s
        cute.arch.sync_threads()
        m = sF[0]
        s = sG[0]
        for w in cutlass.range_constexpr(1, self.nwarps):
            nm = cute.arch.fmax(m, sF[w])
            s = s * cute.math.exp(m - nm) + sG[w] * cute.math.exp(sF[w] - nm)
            m = nm
        cute.arch.sync_threads()
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
        above = cute.arch.warp_reduction(above, lambda a, b: a + b)
        # warp_idx() is a warp-wide shuffle: evaluate it with every lane active
        wid = cute.arch.warp_idx()
        if cute.arch.lane_idx() == 0:
            sI[wid] = above
        cute.arch.sync_threads()
        total = sI[0]
        for w in cutlass.range_constexpr(1, self.nwarps):
            total = total + sI[w]
        cute.arch.sync_threads()
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

_SIZE = {"f32": 4, "i32": 4, "u32": 4, "u64": 8}


def _ptr(buf: Any, dtype: str, numel: int, name: str, align: int | None = None) -> cute.Pointer:
    """Logits: 16-byte aligned (vector loads); per-row arrays: natural alignment."""
    nbytes = getattr(buf, "nbytes", None)
    need = numel * _SIZE[dtype]
    if nbytes is not None and nbytes < need:
        raise common.KernelArgError(f"{name}: buffer of {nbytes} B, kernel touches {need} B")
    return common.gmem_ptr(dtype, common.addr(buf), align or _SIZE[dtype])


class SamplerLauncher:
    """``launcher(logits, temperature, top_k, top_p, min_p, seeds, steps, tokens, num_rows,
    stream)``: logits f32[S, V]; temperature f32[S]; top_k i32[S]; top_p f32[S]; min_p f32[S];
    seeds u64[S]; steps u32[S] -> tokens i32[S]. logits 16-byte aligned; the per-row arrays need
    their natural alignment only."""

    def __init__(self, compiled: Any, vocab: int) -> None:
        self.compiled, self.vocab = compiled, vocab

    def __call__(self, logits: Any, temperature: Any, top_k: Any, top_p: Any, min_p: Any,
                 seeds: Any, steps: Any, tokens: Any, num_rows: int, stream: Any) -> None:
        s = int(num_rows)
        if s <= 0:
            return
        self.compiled(_ptr(logits, "f32", s * self.vocab, "logits", 16),
                      _ptr(temperature, "f32", s, "temperature"), _ptr(top_k, "i32", s, "top_k"),
                      _ptr(top_p, "f32", s, "top_p"), _ptr(min_p, "f32", s, "min_p"),
                      _ptr(seeds, "u64", s, "seeds"), _ptr(steps, "u32", s, "steps"),
                      _ptr(tokens, "i32", s, "tokens"), Int32(s),
                      getattr(stream, "handle", stream))


class LogProbsLauncher:
    """``launcher(logits, token_ids, token_logprob, token_rank, top_ids, top_logprobs, num_rows,
    top_n, stream)``: logits f32[R, V]; token_ids i32[R] -> token_logprob f32[R],
    token_rank i32[R], top_ids i32[R, max_top_n], top_logprobs f32[R, max_top_n] (row stride
    max_top_n, columns [:top_n] written; 0 <= top_n <= min(max_top_n, V); with top_n == 0 the
    top buffers are not touched)."""

    def __init__(self, compiled: Any, vocab: int, max_top_n: int) -> None:
        self.compiled, self.vocab, self.max_top_n = compiled, vocab, max_top_n

    def __call__(self, logits: Any, token_ids: Any, token_logprob: Any, token_rank: Any,
                 top_ids: Any, top_logprobs: Any, num_rows: int, top_n: int,
                 stream: Any) -> None:
        rows, n = int(num_rows), int(top_n)
        if not 0 <= n <= min(self.max_top_n, self.vocab):
            raise common.KernelArgError(
                f"top_n={n}: compiled for 0 <= top_n <= {min(self.max_top_n, self.vocab)}")
        if rows <= 0:
            return
        pl = _ptr(token_logprob, "f32", rows, "token_logprob")
        width = self.max_top_n
        pi = _ptr(top_ids, "i32", rows * width, "top_ids") if n else _ptr(token_rank, "i32", 0, "")
        pv = _ptr(top_logprobs, "f32", rows * width, "top_logprobs") if n else pl
        self.compiled(_ptr(logits, "f32", rows * self.vocab, "logits", 16),
                      _ptr(token_ids, "i32", rows, "token_ids"), pl,
                      _ptr(token_rank, "i32", rows, "token_rank"), pi, pv, Int32(rows), Int32(n),
                      getattr(stream, "handle", stream))


def compile_sampler(vocab: int) -> SamplerLauncher:
    """Compile (once per vocab) the sampler."""

    def build() -> SamplerLauncher:
        f, i = common.fake_ptr("f32", 4), common.fake_ptr("i32", 4)
        compiled = cute.compile(Sampler(vocab), common.fake_ptr("f32"), f, i, f, f,
                                common.fake_ptr("u64", 8), common.fake_ptr("u32", 4), i, Int32(1),
                                common.fake_stream())
        return SamplerLauncher(compiled, vocab)

    return common.cached_compile(("sampler", vocab), build)


def compile_logprobs(vocab: int, max_top_n: int = 20) -> LogProbsLauncher:
    """Compile (once per (vocab, max_top_n)) the logprobs kernel."""

    def build() -> LogProbsLauncher:
        f, i = common.fake_ptr("f32", 4), common.fake_ptr("i32", 4)
        compiled = cute.compile(LogProbs(vocab, max_top_n), common.fake_ptr("f32"), i, f, i, i, f,
                                Int32(1), Int32(1), common.fake_stream())
        return LogProbsLauncher(compiled, vocab, max_top_n)

    return common.cached_compile(("logprobs", vocab, max_top_n), build)
