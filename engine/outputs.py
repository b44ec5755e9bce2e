"""RequestOutput and CompletionOutput, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import LogprobDict


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobDict] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why, when finish_reason == "error"

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobDict | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class StreamOutput:
    """One increment of a streamed request: the new text and tokens since the last one."""

    request_id: str
    index: int  # position of the prompt in the call's prompt list
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: RequestOutput  # the cumulative state
