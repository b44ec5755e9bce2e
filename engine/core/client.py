"""The front end of a two-process engine: ``MultiprocessEngine`` looks like ``LLMEngine`` (add,
abort, step, delta, output) and runs the engine core in a child process.

    front end (this process)                          engine core (child process)
    InputProcessor: text / ids -> validated ids       Scheduler, BlockManager, Executor
    add_request ----- ("add", id, ids, params) ---->  LLMEngine.add_request
    step(): wait for the next CoreStep <------------  LLMEngine.step() -> one CoreStep per step
      mirror Requests += token ids, finish
      OutputProcessor: text, stop strings ---abort-->  LLMEngine.abort (a stop string ends it)

The mirror ``Request`` of each request holds what the core sent (token ids, logprobs, finish),
so the output processor, ``delta`` and ``output`` are the in-process engine's own code. A request
the front end finished (stop string, abort) ignores whatever the core still sends for it.

Death: the core process exiting, or failing to start, raises ``EngineDeadError`` from ``step``;
``heartbeat`` reads the core's shared counter, so a watchdog sees a hung step.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

from engine import tracepoints
from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.core.messages import ABORT, ADD, SHUTDOWN, CoreStep, encode_commands
from engine.engine import OutputViews, new_request, resolve_model_dir
from engine.input_processor import InputProcessor
from engine.output_processor import OutputProcessor
from engine.request import FinishReason, Logprob, Request
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STEP_POLL_MS = 100  # step() waits this long for the core before checking it is alive
START_TIMEOUT_S = 600.0  # loading, compiling and capturing a large model


class EngineCoreDeadError(RuntimeError):
    """The engine core process exited or never started."""


class MultiprocessEngine(OutputViews):
    def __init__(self, args: EngineArgs, fault: str | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.args = args
        self.model_dir = model_dir = resolve_model_dir(args.model)
        self.model_config = mcfg = ModelConfig.from_pretrained(model_dir)  # a bad one: no core
        self._dir = tempfile.mkdtemp(prefix="cuteinfer-core-")
        in_addr = f"ipc://{self._dir}/in"
        out_addr = f"ipc://{self._dir}/out"
        self._zmq = zmq.Context()
        self._push = self._zmq.socket(zmq.PUSH)
        self._push.bind(in_addr)
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.bind(out_addr)
        self._decode = msgspec.msgpack.Decoder(CoreStep).decode
        # wake(): another thread has commands for us; step() stops waiting for the core
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # a byte is in the pipe (or step() is about to flush anyway): later wake()s write
        # nothing. Each write lets the stepping thread take the GIL from the event loop: a
        # burst of 256 requests paid ~1 ms each for it (cProfile of the front end)
        self._woken = False
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        spawn = mp.get_context("spawn")
        self._heartbeat = spawn.Value("q", 0, lock=False)
        parent, child = spawn.Pipe(duplex=False)
        from engine.core.process import run_engine_core

        self.proc = spawn.Process(target=run_engine_core, name="cuteinfer-engine-core",
                                  args=(args, in_addr, out_addr, child, self._heartbeat, fault),
                                  daemon=True)
        self.proc.start()
        child.close()
        try:
            # while the core starts (imports, weights, kernels): the tokenizer (~0.6 s for Qwen3's)
            self.tokenizer = Tokenizer.from_pretrained(model_dir)
            info = self._wait_ready(parent, start_timeout_s)
        except BaseException:
            self.shutdown(timeout=1.0)
            raise
        self.config = cfg = info["config"]  # the EngineConfig the core resolved
        self.backend = info["backend"]
        self.num_pages = info["num_pages"]
        self.eos_token_ids = info["eos_token_ids"]
        self.core_gc_frozen = info["gc_frozen"]  # objects the core froze (freeze_heap)
        self.input_processor = InputProcessor(self.tokenizer, mcfg.vocab_size,
                                              cfg.max_model_len, cfg.block_size,
                                              self.num_pages, str(model_dir))
        self.output_processor = OutputProcessor(self.tokenizer, self._finish_here)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self._outbox: list[tuple[Any, ...]] = []
        self._aborts: list[str] = []
        self._gauges: dict[str, Any] = {}
        self._dead: str | None = None

    def _wait_ready(self, conn: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not conn.poll(0.1):
            if not self.proc.is_alive():
                raise EngineCoreDeadError(
                    f"the engine core process exited while starting (status "
                    f"{self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineCoreDeadError(f"the engine core did not start in {timeout:.0f}s")
        kind, payload = conn.recv()
        conn.close()
        if kind == "error":
            raise EngineCoreDeadError(f"the engine core failed to start: {payload}")
        return payload

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, salt: str | None = None) -> Request:
        self._check_alive()
        # the core draws the seed of a request without one; this mirror's is never used
        req = new_request(self, prompt, params, request_id, salt, lambda p: p.seed or 0)
        rid = req.request_id
        self.requests[rid] = req
        self.output_processor.add(req)
        self._outbox.append((ADD, rid, req.prompt_token_ids, req.params, salt))  # next step()
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self._finish_here(req, FinishReason.ABORT)

    def _finish_here(self, req: Request, reason: FinishReason, stop_reason: Any = None,
                     error: str | None = None) -> None:
        """Finished in the front end (abort, stop string, output error): tell the core."""
        req.finish(reason, stop_reason=stop_reason, error=error)
        self._aborts.append(req.request_id)

    def _flush(self) -> None:
        if self._aborts:
            self._outbox.append((ABORT, self._aborts))
            self._aborts = []
        if self._outbox and self._dead is None:
            if tracepoints.mark is not None:
                tracepoints.mark("flush", len(self._outbox))
            data = encode_commands(self._outbox)
            while True:  # never block on a core that died: its queue would never drain
                try:
                    self._push.send(data, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    self._check_alive()
                    time.sleep(0.001)
            self._outbox = []

    @property
    def heartbeat(self) -> int:
        return int(self._heartbeat.value)

    def has_unfinished(self) -> bool:
        return any(not r.is_finished for r in self.requests.values())

    def gauges(self) -> dict[str, Any]:
        """The core's latest scheduler / KV snapshot (it sends one every 0.1 s). While nothing
        is in flight nobody calls ``step()``: read what the core sent since, here."""
        if not self.has_unfinished():
            while self._dead is None and self._pull.poll(0):
                msg = self._decode(self._pull.recv(copy=False).buffer)
                if msg.gauges is not None:
                    self._gauges = msg.gauges
        return self._gauges

    # -- one step --------------------------------------------------------------------------------
    def wake(self) -> None:
        """Any thread: make a waiting ``step()`` return now (new commands to send). One byte
        per wait: a wake while one is pending writes nothing."""
        if self._woken:
            return
        self._woken = True
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def step(self, timeout_ms: int = STEP_POLL_MS) -> list[Request]:
        """Send what was added or aborted, then wait (up to ``timeout_ms``, or until
        ``wake()``) for the core's next step(s); returns the requests whose state changed.
        Raises EngineCoreDeadError when the core process is gone."""
        self._flush()
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
            # (after the drain: a wake() in between wrote nothing, and this step() returns to
            # a caller whose next step() flushes its commands first)
            self._woken = False
        if self._pull not in ready:
            self._check_alive()
            return []
        changed: dict[str, Request] = {}
        while True:
            msg = self._decode(self._pull.recv(copy=False).buffer)
            if msg.gauges is not None:
                self._gauges = msg.gauges
            for o in msg.outputs:
                req = self.requests.get(o.request_id)
                if req is None or req.is_finished:
                    continue
                self._apply(req, o)
                changed[o.request_id] = req
            if not self._pull.poll(0):
                break
        out = list(changed.values())
        self.output_processor.process(out)
        self._flush()  # aborts of requests a stop string ended
        return out

    @staticmethod
    def _apply(req: Request, o: Any) -> None:
        now = time.perf_counter()
        if o.token_ids:
            req.output_token_ids += o.token_ids
            req.metrics.setdefault("first_token", now)
            req.metrics["last_token"] = now
        if o.logprobs:
            req.logprobs += [{t: Logprob(lp, rank) for t, lp, rank in d} for d in o.logprobs]
        if o.prompt_logprobs:
            req.prompt_logprobs += [None if d is None else
                                    {t: Logprob(lp, rank) for t, lp, rank in d}
                                    for d in o.prompt_logprobs]
        req.num_cached_tokens = o.num_cached_tokens
        req.cumulative_logprob = o.cumulative_logprob
        if o.scheduled_at is not None:
            req.metrics.setdefault("scheduled", o.scheduled_at)
        if o.spec is not None:  # the core's speculative decoding counts (RequestOutput.metrics)
            req.metrics["spec_draft_tokens"], req.metrics["spec_accepted_tokens"] = o.spec
        if o.finish_reason is not None:
            req.finish(FinishReason(o.finish_reason), stop_reason=o.stop_reason, error=o.error)

    def _check_alive(self) -> None:
        if self._dead is None and not self.proc.is_alive():
            self._dead = f"the engine core process exited (status {self.proc.exitcode})"
        if self._dead is not None:
            raise EngineCoreDeadError(self._dead)

    # -- lifecycle -------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the core process (asked first, then terminated). Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            if self.proc.is_alive():
                try:  # (a core that never connected has no queue to take it: don't block)
                    self._push.send(encode_commands([(SHUTDOWN,)]), zmq.NOBLOCK)
                except zmq.Again:
                    pass
                self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(1.0)
            if self.proc.is_alive():
                self.proc.kill()
        finally:
            self._push.close(linger=0)
            self._pull.close(linger=0)
            self._zmq.term()
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            for name in ("in", "out"):
                try:
                    os.unlink(Path(self._dir) / name)
                except OSError:
                    pass
            try:
                os.rmdir(self._dir)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.shutdown(timeout=0.5)
        except Exception:
            pass
