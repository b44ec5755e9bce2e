"""The engine core process: scheduler, block manager and executor in a busy loop.

    while True:
        take the front end's commands (adds, aborts): block only when there is no work
        LLMEngine.step()                               # schedule -> execute -> update
        send one CoreStep: per changed request its new token ids / logprobs / finish

The core runs the in-process ``LLMEngine`` with ``process_outputs=False``: no detokenization and
no stop strings here (the front end's output processor finds a stop string and aborts the
request). Started by ``engine.core.client.CoreClient`` with the ``spawn`` method (no CUDA state
crosses a fork); it exits when told to, or when its parent process is gone.

A heartbeat thread copies ``LLMEngine.heartbeat`` (it grows every step and every layer of a numpy
forward) into a shared integer every 50 ms, so the front end's watchdog can tell a long step
from a hung one without asking the core anything.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Any

from engine import envs, tracepoints

GAUGE_INTERVAL_S = 0.1
IDLE_POLL_MS = 100

log = logging.getLogger(__name__)


class AdmissionClock:
    """Stamps ``req.metrics["scheduled"]`` (the start of the step that first admitted it: the
    end of its queue time, vLLM's ``scheduled_ts``) around ``LLMEngine.step()``, reading only the
    scheduler's queue lengths: O(1) a step, O(admitted + changed) in a step that admitted some.
    Admitted = what left the waiting queue, preempted requests (which return to it) counted
    back; they are the tail of ``running``, or finished in that very step."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.t, self.waiting, self.preempted = 0.0, 0, 0

    def before(self) -> None:
        s = self.sched
        self.t, self.waiting, self.preempted = time.perf_counter(), len(s.waiting), \
            s.num_preemptions

    def after(self, changed: list[Any]) -> None:
        s = self.sched
        admitted = self.waiting - len(s.waiting) + s.num_preemptions - self.preempted
        if admitted <= 0:
            return
        t = self.t
        for r in s.running[-admitted:]:
            r.metrics.setdefault("scheduled", t)
        for r in changed:
            if r.is_finished:
                r.metrics.setdefault("scheduled", t)


def run_engine_core(args: Any, in_addr: str, out_addr: str, ready: Any, heartbeat: Any,
                    fault: str | None = None) -> None:
    """Process entry point. ``ready`` (a Pipe end) gets ``("ready", info)`` (the resolved
    EngineConfig, the number of KV pages, the backend, the EOS ids) or
    ``("error", message)``; ``heartbeat`` is a shared ``multiprocessing.Value("q")``;
    ``fault`` names a test-only fault hook, ``"module:function"``, called with the engine."""
    logging.basicConfig(level=logging.INFO, format="[cuteinfer core] %(message)s")
    try:
        import zmq

        from engine.engine import LLMEngine

        eng = LLMEngine(args, process_outputs=False)
        if envs.grammar_warmup():
            try:
                eng.processors.warm_up()
            except Exception as e:  # noqa: BLE001 -- the first constrained request says why
                log.warning("structured output could not be made ready: %s: %s",
                            type(e).__name__, e)
        if fault:
            import importlib

            mod, _, fn = fault.partition(":")
            getattr(importlib.import_module(mod), fn)(eng)
        info = {"config": eng.config, "num_pages": eng.block_manager.num_pages,
                "backend": eng.backend, "eos_token_ids": tuple(eng.eos_token_ids)}
    except BaseException as e:  # noqa: BLE001 -- reported to the parent, which raises it
        ready.send(("error", f"{type(e).__name__}: {e}"))
        return
    from engine.core import freeze_heap

    info["gc_frozen"] = freeze_heap()  # start-up's objects out of the loop's collections
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    ready.send(("ready", info))
    ready.close()
    core = _Core(eng, pull, push, heartbeat)
    try:
        core.run()
    except BaseException:  # the loop itself failed: say why, exit non-zero
        log.error("engine core died:\n%s", traceback.format_exc())
        os._exit(1)
    finally:
        core.stop_beat.set()
    push.close(linger=1000)
    pull.close(linger=0)
    ctx.term()


class _Core:
    def __init__(self, eng: Any, pull: Any, push: Any, heartbeat: Any) -> None:
        import msgspec

        from engine.core.messages import CoreOutput, CoreStep

        self.eng, self.pull, self.push, self.heartbeat = eng, pull, push, heartbeat
        self.encode = msgspec.msgpack.Encoder().encode
        self.CoreOutput, self.CoreStep = CoreOutput, CoreStep
        self.cursors: dict[str, list[int]] = {}  # request id -> [tokens, prompt logprobs] sent
        self.clock = AdmissionClock(eng.scheduler)
        self.gauges_at = 0.0
        self.stopping = False
        self.parent = os.getppid()
        self.stop_beat = threading.Event()
        threading.Thread(target=self._beat, name="cuteinfer-core-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self.stop_beat.wait(0.05):
            self.heartbeat.value = self.eng.heartbeat
            if os.getppid() != self.parent:  # the front end is gone: nobody to serve
                os._exit(0)

    def run(self) -> None:
        import zmq

        eng = self.eng
        while not self.stopping:
            busy = eng.has_unfinished()
            if busy:
                while self.pull.poll(0):
                    self._commands(self.pull.recv(zmq.NOBLOCK))
            elif self.pull.poll(IDLE_POLL_MS):
                self._commands(self.pull.recv())
                continue
            else:
                self._send([])  # idle: the gauges, every GAUGE_INTERVAL_S
                continue
            if self.stopping or not eng.has_unfinished():
                continue
            self.clock.before()
            changed = eng.step()
            self.clock.after(changed)
            self.heartbeat.value = eng.heartbeat
            self._send([self._output(r) for r in changed])

    def _commands(self, data: bytes) -> None:
        from engine.core.messages import ABORT, ADD, SHUTDOWN, decode_commands

        eng, refused = self.eng, []
        cmds = decode_commands(data)
        if tracepoints.mark is not None:
            tracepoints.mark("core", len(cmds))
        for cmd in cmds:
            if cmd[0] == ADD:
                _, rid, ids, params, salt = cmd
                try:
                    req = eng.add_request(ids, params, request_id=rid, salt=salt)
                except Exception as e:  # validated by the front end: a bug or a race
                    refused.append(self.CoreOutput(rid, [], finish_reason="error",
                                                   error=f"{type(e).__name__}: {e}"))
                    continue
                # the front end's mirror starts with position 0's None too (add_request)
                self.cursors[req.request_id] = [0, 1 if req.wants_prompt_logprobs else 0]
            elif cmd[0] == ABORT:
                for rid in cmd[1]:
                    eng.abort(rid)
                    eng.pop_finished(rid)
                    self.cursors.pop(rid, None)
            elif cmd[0] == SHUTDOWN:
                self.stopping = True
        if tracepoints.mark is not None:
            tracepoints.mark("admitted", len(cmds))
        if refused:
            self._send(refused)

    def _output(self, req: Any) -> Any:
        rid = req.request_id
        cur = self.cursors.get(rid)
        if cur is None:  # not ours (cannot happen) or already reported finished
            return None
        toks = req.output_token_ids
        n0, p0 = cur
        lps = None
        if req.params.logprobs is not None:
            lps = [[(t, lp.logprob, lp.rank) for t, lp in d.items()] for d in req.logprobs[n0:]]
        plps = None
        if req.params.prompt_logprobs is not None and len(req.prompt_logprobs) > p0:
            plps = [None if d is None else [(t, lp.logprob, lp.rank) for t, lp in d.items()]
                    for d in req.prompt_logprobs[p0:]]
            cur[1] = len(req.prompt_logprobs)
        cur[0] = len(toks)
        fin = req.finish_reason.value if req.is_finished else None
        if req.is_finished:
            self.eng.pop_finished(rid)
            del self.cursors[rid]
        m = req.metrics
        spec = (int(m["spec_draft_tokens"]), int(m["spec_accepted_tokens"])) \
            if "spec_draft_tokens" in m else None
        return self.CoreOutput(rid, toks[n0:], lps, plps, fin, req.stop_reason, req.error,
                               req.num_cached_tokens, req.cumulative_logprob,
                               m.get("scheduled") if n0 == 0 else None, spec)

    def _send(self, outs: list[Any]) -> None:
        now = time.monotonic()
        gauges = None
        if now - self.gauges_at >= GAUGE_INTERVAL_S:
            self.gauges_at = now
            gauges = self.eng.gauges()
        elif not outs:
            return
        outs = [o for o in outs if o is not None]
        if not outs and gauges is None:
            return
        self.push.send(self.encode(self.CoreStep(outs, self.eng.heartbeat, gauges)),
                       copy=False)
