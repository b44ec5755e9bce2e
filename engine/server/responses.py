"""OpenAI's response bodies and server-sent-event chunks of a ``ChoiceGroup``'s deltas, for
/v1/completions (echo, logprobs of the prompt and the completion) and /v1/chat/completions (tool
calls, parsed whole or streamed). Choice ``i`` of prompt ``p`` has index ``p * n + i``.

Usage: prompt tokens counted once per prompt, completion tokens summed over the choices,
``cached_tokens`` the prefix-cache hit of each prompt's first copy (what a client's own prompt
found; its siblings share the first copy's pages). Streamed: with ``include_usage`` a last chunk
of usage and no choices; with ``continuous_usage_stats`` too, every chunk carries its choice's
running usage (vLLM's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from engine.server.choices import ChoiceGroup
from engine.server.render import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    error_event,
    join_logprobs,
    prompt_logprobs_json,
    sse,
    usage_of,
)
from engine.server.stream import StreamDelta
from engine.server.tool_parsers import ToolCall
from engine.server.tools import PlannedStream, ToolPlan

DONE = b"data: [DONE]\n\n"


@dataclass
class Rendering:
    """What rendering a request's choices needs, besides the deltas."""

    head: dict[str, Any]  # id, object, created, model
    prompts: list[list[int]]
    n: int
    logprobs: int | None  # completions: top-n; chat: top_logprobs (None: no logprobs)
    as_ids: bool = False  # return_tokens_as_token_ids
    prompt_logprobs: bool = False  # the request asked for vLLM's prompt_logprobs
    include_usage: bool = False
    continuous_usage: bool = False

    def prompt_of(self, index: int) -> list[int]:
        return self.prompts[index // self.n]

    def usage(self, finals: dict[int, StreamDelta]) -> dict[str, Any]:
        return usage_of(sum(len(p) for p in self.prompts),
                        sum(d.num_output_tokens for d in finals.values()),
                        sum(finals[p * self.n].num_cached_tokens
                            for p in range(len(self.prompts)) if p * self.n in finals))

    def running_usage(self, index: int, d: StreamDelta) -> dict[str, Any]:
        return usage_of(len(self.prompt_of(index)), d.num_output_tokens)


# -- /v1/completions -----------------------------------------------------------------------------


@dataclass
class CompletionRendering(Rendering):
    echo_texts: list[str] | None = None  # per prompt, with echo
    decode: Callable[[int], str] | None = None  # one token's text (echo logprobs)

    def choice(self, index: int, d: StreamDelta, offset: int, first: bool
               ) -> tuple[dict[str, Any], int]:
        """One choice (or chunk of one: ``first`` for its first); returns the next offset."""
        text, lp = d.text, None
        echo = first and self.echo_texts is not None
        if echo:
            text = self.echo_texts[index // self.n] + text  # type: ignore[index]
        if self.logprobs is not None:
            if echo:
                assert self.decode is not None
                lp, offset = echo_logprobs(self.prompt_of(index), d.prompt_logprobs or [],
                                           self.decode, self.as_ids)
            done, offset = completion_logprobs(d.token_ids, d.logprobs or [], offset, self.as_ids)
            lp = join_logprobs(lp, done)
        c = {"index": index, "text": text, "logprobs": lp, "finish_reason": d.finish_reason,
             "stop_reason": d.stop_reason}
        if self.prompt_logprobs and first:
            c["prompt_logprobs"] = prompt_logprobs_json(d.prompt_logprobs)
        return c, offset

    def body(self, finals: dict[int, StreamDelta]) -> dict[str, Any]:
        choices = [self.choice(i, finals[i], 0, True)[0] for i in sorted(finals)]
        return {**self.head, "choices": choices, "usage": self.usage(finals)}

    async def chunks(self, group: ChoiceGroup) -> AsyncIterator[bytes]:
        offsets: dict[int, int] = {}
        extra = {"usage": None} if self.include_usage else {}
        finals: dict[int, StreamDelta] = {}
        async for index, d in group:
            if d.finish_reason == "error":
                yield error_event(d)
                yield DONE
                return
            first = index not in offsets
            if not (d.text or d.token_ids or d.finished):
                continue
            c, offsets[index] = self.choice(index, d, offsets.get(index, 0), first)
            if self.continuous_usage:
                extra = {"usage": self.running_usage(index, d)}
            yield sse({**self.head, "choices": [c], **extra})
            if d.finished:
                finals[index] = d
        if self.include_usage and not group.aborted:
            yield sse({**self.head, "choices": [], "usage": self.usage(finals)})
        yield DONE


# -- /v1/chat/completions ------------------------------------------------------------------------


@dataclass
class ChatRendering(Rendering):
    plan: ToolPlan | None = None

    def _logprobs(self, d: StreamDelta) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return {"content": chat_logprobs(d.token_ids, d.logprobs or [], self.logprobs,
                                         self.as_ids)}

    def body(self, finals: dict[int, StreamDelta]) -> dict[str, Any]:
        choices = []
        plan = self.plan
        for i in sorted(finals):
            d = finals[i]
            content: str | None = d.text
            calls: list[ToolCall] = []
            finish = d.finish_reason
            if plan is not None and plan.parses:
                content, calls = plan.extract(d.text)
                finish = plan.finish_reason(bool(calls), finish)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.to_json() for c in calls]
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(d),
                            "finish_reason": finish, "stop_reason": d.stop_reason})
        out = {**self.head, "choices": choices, "usage": self.usage(finals)}
        if self.prompt_logprobs:
            out["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs)
        return out

    async def chunks(self, group: ChoiceGroup) -> AsyncIterator[bytes]:
        extra = {"usage": None} if self.include_usage else {}
        total = len(self.prompts) * self.n
        for i in range(total):
            if self.continuous_usage:
                extra = {"usage": usage_of(len(self.prompt_of(i)), 0)}
            yield sse({**self.head, "choices": [{
                "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}], **extra})
        plan = self.plan
        parsers: dict[int, PlannedStream] = {}
        if plan is not None and plan.parses:
            parsers = {i: plan.stream() for i in range(total)}
        ncalls: dict[int, int] = {}  # tool calls sent per choice
        finals: dict[int, StreamDelta] = {}
        async for index, d in group:
            if d.finish_reason == "error":
                yield error_event(d)
                yield DONE
                return
            delta: dict[str, Any] = {}
            content, calls, finish = d.text, [], d.finish_reason
            parser = parsers.get(index)
            if parser is not None:
                content, calls = parser.feed(d.text)
                if d.finished:
                    more, late = parser.finish()
                    content, calls = content + more, calls + late
            if content:
                delta["content"] = content
            if calls:
                k = ncalls.get(index, 0)
                delta["tool_calls"] = [c.to_delta(k + j) for j, c in enumerate(calls)]
                ncalls[index] = k + len(calls)
            if d.finished and plan is not None and plan.parses:
                finish = plan.finish_reason(ncalls.get(index, 0) > 0, finish)
            lp = self._logprobs(d) if d.token_ids else None
            if not (delta or d.finished or lp):
                continue
            chunk = {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": lp,
                                               "finish_reason": finish,
                                               "stop_reason": d.stop_reason}]}
            if self.prompt_logprobs and d.prompt_logprobs is not None and index == 0:
                chunk["prompt_logprobs"] = prompt_logprobs_json(d.prompt_logprobs)
            if self.continuous_usage:
                extra = {"usage": self.running_usage(index, d)}
            yield sse({**chunk, **extra})
            if d.finished:
                finals[index] = d
        if self.include_usage and not group.aborted:
            yield sse({**self.head, "choices": [], "usage": self.usage(finals)})
        yield DONE
