"""One step's data, flat: the ``StepBatch`` the executor runs and the ``StepOutput`` it returns.

These are plain arrays in the vocabulary of vLLM / FlashAttention; kernels and executors know
nothing of requests. The scheduler's output is flattened into a ``StepBatch`` by ``build_batch``
(the one place a step's batch is built).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
