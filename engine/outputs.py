"""What a request gives back: ``RequestDelta`` (what one step added, the one thing the output
processor emits), and its renderings ``RequestOutput`` / ``CompletionOutput`` (vLLM's shape) and
``StreamOutput``; the server's SSE chunks render the same delta."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import LogprobDict


@dataclass
class RequestDelta:
    """What one step added to a request: new text and tokens, and how it ended (if it did)."""

    text: str
    token_ids: list[int]
    logprobs: list[LogprobDict] | None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    fatal: bool = False  # the engine died under the request (HTTP 503 rather than 500)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # cumulative
    num_cached_tokens: int = 0
    # the prompt's logprobs (when asked for), once: on the delta where the prompt is computed
    prompt_logprobs: list[LogprobDict | None] | None = None

    def merge(self, later: RequestDelta) -> RequestDelta:
        """This delta followed by ``later``, as one."""
        lps = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        plps = self.prompt_logprobs if later.prompt_logprobs is None else later.prompt_logprobs
        # (a constructor call: dataclasses.replace inspects the fields on every call, ~10x
        # slower, and a consumer behind the engine merges a delta per token)
        return RequestDelta(self.text + later.text, self.token_ids + later.token_ids, lps,
                            later.finished, later.finish_reason, later.stop_reason,
                            later.error, later.fatal, later.num_prompt_tokens,
                            later.num_output_tokens, later.num_cached_tokens, plps)


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
