"""Per-request logits processors in place on fp32 logits, and the count of each sampled token.

``LogitsProcess``, per sample row r of ``logits f32[S, row_stride]`` (columns [0, V) read and
written), the math of ``engine.sampling.process_logits`` in its order (engine/step.py's FLAG_*):
  flags[r] == 0: nothing (the CTA returns at once: rows without processors cost one load);
  GRAMMAR:  x[v] = -inf where bit v of ``gmask[grammar_row[r]]`` is 0 (structured output);
  (SAVE_RAW is the host's: logprobs of such a row are of its logits after the grammar mask
  only, so the executor recomputes them, engine/executor/cuda_logits.py; ignored here)
  SPARSE:   ``x[ids[i]] += vals[i]`` for i in ``[sparse_start[r], sparse_start[r+1])``
            (logit_bias; -inf bans bad words and min_tokens' stop ids; ids unique per row);
  ALLOWED:  x[v] = -inf where bit v of ``allowed_bits[slot[r]]`` is 0;
  PENALTY:  with c = counts[slot, v] (less one for ``last[slot]`` when ``counted[slot] ==
            steps[r] + 1``: a re-run of a step whose token was already counted),
            seen = c > 0 or bit v of ``prompt_bits[slot]``:
            seen: x = x / rep if x > 0 else x * rep;  c > 0: x = x - freq * c, then x - pres.
Bans and masks are -inf, which commutes with adding a finite bias, so the sparse adds may run
before the dense pass that holds the allowed mask and the penalties (vLLM's order: allowed, bad
words, min_tokens, bias, penalties). Float ops are fp32 in numpy's order; the compiler may fuse
``x - freq * c`` into one FMA (a last-bit difference from numpy).

``CountTokens``, after the sampler: for each PENALTY row with ``counted[slot] == steps[r]``:
``counts[slot, tokens[r]] += 1``, ``counted[slot] = steps[r] + 1``, ``last[slot] = tokens[r]``.
So the counts live on the device and advance with the sampled token; running a step twice
(graph replay of an eager step, a retried step) counts its token once and sees the same counts.
One CTA; a slot is in at most one row of a step (the host's slot pool), so no atomics.

Layout: bitmasks ``u32[rows, W]``, W = ceil(V / 32), bit ``v & 31`` of word ``v >> 5``; slot
state ``counts i32[num_slots, V]``, ``prompt_bits / allowed_bits u32[num_slots, W]``,
``counted / last i32[num_slots]``; per row ``flags u32``, ``slot i32``, ``steps u32``,
``grammar_row i32``, ``penalties f32[S, 3]`` (repetition, frequency, presence),
``sparse_start i32[S + 1]``; ``sparse_ids i32[K]``, ``sparse_vals f32[K]``.
Grid ``(rows, chunks, 1)``, 512 threads (process): CTA (r, k) owns the k-th of ``chunks``
equal column ranges of row r and runs every pass on it (its sparse entries too), so each
element sees the same ops in the same order whatever ``chunks`` is (the results are the same
bits). ``chunks`` 1 is the kernel of v12-v31; more spread a processed row over as many SMs
(one CTA streams ~1.2 MB of a Qwen3 row at latency-bound speed). ``(1, 1, 1)``, 256 threads
(count).
Cost: a processed row is read and written once per dense pass (grammar; allowed/penalties),
plus the penalty state of its slot (counts: as many bytes as the row).
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Uint32

from cutlass_kernels._common import Ptr, Scalar, Signature
from engine import envs

FLAG_GRAMMAR, FLAG_SPARSE, FLAG_ALLOWED, FLAG_PENALTY = 1, 4, 8, 16  # engine/step.py's


def _bit(word: Uint32, idx: Int32) -> cutlass.Boolean:
    return ((word >> Uint32(idx & Int32(31))) & Uint32(1)) != Uint32(0)


def _on(flags: Uint32, flag: int) -> cutlass.Boolean:
    return (flags & Uint32(flag)) != Uint32(0)


class LogitsProcess:
    """``chunks`` CTAs per sample row; see the module docstring."""

    def __init__(self, vocab: int, row_stride: int | None = None, chunks: int = 1) -> None:
        self.vocab = vocab
        self.stride = vocab if row_stride is None else row_stride
        if not 0 < vocab <= self.stride:
            raise ValueError(f"vocab={vocab}, row_stride={row_stride}: need 0 < vocab <= "
                             "row_stride")
        self.words = (vocab + 31) // 32
        # 4-wide vectors share one bitmask word (32 % 4 == 0); counts rows are V wide
        self.vec = 4 if vocab % 4 == 0 and self.stride % 4 == 0 else 1
        self.nvec = vocab // self.vec
        self.threads = 512
        if chunks < 1:
            raise ValueError(f"chunks={chunks}: need >= 1")
        self.chunks = chunks
        self.span = -(-self.nvec // chunks)  # vectors per CTA (the last one's range may be short)

    @cute.jit
    def __call__(self, logits: cute.Pointer, flags: cute.Pointer,
                 slot: cute.Pointer, steps: cute.Pointer, penalties: cute.Pointer,
                 grammar_row: cute.Pointer, gmask: cute.Pointer, sparse_start: cute.Pointer,
                 sparse_ids: cute.Pointer, sparse_vals: cute.Pointer, counts: cute.Pointer,
                 counted: cute.Pointer, last: cute.Pointer, prompt_bits: cute.Pointer,
                 allowed_bits: cute.Pointer, num_rows: Int32, num_slots: Int32,
                 num_sparse: Int32, stream: cuda.CUstream):
        lay = cute.make_layout((num_rows, self.nvec, self.vec), stride=(self.stride, self.vec, 1))
        rows = cute.make_layout(num_rows)
        slots = cute.make_layout(num_slots)
        sp = cute.make_layout(num_sparse)
        self.kernel(
            cute.make_tensor(logits, lay),
            cute.make_tensor(flags, rows), cute.make_tensor(slot, rows),
            cute.make_tensor(steps, rows),
            cute.make_tensor(penalties, cute.make_layout((num_rows, 3), stride=(3, 1))),
            cute.make_tensor(grammar_row, rows),
            cute.make_tensor(gmask, cute.make_layout((num_rows, self.words),
                                                     stride=(self.words, 1))),
            cute.make_tensor(sparse_start, cute.make_layout(num_rows + 1)),
            cute.make_tensor(sparse_ids, sp), cute.make_tensor(sparse_vals, sp),
            cute.make_tensor(counts, cute.make_layout((num_slots, self.nvec, self.vec),
                                                      stride=(self.vocab, self.vec, 1))),
            cute.make_tensor(counted, slots), cute.make_tensor(last, slots),
            cute.make_tensor(prompt_bits, cute.make_layout((num_slots, self.words),
                                                           stride=(self.words, 1))),
            cute.make_tensor(allowed_bits, cute.make_layout((num_slots, self.words),
                                                            stride=(self.words, 1)))).launch(
            grid=[num_rows, self.chunks, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mFlags: cute.Tensor,
               mSlot: cute.Tensor, mStep: cute.Tensor, mPen: cute.Tensor, mGRow: cute.Tensor,
               mGMask: cute.Tensor, mStart: cute.Tensor, mIds: cute.Tensor, mVals: cute.Tensor,
               mCounts: cute.Tensor, mCounted: cute.Tensor, mLast: cute.Tensor,
               mPrompt: cute.Tensor, mAllowed: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        r, k, _ = cute.arch.block_idx()
        lo = k * self.span  # this CTA's vectors of the row: [lo, hi)
        hi = cutlass.min(lo + self.span, self.nvec)
        f = mFlags[r]
        if f != Uint32(0):
            if _on(f, FLAG_GRAMMAR):
                self._grammar_pass(mL, mGMask, r, mGRow[r], tidx, lo, hi)
                cute.arch.sync_threads()
            if _on(f, FLAG_SPARSE):
                for i in cutlass.range(mStart[r] + tidx, mStart[r + 1], self.threads, unroll=1):
                    t = mIds[i]
                    c = t // self.vec
                    if (c >= lo) & (c < hi):  # (another CTA's range: that CTA adds it)
                        v = mVals[i]
                        x = mL[r, c, t % self.vec]
                        mL[r, c, t % self.vec] = x + v  # -inf: banned
                cute.arch.sync_threads()
            if _on(f, FLAG_ALLOWED) | _on(f, FLAG_PENALTY):
                s = mSlot[r]
                excl = Int32(-1)  # this step's token, when a re-run finds it counted already
                if mCounted[s] == Int32(mStep[r]) + Int32(1):
                    excl = mLast[s]
                self._dense_pass(mL, mCounts, mPrompt, mAllowed, r, s, f, excl, mPen[r, 0],
                                 mPen[r, 1], mPen[r, 2], tidx, lo, hi)

    @cute.jit
    def _grammar_pass(self, mL: cute.Tensor, mGMask: cute.Tensor, r: Int32, g: Int32,
                      tidx: Int32, lo: Int32, hi: Int32):
        rV = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
        for c in range(lo + tidx, hi, self.threads):
            v = mL[r, c, None].load()
            w = Uint32(mGMask[g, (c * self.vec) // 32])
            for e in cutlass.range_constexpr(self.vec):
                idx = c * self.vec + e
                ve = v[e]  # read outside the select: an SSA vector is not indexed inside one
                rV[e] = ve if _bit(w, idx) else -Float32.inf
            mL[r, c, None].store(rV.load())

    @cute.jit
    def _dense_pass(self, mL: cute.Tensor, mCounts: cute.Tensor, mPrompt: cute.Tensor,
                    mAllowed: cute.Tensor, r: Int32, s: Int32, f: Uint32, excl: Int32,
                    rep: Float32, freq: Float32, pres: Float32, tidx: Int32, lo: Int32,
                    hi: Int32):
        allowed = _on(f, FLAG_ALLOWED)
        pen = _on(f, FLAG_PENALTY)
        rV = cute.make_rmem_tensor(cute.make_layout(self.vec), Float32)
        for c in range(lo + tidx, hi, self.threads):
            v = mL[r, c, None].load()
            word = (c * self.vec) // 32
            aw = Uint32(0xFFFFFFFF)
            if allowed:
                aw = Uint32(mAllowed[s, word])
            pw = Uint32(0)
            cv = cute.make_rmem_tensor(cute.make_layout(self.vec), Int32)
            cv.fill(0)
            if pen:
                pw = Uint32(mPrompt[s, word])
                cv.store(mCounts[s, c, None].load())
            for e in cutlass.range_constexpr(self.vec):
                idx = c * self.vec + e
                ve = v[e]
                x = ve if _bit(aw, idx) else -Float32.inf
                ce = cv[e]
                cnt = ce - (Int32(1) if idx == excl else Int32(0))
                seen = (cnt > Int32(0)) | _bit(pw, idx)
                if seen:
                    x = x / rep if x > Float32(0.0) else x * rep
                if cnt > Int32(0):
                    x = x - freq * Float32(cnt)
                    x = x - pres
                rV[e] = x
            mL[r, c, None].store(rV.load())


class CountTokens:
    """One CTA over the rows: each PENALTY row's sampled token joins its slot's counts."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.threads = 256

    @cute.jit
    def __call__(self, flags: cute.Pointer, slot: cute.Pointer, steps: cute.Pointer,
                 tokens: cute.Pointer, counts: cute.Pointer, counted: cute.Pointer,
                 last: cute.Pointer, num_rows: Int32, num_slots: Int32, stream: cuda.CUstream):
        rows = cute.make_layout(num_rows)
        slots = cute.make_layout(num_slots)
        self.kernel(cute.make_tensor(flags, rows), cute.make_tensor(slot, rows),
                    cute.make_tensor(steps, rows), cute.make_tensor(tokens, rows),
                    cute.make_tensor(counts, cute.make_layout((num_slots, self.vocab),
                                                              stride=(self.vocab, 1))),
                    cute.make_tensor(counted, slots), cute.make_tensor(last, slots),
                    num_rows).launch(grid=[1, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mFlags: cute.Tensor, mSlot: cute.Tensor, mStep: cute.Tensor,
               mTok: cute.Tensor, mCounts: cute.Tensor, mCounted: cute.Tensor,
               mLast: cute.Tensor, num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        for r in cutlass.range(tidx, num_rows, self.threads, unroll=1):
            if _on(mFlags[r], FLAG_PENALTY):
                s = mSlot[r]
                step = Int32(mStep[r])
                if mCounted[s] == step:
                    t = mTok[r]
                    mCounts[s, t] = mCounts[s, t] + Int32(1)
                    mCounted[s] = step + Int32(1)
                    mLast[s] = t


# ---------------------------------------------------------------------------------------------
# Host side

ROW, LOGITS = ("num_rows",), ("num_rows", "stride")
SLOT_BITS = ("num_slots", "words")
PROCESS = Signature(
    Ptr("logits", "f32", shape=LOGITS),
    Ptr("flags", "u32", 4, ROW), Ptr("slot", "i32", 4, ROW), Ptr("steps", "u32", 4, ROW),
    Ptr("penalties", "f32", 4, ("num_rows", 3)), Ptr("grammar_row", "i32", 4, ROW),
    Ptr("gmask", "u32", 4, ("num_rows", "words")), Ptr("sparse_start", "i32", 4),
    Ptr("sparse_ids", "i32", 4, ("num_sparse",)), Ptr("sparse_vals", "f32", 4, ("num_sparse",)),
    Ptr("counts", "i32", shape=("num_slots", "vocab")), Ptr("counted", "i32", 4, ("num_slots",)),
    Ptr("last", "i32", 4, ("num_slots",)), Ptr("prompt_bits", "u32", 4, SLOT_BITS),
    Ptr("allowed_bits", "u32", 4, SLOT_BITS),
    Scalar("num_rows", Int32), Scalar("num_slots", Int32), Scalar("num_sparse", Int32))
COUNT = Signature(
    Ptr("flags", "u32", 4, ROW), Ptr("slot", "i32", 4, ROW), Ptr("steps", "u32", 4, ROW),
    Ptr("tokens", "i32", 4, ROW), Ptr("counts", "i32", 4, ("num_slots", "vocab")),
    Ptr("counted", "i32", 4, ("num_slots",)), Ptr("last", "i32", 4, ("num_slots",)),
    Scalar("num_rows", Int32), Scalar("num_slots", Int32))


class LogitsProcessLauncher:
    """``launcher(logits, flags, slot, steps, penalties, grammar_row, gmask, sparse_start,
    sparse_ids, sparse_vals, counts, counted, last, prompt_bits, allowed_bits, num_rows,
    num_slots, num_sparse, stream)`` (module docstring). logits and counts 16-byte
    aligned; everything else its natural alignment. ``num_sparse``: the capacity of the sparse
    arrays (entries are found through sparse_start); ``num_slots`` >= 1."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.vocab, self.words = kernel, kernel.op.vocab, kernel.op.words

    def __call__(self, *args: Any) -> None:
        *ptrs, num_rows, num_slots, num_sparse, stream = args
        if int(num_slots) < 1 or int(num_sparse) < 1:
            raise common.KernelArgError(f"num_slots={num_slots}, num_sparse={num_sparse}: "
                                        "each must be >= 1 (the buffers are never empty)")
        if int(num_rows) <= 0:
            return
        self.kernel(*ptrs, int(num_rows), int(num_slots), int(num_sparse), stream)


class CountTokensLauncher:
    """``launcher(flags, slot, steps, tokens, counts, counted, last, num_rows, num_slots,
    stream)``: after the sampler wrote ``tokens i32[S]`` (module docstring)."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.vocab = kernel, kernel.op.vocab

    def __call__(self, flags: Any, slot: Any, steps: Any, tokens: Any, counts: Any, counted: Any,
                 last: Any, num_rows: int, num_slots: int, stream: Any) -> None:
        if int(num_rows) <= 0:
            return
        self.kernel(flags, slot, steps, tokens, counts, counted, last, int(num_rows),
                    int(num_slots), stream)


def compile_logits_process(vocab: int, row_stride: int | None = None,
                           chunks: int | None = None) -> LogitsProcessLauncher:
    """Compile (once per (vocab, row_stride, chunks)) the processors over logits rows of
    ``row_stride`` (default vocab) floats, ``vocab`` of them real; ``chunks`` CTAs a row
    (default: ``CUTEINFER_LOGITS_CHUNKS``, else 8)."""
    stride = vocab if row_stride is None else row_stride
    n = envs.logits_chunks() if chunks is None else chunks
    return common.cached_compile(
        ("logits_process", vocab, stride, n),
        lambda: LogitsProcessLauncher(PROCESS.compile(LogitsProcess(vocab, stride, n))))


def compile_count_tokens(vocab: int) -> CountTokensLauncher:
    """Compile (once per vocab) the count of sampled tokens into the slots' counts."""
    return common.cached_compile(
        ("count_tokens", vocab), lambda: CountTokensLauncher(COUNT.compile(CountTokens(vocab))))
