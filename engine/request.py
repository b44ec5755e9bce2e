"""The long-lived request: token ids, how many are computed, sampled outputs, finish reason.

``Request`` is the only owner of its token ids (``prompt_token_ids`` then ``output_token_ids``)
and of its progress (``num_computed_tokens``). The block manager keeps no copy: the scheduler
hands it ``token_ids``, a view that reads both lists in place (no concatenation per step).

State machine::

    WAITING --schedule--> RUNNING --finish--> FINISHED (stop | length | abort | error)
       ^                     |
       +----- PREEMPTED <----+   (pages released; recomputed from scratch when rescheduled)
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, overload

from engine.sampling_params import SamplingParams
from engine.step import pack_sampling_row

if TYPE_CHECKING:
    from engine.logits_processors import RequestProcessors


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
    sched_step: int = 0  # Scheduler.budget_steps when it was added (the mixed-step wait lift)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    logprobs: list[LogprobDict] = field(default_factory=list)
    prompt_logprobs: list[LogprobDict | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""  # output text (stop strings removed); the output processor writes it
    metrics: dict[str, float] = field(default_factory=dict)
    # logits processors (engine/logits_processors.py): None unless the params ask for one
    procs: RequestProcessors | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.token_ids = TokenIds(self)

    def __getstate__(self) -> dict[str, object]:  # copy / pickle: the copy gets its own view
        state = self.__dict__.copy()
        del state["token_ids"]
        state["procs"] = None  # device slots and matchers belong to the engine's state
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.token_ids = TokenIds(self)

    @cached_property
    def sampling_row(self) -> bytes:
        """Sampling parameters and seed packed for the step builder (``engine.step``), once:
        they do not change while the request runs."""
        return pack_sampling_row(self.params, self.seed)

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

    @cached_property
    def max_output_tokens(self) -> int:
        """Output budget: max_tokens, capped by max_model_len. Read at every sampled token, so
        computed once: the prompt, max_model_len and params are fixed once the request exists."""
        room = self.max_model_len - len(self.prompt_token_ids)
        mt = self.params.max_tokens
        return room if mt is None or mt > room else mt

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        if self.procs is not None:  # its processor slot and matcher are free again
            self.procs.release()
            self.procs = None


class TokenIds(Sequence[int]):
    """``all_token_ids`` read in place: the request's prompt then output token ids, always
    current (it reads the request's lists at each access; it holds the request weakly, so it
    makes no reference cycle)."""

    __slots__ = ("_req",)

    def __init__(self, req: Request) -> None:
        self._req = weakref.ref(req)

    def _get(self) -> Request:
        req = self._req()
        if req is None:
            raise ReferenceError("the request of these token ids is gone")
        return req

    def __len__(self) -> int:  # on the hot path (every commit): _get inlined
        req = self._req()
        if req is None:
            raise ReferenceError("the request of these token ids is gone")
        return len(req.prompt_token_ids) + len(req.output_token_ids)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        req = self._get()
        p = len(req.prompt_token_ids)
        n = p + len(req.output_token_ids)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                return req.all_token_ids[i]
            return req.token_slice(start, max(0, stop - start))
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token index out of range")
        return req.prompt_token_ids[i] if i < p else req.output_token_ids[i - p]

    def __iter__(self) -> Iterator[int]:
        req = self._get()
        yield from req.prompt_token_ids
        yield from req.output_token_ids
