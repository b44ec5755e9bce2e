"""What crosses between the API-server process and the engine core process.

    front end --PUSH--> [commands]  --PULL--> core    a pickled list per send: adds, aborts
    front end <--PULL-- [CoreStep]  <--PUSH-- core    msgpack, one message per engine step

Requests arrive already tokenized and validated (the front end's input processor); the core
answers each step with one batched message: per request, the token ids, logprobs and finish of
that step (no text: detokenization and stop strings are the front end's output processor's).
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec

# (token, logprob, rank) triples of one position, the sampled token first
WireLogprobs = list[tuple[int, float, int | None]]


class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    token_ids: list[int]  # new since the last message for this request
    logprobs: list[WireLogprobs] | None = None  # one entry per new token (when asked for)
    prompt_logprobs: list[WireLogprobs | None] | None = None  # new prompt positions
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    cumulative_logprob: float = 0.0
    # when the core first admitted it (time.perf_counter(): CLOCK_MONOTONIC, one clock for
    # both processes on Linux); sent until its first tokens are, for the queue-time metrics
    scheduled_at: float | None = None
    # speculative decoding so far (drafted, accepted), when the request has speculated
    spec: tuple[int, int] | None = None


class CoreStep(msgspec.Struct, array_like=True, gc=False):
    outputs: list[CoreOutput]
    heartbeat: int = 0
    gauges: dict[str, Any] | None = None  # the scheduler / KV snapshot, at most every 0.1 s


# commands, front end -> core (pickled: SamplingParams is a dataclass, adds are rare)
ADD, ABORT, SHUTDOWN = "add", "abort", "shutdown"


def encode_commands(cmds: list[tuple[Any, ...]]) -> bytes:
    return pickle.dumps(cmds, protocol=pickle.HIGHEST_PROTOCOL)


def decode_commands(data: bytes) -> list[tuple[Any, ...]]:
    return pickle.loads(data)  # noqa: S301 -- from our own front end over a private ipc socket
