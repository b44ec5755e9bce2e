"""LLMEngine: requests in, one step at a time: schedule -> execute -> process outputs.

The embedded API (``engine.api.LLM``) and the server both drive this class. A failing step fails
only the requests in it (finish_reason ``"error"``, pages freed); the engine keeps serving.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.executor.base import Executor, ExecutorError
from engine.kv import BlockManager
from engine.model.loader import load_checkpoint
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import FinishReason, Logprob, LogprobDict, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, StepPlan, prepare
from engine.step import Logprobs
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestError(ValueError):
    """A request the engine refuses (too long, empty, bad token ids, no tokenizer...)."""


def check_text(text: str, field: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (``"\\ud800"``, which JSON and Python
    strings allow) cannot reach the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{field} is not valid text: {e.reason} at character {e.start} "
                           f"({text[e.start]!r}); send valid Unicode (lone surrogates are "
                           "not)") from None


@dataclass
class StepStats:
    steps: int = 0
    eager_steps: int = 0
    graph_steps: int = 0
    failed_steps: int = 0
    tokens: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def resolve_model_dir(model: str) -> Path:
    if model:
        return Path(model)
    from engine.model.gguf_convert import default_model_dir

    return default_model_dir()


def resolve_backend(backend: str) -> str:
    if backend != "auto":
        return backend
    from engine.cuda.driver import gpu_available

    return "cuda" if gpu_available() is None else "numpy"


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        model_dir = resolve_model_dir(config.model)
        self.model_dir = model_dir
        mcfg = ModelConfig.from_pretrained(model_dir)
        self.model_config = mcfg
        self.backend = resolve_backend(config.backend)
        self.config = config.resolve(mcfg, self.backend)
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        eos = list(mcfg.eos_token_ids)
        if self.tokenizer is not None:
            eos += [t for t in self.tokenizer.eos_token_ids if t not in eos]
        self.eos_token_ids = tuple(eos)
        ckpt = load_checkpoint(model_dir, mcfg)
        self.executor, num_pages = self._make_executor(ckpt)
        try:
            self.block_manager = BlockManager(
                num_pages, self.config.block_size,
                enable_prefix_caching=self.config.enable_prefix_caching,
                duplicate_policy=self.config.duplicate_policy, reserve_padding_page=True)
            self.config.check_kv_capacity(self.block_manager.num_pages)
        except Exception:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(self.config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self._rng = np.random.default_rng(self.config.seed)
        self._ids = itertools.count()
        self._arrival = itertools.count()
        self.stats = StepStats()
        # test-only hook: called with the plan before each step runs; raising fails the step
        self.fault_hook: Callable[[StepPlan], None] | None = None

    def _make_executor(self, ckpt) -> tuple[Executor, int]:
        cfg = self.config
        if self.backend == "numpy":
            from engine.executor.numpy_executor import NumpyExecutor

            n = cfg.num_gpu_blocks_override
            if n is None:
                per_page = NumpyExecutor.bytes_per_page(ckpt, cfg.block_size)
                fit = max(1, (1 << 30) // per_page)  # at most ~1 GiB of float32 KV
                want = cfg.max_num_seqs * cfg.max_pages_per_seq + 1
                n = max(min(cfg.cpu_kv_pages, want, fit), min(cfg.max_pages_per_seq + 1, fit), 2)
            return NumpyExecutor(ckpt, n, cfg.block_size), n
        if self.backend == "cuda":
            from engine.executor.cuda_executor import CudaExecutor

            ex = CudaExecutor(ckpt, cfg)
            return ex, ex.num_pages
        raise ConfigError(f"backend {self.backend!r}: use 'numpy', 'cuda' or 'auto'")

    # -- requests --------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.model_dir} has no tokenizer.json: pass token ids "
                                   "instead of a string prompt")
            check_text(prompt, "prompt")
            return self.tokenizer.encode(prompt), prompt
        ids = list(prompt)
        if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
            raise RequestError("prompt must be a string or a list of integer token ids")
        return [int(t) for t in ids], None

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, salt: str | None = None) -> Request:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"sampling_params must be SamplingParams, got "
                               f"{type(params).__name__}")
        ids, text = self.encode_prompt(prompt)
        vocab = self.model_config.vocab_size
        mml = self.config.max_model_len
        if not ids:
            raise RequestError("prompt is empty: it must have at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab})")
        if len(ids) >= mml:
            raise RequestError(f"prompt has {len(ids)} tokens, but max_model_len is {mml} "
                               f"(it must leave room for at least one generated token); "
                               f"shorten the prompt or raise max_model_len")
        # the whole request (prompt + its output budget) must fit the pool alone, or it would
        # be accepted and fail part-way
        total = len(ids) + min(params.max_tokens or mml, mml - len(ids))
        need = -(-total // self.config.block_size)
        if need > self.block_manager.num_pages:
            raise RequestError(f"the prompt ({len(ids)} tokens) and max_tokens need {need} KV "
                               f"pages but the cache has {self.block_manager.num_pages}; lower "
                               "max_tokens or shorten the prompt")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request_id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        req = Request(rid, ids, params, seed, next(self._arrival), prompt=text, salt=salt,
                      eos_token_ids=self.eos_token_ids, max_model_len=mml)
        req.metrics["arrival"] = time.perf_counter()
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs.append(None)
        self.requests[rid] = req
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def pop_finished(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
        return req

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one step. Returns the requests whose state changed (new tokens or finished)."""
        sched = self.scheduler
        plan = sched.schedule()
        if not plan.seqs:
            if sched.waiting and not sched.running:
                # The head request cannot fit the KV cache even alone: refuse it, don't spin.
                req = sched.waiting[0]
                sched.finish(req, FinishReason.ERROR, error=(
                    f"request needs more KV pages than the cache holds "
                    f"({self.block_manager.num_pages} pages of {self.config.block_size})"))
                return [req]
            return []
        try:
            if self.fault_hook is not None:
                self.fault_hook(plan)
            # the by-reference page total of the step must fit the page-index buffer
            self.block_manager.check_step_refs([s.request.request_id for s in plan.seqs],
                                               self.config.max_num_seqs,
                                               self.config.max_model_len)
            batch = prepare(plan, sched)
            out = self.executor.execute(batch)
        except Exception as e:  # fail this step's requests only; keep serving
            return self._fail_step(plan, e)
        sched.commit(plan)
        self.stats.steps += 1
        self.stats.tokens += plan.num_tokens
        if out.graph:
            self.stats.graph_steps += 1
        else:
            self.stats.eager_steps += 1
        changed: list[Request] = []
        row = 0
        pl_row = 0
        for s in plan.seqs:
            req = s.request
            n_pl = len(s.prompt_logprob_positions) if out.prompt_logprobs is not None else 0
            try:
                for i, p in enumerate(s.prompt_logprob_positions[:n_pl]):
                    req.prompt_logprobs.append(self._logprob_dict(
                        out.prompt_logprobs, pl_row + i, req.prompt_token_ids[p + 1],
                        req.params.prompt_logprobs or 0))
                if s.sample:
                    tok = int(out.sampled[row])
                    lp = None
                    if req.params.logprobs is not None and out.logprobs is not None:
                        lp = self._logprob_dict(out.logprobs, row, tok, req.params.logprobs)
                    self._append_token(req, tok, lp)
            except Exception as e:  # this request's output could not be processed: fail it alone
                self.scheduler.finish(req, FinishReason.ERROR,
                                      error=f"processing the output failed: "
                                      f"{type(e).__name__}: {e}")
                changed.append(req)
            else:
                if s.sample:
                    changed.append(req)
            pl_row += n_pl
            row += int(s.sample)
        return changed

    def _fail_step(self, plan: StepPlan, exc: Exception) -> list[Request]:
        self.stats.failed_steps += 1
        rows = getattr(exc, "rows", None) if isinstance(exc, ExecutorError) else None
        failed = [s.request for i, s in enumerate(plan.seqs) if rows is None or i in rows]
        self.scheduler.abandon(plan, failed)
        msg = f"{type(exc).__name__}: {exc}"
        for req in failed:
            self.scheduler.finish(req, FinishReason.ERROR, error=msg)
        return failed

    def _logprob_dict(self, lp: Logprobs, row: int, token: int, n: int) -> LogprobDict:
        dec = self._decode_one
        d: LogprobDict = {token: Logprob(float(lp.token_logprob[row]), int(lp.token_rank[row]),
                                         dec(token))}
        for j in range(min(n, lp.top_ids.shape[1])):
            t = int(lp.top_ids[row, j])
            if t not in d:
                d[t] = Logprob(float(lp.top_logprobs[row, j]), j + 1, dec(t))
        return d

    def _decode_one(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], False)

    def _append_token(self, req: Request, tok: int, lp: LogprobDict | None) -> None:
        params = req.params
        req.output_token_ids.append(tok)
        now = time.perf_counter()
        req.metrics.setdefault("first_token", now)
        req.metrics["last_token"] = now
        if lp is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp[tok].logprob
        if req.detok is not None:
            delta = req.detok.step(tok)
            req.text += delta
            if params.stop_strs and delta:
                if self._check_stop_strings(req, len(delta)):
                    return
        if tok in params.stop_token_ids:
            self._finish_text(req)
            self.scheduler.finish(req, FinishReason.STOP, stop_reason=tok)
        elif not params.ignore_eos and tok in req.eos_token_ids:
            self._finish_text(req)
            self.scheduler.finish(req, FinishReason.STOP)
        elif len(req.output_token_ids) >= req.max_output_tokens:
            self._finish_text(req)
            self.scheduler.finish(req, FinishReason.LENGTH)

    def _finish_text(self, req: Request) -> None:
        if req.detok is not None:
            req.text += req.detok.finish()
            if req.params.stop_strs:
                self._check_stop_strings(req, len(req.text), finish=False)

    def _check_stop_strings(self, req: Request, new_chars: int, finish: bool = True) -> bool:
        """vLLM's rule: a stop string may straddle tokens; search the tail that could hold one
        ending in the new text. Truncate before it (or after it with include_stop_str_in_output).
        """
        text = req.text
        for s in req.params.stop_strs:
            start = max(0, len(text) - new_chars - len(s) + 1)
            i = text.find(s, start)
            if i >= 0:
                end = i + len(s) if req.params.include_stop_str_in_output else i
                req.text = text[:end]
                if finish:
                    self.scheduler.finish(req, FinishReason.STOP, stop_reason=s)
                else:
                    req.stop_reason = s
                return True
        return False

    # -- outputs ---------------------------------------------------------------------------------
    def visible_text(self, req: Request) -> str:
        """Text safe to show now: while running, hold back what could start a stop string."""
        if req.is_finished or not req.params.stop_strs or req.params.include_stop_str_in_output:
            return req.text
        hold = max(len(s) for s in req.params.stop_strs) - 1
        return req.text[:max(0, len(req.text) - hold)]

    def output(self, req: Request) -> RequestOutput:
        comp = CompletionOutput(
            index=0, text=self.visible_text(req), token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None
            else None,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason, error=req.error)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=list(req.prompt_logprobs) if req.wants_prompt_logprobs else None,
            outputs=[comp], finished=req.is_finished, num_cached_tokens=req.num_cached_tokens,
            metrics=dict(req.metrics))

    def status_counts(self) -> dict[str, int]:
        sched = self.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting),
                "preempted": sum(1 for r in sched.waiting
                                 if r.status == RequestStatus.PREEMPTED)}
