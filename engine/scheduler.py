"""Continuous batching with chunked prefill, admission against real KV accounting, preemption.

Each step: running requests first (a decode token each, or the next chunk of an unfinished
prefill), then waiting ones in FIFO order (preempted requests go back to the front) while the
token budget, ``max_num_seqs`` and the block manager's ``free + inactive`` pages allow. When a
running request cannot get its next page, the most recently admitted running request is
preempted (pages released; it is recomputed later, prefix cache permitting, and under greedy it
produces the same tokens).

A step is three calls (``LLMEngine.step``)::

    out = scheduler.schedule()                      # -> SchedulerOutput (frozen)
    step_out = executor.execute(build_batch(out))   # -> StepOutput
    changed = scheduler.update_from_output(out, step_out)

``update_from_output`` commits the step's KV, appends the sampled tokens (and logprobs) to their
requests and finishes them on EOS, a stop token or length. A step that failed is handed back with
``fail_step`` instead: only its requests (or only the failed rows) finish with an error. The
scheduler owns the block manager: nothing else calls it. The manager keeps pages, hashes and
refcounts only; each ``Request`` owns its token ids and ``num_computed_tokens``, and the
scheduler passes them to the calls that need them (``commit``, ``rollback``).

The decode path is per-request Python run 64-256 times a step, so it is kept lean: no per-token
numpy scalars, one clock read per step, no page work for a token that stays inside its last
page (``BlockManager.append_slots`` / ``commit``), sampling rows and page tables stored packed
for ``build_batch`` (``python -m tools.bench_host`` measures it).
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine import envs
from engine.config import EngineConfig
from engine.kv import BlockManager, OutOfPagesError, PageRefOverflowError
from engine.request import FinishReason, Logprob, LogprobDict, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.speculative import (
    MIN_ACCEPTANCE,
    PROBATION_STEPS,
    DeviceDrafts,
    SpeculativeConfig,
    accept,
    eligible,
    ngram_propose,
)
from engine.step import Logprobs, StepOutput


@dataclass(slots=True)
class ScheduledRequest:  # one per request per step: a plain record (frozen costs on the hot path)
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_new: int
    slots: list[int]
    sample: bool  # this step computes the last known token: sample the next one
    page_table: array[int]  # the block manager's table itself (int32), read by build_batch
    prompt_logprob_positions: tuple[int, ...] = ()
    # speculative drafts after the pending token (engine/speculative.py): the step computes
    # [pending, *drafts] and samples every one of those rows
    drafts: tuple[int, ...] = ()
    # >= 0: the drafts are left to the device (``DeviceDrafts``): this block of the step's
    # draft launch; ``drafts`` holds placeholders and the step's output carries the real ones
    draft_slot: int = -1
    # its KV was committed when the step after it was planned (``_plan_ahead``): its input
    # tokens were known then; ``update_from_output`` only advances the request
    committed: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """What one step computes. ``error`` is set when the step cannot run (its page references
    would not fit the page-index buffer): its requests then fail, the engine serves on."""

    seqs: tuple[ScheduledRequest, ...]
    preempted: tuple[Request, ...] = ()
    refused: tuple[Request, ...] = ()  # finished with an error: can never fit the KV cache
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum([s.num_new for s in self.seqs])


# mixed_step_tokens' lifts (Scheduler._prompt_budget says what each does; fitted in
# tools/sim_schedule.py, measured in docs/perf.md v35-v36): 48 prompt tokens a weight read of
# decode-row KV (~+30% of that read's time on an H100), where that gives at least 2 x T rows (a
# few tokens past the graphs' rows cost an eager step); lifted steps of 6 x T (768: qwen3-8b
# ~26 ms, under 4x its 64-row decode step); a burst is more than 4 waiting per decoding one; a
# prompt waits 20-40 steps; the early lift only while at most half the seats decode
MIXED_TOKENS_PER_READ = 48
MIXED_WAITING_X = 4
MIXED_WAIT_STEPS = 20
MIXED_LIFT = 6
MIXED_EARLY_X = 2
MIXED_KV_X = 2


def _not_one_token(s: ScheduledRequest) -> bool:
    return s.num_new != 1


class _NoRoom(Exception):
    """A step planned ahead would preempt (``_plan_ahead``): ``seqs`` hold slots to undo."""

    def __init__(self, seqs: list[ScheduledRequest]) -> None:
        self.seqs = seqs


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 kv_per_weight: float = 0.0) -> None:
        self.config = config
        self.bm = block_manager
        # ModelConfig.kv_per_weight (mixed_step_tokens' KV-read lift; 0: none)
        self.kv_per_weight = kv_per_weight
        # steps planned with a prompt budget (mixed_step_tokens' wait lift counts a prompt's
        # wait in them, not in seconds, so that an offline run schedules the same steps every
        # time); Request.sched_step is this count when the request was added
        self.budget_steps = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # requests whose step in flight samples their last token, released when the step
        # after it was planned (``_plan_ahead``); ``finish`` then has nothing to release
        self._released: set[str] = set()
        self.plan_ahead = envs.plan_ahead()  # steps with prompt tokens too (``_plan_ahead``)
        self.num_preemptions = 0
        self.spec = config.speculative_config  # engine.speculative.SpeculativeConfig or None
        self.clock: Callable[[], float] = time.perf_counter  # seconds (Request.metrics' clock)
        # speculate only in steps without prompt tokens (the engine: executors whose logits
        # depend on the step's composition, i.e. cuda)
        self.spec_alone = False
        # the proposer seam: (request, k) -> up to k draft tokens (tests set oracles here)
        self.proposer: Callable[[Request, int], list[int]] = self._ngram
        # speculative decoding: drafted, accepted, verify spans; spans by accepted count
        self.spec_totals = [0, 0, 0]
        self.spec_accepted_hist = [0] * ((self.spec.num_speculative_tokens + 1) if self.spec
                                         else 0)

    # -- queue management ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        req.sched_step = self.budget_steps
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        """Finish a request now; its pages return at once."""
        if req.is_finished:
            return
        if req.request_id in self._released:  # (by ``_plan_ahead``: its last token came now)
            self._released.discard(req.request_id)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.bm.release(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish(reason, stop_reason, error)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.release(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- scheduling ------------------------------------------------------------------------------
    def _prompt_logprob_positions(self, req: Request, start: int, n: int) -> tuple[int, ...]:
        if not req.wants_prompt_logprobs:
            return ()
        last = req.num_prompt_tokens - 1  # logits at the last prompt position sample a token
        have = len(req.prompt_logprobs)  # entries for positions 0 .. have-1 exist
        return tuple(p for p in range(start, min(start + n, last)) if p + 1 >= have)

    def schedule(self) -> SchedulerOutput:
        seqs, preempted = self._schedule()
        return self._output(seqs, preempted)

    def _output(self, seqs: list[ScheduledRequest], preempted: list[Request]) -> SchedulerOutput:
        if not seqs:
            if self.waiting and not self.running:
                # The head request cannot fit the KV cache even alone: refuse it, don't spin.
                req = self.waiting[0]
                self.finish(req, FinishReason.ERROR, error=(
                    f"request needs more KV pages than the cache holds "
                    f"({self.bm.num_pages} pages of {self.config.block_size})"))
                return SchedulerOutput((), tuple(preempted), refused=(req,))
            return SchedulerOutput((), tuple(preempted))
        if any(s.num_new != 1 for s in seqs):
            # one-token (decode) rows first: a mixed step's executor runs them through the
            # decode attention kernel and the rest through the prefill one (a stable sort)
            seqs.sort(key=_not_one_token)
        error = None
        try:  # the by-reference page total of the step must fit the page-index buffer
            self.bm.check_step_refs([s.request.request_id for s in seqs],
                                    self.config.max_num_seqs, self.config.max_model_len)
        except PageRefOverflowError as e:
            error = f"{type(e).__name__}: {e}"
        return SchedulerOutput(tuple(seqs), tuple(preempted), error=error)

    def schedule_continuation(self, prev: SchedulerOutput,
                              procs: bool = False) -> SchedulerOutput | None:
        """Async scheduling: the decode step after ``prev``, planned before ``prev``'s tokens
        are known. Each request of ``prev`` decodes one more token (its input: the token
        ``prev`` samples for it, taken on the device), so it must be a plain decode row that
        stays running whatever ``prev`` samples -- except for a stop token or EOS, found one
        step late (that request's extra row is dropped, ``update_from_output``). None when the
        next step is anything else (admissions, prefills, speculation, logprobs, logits
        processors unless ``procs`` -- the engine then gives the step its processors once
        ``prev`` is complete --, a pool that is full, a request that ``prev`` finishes by
        length while others wait for its seat): the engine then finishes ``prev`` and plans
        normally. So a workload whose requests end by length runs the steps synchronous
        scheduling runs, row for row (on cuda another step composition means other buckets,
        whose kernels round some rows differently)."""
        cfg, bm = self.config, self.bm
        if self.spec is not None and len(self.running) < self.spec.disable_by_batch_size:
            return None
        if ((self.waiting and len(self.running) < cfg.max_num_seqs)
                or len(prev.seqs) != len(self.running) or any(map(_not_one_token, prev.seqs))):
            return self._plan_ahead(prev)  # admissions, prompt chunks
        seqs: list[ScheduledRequest] = []
        for s in prev.seqs:
            req = s.request
            if (not s.sample or s.drafts or req.is_finished
                    or (req.procs is not None and not procs)
                    or req.params.logprobs is not None):
                return self._undo(seqs)
            # after prev the request holds len(output) + 1 tokens; one more must be allowed
            if (len(req.output_token_ids) + 2 > req.max_output_tokens
                    or s.start + 2 > cfg.max_model_len):
                if self.waiting:  # it finishes with prev: its seat goes to a waiting request
                    self._undo(seqs)  # now, as synchronous scheduling gives it
                    return self._plan_ahead(prev)
                continue  # prev's token is its last: it finishes then
            try:
                slots = bm.append_slots(req.request_id, 1)
            except OutOfPagesError:
                return self._undo(seqs)
            seqs.append(ScheduledRequest(req, s.start + 1, 1, slots, True,
                                         bm.page_table_view(req.request_id)))
        if not seqs:
            return None
        try:
            bm.check_step_refs([s.request.request_id for s in seqs], cfg.max_num_seqs,
                               cfg.max_model_len)
        except PageRefOverflowError:
            return self._undo(seqs)
        if self._budgeted():
            self.budget_steps += 1  # a step with a prompt budget, as ``_prompt_budget`` counts
        return SchedulerOutput(tuple(seqs))

    def _undo(self, seqs: list[ScheduledRequest]) -> None:
        for s in seqs:
            self.bm.rollback(s.request.request_id, s.num_new, s.start)

    def _plan_ahead(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """``schedule_continuation`` of a step that is not plain decoding, or beside waiting
        requests (a mixed step: decode rows beside prompt chunks and admissions): the step
        ``schedule`` would plan once ``prev`` is complete, planned now. ``prev``'s KV is
        committed now (its input tokens are known; ``update_from_output`` then only advances its
        requests), each request ``prev`` samples for holds a placeholder token while
        ``_schedule`` runs (its row's input is ``prev``'s sample, taken on the device), and the
        requests whose last token ``prev`` samples (by length) leave the running list and give
        their pages back now, as they would before a synchronous plan (``finish`` then has
        nothing to release; the device reuses a page only after ``prev``, in stream order).
        None (plan once ``prev`` is complete) where the step needs what only the host has or
        could differ from synchronous scheduling's: a preemption, speculation, logprobs,
        prompt logprobs or logits processors. A request that a stop token or EOS ends in
        ``prev`` is found one step late, as in a decode continuation (its row is dropped)."""
        if self.spec is not None or not self.plan_ahead:
            return None
        pending: list[Request] = []  # prev samples their next token
        ends: list[Request] = []  # prev samples their last token (length)
        for s in prev.seqs:
            req = s.request
            if s.drafts or s.prompt_logprob_positions:
                return None
            if req.is_finished:  # (a stop found a step late, an abort: not running now)
                continue
            if s.sample:
                (ends if len(req.output_token_ids) + 1 >= req.max_output_tokens
                 else pending).append(req)
        for reqs in (self.running, self.waiting):
            for r in reqs:
                if (r.procs is not None or r.params.logprobs is not None
                        or r.params.prompt_logprobs is not None):
                    return None
        bm = self.bm
        for s in prev.seqs:  # (commit skips pages without a new full one: most rows)
            req = s.request
            if req.is_finished:
                continue
            req.num_computed_tokens = end = s.start + s.num_new
            bm.commit(req.request_id, s.start, end, req.token_ids)
            s.committed = True
        if ends:  # their seats and pages are free for the plan, as synchronously
            gone = {id(r) for r in ends}
            self.running = [r for r in self.running if id(r) not in gone]
            for req in ends:
                bm.release(req.request_id)
                self._released.add(req.request_id)
        steps = self.budget_steps
        for req in pending:
            req.output_token_ids.append(0)
        try:
            seqs, _ = self._schedule(ahead=True)
        except _NoRoom as e:  # (only running requests had slots: rolled back)
            self._undo(e.seqs)
            seqs = []
        finally:
            for req in pending:
                req.output_token_ids.pop()
        if not seqs:
            self.budget_steps = steps
            return None
        return self._output(seqs, [])

    def _budgeted(self) -> bool:
        """Whether steps beside running requests have a mixed-step prompt budget (counted in
        ``budget_steps``)."""
        cfg = self.config
        return bool(cfg.mixed_step_tokens and cfg.enable_chunked_prefill and self.running)

    def _prompt_budget(self, budget: int) -> int:
        """Prompt tokens this step may compute: all of the budget, or mixed_prefill_tokens when
        a running request decodes (its next token waits for this step); and, with
        mixed_step_tokens T, the step's rows in all: T less the decode rows, at least T / 4
        (admissions go on beside many decodes), so that a mixed step of up to T tokens replays
        a mixed-step graph on cuda. T is lifted where it would starve prompts:

        - decode rows that read C tokens of KV cost about ``C * kv_per_weight`` weight reads
          beyond the weights; the step may add ``MIXED_TOKENS_PER_READ`` prompt tokens a read
          (~30% more time) where that gives ``MIXED_KV_X`` x T rows or more: 256 streams over
          3,000-token prefixes admit thousands a step;
        - while more than ``MIXED_WAITING_X`` requests wait per decoding one (a burst), once
          the oldest request with prompt tokens left (waiting, or running a chunked prefill)
          has waited ``MIXED_WAIT_STEPS`` x (seats + decode rows) / seats of these steps
          (long prompts), or, while at most 1 / ``MIXED_EARLY_X`` of ``max_num_seqs`` decode,
          when capped steps would not compute the prompt tokens left before that wait ends
          (a wave's refill),
          ``MIXED_LIFT`` x T: a step stays under ~5x a decode step, prompts keep most of their
          throughput, and few decode rows pay for the lifted steps. Steps, not seconds: the
          same requests schedule the same steps.
        """
        cfg = self.config
        mpt, t = cfg.mixed_prefill_tokens, cfg.mixed_step_tokens
        if not (mpt or t) or not cfg.enable_chunked_prefill or not self.running:
            return budget
        if not self._budgeted():  # whether one request decodes (nearly always the first)
            if not any(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running):
                return budget
            return min(budget, mpt)
        self.budget_steps = now = self.budget_steps + 1
        d = kv = left = 0
        waiting = self.waiting
        oldest = waiting[0].sched_step if waiting else now  # the oldest prompt left
        for r in self.running:
            n = r.num_computed_tokens
            if n >= r.num_prompt_tokens:
                d += 1
                kv += n
            else:
                left += r.num_prompt_tokens - n
                if r.sched_step < oldest:
                    oldest = r.sched_step
        if not d:
            return budget
        pbudget = min(budget, mpt) if mpt else budget
        cap = max(t - d, t // 4, 1)
        kvt = int(MIXED_TOKENS_PER_READ * kv * self.kv_per_weight)
        if kvt > cap and d + kvt >= MIXED_KV_X * t:
            cap = kvt  # (a few tokens past the graphs' rows would cost an eager step)
        if cap < MIXED_LIFT * t:
            seats = cfg.max_num_seqs
            # the prompt tokens that capped steps would compute before the oldest prompt has
            # waited its steps: lift now if they are fewer than the prompt tokens left
            # (at a wave's refill the decode rows are fewest now; waiting would lift later,
            # beside more of them)
            room = (MIXED_WAIT_STEPS * (seats + d) // seats - (now - oldest)) * cap
            if room < 0 or len(waiting) > MIXED_WAITING_X * d:
                return min(pbudget, MIXED_LIFT * t)
            if d * MIXED_EARLY_X > seats:
                return min(pbudget, cap)
            for r in waiting:
                if left > room:
                    break
                left += len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if left > room:
                cap = MIXED_LIFT * t
        return min(pbudget, cap)

    def _schedule(self, ahead: bool = False) -> tuple[list[ScheduledRequest], list[Request]]:
        """The step's rows; ``ahead`` (``_plan_ahead``): raise ``_NoRoom`` instead of
        preempting."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # per-request prefill cap (chunked prefill only): a long prompt leaves budget to others
        cap = (cfg.long_prefill_token_threshold or budget) if cfg.enable_chunked_prefill \
            else budget
        seqs: list[ScheduledRequest] = []
        preempted: list[Request] = []
        bm = self.bm
        append_slots, table = bm.append_slots, bm.page_table_view
        pbudget = self._prompt_budget(budget)

        # Running requests first: a decode token each, or the next chunk. Preemption only ever
        # removes the list's tail (it ends the loop there), so iterating the list itself is safe.
        spec = self.spec
        if spec is not None and (
                len(self.running) >= spec.disable_by_batch_size
                or (self.spec_alone and (
                    (self.waiting and len(self.running) < cfg.max_num_seqs)
                    or any(len(r.prompt_token_ids) + len(r.output_token_ids)
                           - r.num_computed_tokens != 1 for r in self.running)))):
            # a large batch: verify rows cost compute, decode plainly; and (spec_alone) no
            # span in a step that computes prompt tokens (an admission, a prefill chunk, a
            # recompute): on cuda such a step runs the multi-token forward, whose rounding is
            # not plain decoding's, while a step of spans and decode rows replays verify rows
            # (the bits of plain decoding), so speculation changes no token there
            spec = None
        for req in self.running:
            if budget <= 0:
                break
            rid, start = req.request_id, req.num_computed_tokens
            total = len(req.prompt_token_ids) + len(req.output_token_ids)
            if spec is not None and total - start == 1 and budget > 1:
                s = self._speculate(req, spec, start, total, budget)
                if s is not None:
                    seqs.append(s)
                    budget -= s.num_new
                    continue
            n = total - start  # min(total - start, budget, cap), without the call
            if n > budget:
                n = budget
            if n > 1 or start < req.num_prompt_tokens:  # a prefill chunk (its last token
                # too: a step stays within the cap) or a preempted request's recompute
                if n > cap:
                    n = cap
                if n > pbudget:
                    n = pbudget
                    if n <= 0:
                        continue  # keeps its pages; the next step goes on
                pbudget -= n
            try:
                slots = append_slots(rid, n)
            except OutOfPagesError:
                if ahead:
                    raise _NoRoom(seqs) from None
                slots = self._preempt_until_fits(req, n, preempted)
                if slots is None:
                    break
            seqs.append(ScheduledRequest(
                req, start, n, slots, start + n == total, table(rid),
                () if req.params.prompt_logprobs is None else
                self._prompt_logprob_positions(req, start, n)))
            budget -= n

        while (self.waiting and budget > 0 and pbudget > 0
               and len(self.running) < cfg.max_num_seqs):
            req = self.waiting[0]
            tokens = req.all_token_ids
            use_cache = cfg.prompt_logprobs_prefix_cache or not (
                req.wants_prompt_logprobs and len(req.prompt_logprobs) < req.num_prompt_tokens)
            salt = req.salt if use_cache else f"\0nocache:{req.request_id}"
            # what create() will take; under the private salt that is only the request's own
            # pages from before a preemption (their prompt logprobs exist already)
            cached = bm.num_cached_prefix_tokens(tokens, salt)
            remaining = len(tokens) - cached
            n = min(remaining, budget, cap, pbudget)
            if n < remaining and not cfg.enable_chunked_prefill:
                break
            need = bm.pages_needed_for_new(tokens, salt, num_new_tokens=n)
            if not bm.can_allocate(need):
                break
            self.waiting.popleft()
            cached = bm.create(req.request_id, tokens, salt)
            # admission checked can_allocate for exactly this: it cannot fail
            slots = bm.append_slots(req.request_id, n)
            req.num_computed_tokens = cached
            req.num_cached_tokens = cached
            have = min(cached + 1, req.num_prompt_tokens)  # (the cache may hold outputs too)
            if req.wants_prompt_logprobs and len(req.prompt_logprobs) < have:
                # logits of cached positions were never computed: their entries stay None
                req.prompt_logprobs += [None] * (have - len(req.prompt_logprobs))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(ScheduledRequest(
                req, cached, n, slots, sample=cached + n == len(tokens),
                page_table=table(req.request_id),
                prompt_logprob_positions=self._prompt_logprob_positions(req, cached, n)))
            budget -= n
            pbudget -= n
        return seqs, preempted

    def _ngram(self, req: Request, k: int) -> list[int]:
        spec = self.spec
        assert spec is not None
        return ngram_propose(req.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _speculate(self, req: Request, spec: SpeculativeConfig, start: int, total: int,
                   budget: int) -> ScheduledRequest | None:
        """A decoding request's speculative span ``[pending, *drafts]``, or None: plain decode
        (not eligible, no draft, or the span's pages do not fit: then the plain token may still
        fit, or preempt, as any decode)."""
        if not eligible(req.params, req.procs) or not req.output_token_ids:
            return None
        m = req.metrics
        if m.get("spec_steps", 0) >= PROBATION_STEPS and m["spec_accepted_tokens"] < (
                MIN_ACCEPTANCE * m["spec_draft_tokens"]):
            return None  # its drafts keep failing
        k = min(spec.num_speculative_tokens, budget - 1,
                req.max_output_tokens - len(req.output_token_ids) - 1,
                self.config.max_model_len - total)
        if k < 1:
            return None
        got = self.proposer(req, k)
        slot = -1
        if isinstance(got, DeviceDrafts):  # on the device: placeholders until the step's output
            drafts: tuple[int, ...] = (0,) * min(len(got), k)
            slot = got.slot
        else:
            drafts = tuple(got[:k])
        if not drafts:
            return None
        try:
            slots = self.bm.append_slots(req.request_id, 1 + len(drafts))
        except OutOfPagesError:
            return None
        return ScheduledRequest(req, start, 1 + len(drafts), slots, True,
                                self.bm.page_table_view(req.request_id), (), drafts, slot)

    def _preempt_until_fits(self, req: Request, n: int,
                            preempted: list[Request]) -> list[int] | None:
        """``req``'s next n slots did not fit: preempt the most recently admitted running
        requests until they do. None when ``req`` itself had to go."""
        while True:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None
            try:
                return self.bm.append_slots(req.request_id, n)
            except OutOfPagesError:
                pass

    # -- after the step --------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, step: StepOutput) -> list[Request]:
        """The step ran: commit its KV, append sampled tokens and logprobs, finish requests on
        EOS / stop token / length. Returns the requests that changed (sampled or finished). An
        error while one request's output is processed fails that request only."""
        changed: list[Request] = []
        commit = self.bm.commit
        sampled = step.sampled.tolist()  # plain ints, once (not a numpy scalar per row)
        prompt_lps, lps = step.prompt_logprobs, step.logprobs
        now = self.clock()  # the step's tokens all arrived now
        row = pl_row = 0
        dev = 0  # spans whose drafts were on the device, in step order (step.drafts)
        for s in out.seqs:
            req = s.request
            start = s.start
            if s.draft_slot >= 0:
                dev += 1
            if req.is_finished:  # (async scheduling: it stopped on the step before this one)
                row += s.sample + len(s.drafts)
                continue
            if s.drafts:  # a speculative span: rows row .. row + len(drafts)
                d = s.drafts
                if s.draft_slot >= 0:
                    if step.drafts is None or len(step.drafts) < dev:
                        raise RuntimeError("a step with device drafts returned none "
                                           "(StepOutput.drafts)")
                    d = tuple(step.drafts[dev - 1])
                self._update_spec(s, sampled[row:row + 1 + len(s.drafts)], now, changed, d)
                row += 1 + len(s.drafts)
                continue
            req.num_computed_tokens = end = start + s.num_new
            if not s.committed:
                commit(req.request_id, start, end, req.token_ids)
            n_pl = 0 if prompt_lps is None else len(s.prompt_logprob_positions)
            if not (s.sample or n_pl):  # a prefill chunk: nothing to append
                continue
            try:
                if n_pl:
                    for i, p in enumerate(s.prompt_logprob_positions[:n_pl]):
                        req.prompt_logprobs.append(logprob_dict(
                            prompt_lps, pl_row + i, req.prompt_token_ids[p + 1],
                            req.params.prompt_logprobs or 0))
                if s.sample:  # append the token; finish on a stop token, EOS or length
                    tok = sampled[row]
                    params = req.params
                    lp = None
                    if params.logprobs is not None and lps is not None:
                        lp = logprob_dict(lps, row, tok, params.logprobs)
                    out_ids = req.output_token_ids
                    out_ids.append(tok)
                    metrics = req.metrics
                    if "first_token" not in metrics:
                        metrics["first_token"] = now
                    metrics["last_token"] = now
                    if lp is not None:
                        req.logprobs.append(lp)
                        req.cumulative_logprob += lp[tok].logprob
                    self._finish_on(req, tok, params, len(out_ids))
                    changed.append(req)
            except Exception as e:  # this request's output could not be processed: fail it alone
                self.finish(req, FinishReason.ERROR,
                            error=f"processing the output failed: {type(e).__name__}: {e}")
                changed.append(req)
            pl_row += n_pl
            row += s.sample
        return changed

    def _finish_on(self, req: Request, tok: int, params: SamplingParams, n_out: int) -> None:
        """``tok`` was just appended (the ``n_out``-th output): finish on a stop token, EOS or
        the length."""
        if tok in params.stop_token_ids:
            self.finish(req, FinishReason.STOP, stop_reason=tok)
        elif not params.ignore_eos and tok in req.eos_token_ids:
            self.finish(req, FinishReason.STOP)
        elif n_out >= req.max_output_tokens:
            self.finish(req, FinishReason.LENGTH)

    def _update_spec(self, s: ScheduledRequest, ys: list[int], now: float,
                     changed: list[Request], d: tuple[int, ...]) -> None:
        """Accept the longest prefix of drafts ``d`` equal to the sampled tokens, append those
        tokens and the first sampled one after them (one at a time: a stop token, EOS or the
        length ends the run there), keep their KV and give the rejected slots back."""
        req, start = s.request, s.start
        m = accept(d, ys)
        met = req.metrics
        met["spec_steps"] = met.get("spec_steps", 0) + 1
        met["spec_draft_tokens"] = met.get("spec_draft_tokens", 0) + len(d)
        met["spec_accepted_tokens"] = met.get("spec_accepted_tokens", 0) + m
        tot = self.spec_totals
        tot[0] += len(d)
        tot[1] += m
        tot[2] += 1
        self.spec_accepted_hist[m] += 1
        try:
            params, out_ids = req.params, req.output_token_ids
            if "first_token" not in met:
                met["first_token"] = now
            met["last_token"] = now
            for tok in ys[:m + 1]:
                out_ids.append(tok)
                self._finish_on(req, tok, params, len(out_ids))
                if req.is_finished:
                    break  # its pages are released; the tokens after it are dropped
            if not req.is_finished:
                req.num_computed_tokens = end = start + 1 + m  # pending + accepted drafts
                self.bm.commit(req.request_id, start, end, req.token_ids)
                self.bm.rollback(req.request_id, len(d) - m, end)
        except Exception as e:  # this request's output could not be processed: fail it alone
            self.finish(req, FinishReason.ERROR,
                        error=f"processing the output failed: {type(e).__name__}: {e}")
        changed.append(req)

    def fail_step(self, out: SchedulerOutput, rows: set[int] | None,
                  error: str) -> list[Request]:
        """The step did not run. The requests of ``rows`` (all when None) finish with
        ``error``; the others give their slots back and are scheduled again next step. Rows
        committed ahead (``_plan_ahead``) fail too, and the prefix cache is dropped: pages
        they completed are registered, and their KV is not real."""
        failed = [s.request for i, s in enumerate(out.seqs)
                  if rows is None or i in rows or s.committed]
        failed_ids = {r.request_id for r in failed}
        if any(s.committed for s in out.seqs) and self.bm.prefix_caching:
            self.bm.set_prefix_caching(False)
            self.bm.set_prefix_caching(True)
        for s in out.seqs:
            if s.request.request_id not in failed_ids and s.request.status == RequestStatus.RUNNING:
                self.bm.rollback(s.request.request_id, s.num_new, s.start)
        for req in failed:
            self.finish(req, FinishReason.ERROR, error=error)
        return failed

    def page_table(self, req: Request) -> list[int]:
        return self.bm.page_table(req.request_id)


def logprob_dict(lp: Logprobs, row: int, token: int, n: int) -> LogprobDict:
    """A row's logprobs in vLLM's shape: the token's, then the top-n (decoded text is filled in
    by the output processor)."""
    d: LogprobDict = {token: Logprob(float(lp.token_logprob[row]), int(lp.token_rank[row]))}
    for j in range(min(n, lp.top_ids.shape[1])):
        t = int(lp.top_ids[row, j])
        if t not in d:
            d[t] = Logprob(float(lp.top_logprobs[row, j]), j + 1)
    return d
