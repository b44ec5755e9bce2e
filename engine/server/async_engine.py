"""The engine thread: one thread owns the ``LLMEngine``; asyncio handlers talk to it by queues.

    handler (event loop)                          engine thread
    await AsyncEngine.add(ids, params) --add--->  commands (queue.Queue) -> engine.add_request
        <-- accepted | rejected (the exception) -- loop.call_soon_threadsafe
    async for delta in stream  <----- deltas ---  engine.step(): changed requests -> StreamDelta
    stream.abort() (disconnect) ---- abort ---->  engine.abort + pop_finished (pages freed)

Nothing but the engine thread touches the engine after ``start()``; the rest of the server reads
the ``snapshot()`` it publishes. A step exception fails only that step's requests (the engine
finishes them with ``"error"``). A watchdog thread declares the engine dead when the loop thread
has exited, or has made no progress for ``step_timeout_s`` while requests are in flight; every
request still in flight then gets a terminal error, ``health()`` turns false for good, and
``on_fatal`` lets the server drain and exit non-zero so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.server.stream import ACCEPTED, EngineDeadError, RequestStream, StreamDelta

log = logging.getLogger("cuteinfer.server")


@dataclass
class _Tracked:
    stream: RequestStream
    req: Request
    sent_text: int = 0
    sent_tokens: int = 0

    def delta(self, text: str) -> StreamDelta:
        req = self.req
        toks = req.output_token_ids
        new_text = text[self.sent_text:]
        self.sent_text = max(self.sent_text, len(text))
        new_toks = list(toks[self.sent_tokens:])
        lps = list(req.logprobs[self.sent_tokens:]) if req.params.logprobs is not None else None
        self.sent_tokens = len(toks)
        return StreamDelta(
            new_text, new_toks, lps, req.is_finished,
            req.finish_reason.value if req.finish_reason else None, req.stop_reason, req.error,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(toks),
            num_cached_tokens=req.num_cached_tokens)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, step_timeout_s: float = 120.0,
                 on_fatal: Callable[[str], None] | None = None,
                 on_finish: Callable[[Request], None] | None = None,
                 snapshot_interval_s: float = 0.1) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self.on_fatal = on_fatal
        self.on_finish = on_finish  # called on the engine thread with each finished request
        self.snapshot_interval_s = snapshot_interval_s
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # in flight, from add() to a terminal item
        self._tracked: dict[str, _Tracked] = {}  # accepted requests; engine thread only
        self._fatal: str | None = None
        self._stopping = False
        self._stop_watch = threading.Event()
        self._progress_at = time.monotonic()
        self._snapshot: dict[str, Any] = {}
        self._snapshot_at = 0.0
        self._thread = threading.Thread(target=self._run, name="cuteinfer-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="cuteinfer-watchdog",
                                          daemon=True)

    # -- lifecycle (any thread) ------------------------------------------------------------------
    def start(self) -> None:
        self._refresh_snapshot(force=True)
        self._thread.start()
        self._watchdog.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the loop; requests still in flight get a 503-style terminal error."""
        with self._lock:
            self._stopping = True
            streams = list(self._streams.values())
            self._streams.clear()
        self._fail(streams, "the server is shutting down")
        self._commands.put(("wake",))
        self._stop_watch.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def fatal(self) -> str | None:
        """Why the engine is dead, or None while it is alive."""
        return self._fatal

    def health(self) -> tuple[bool, str]:
        if self._fatal is not None:
            return False, self._fatal
        if self._stopping:
            return False, "the server is shutting down"
        if not self._thread.is_alive():
            return False, "the engine loop is not running"
        return True, "ok"

    def snapshot(self) -> dict[str, Any]:
        """Engine gauges as of ``snapshot()["at"]`` (``time.monotonic()``), published by the
        engine thread after a step (at most every ``snapshot_interval_s``) and when idle."""
        return self._snapshot

    def num_in_flight(self) -> int:
        return len(self._streams)

    # -- requests (event loop) -------------------------------------------------------------------
    async def add(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                  request_id: str) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises what ``add_request``
        raised (RequestError, SamplingParamsError) or EngineDeadError."""
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        with self._lock:
            if self._fatal is not None:
                raise EngineDeadError(f"the engine is dead ({self._fatal})")
            if self._stopping:
                raise EngineDeadError("the server is shutting down")
            self._streams[request_id] = stream
            self._commands.put(("add", stream, list(prompt_token_ids), params))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                self._drain(block=not eng.has_unfinished())
                if self._fatal is not None or self._stopping:
                    return
                if not eng.has_unfinished():
                    self._progress_at = time.monotonic()
                    self._refresh_snapshot(force=True)
                    continue
                before = (eng.stats.steps, eng.stats.failed_steps)
                changed = eng.step()
                if changed or (eng.stats.steps, eng.stats.failed_steps) != before:
                    self._progress_at = time.monotonic()
                self._publish(changed)
                self._refresh_snapshot()
        except BaseException as e:  # the loop itself failed: nothing can be served any more
            log.error("engine loop died:\n%s", traceback.format_exc())
            self._die(f"the engine loop died: {type(e).__name__}: {e}")

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.2) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        posts: list[tuple[RequestStream, Any]] = []
        while True:
            if cmd[0] == "add":
                self._do_add(cmd[1], cmd[2], cmd[3], posts)
            elif cmd[0] == "abort":
                self._do_abort(cmd[1])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        _deliver(posts)

    def _do_add(self, stream: RequestStream, ids: list[int], params: SamplingParams,
                posts: list[tuple[RequestStream, Any]]) -> None:
        try:
            req = self.engine.add_request(ids, params, request_id=stream.request_id)
        except Exception as e:  # refused: the handler turns it into a 400 (or a 500 if a bug)
            with self._lock:
                self._streams.pop(stream.request_id, None)
            posts.append((stream, e))
            return
        self._tracked[req.request_id] = _Tracked(stream, req)
        posts.append((stream, ACCEPTED))

    def _do_abort(self, request_id: str) -> None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        self.engine.abort(request_id)
        req = self.engine.pop_finished(request_id)
        if req is not None and self.on_finish is not None:
            self.on_finish(req)

    def _publish(self, changed: list[Request]) -> None:
        eng = self.engine
        posts: list[tuple[RequestStream, Any]] = []
        for req in changed:
            rid = req.request_id
            t = self._tracked.get(rid)
            if t is None:  # aborted meanwhile
                if req.is_finished:
                    eng.pop_finished(rid)
                continue
            posts.append((t.stream, t.delta(eng.visible_text(req))))
            if req.is_finished:
                del self._tracked[rid]
                eng.pop_finished(rid)
                with self._lock:
                    self._streams.pop(rid, None)
                if self.on_finish is not None:
                    self.on_finish(req)
        _deliver(posts)

    def _refresh_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._snapshot_at < self.snapshot_interval_s:
            return
        self._snapshot_at = now
        eng = self.engine
        sched = eng.scheduler
        st = eng.stats
        self._snapshot = {
            "at": now, "running": len(sched.running), "waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions, "kv": eng.block_manager.gauges(),
            "kv_stats": eng.block_manager.stats(), "steps": st.steps,
            "eager_steps": st.eager_steps, "graph_steps": st.graph_steps,
            "failed_steps": st.failed_steps, "tokens": st.tokens}

    # -- death -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        interval = min(1.0, max(0.05, self.step_timeout_s / 4))
        while not self._stop_watch.wait(interval):
            if self._fatal is not None or self._stopping:
                return
            if not self._thread.is_alive():
                self._die("the engine loop thread exited")
                return
            stalled = time.monotonic() - self._progress_at
            if self._streams and stalled > self.step_timeout_s:
                self._die(f"the engine made no progress for {stalled:.1f}s with "
                          f"{len(self._streams)} request(s) in flight (step timeout "
                          f"{self.step_timeout_s:g}s)")
                return

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._fatal is not None:
                return
            self._fatal = reason
            streams = list(self._streams.values())
            self._streams.clear()
        log.error("engine is dead: %s; failing %d request(s) in flight", reason, len(streams))
        self._fail(streams, reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _fail(self, streams: list[RequestStream], reason: str) -> None:
        err = EngineDeadError(reason)
        posts: list[tuple[RequestStream, Any]] = []
        for s in streams:
            # a stream not yet accepted gets the exception; an accepted one, a terminal delta
            posts.append((s, err))
            posts.append((s, StreamDelta("", [], None, True, "error", None, reason, fatal=True)))
        _deliver(posts)


def _deliver(posts: list[tuple[RequestStream, Any]]) -> None:
    """Hand items to their streams' event loops: one wake-up per loop per batch."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
    for s, item in posts:
        by_loop.setdefault(s.loop, []).append((s, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for s, item in items:
        s.push(item)
