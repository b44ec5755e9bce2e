"""One step's data, flat: the ``StepBatch`` the executor runs and the ``StepOutput`` it returns.

These are plain arrays in the vocabulary of vLLM / FlashAttention; kernels and executors know
nothing of requests. The scheduler's output is flattened into a ``StepBatch`` by ``build_batch``
(the one place a step's batch is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput


@dataclass
class StepBatch:
    """One step's inputs, flat, in the vocabulary of vLLM / FlashAttention.

    T = total new tokens, B = sequences in the step, S = rows to sample.
    Sequence b owns tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; its KV after the step holds
    ``context_lens[b]`` tokens (cached + new), the new ones at the end.
    """

    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int64 [T] physical KV slot of each new token
    cu_seqlens_q: np.ndarray  # int32 [B+1]
    context_lens: np.ndarray  # int32 [B]
    page_indices: np.ndarray  # int32 [B, max_pages] rows of each sequence's page list (by ref.)
    # --- sampling: one row per sequence that samples a token this step -----------------------
    sample_token_idx: np.ndarray  # int32 [S] index into the T tokens whose logits are sampled
    temperature: np.ndarray  # float32 [S] (0 = greedy)
    top_k: np.ndarray  # int32 [S] (0 = off)
    top_p: np.ndarray  # float32 [S] (1 = off)
    min_p: np.ndarray  # float32 [S] (0 = off)
    seeds: np.ndarray  # uint64 [S]
    sample_steps: np.ndarray  # uint32 [S] per-request counter (tokens generated so far)
    num_logprobs: np.ndarray  # int32 [S] top-n logprobs wanted (-1 = none, 0 = chosen only)
    # --- prompt logprobs: token rows whose next-token logprobs are wanted --------------------
    prompt_logprob_idx: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int32))  # int32 [P] token rows
    prompt_logprob_targets: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int32))  # int32 [P] the actual next token
    prompt_num_logprobs: int = 0  # top-n for prompt rows (max over requests in the step)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (a graph-replayable step)."""
        return self.num_tokens == self.num_seqs and self.num_seqs > 0


@dataclass
class Logprobs:
    """Logprobs of a set of rows: the chosen token's, plus the top-n (ids descending by value)."""

    token_logprob: np.ndarray  # float32 [R] logprob of the sampled / actual token
    token_rank: np.ndarray  # int32 [R] 1-based rank of that token
    top_ids: np.ndarray  # int32 [R, n]
    top_logprobs: np.ndarray  # float32 [R, n]


@dataclass
class StepOutput:
    sampled: np.ndarray  # int32 [S]
    logprobs: Logprobs | None = None  # for the S sample rows, when any asked
    prompt_logprobs: Logprobs | None = None  # for the P prompt rows
    graph: bool = False  # the forward replayed a captured CUDA graph


def build_batch(out: SchedulerOutput) -> StepBatch:
    """Flatten a step's scheduled requests into the executor's arrays (a pure function)."""
    seqs = out.seqs
    b = len(seqs)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    cu = [0]
    ctx = []
    tables = []
    sample_reqs = []
    sample_idx: list[int] = []
    pl_idx: list[int] = []
    pl_tgt: list[int] = []
    pl_n = 0
    for s in seqs:
        req = s.request
        base = cu[-1]
        ids += req.token_slice(s.start, s.num_new)
        pos += range(s.start, s.start + s.num_new)
        slots += s.slots
        cu.append(base + s.num_new)
        ctx.append(s.start + s.num_new)
        tables.append(s.page_table)
        if s.sample:
            sample_idx.append(base + s.num_new - 1)
            sample_reqs.append(req)
        for p in s.prompt_logprob_positions:
            pl_idx.append(base + p - s.start)
            pl_tgt.append(req.prompt_token_ids[p + 1])
            pl_n = max(pl_n, req.params.prompt_logprobs or 0)
    width = max(max((len(t) for t in tables), default=1), 1)
    page_indices = np.array([t + [0] * (width - len(t)) if len(t) < width else t
                             for t in tables], np.int32).reshape(b, width)
    sp = [r.params for r in sample_reqs]
    return StepBatch(
        input_ids=np.asarray(ids, np.int32),
        positions=np.asarray(pos, np.int32),
        slot_mapping=np.asarray(slots, np.int64),
        cu_seqlens_q=np.asarray(cu, np.int32),
        context_lens=np.asarray(ctx, np.int32),
        page_indices=page_indices,
        sample_token_idx=np.asarray(sample_idx, np.int32),
        temperature=np.asarray([p.temperature for p in sp], np.float32),
        top_k=np.asarray([p.top_k for p in sp], np.int32),
        top_p=np.asarray([p.top_p for p in sp], np.float32),
        min_p=np.asarray([p.min_p for p in sp], np.float32),
        seeds=np.asarray([r.seed for r in sample_reqs], np.uint64),
        sample_steps=np.asarray([len(r.output_token_ids) for r in sample_reqs], np.uint32),
        num_logprobs=np.asarray([-1 if p.logprobs is None else p.logprobs for p in sp],
                                np.int32),
        prompt_logprob_idx=np.asarray(pl_idx, np.int32),
        prompt_logprob_targets=np.asarray(pl_tgt, np.int32),
        prompt_num_logprobs=pl_n,
    )
