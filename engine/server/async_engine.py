"""The engine thread: one thread owns the ``LLMEngine``; asyncio handlers talk to it by queues.

    handler (event loop)                          engine thread
    await AsyncEngine.add(ids, params) --add--->  commands (queue.Queue) -> engine.add_request
        <-- accepted | rejected (the exception) -- loop.call_soon_threadsafe
    async for delta in stream  <----- deltas ---  engine.step(): changed requests -> StreamDelta
    stream.abort() (disconnect) ---- abort ---->  engine.abort + pop_finished (pages freed)

Nothing but the engine thread touches the engine after ``start()`` (the watchdog only reads the
``heartbeat`` int); the rest of the server reads the ``snapshot()`` it publishes. A step exception
fails only that step's requests (the engine finishes them with ``"error"``).

Lifecycle: serving -> ``stop_accepting()`` (new requests EngineDeadError, i.e. 503; the loop keeps
running those in flight; ``wait_idle()`` waits for them) -> ``shutdown()`` (what is still in flight
gets a terminal 503-style error; the loop exits). Dead is the other way out: the loop thread
raised, or the watchdog saw work in flight while ``engine.heartbeat`` stood still for
``step_timeout_s`` (it grows every step and every layer of a numpy forward, so a 70 s prefill is
alive and a hung step is not). Every request in flight then gets a terminal error, ``health()``
turns false for good, and ``on_fatal`` lets the server drain and exit non-zero.

Ordering (what a client may rely on): every state change a terminal item reports (``fatal``,
``on_fatal``, ``health()``, ``on_finish``) is made before it is posted to the event loop, and a
stream leaves the books (``num_in_flight()``, ``wait_idle()``) when its terminal item reaches it
on the loop: before its client can see the end, never before the end was delivered.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from engine import tracepoints
from engine.core.process import AdmissionClock
from engine.engine import LLMEngine, RequestError
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.server.stream import (
    ACCEPTED,
    EngineDeadError,
    RequestStream,
    StreamDelta,
    deliver,
)

log = logging.getLogger("cuteinfer.server")

SHUTTING_DOWN = "the server is shutting down"
DRAIN_BATCH = 32  # commands the engine thread takes per step


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, step_timeout_s: float = 120.0,
                 on_fatal: Callable[[str], None] | None = None,
                 on_finish: Callable[[Request], None] | None = None,
                 on_output: Callable[[Request], None] | None = None,
                 snapshot_interval_s: float = 0.1) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self.on_fatal = on_fatal  # called once, before any client can see the failure
        self.on_finish = on_finish  # called on the engine thread with each finished request
        self.on_output = on_output  # ... with each request a step changed (metrics)
        self.snapshot_interval_s = snapshot_interval_s
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._lock = threading.Lock()  # guards the fields below
        self._idle = threading.Condition(self._lock)  # notified when _streams empties
        self._streams: dict[str, RequestStream] = {}  # in flight, from add() to a terminal item
        self._busy_since = 0.0  # when _streams last went from empty to non-empty
        self._fatal: str | None = None
        self._refusing: str | None = None  # why add() refuses (draining or shut down)
        self._stopping = False  # the loop thread should exit
        self._tracked: dict[str, RequestStream] = {}  # accepted requests; engine thread only
        self._prompt_lps: set[str] = set()  # tracked ones whose prompt logprobs are not sent yet
        self._stop_watch = threading.Event()
        self._snapshot: dict[str, Any] = {}
        self._snapshot_at = 0.0
        self._thread = threading.Thread(target=self._run, name="cuteinfer-engine", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="cuteinfer-watchdog",
                                          daemon=True)
        # a two-process engine's step() waits on the core: wake() makes it look at _commands
        self._wake: Callable[[], None] = getattr(engine, "wake", lambda: None)

    # -- lifecycle (any thread) ------------------------------------------------------------------
    def start(self) -> None:
        self._refresh_snapshot(force=True)
        self._thread.start()
        self._watchdog.start()

    def stop_accepting(self, reason: str = SHUTTING_DOWN) -> None:
        """Refuse new requests from now on (EngineDeadError: 503) and report unhealthy; those
        in flight keep running. The first step of a graceful shutdown."""
        with self._lock:
            if self._refusing is None:
                self._refusing = reason

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight (each one's terminal item reached its stream);
        False if ``timeout`` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._streams, timeout)

    def shutdown(self, reason: str = SHUTTING_DOWN, timeout: float = 5.0) -> None:
        """Stop the loop; requests still in flight get a 503-style terminal error. Waits up to
        ``timeout`` for the loop thread (0: not at all) to finish the step it is in. Idempotent."""
        with self._lock:
            if self._refusing is None:
                self._refusing = reason
            self._stopping = True
            streams = self._take_streams()
        self._fail(streams, reason)
        self._commands.put(("wake",))
        self._wake()
        self._stop_watch.set()
        on_loop = threading.current_thread() is self._thread
        if timeout > 0 and self._thread.is_alive() and not on_loop:
            self._thread.join(timeout)

    @property
    def fatal(self) -> str | None:
        """Why the engine is dead, or None while it is alive."""
        return self._fatal

    def health(self) -> tuple[bool, str]:
        if self._fatal is not None:
            return False, self._fatal
        if self._refusing is not None:
            return False, self._refusing
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
                  request_id: str, salt: str | None = None) -> RequestStream:
        """Queue a request (``salt``: its prefix-cache namespace); returns once the engine
        accepted it. Raises what ``add_request`` raised (RequestError, SamplingParamsError) or
        EngineDeadError."""
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        if tracepoints.mark is not None:
            tracepoints.mark("add", request_id)
        with self._lock:
            if self._fatal is not None:
                raise EngineDeadError(f"the engine is dead ({self._fatal})")
            if self._refusing is not None:
                raise EngineDeadError(self._refusing)
            if request_id in self._streams:  # the engine would refuse it too, too late: by then
                # the first request's stream would be gone from the books
                raise RequestError(f"request_id {request_id!r} is already in use")
            if not self._streams:
                self._busy_since = time.monotonic()
            self._streams[request_id] = stream
            self._commands.put(("add", stream, list(prompt_token_ids), params, salt))
        self._wake()
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    def abort(self, stream: RequestStream) -> None:
        self.release(stream)
        self._commands.put(("abort", stream.request_id))
        self._wake()

    def release(self, stream: RequestStream) -> None:
        """``stream`` ended (its terminal item reached it, or it was aborted): off the books."""
        with self._lock:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                if not self._streams:
                    self._idle.notify_all()

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        # an in-process engine's admissions are stamped here; a two-process one's in its core
        sched = getattr(eng, "scheduler", None)
        clock = None if sched is None else AdmissionClock(sched)
        try:
            while True:
                self._drain(block=not eng.has_unfinished())
                if self._fatal is not None or self._stopping:
                    return
                if not eng.has_unfinished():
                    self._refresh_snapshot(force=True)
                    continue
                if clock is None:
                    self._publish(eng.step())
                else:
                    clock.before()
                    changed = eng.step()
                    clock.after(changed)
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
        # at most DRAIN_BATCH commands, then a step (which sends them to a two-process core):
        # while a burst arrives the event loop keeps this queue from emptying, and an unbounded
        # drain sent 225 requests of a 256-request burst to the core in one message, 0.2 s after
        # the first of them arrived (tools/gpu_shared_prefix.sh's admission trace)
        for n in range(1, DRAIN_BATCH + 1):
            if cmd[0] == "add":
                self._do_add(cmd[1], cmd[2], cmd[3], cmd[4], posts)
            elif cmd[0] == "abort":
                self._do_abort(cmd[1])
            if n == DRAIN_BATCH:
                self._wake()  # more may be queued: the step after this one takes them
                break
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        deliver(posts)

    def _do_add(self, stream: RequestStream, ids: list[int], params: SamplingParams,
                salt: str | None, posts: list[tuple[RequestStream, Any]]) -> None:
        if tracepoints.mark is not None:
            tracepoints.mark("drain", stream.request_id)
        try:
            req = self.engine.add_request(ids, params, request_id=stream.request_id, salt=salt)
        except Exception as e:  # refused: the handler turns it into a 400 (or a 500 if a bug)
            posts.append((stream, e))
            return
        self._tracked[req.request_id] = stream
        if req.wants_prompt_logprobs:
            self._prompt_lps.add(req.request_id)
        posts.append((stream, ACCEPTED))

    def _do_abort(self, request_id: str) -> None:
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        self._prompt_lps.discard(request_id)
        self.engine.abort(request_id)
        req = self.engine.pop_finished(request_id)
        if req is not None and self.on_finish is not None:
            self.on_finish(req)

    def _publish(self, changed: list[Request]) -> None:
        eng = self.engine
        posts: list[tuple[RequestStream, Any]] = []
        on_output = self.on_output
        for req in changed:
            rid = req.request_id
            stream = self._tracked.get(rid)
            if stream is None:  # aborted meanwhile
                if req.is_finished:
                    eng.pop_finished(rid)
                continue
            if on_output is not None:
                on_output(req)
            delta = eng.delta(req)
            if self._prompt_lps and rid in self._prompt_lps and (
                    req.output_token_ids or req.is_finished):  # the prompt is computed
                self._prompt_lps.discard(rid)
                delta.prompt_logprobs = list(req.prompt_logprobs)
            posts.append((stream, delta))
            if req.is_finished:
                del self._tracked[rid]
                eng.pop_finished(rid)
                if self.on_finish is not None:
                    self.on_finish(req)
        if tracepoints.mark is not None and posts:
            tracepoints.mark("deliver", len(posts))
        deliver(posts)

    def _take_streams(self) -> list[RequestStream]:
        """All streams in flight, leaving none (holding ``_lock``)."""
        streams = list(self._streams.values())
        self._streams.clear()
        self._idle.notify_all()
        return streams

    def _refresh_snapshot(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._snapshot_at < self.snapshot_interval_s:
            return
        self._snapshot_at = now
        self._snapshot = {"at": now, **self.engine.gauges()}

    # -- death -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Stalled = work in flight and ``engine.heartbeat`` unchanged for ``step_timeout_s``,
        counted from the later of its last change (as seen here) and the moment work arrived:
        time spent idle, or before ``start()``, is no stall."""
        interval = min(1.0, max(0.05, self.step_timeout_s / 4))
        beat, moved_at = self.engine.heartbeat, time.monotonic()
        while not self._stop_watch.wait(interval):
            if self._fatal is not None or self._stopping:
                return
            if not self._thread.is_alive():
                self._die("the engine loop thread exited")
                return
            now = time.monotonic()
            b = self.engine.heartbeat
            if b != beat:
                beat, moved_at = b, now
                continue
            stalled = now - max(moved_at, self._busy_since)
            n = len(self._streams)
            if n and stalled > self.step_timeout_s:
                self._die(f"the engine made no progress for {stalled:.1f}s with {n} "
                          f"request(s) in flight (step timeout {self.step_timeout_s:g}s)")
                return

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._fatal is not None:
                return
            self._fatal = reason
            streams = self._take_streams()
        log.error("engine is dead: %s; failing %d request(s) in flight", reason, len(streams))
        try:
            if self.on_fatal is not None:  # before the clients hear of it: they may ask
                self.on_fatal(reason)
        except Exception:
            log.exception("on_fatal failed")
        finally:
            self._fail(streams, reason)

    def _fail(self, streams: list[RequestStream], reason: str) -> None:
        err = EngineDeadError(reason)
        posts: list[tuple[RequestStream, Any]] = []
        for s in streams:
            # a stream not yet accepted gets the exception; an accepted one, a terminal delta
            posts.append((s, err))
            posts.append((s, StreamDelta("", [], None, True, "error", None, reason, fatal=True)))
        deliver(posts)
