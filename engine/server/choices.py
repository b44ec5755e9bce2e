"""The engine requests behind one API request: ``n`` choices of each prompt, every choice its own
engine request, merged into one stream of ``(choice index, delta)`` (vLLM's parallel sampling:
the copies of a seeded request get seeds ``seed``, ``seed + 1``, ...).

    prompt p: copy 0 --add--> engine         its prefill computes the prompt and registers its
              first delta of copy 0 arrives  full pages in the prefix cache; then
              copies 1..n-1 --add--> engine  they find all of it but the last partial page cached

The prefix cache registers a page once it is computed, so copies admitted in the same step would
each compute (and hold) the whole prompt: hence the staggered start. When there is nothing to
share (prefix caching off, a prompt of less than one full page plus a token, or a first copy that
asks for prompt logprobs, which bypasses the cache) every copy starts at once.

Refusals of the first copies are the request's (raised by ``start``: a 400 before any answer); a
sibling refused later (the engine died, the server began draining) ends its choice with an error
delta. ``abort()`` (client gone) aborts every request of the group, started or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.engine import RequestError
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.server.async_engine import AsyncEngine
from engine.server.stream import EngineDeadError, RequestStream, StreamDelta


@dataclass
class Choice:
    index: int  # in the response's choices
    prompt_index: int
    ids: list[int]
    params: SamplingParams
    request_id: str
    first: bool  # the first copy of its prompt


def copy_params(params: SamplingParams, **changes: Any) -> SamplingParams:
    """``params`` with ``changes``, the fields the request left unset still unset (so the model's
    defaults still apply to them: ``dataclasses.replace`` would freeze the built-in ones)."""
    keep = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    keep.update({k: None for k in params.unset}, **changes)
    return SamplingParams(**keep)


def make_choices(request_id: str, prompts: list[list[int]], params: SamplingParams,
                 n: int) -> list[Choice]:
    """The n copies of each prompt, choice index ``prompt_index * n + copy``; a seeded request's
    copies get seeds ``seed + copy``. (Each copy computes its own prompt logprobs, if asked
    for: such a request bypasses the prefix cache, so there is nothing to share anyway.)"""
    single = len(prompts) == 1 and n == 1
    out = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            copy = params if params.seed is None or i == 0 else copy_params(
                params, seed=(params.seed + i) % 2**64)
            index = p * n + i
            out.append(Choice(index, p, ids, copy,
                              request_id if single else f"{request_id}-{index}", i == 0))
    return out


def _refused(e: Exception) -> StreamDelta:
    return StreamDelta("", [], None, True, "error", None, str(e),
                       fatal=isinstance(e, EngineDeadError))


class ChoiceGroup:
    def __init__(self, engine: AsyncEngine, choices: list[Choice], salt: str | None,
                 stagger: bool) -> None:
        self.engine = engine
        self.choices = choices
        self.salt = salt
        self.stagger = stagger
        self.streams: dict[int, RequestStream] = {}
        self.aborted = False
        self._queue: asyncio.Queue[tuple[int, StreamDelta | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Future[None]] = []
        self._ended = 0
        self._siblings: dict[int, list[Choice]] = {}  # prompt index -> copies not yet added

    @property
    def finished(self) -> bool:
        return self.aborted or self._ended == len(self.choices)

    async def start(self) -> None:
        """Add the first copy of every prompt (every copy without staggering); raises what the
        engine's intake raised (RequestError, SamplingParamsError, EngineDeadError)."""
        now = [c for c in self.choices if c.first or not self.stagger]
        for c in self.choices:
            if not (c.first or not self.stagger):
                self._siblings.setdefault(c.prompt_index, []).append(c)
        try:
            for c in now:
                self.streams[c.index] = await self._add(c)
        except BaseException:
            self.abort()
            raise
        for c in now:
            self._pump(c)

    async def _add(self, c: Choice) -> RequestStream:
        return await self.engine.add(c.ids, c.params, c.request_id, salt=self.salt)

    def _pump(self, c: Choice) -> None:
        self._tasks.append(asyncio.ensure_future(self._forward(c, self.streams[c.index])))

    async def _forward(self, c: Choice, stream: RequestStream) -> None:
        try:
            async for d in stream:
                self._queue.put_nowait((c.index, d))
                if c.first:  # the prompt is computed: its pages are registered
                    self._release(c.prompt_index)
        finally:
            if c.first:
                self._release(c.prompt_index)  # it ended before a first delta
            self._queue.put_nowait((c.index, None))

    def _release(self, prompt_index: int) -> None:
        siblings = self._siblings.pop(prompt_index, None)
        if siblings and not self.aborted:
            self._tasks.append(asyncio.ensure_future(self._add_siblings(siblings)))

    async def _add_siblings(self, siblings: list[Choice]) -> None:
        for c in siblings:
            try:
                self.streams[c.index] = await self._add(c)
            except (RequestError, SamplingParamsError, EngineDeadError) as e:
                self._queue.put_nowait((c.index, _refused(e)))
                self._queue.put_nowait((c.index, None))
                continue
            self._pump(c)

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        while not self.finished:
            index, d = await self._queue.get()
            if d is None:
                self._ended += 1
            elif not self.aborted:
                yield index, d

    def abort(self) -> None:
        """Stop every request of the group (client gone); no-op once all have finished."""
        if self.finished:
            return
        self.aborted = True
        for t in self._tasks:
            t.cancel()
        for s in self.streams.values():
            s.abort()
        self._queue.put_nowait((-1, None))  # wakes the consumer
