"""The long-lived request: token ids, how many are computed, sampled outputs, finish reason.

State machine::

    WAITING --schedule--> RUNNING --finish--> FINISHED (stop | length | abort | error)
       ^                     |
       +----- PREEMPTED <----+   (pages released; recomputed from scratch when rescheduled)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Logprob:
    """vLLM's shape: the logprob, its 1-based rank in the vocabulary, and the decoded token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobDict = dict[int, Logprob]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the effective seed (params.seed, or drawn from the engine's generator)
    arrival: int  # admission order (FIFO)
    prompt: str | None = None
    salt: str | None = None  # prefix-cache namespace (e.g. an adapter name)
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prefix-cache hit of the latest admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[LogprobDict] = field(default_factory=list)
    prompt_logprobs: list[LogprobDict | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""  # output text (stop strings removed); the output processor writes it
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, n: int) -> list[int]:
        """``all_token_ids[start:start + n]`` without building the whole list (a decode step
        asks for one token of a long sequence)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:start - p + n]
        if start + n <= p:
            return self.prompt_token_ids[start:start + n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:start + n - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def max_output_tokens(self) -> int:
        """Output budget: max_tokens, capped by max_model_len."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.params.max_tokens
        return room if mt is None else min(mt, room)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
