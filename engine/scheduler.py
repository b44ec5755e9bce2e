"""Continuous batching with chunked prefill, admission against real KV accounting, preemption.

Each step: running requests first (a decode token each, or the next chunk of an unfinished
prefill), then waiting ones in FIFO order (preempted requests go back to the front) while the
token budget, ``max_num_seqs`` and the block manager's ``free + inactive`` pages allow. When a
running request cannot get its next page, the most recently admitted running request is
preempted (pages released; it is recomputed later, prefix cache permitting, and under greedy it
produces the same tokens).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from engine.config import EngineConfig
from engine.kv import BlockManager, OutOfPagesError
from engine.request import FinishReason, Request, RequestStatus
from engine.step import StepBatch


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # first position computed this step (== num_computed_tokens before the step)
    num_new: int
    slots: list[int]
    sample: bool  # this step computes the last known token: sample the next one
    prompt_logprob_positions: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    seqs: list[ScheduledSeq]
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        """Finish a request now; its pages return at once."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
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
    def _prompt_logprob_positions(self, req: Request, start: int, n: int) -> list[int]:
        if not req.wants_prompt_logprobs:
            return []
        last = req.num_prompt_tokens - 1  # logits at the last prompt position sample a token
        have = len(req.prompt_logprobs)  # entries for positions 0 .. have-1 exist
        return [p for p in range(start, min(start + n, last)) if p + 1 >= have]

    def schedule(self) -> StepPlan:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        # per-request prefill cap (chunked prefill only): a long prompt leaves budget to others
        cap = (cfg.long_prefill_token_threshold or budget) if cfg.enable_chunked_prefill \
            else budget
        seqs: list[ScheduledSeq] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed_tokens
            remaining = req.num_tokens - start
            n = min(remaining, budget, cap)
            tokens = req.token_slice(start, n)
            while True:
                try:
                    slots = self.bm.append_slots(req.request_id, n, tokens)
                    break
                except OutOfPagesError:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        slots = None
                        break
            if slots is None:
                break
            seqs.append(ScheduledSeq(req, start, n, slots, sample=start + n == req.num_tokens,
                                     prompt_logprob_positions=self._prompt_logprob_positions(
                                         req, start, n)))
            budget -= n
            i += 1

        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            tokens = req.all_token_ids
            use_cache = cfg.prompt_logprobs_prefix_cache or not (
                req.wants_prompt_logprobs and len(req.prompt_logprobs) < req.num_prompt_tokens)
            salt = req.salt if use_cache else f"\0nocache:{req.request_id}"
            cached = self.bm.num_cached_prefix_tokens(tokens, salt) if use_cache else 0
            remaining = len(tokens) - cached
            n = min(remaining, budget, cap)
            if n < remaining and not cfg.enable_chunked_prefill:
                break
            need = self.bm.pages_needed_for_new(tokens, salt, num_new_tokens=n)
            if not self.bm.can_allocate(need):
                break
            self.waiting.popleft()
            cached = self.bm.create(req.request_id, tokens, salt)
            # admission checked can_allocate for exactly this: it cannot fail
            slots = self.bm.append_slots(req.request_id, n, tokens[cached:cached + n])
            req.num_computed_tokens = cached
            req.num_cached_tokens = cached
            if req.wants_prompt_logprobs and len(req.prompt_logprobs) < cached + 1:
                # logits of cached positions were never computed: their entries stay None
                req.prompt_logprobs += [None] * (cached + 1 - len(req.prompt_logprobs))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seqs.append(ScheduledSeq(req, cached, n, slots, sample=cached + n == len(tokens),
                                     prompt_logprob_positions=self._prompt_logprob_positions(
                                         req, cached, n)))
            budget -= n
        return StepPlan(seqs, preempted)

    # -- after the step --------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """The step ran: its tokens' KV is real."""
        for s in plan.seqs:
            req = s.request
            req.num_computed_tokens = s.start + s.num_new
            self.bm.commit(req.request_id, req.num_computed_tokens)

    def abandon(self, plan: StepPlan, failed: Iterable[Request]) -> None:
        """The step did not run. Failed requests finish with an error elsewhere; the others give
        their step's slots back and are scheduled again next step."""
        failed_ids = {r.request_id for r in failed}
        for s in plan.seqs:
            if s.request.request_id not in failed_ids and s.request.status == RequestStatus.RUNNING:
                self.bm.rollback(s.request.request_id, s.num_new)

    def page_table(self, req: Request) -> list[int]:
        return self.bm.page_table(req.request_id)


def prepare(plan: StepPlan, scheduler: Scheduler) -> StepBatch:
    """Flatten a plan into the executor's arrays (the one place a step's batch is built)."""
    seqs = plan.seqs
    b = len(seqs)
    bm = scheduler.bm
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    cu = [0]
    ctx = []
    tables = []
    sample_idx: list[int] = []
    sample_reqs: list[Request] = []
    pl_idx: list[int] = []
    pl_tgt: list[int] = []
    pl_n = 0
    for s in seqs:
        req = s.request
        base = cu[-1]
        ids += req.token_slice(s.start, s.num_new)
        pos += range(s.start, s.start + s.num_new)
        slots += s.slots
        cu.append(base + s.num_new)
        ctx.append(s.start + s.num_new)
        tables.append(bm.page_table_view(req.request_id))
        if s.sample:
            sample_idx.append(base + s.num_new - 1)
            sample_reqs.append(req)
        for p in s.prompt_logprob_positions:
            pl_idx.append(base + p - s.start)
            pl_tgt.append(req.prompt_token_ids[p + 1])
            pl_n = max(pl_n, req.params.prompt_logprobs or 0)
    width = max(max((len(t) for t in tables), default=1), 1)
    page_indices = np.array([t + [0] * (width - len(t)) if len(t) < width else t
                             for t in tables], np.int32).reshape(b, width)
    sp = [r.params for r in sample_reqs]
    return StepBatch(
        input_ids=np.asarray(ids, np.int32),
        positions=np.asarray(pos, np.int32),
        slot_mapping=np.asarray(slots, np.int64),
        cu_seqlens_q=np.asarray(cu, np.int32),
        context_lens=np.asarray(ctx, np.int32),
        page_indices=page_indices,
        sample_token_idx=np.asarray(sample_idx, np.int32),
        temperature=np.asarray([p.temperature for p in sp], np.float32),
        top_k=np.asarray([p.top_k for p in sp], np.int32),
        top_p=np.asarray([p.top_p for p in sp], np.float32),
        min_p=np.asarray([p.min_p for p in sp], np.float32),
        seeds=np.asarray([r.seed for r in sample_reqs], np.uint64),
        sample_steps=np.asarray([len(r.output_token_ids) for r in sample_reqs], np.uint32),
        num_logprobs=np.asarray([-1 if p.logprobs is None else p.logprobs for p in sp],
                                np.int32),
        prompt_logprob_idx=np.asarray(pl_idx, np.int32),
        prompt_logprob_targets=np.asarray(pl_tgt, np.int32),
        prompt_num_logprobs=pl_n,
    )
