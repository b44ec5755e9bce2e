"""LLMEngine: requests in, one step at a time: schedule -> execute -> update -> process outputs.

    out = scheduler.schedule()                            # SchedulerOutput
    step = executor.execute(build_batch(out))             # StepOutput
    changed = scheduler.update_from_output(out, step)     # tokens appended, EOS/length
    output_processor.process(changed)                     # text, stop strings

The embedded API (``engine.api.LLM``) and the server both drive this class. A failing step fails
only the requests in it (finish_reason ``"error"``, pages freed); the engine keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine import envs
from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.executor.base import ExecutorError
from engine.executor.registry import create_executor
from engine.input_processor import InputProcessor, RequestError, check_text
from engine.kv import BlockManager
from engine.logits_processors import EarlyMasks, LogitsProcessorState, ProcessorError
from engine.model.loader import load_checkpoint
from engine.output_processor import OutputProcessor
from engine.outputs import RequestDelta, RequestOutput
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculative import build_dflash_proposer
from engine.step import StepOutput, build_batch
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestError", "check_text"]


@dataclass
class StepStats:
    steps: int = 0
    eager_steps: int = 0
    graph_steps: int = 0
    failed_steps: int = 0
    tokens: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def _failure(e: Exception) -> tuple[set[int] | None, str]:
    """A step's failure: the rows an ExecutorError names (None: every request), the message."""
    rows = getattr(e, "rows", None) if isinstance(e, ExecutorError) else None
    return rows, f"{type(e).__name__}: {e}"


def _no(_handle: Any) -> bool:
    return False


def _src_rows(prev: SchedulerOutput, nxt: SchedulerOutput) -> np.ndarray:
    """Per token of ``nxt``: the sample row of ``prev`` that is its input (a request ``prev``
    samples for: its one-token row), or -1 (the token is on the host)."""
    row: dict[int, int] = {}
    for s in prev.seqs:
        if s.sample:
            row[id(s.request)] = len(row)
    src: list[int] = []
    for s in nxt.seqs:
        r = row.get(id(s.request), -1) if s.num_new == 1 else -1
        if r >= 0 and s.start < s.request.num_tokens:  # (its input token is known)
            r = -1
        if s.num_new == 1:
            src.append(r)
        else:
            src += [-1] * s.num_new
    return np.array(src, np.int64)


@dataclass
class _Gate:
    """A gated step's gate (engine/structured/remote.py): the worker, the step's sequence number
    and the worker keys of its grammar rows. ``launch_gated`` reads ``region`` (host address,
    bytes, the rows' address, the flag's address), ``seq`` and ``rows``."""

    worker: Any
    seq: int
    keys: list[int]

    @property
    def region(self) -> tuple[int, int, int, int]:
        return self.worker.gate_region

    @property
    def rows(self) -> int:
        return len(self.keys)


class _GatedRows:
    """``build_batch``'s processors for a gated step: rows without masks."""

    def __init__(self, procs: LogitsProcessorState) -> None:
        self.procs = procs
        self.active = procs.active

    def prepare(self, sample_reqs: Sequence[Request]) -> Any:
        return self.procs.prepare(sample_reqs, masks=False)


@dataclass
class _Later:
    """A deferred step in flight: its forward launched (``handle``), its processor rows built
    (``procs``, grammar masks maybe still computing) or the error that building them raised;
    ``launch_procs`` still to call."""

    handle: Any
    procs: Any
    error: Exception | None


def resolve_model_dir(model: str) -> Path:
    """--model -> checkpoint directory: a directory, a .gguf file, a hub id or the default."""
    from engine.model.hub import resolve_model

    return resolve_model(model)


def new_request(eng: Any, prompt: str | Sequence[int],
                params: SamplingParams | None, request_id: str | None, salt: str | None,
                seed: Callable[[SamplingParams], int]) -> Request:
    """A checked ``Request`` for ``eng`` (an LLMEngine, or the two-process engine's front end):
    the input processor's ids and params, a free request id, arrival order and time; not yet
    registered anywhere. ``seed``: the request's effective seed from its params."""
    ids, text, params = eng.input_processor.process(prompt, params)
    rid = request_id if request_id is not None else f"req-{next(eng._ids)}"
    if rid in eng.requests:
        raise RequestError(f"request_id {rid!r} is already in use")
    req = Request(rid, ids, params, seed(params), next(eng._arrival), prompt=text, salt=salt,
                  eos_token_ids=eng.eos_token_ids, max_model_len=eng.config.max_model_len)
    req.metrics["arrival"] = time.perf_counter()
    if params.prompt_logprobs is not None:
        req.prompt_logprobs.append(None)
    return req


class OutputViews:
    """The renderings of a request, from the engine's output processor, and the request table's
    clean-up (shared by LLMEngine and the two-process engine's front end,
    engine.core.client.MultiprocessEngine)."""

    output_processor: OutputProcessor
    requests: dict[str, Request]

    def pop_finished(self, request_id: str) -> Request | None:
        """Forget a finished request (None if unknown); an unfinished one stays."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
            self.output_processor.remove(request_id)
        return req

    def visible_text(self, req: Request) -> str:
        return self.output_processor.visible_text(req)

    def output(self, req: Request) -> RequestOutput:
        return self.output_processor.output(req)

    def delta(self, req: Request) -> RequestDelta:
        """What ``req`` added since the last call (its consumer's cursor)."""
        return self.output_processor.delta(req)


class LLMEngine(OutputViews):
    def __init__(self, args: EngineArgs, process_outputs: bool = True) -> None:
        """``process_outputs=False``: the engine core process (engine/core), whose front end
        detokenizes and finds stop strings itself: no text here."""
        self.model_dir = model_dir = resolve_model_dir(args.model)
        self.model_config = mcfg = ModelConfig.from_pretrained(model_dir)
        # checked and resolved once: cfg.backend is "numpy" or "cuda", max_model_len an int
        self.config = cfg = args.create_engine_config(mcfg)
        self.backend = cfg.backend
        # the tokenizer (~0.6 s for Qwen3's) loads while the executor compiles and uploads
        with ThreadPoolExecutor(1, thread_name_prefix="cuteinfer-tokenizer") as pool:
            tok = pool.submit(Tokenizer.from_pretrained, model_dir)
            self.executor, num_pages = create_executor(
                cfg.backend, load_checkpoint(model_dir, mcfg), cfg)
            try:
                self.tokenizer = tok.result()
            except BaseException:
                self.executor.shutdown()
                raise
        eos = list(mcfg.eos_token_ids)
        if self.tokenizer is not None:
            eos += [t for t in self.tokenizer.eos_token_ids if t not in eos]
        self.eos_token_ids = tuple(eos)
        try:
            self.block_manager = BlockManager(
                num_pages, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching,
                duplicate_policy=cfg.duplicate_policy, reserve_padding_page=True)
            cfg.check_kv_capacity(self.block_manager.num_pages)
        except Exception:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(cfg, self.block_manager, mcfg.kv_per_weight)
        self.scheduler.spec_alone = not self.executor.batch_invariant
        spec = cfg.speculative_config
        if spec is not None and spec.method == "dflash":  # the drafter behind the proposer seam
            try:
                self.scheduler.proposer = build_dflash_proposer(
                    spec, mcfg, self.executor, self.block_manager, cfg.max_model_len)
            except Exception:
                self.executor.shutdown()
                raise
        self.input_processor = InputProcessor(self.tokenizer, mcfg.vocab_size, cfg.max_model_len,
                                              cfg.block_size, self.block_manager.num_pages,
                                              str(model_dir),
                                              mcfg.sampling_defaults(cfg.generation_config))
        self.process_outputs = process_outputs
        self.output_processor = OutputProcessor(self.tokenizer if process_outputs else None,
                                                self.scheduler.finish)
        # logits processors and structured output (engine/logits_processors.py)
        self.processors = LogitsProcessorState(self.tokenizer, mcfg.vocab_size,
                                               self.eos_token_ids, cfg.max_num_seqs)
        self.requests: dict[str, Request] = {}
        self._rng = np.random.default_rng(cfg.seed)
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self.stats = StepStats()
        # test-only hook: called with the step's SchedulerOutput before it runs; raising fails it
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        # async scheduling: the step in flight (SchedulerOutput, handle, failure), completed by
        # the next step() call
        self.async_scheduling = bool(cfg.async_scheduling)
        self._pending: tuple[SchedulerOutput, Any, Any] | None = None
        # a step planned ahead that the executor would run at once: the next call runs it
        # (after the step before it was completed and its outputs went out)
        self._after: tuple[SchedulerOutput, Any, np.ndarray] | None = None
        self._mask_pool: ThreadPoolExecutor | None = None  # grammar masks of deferred steps
        self._gate_on = envs.grammar_gate()
        self._gate: _Gate | None = None  # a gated step's gate until a job will open it
        self._gate_job: Any = None  # the job that opens the gate of the gated step in flight
        trace = envs.step_trace_path()  # one line per step (CUTEINFER_STEP_TRACE), or None
        self._trace = None if trace is None else open(trace, "a", buffering=1 << 16)  # noqa: SIM115
        self._marks: list[float] = []

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, salt: str | None = None) -> Request:
        req = new_request(self, prompt, params, request_id, salt, lambda p: (
            p.seed if p.seed is not None else int(self._rng.integers(2**63))))
        try:
            self.processors.attach(req)
        except ProcessorError as e:
            raise RequestError(str(e)) from None
        self.requests[req.request_id] = req
        self.output_processor.add(req)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT)

    @property
    def heartbeat(self) -> int:
        """Grows while the engine makes progress: every step, and every layer of a numpy
        forward (a legitimate long prefill keeps it moving; a hung step does not)."""
        return self.stats.steps + self.stats.failed_steps + self.executor.heartbeat

    @property
    def num_pages(self) -> int:
        return self.block_manager.num_pages

    def has_unfinished(self) -> bool:
        return (self._pending is not None or self._after is not None
                or self.scheduler.has_work())

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step. Returns the requests whose state changed (new tokens or finished)."""
        if self._trace is None:
            return self._step()
        t0 = time.perf_counter()
        self._marks = []
        changed = self._step()
        st = self.stats
        marks = self._marks + [0.0] * (3 - len(self._marks))
        self._trace.write(f"{t0:.6f} {time.perf_counter():.6f} {st.steps} {st.tokens} "
                          f"{st.graph_steps} {len(self.scheduler.running)} "
                          f"{len(self.scheduler.waiting)} {marks[0]:.6f} {marks[1]:.6f} "
                          f"{marks[2]:.6f}\n")
        return changed

    def _mark(self) -> None:
        """Step trace: the time a phase of the step ended (scheduled, batch built, executed)."""
        if self._trace is not None:
            self._marks.append(time.perf_counter())

    def _step(self) -> list[Request]:
        if self._pending is not None:
            return self._step_pipelined()
        if self._after is not None:
            nxt, batch, src = self._after
            self._after = None
            return self._complete(nxt, *self._start(batch, src))
        out = self.scheduler.schedule()
        self._mark()
        if not out.seqs:
            return list(out.refused)
        handle, failure = self._launch(out)
        if (self.async_scheduling and failure is None and hasattr(self.executor, "launch")
                and (all(s.num_new == 1 and s.sample for s in out.seqs)
                     or getattr(self.executor, "in_flight", _no)(handle))):
            # completed by the next step(), overlapped with the step after it; a step the
            # executor ran at once (cuda: eagerly; numpy: all) is completed now, unless it
            # decodes only (a step planned ahead, after this one, is always pipelined)
            self._pending = (out, handle, None)
            return list(out.refused)
        return self._complete(out, handle, failure)

    def _launch(self, out: SchedulerOutput, src_rows: np.ndarray | None = None
                ) -> tuple[Any, tuple[set[int] | None, str] | None]:
        """Build and launch a step: (handle, None), or (None, (rows, error)) when it cannot
        run (its requests, or those rows, fail; the engine serves on)."""
        batch, failure = self._build(out)
        return (None, failure) if failure is not None else self._start(batch, src_rows)

    def _build(self, out: SchedulerOutput, deferred: bool = False, gated: bool = False
               ) -> tuple[Any, tuple[set[int] | None, str] | None]:
        """(the step's StepBatch, None) or (None, failure). ``deferred``: without its logits
        processors (they come later: ``_Later``); ``gated``: with them, their grammar masks
        to come (``_start_gated``)."""
        if out.error is not None:
            return None, (None, out.error)
        try:
            if self.fault_hook is not None:
                self.fault_hook(out)
            batch = build_batch(out, None if deferred else (
                _GatedRows(self.processors) if gated else self.processors))
            self._mark()
            return batch, None
        except Exception as e:  # fail this step's requests (or rows) only; keep serving
            return None, _failure(e)

    def _start(self, batch: Any, src_rows: np.ndarray | None = None, deferred: bool = False
               ) -> tuple[Any, tuple[set[int] | None, str] | None]:
        try:
            launch = getattr(self.executor, "launch", None)  # (a duck-typed executor: execute)
            if deferred:
                handle = self.executor.launch_deferred(batch, src_rows)
            elif launch is None:
                handle = self.executor.execute(batch)
            else:
                handle = launch(batch, src_rows)
            self._mark()
            return handle, None
        except Exception as e:  # fail this step's requests (or rows) only; keep serving
            return None, _failure(e)

    def _finish(self, handle: Any, failure: tuple[set[int] | None, str] | None
                ) -> tuple[StepOutput | None, tuple[set[int] | None, str] | None]:
        if failure is not None:
            return None, failure
        try:
            finish = getattr(self.executor, "finish", None)
            return (handle if finish is None else finish(handle)), None
        except Exception as e:
            return None, (None, f"{type(e).__name__}: {e}")

    def _step_pipelined(self) -> list[Request]:
        """Async scheduling: plan and launch the step after the one in flight (the input
        tokens of its decode rows come from that step's samples on the device), then complete
        the one in flight while the GPU runs the next. Steps with prompt tokens (admissions,
        chunks: ``Scheduler._plan_ahead``) are planned ahead too, and launched ahead where the
        executor leaves them running (cuda: a mixed-step graph); one it would run at once
        (an eager prefill) runs in the next call, after the one in flight is complete. A step
        that cannot be planned ahead (preemption, speculation, logprobs, a failure) ends the
        pipeline: the next call plans normally.

        Steps with logits processors pipeline too (``_Later``): their rows (grammar masks, bad
        words, min_tokens) depend on the tokens of the step before, so step N+1's forward is
        launched first (``launch_deferred``), its rows are built once N is complete and its
        grammar masks computed on a worker thread while this thread processes N's outputs and
        plans N+2; the next call joins them and launches N+1's sampling (``launch_procs``),
        N+2's forward queued right behind it (``launch_deferred`` before ``launch_procs``: the
        executor stages it first and starts it right after N+1's tail)."""
        assert self._pending is not None
        out, handle, failure = self._pending
        self._pending = None
        defer = hasattr(self.executor, "launch_procs")
        nxt = (self.scheduler.schedule_continuation(out, procs=defer) if failure is None
               else None)
        self._mark()
        deferred, gated, batch, bad = False, False, None, None
        if nxt is not None:
            # only rows that depend on out's tokens wait for them (grammar masks, bad words,
            # min_tokens); penalties, logit_bias and allowed ids ride the whole decode graph
            deferred = self.processors.active and any(
                s.request.procs is not None and not s.request.procs.known_ahead()
                for s in nxt.seqs)
            # grammar masks alone: launched whole, the device waiting for them (gated)
            gated = deferred and self._gateable(nxt)
            batch, bad = self._build(nxt, deferred and not gated, gated)
        launched = None
        after = False  # nxt runs once out is complete (it cannot be launched behind it)
        if nxt is not None:
            src = _src_rows(out, nxt)
            if bad is None and not self._launches_async(batch):
                after, launched = True, (None, None)
            elif bad is not None:
                launched = (None, bad)
            elif deferred and not gated and isinstance(handle, _Later):
                # before out's sampling: the executor stages the next forward and starts it
                # right behind out's tail (``launch_procs``), not after this host's work
                launched = self._start(batch, src, deferred)
        if isinstance(handle, _Later):  # out's rows are ready (its masks maybe still computing)
            handle, failure = self._launch_procs(handle)
            if failure is not None and nxt is not None:
                if launched is not None:
                    self._finish(*launched)  # (queued behind out's tail: never runs)
                self.scheduler.fail_step(nxt, set(), "the step before it failed")
                nxt = None
        if nxt is not None and launched is None:
            if gated and self.executor.can_gate(batch):
                launched = self._start_gated(batch, src)
            if launched is None:
                if gated:  # (no heads / tail graphs yet, or the gated launch failed): deferred
                    gated, batch.procs = False, None
                launched = self._start(batch, src, deferred)
        if self._gate_job is not None:
            # out was launched gated: its masks must be written (or its gate opened, should
            # the worker have died meanwhile) before this thread waits for it
            self._gate_job.exception()
            self._gate_job = None
        step, failure = self._finish(handle, failure)
        if failure is not None and nxt is not None:
            # the next step's inputs are not valid: discard it, give its slots back first
            self._open_gate()
            if not after:
                self._finish(*launched)
            self.scheduler.fail_step(nxt, set(), "the step before it failed")
            nxt = None
        later: list[_Later] = []
        then = early = None
        if nxt is not None and gated and launched[1] is None:
            # out's matchers advance and nxt's masks compute in the worker, which then opens
            # the gate the device waits on
            early = self._start_early(out, step, nxt, self._gate)
            if early is not None and early.job is not None and early.job.gate:
                self._gate = None  # (the job opens it, or fails and opens it)
                self._gate_job = early.job
        elif nxt is not None and deferred and launched[1] is None:
            # nxt's grammar masks start now, from out's samples, and compute while out's
            # outputs are committed (the commit's finishes are applied to the matchers after it)
            early = self._start_early(out, step, nxt)

            def then() -> None:  # after out's tokens advanced the matchers, before its outputs
                later.append(self._prepare_later(nxt, launched[0], early))
        self._open_gate()  # (a gated step whose job was not sent runs unmasked: never waits)
        changed = self._complete(out, step, failure, finished=True, then=then, early=early)
        if after and nxt is not None:
            # a step the executor would run now, before out's outputs: the next call runs it,
            # once they went out (its input tokens are out's samples, on the host by then)
            self._after = (nxt, batch, src)
        elif nxt is not None:
            if later:
                launched = (later[0], None)
            self._pending = (nxt, *launched)
        return changed

    def _launches_async(self, batch: Any) -> bool:
        """Whether the executor leaves ``batch`` running (async scheduling): a step it would
        run at once is launched after the step in flight is complete. Plain decode steps are
        always launched ahead (they replay a graph but for a bucket still to capture)."""
        if batch.is_decode:
            return True
        f = getattr(self.executor, "launches_async", None)
        return True if f is None else f(batch)

    def _mask_submit(self) -> Callable[[Callable[[], None]], Any]:
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="cuteinfer-masks")
        return self._mask_pool.submit

    def _start_early(self, done: SchedulerOutput, step: StepOutput | None,
                     nxt: SchedulerOutput, gate: _Gate | None = None) -> EarlyMasks | None:
        """``start_early``: ``done``'s matchers advanced and ``nxt``'s masks started before
        ``done``'s outputs are committed. None (the usual path in ``_complete``) when ``done``
        failed. ``gate``: nxt was launched gated (``_start_gated``)."""
        if step is None or step.sampled.shape[0] < len(done.seqs):
            return None
        return self.processors.start_early(
            done, step.sampled, [s.request for s in nxt.seqs], self._mask_submit(),
            None if gate is None else (gate.seq, gate.keys))

    # -- gated steps (CUTEINFER_GRAMMAR_GATE) ------------------------------------------------
    def _gateable(self, nxt: SchedulerOutput) -> bool:
        """Whether ``nxt`` can be launched gated: the grammar worker runs, the executor can
        wait for its masks on the device, and every row that is not known ahead has only its
        grammar mask late."""
        p = self.processors
        if not (self._gate_on and p.remote and p.worker is not None and p.worker.dead is None
                and hasattr(self.executor, "launch_gated")):
            return False
        return all(s.request.procs is None or s.request.procs.gated_ahead() for s in nxt.seqs)

    def _start_gated(self, batch: Any, src_rows: np.ndarray
                     ) -> tuple[Any, tuple[set[int] | None, str] | None] | None:
        """Launch a gated step (``launch_gated``): its gate stays in ``self._gate`` until a job
        that opens it is sent (``_open_gate`` otherwise). None when the gated launch failed
        (e.g. the device would not map the worker's memory): the step is then launched
        deferred, as every later one (no request fails for it)."""
        w = self.processors.worker
        self._gate = gate = _Gate(w, w.next_gate(), batch.procs.grammar_keys or [])
        try:
            handle = self.executor.launch_gated(batch, src_rows, gate)
            self._mark()
            return handle, None
        except Exception as e:  # noqa: BLE001
            self._open_gate()
            self._gate_on = False
            log.warning("gated launch failed (%s: %s); steps with grammar rows are launched "
                        "deferred from now on", type(e).__name__, e)
            return None

    def _open_gate(self) -> None:
        """Release a gated step no job will release: its grammar rows run unmasked (their
        requests' advance then judges the tokens)."""
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.worker.open_gate(gate.seq, gate.rows)

    def _prepare_later(self, out: SchedulerOutput, handle: Any,
                       early: EarlyMasks | None = None) -> _Later:
        """A deferred step's logits processor rows, now that the step before it is complete (a
        request that step finished samples unconstrained here; its row is dropped); its grammar
        masks start on the mask thread (or started there already: ``early``)."""
        try:
            procs = self.processors.prepare([s.request for s in out.seqs], early)
        except Exception as e:  # noqa: BLE001 -- fails this step (``_launch_procs``)
            return _Later(handle, None, e)
        if procs is not None and procs.fill is not None:
            procs.fill_async(self._mask_submit())
        return _Later(handle, procs, None)

    def _launch_procs(self, later: _Later) -> tuple[Any, tuple[set[int] | None, str] | None]:
        """Launch a deferred step's sampling with its processor rows (``launch_procs``)."""
        try:
            if later.error is not None:
                raise later.error
            return self.executor.launch_procs(later.handle, later.procs), None
        except Exception as e:  # fail this step's requests (or rows) only; keep serving
            if later.procs is not None:
                later.procs.fill_masks(wait_only=True)
            self._finish(later.handle, None)
            return None, _failure(e)

    def _complete(self, out: SchedulerOutput, handle: Any,
                  failure: tuple[set[int] | None, str] | None,
                  finished: bool = False, then: Callable[[], None] | None = None,
                  early: EarlyMasks | None = None) -> list[Request]:
        """Wait for a launched step (``finished``: ``handle`` is its output already) and
        commit its results: tokens, finishes, outputs; or fail it. ``then``: called once the
        tokens are committed and the matchers advanced, before the outputs are processed.
        ``early``: the matchers were advanced already (``_start_early``)."""
        step = handle
        if not finished:
            step, failure = self._finish(handle, failure)
        if failure is not None:
            rows, error = failure
            self.stats.failed_steps += 1
            self.processors.step_failed(out)  # device slot state is rebuilt on next use
            return self.scheduler.fail_step(out, rows, error)
        assert step is not None
        self.stats.steps += 1
        self.stats.tokens += out.num_tokens
        self.stats.graph_steps += int(step.graph)
        self.stats.eager_steps += int(not step.graph)
        changed = self.scheduler.update_from_output(out, step)
        self.processors.after_step(out, self.scheduler.finish, FinishReason.STOP,
                                   FinishReason.ERROR, early)  # matchers take the tokens
        if then is not None:
            then()
        if self.process_outputs:
            self.output_processor.process(changed)
        return changed

    def gauges(self) -> dict:
        """The scheduler, KV and step counters the server's metrics read."""
        sched, st = self.scheduler, self.stats
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "num_preemptions": sched.num_preemptions, "kv": self.block_manager.gauges(),
                "kv_stats": self.block_manager.stats(), "steps": st.steps,
                "eager_steps": st.eager_steps, "graph_steps": st.graph_steps,
                "failed_steps": st.failed_steps, "tokens": st.tokens,
                "spec": {"draft_tokens": sched.spec_totals[0],
                         "accepted_tokens": sched.spec_totals[1], "drafts": sched.spec_totals[2],
                         "accepted_per_draft": list(sched.spec_accepted_hist)}}
