"""Sampling math, defined once: the numpy executor uses it; the GPU sampler tests compare to it.

Randomness is a counter-based hash of (seed, step, token index), so a request's draws depend only
on its own seed and on how many tokens it has generated: reproducible across batch compositions,
and replayable inside a CUDA graph (seed and step are device data).
"""

from __future__ import annotations

import numpy as np

from engine.step import (
    FLAG_ALLOWED,
    FLAG_GRAMMAR,
    FLAG_PENALTY,
    FLAG_SPARSE,
    Logprobs,
    ProcessorRows,
    SlotInit,
)

_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)
_GOLDEN = np.uint32(0x9E3779B9)
_SALT = np.uint32(0x632BE5AB)


def mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 (Chris Wellons): a strong 32-bit integer finalizer. uint32 in, uint32 out."""
    x = np.asarray(x, dtype=np.uint32).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= _M1
        x ^= x >> np.uint32(15)
        x *= _M2
        x ^= x >> np.uint32(16)
    return x


def row_key(seed: int | np.ndarray, step: int | np.ndarray) -> np.ndarray:
    """Per-(request, step) key: ``mix32(lo ^ mix32(hi ^ mix32(step ^ GOLDEN)))``."""
    seed = np.asarray(seed, dtype=np.uint64)
    lo = (seed & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = (seed >> np.uint64(32)).astype(np.uint32)
    step = np.asarray(step, dtype=np.uint32)
    return mix32(lo ^ mix32(hi ^ mix32(step ^ _GOLDEN)))


def uniform(seed: int, step: int, vocab_size: int) -> np.ndarray:
    """float32 uniforms in (0, 1) for token ids 0..V-1: ``((mix32(k ^ mix32(v + SALT)) >> 9)
    + 0.5) * 2^-23``, exact in float32 and never 0 or 1 (with ``>> 8`` and 2^-24 the top value
    rounded to 1.0: an infinite Gumbel score in ~1 draw of 100 at a 150k vocab). The GPU computes
    the same bits."""
    k = row_key(seed, step)
    with np.errstate(over="ignore"):
        v = np.arange(vocab_size, dtype=np.uint32) + _SALT
    return bits_to_uniform(mix32(k ^ mix32(v)))


def bits_to_uniform(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint32)
    return ((x >> np.uint32(9)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)


def gumbel(seed: int, step: int, vocab_size: int) -> np.ndarray:
    u = uniform(seed, step, vocab_size)
    return -np.log(-np.log(u))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(x - m, dtype=np.float32).sum(axis=-1, keepdims=True, dtype=np.float32))
    return (x - m - lse).astype(np.float32)


def keep_mask(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Which tokens survive top-k, top-p and min-p filtering of ``softmax(z)`` (one row)."""
    z = np.asarray(z, dtype=np.float32)
    v = z.shape[-1]
    keep = np.ones(v, dtype=bool)
    if top_k <= 0 and top_p >= 1.0 and min_p <= 0.0:
        return keep
    p = np.exp(z - z.max(), dtype=np.float64)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if 0 < top_k < v:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        kept = order[keep[order]]
        pk = p[kept] / p[kept].sum()
        before = np.cumsum(pk) - pk  # mass of strictly higher-ranked tokens
        keep[kept[before >= top_p]] = False
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    return keep


def target_distribution(logits: np.ndarray, temperature: float, top_k: int = 0,
                        top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The exact distribution ``sample_row`` draws from (float64), for statistical tests."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p *= keep_mask(z.astype(np.float32), top_k, top_p, min_p)
    return p / p.sum()


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
               seed: int, step: int) -> int:
    logits = np.asarray(logits, dtype=np.float32)
    if temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits / np.float32(temperature)
    keep = keep_mask(z, top_k, top_p, min_p)
    score = np.where(keep, z + gumbel(seed, step, z.shape[-1]), -np.inf)
    return int(np.argmax(score))


def sample(logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
           min_p: np.ndarray, seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Sample one token per row. Arrays as in StepBatch; returns int32 [S]."""
    out = np.empty(logits.shape[0], dtype=np.int32)
    for r in range(logits.shape[0]):
        out[r] = sample_row(logits[r], float(temperature[r]), int(top_k[r]), float(top_p[r]),
                            float(min_p[r]), int(seeds[r]), int(steps[r]))
    return out


def compute_logprobs(logits: np.ndarray, token_ids: np.ndarray, n: int) -> Logprobs:
    """Logprobs of raw logits: the given tokens' logprob and 1-based rank, and the top-n."""
    lp = log_softmax(logits)
    rows = np.arange(lp.shape[0])
    tok = lp[rows, token_ids]
    rank = (lp > tok[:, None]).sum(axis=1).astype(np.int32) + 1
    n = max(int(n), 0)
    if n:
        top = np.argsort(-lp, axis=1, kind="stable")[:, :n].astype(np.int32)
        top_lp = np.take_along_axis(lp, top, axis=1)
    else:
        top = np.zeros((lp.shape[0], 0), np.int32)
        top_lp = np.zeros((lp.shape[0], 0), np.float32)
    return Logprobs(token_logprob=tok.astype(np.float32), token_rank=rank, top_ids=top,
                    top_logprobs=top_lp.astype(np.float32))


# ---- logits processors (engine/logits_processors.py): the reference the GPU kernel matches ----


class SlotState:
    """The per-request processor state a device keeps in its slots, in numpy (the numpy
    executor's, and the GPU tests' oracle): output counts, counted, last, prompt and allowed
    bits per slot (``engine.step.SlotInit``)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.counts: dict[int, np.ndarray] = {}  # int32 [V]
        self.counted: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.prompt: dict[int, np.ndarray] = {}  # bool [V]
        self.allowed: dict[int, np.ndarray | None] = {}  # bool [V]

    def init(self, inits: list[SlotInit]) -> None:
        from engine.logits_processors import bits_to_mask

        v = self.vocab_size
        for it in inits:
            s = it.slot
            self.counts[s] = np.bincount(it.output_ids, minlength=v).astype(np.int32)[:v]
            self.counted[s] = int(it.output_ids.size)
            self.last[s] = int(it.output_ids[-1]) if it.output_ids.size else -1
            self.prompt[s] = bits_to_mask(it.prompt_bits, v)
            self.allowed[s] = None if it.allowed_bits is None else \
                bits_to_mask(it.allowed_bits, v)

    def count(self, rows: ProcessorRows, steps: np.ndarray, tokens: np.ndarray) -> None:
        """After sampling: a penalized row's token joins its slot's counts, once per step."""
        for r in np.nonzero(rows.flags & FLAG_PENALTY)[0]:
            s, step, tok = int(rows.slot[r]), int(steps[r]), int(tokens[r])
            if self.counted[s] == step:
                self.counts[s][tok] += 1
                self.counted[s] = step + 1
                self.last[s] = tok


def process_logits(logits: np.ndarray, rows: ProcessorRows, steps: np.ndarray,
                   state: SlotState) -> tuple[np.ndarray, np.ndarray]:
    """(processed logits, logits after the grammar mask only: what logprobs are of), float32
    [S, V]. The order and float32 arithmetic of cutlass_kernels/logits_process.py."""
    from engine.logits_processors import bits_to_mask

    x = np.array(logits, np.float32)
    v = x.shape[1]
    rows.fill_masks()
    for r in np.nonzero(rows.flags & FLAG_GRAMMAR)[0]:
        keep = bits_to_mask(rows.grammar_mask[rows.grammar_row[r]], v)
        x[r, ~keep] = -np.inf
    raw = x.copy()
    for r in np.nonzero(rows.flags)[0]:
        f, xr = int(rows.flags[r]), x[r]
        if f & FLAG_SPARSE:
            lo, hi = rows.sparse_start[r], rows.sparse_start[r + 1]
            ids = rows.sparse_ids[lo:hi]
            xr[ids] = xr[ids] + rows.sparse_vals[lo:hi]
        s = int(rows.slot[r])
        if f & FLAG_ALLOWED:
            xr[~state.allowed[s]] = -np.inf
        if f & FLAG_PENALTY:
            cnt = state.counts[s].copy()
            if state.counted[s] == int(steps[r]) + 1:  # this step's own token: not yet counted
                cnt[state.last[s]] -= 1
            out = cnt > 0
            rp, fp, pp = (np.float32(p) for p in rows.penalties[r])
            seen = out | state.prompt[s]
            xr[seen] = np.where(xr[seen] > 0, xr[seen] / rp, xr[seen] * rp)
            xr[out] = xr[out] - fp * cnt[out].astype(np.float32)
            xr[out] = xr[out] - pp
    return x, raw
