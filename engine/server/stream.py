"""The asyncio side of a request: ``RequestStream`` yields the ``StreamDelta``s the engine thread
posts to it (``deliver``: by ``loop.call_soon_threadsafe``), ending with a finished one. The
deltas are the output processor's (``LLMEngine.delta``: one cursor per request)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from engine.outputs import RequestDelta

if TYPE_CHECKING:
    from engine.server.async_engine import AsyncEngine


class EngineDeadError(RuntimeError):
    """The engine loop is dead, stalled or shutting down: no request can be served."""


StreamDelta = RequestDelta  # the output processor's delta, as the engine thread posts it


ACCEPTED = object()  # first item of an accepted request's queue


class RequestStream:
    """The asyncio side of one request: its deltas in order, the last one ``finished``."""

    def __init__(self, request_id: str, owner: AsyncEngine,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self.aborted = False
        self._owner = owner
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def push(self, item: Any) -> None:  # on the event loop
        self._queue.put_nowait(item)
        if _ends(item):  # off the books before the client can see the end
            self._owner.release(self)

    async def wait_accepted(self) -> None:
        item = await self._queue.get()
        if item is not ACCEPTED:  # the exception that refused it (or killed the engine)
            self.finished = True
            raise item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        while True:
            item = await self._queue.get()
            if item is None:  # aborted by abort()
                raise StopAsyncIteration
            if isinstance(item, StreamDelta):  # (skips the exception meant for wait_accepted)
                break
        # A consumer that fell behind the engine gets what piled up as one delta: one chunk to
        # render and send instead of several (the engine thread keeps the GIL more of the time).
        while not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if nxt is None:
                raise StopAsyncIteration
            if isinstance(nxt, StreamDelta):
                item = item.merge(nxt)
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request (client gone); wakes a pending ``__anext__``. No-op when finished."""
        if self.finished:
            return
        self.finished = self.aborted = True
        self._owner.abort(self)
        self._queue.put_nowait(None)


def deliver(posts: list[tuple[RequestStream, Any]]) -> None:
    """Hand items to their streams' event loops (any thread): one wake-up per loop per batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for s, item in posts:
        by_loop.setdefault(s.loop, []).append((s, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            for s, item in items:
                if _ends(item):
                    s._owner.release(s)


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for s, item in items:
        s.push(item)


def _ends(item: Any) -> bool:
    """A request's last item: a refusal (or death before acceptance), or a finished delta."""
    return isinstance(item, BaseException) or (isinstance(item, StreamDelta) and item.finished)
