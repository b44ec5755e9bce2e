"""One step's data, flat: the ``StepBatch`` the executor runs and the ``StepOutput`` it returns.

These are plain arrays in the vocabulary of vLLM / FlashAttention; kernels and executors know
nothing of requests. The scheduler's output is flattened into a ``StepBatch`` by ``build_batch``
(the one place a step's batch is built).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from array import array
    from collections.abc import Callable

    from engine.logits_processors import LogitsProcessorState
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import SchedulerOutput


@dataclass
class StepBatch:
    """One step's inputs, flat, in the vocabulary of vLLM / FlashAttention.

    T = total new tokens, B = sequences in the step, S = rows to sample.
    Sequence b owns tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``; its KV after the step holds
    ``context_lens[b]`` tokens (cached + new), the new ones at the end.
    """

    input_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int64 [T] physical KV slot of each new token
    cu_seqlens_q: np.ndarray  # int32 [B+1]
    context_lens: np.ndarray  # int32 [B]
    page_indices: np.ndarray  # int32 [B, max_pages] rows of each sequence's page list (by ref.)
    # --- sampling: one row per sequence that samples a token this step -----------------------
    sample_token_idx: np.ndarray  # int32 [S] index into the T tokens whose logits are sampled
    temperature: np.ndarray  # float32 [S] (0 = greedy)
    top_k: np.ndarray  # int32 [S] (0 = off)
    top_p: np.ndarray  # float32 [S] (1 = off)
    min_p: np.ndarray  # float32 [S] (0 = off)
    seeds: np.ndarray  # uint64 [S]
    sample_steps: np.ndarray  # uint32 [S] per-request counter (tokens generated so far)
    num_logprobs: np.ndarray  # int32 [S] top-n logprobs wanted (-1 = none, 0 = chosen only)
    # --- prompt logprobs: token rows whose next-token logprobs are wanted --------------------
    prompt_logprob_idx: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int32))  # int32 [P] token rows
    prompt_logprob_targets: np.ndarray = field(
        default_factory=lambda: np.zeros(0, np.int32))  # int32 [P] the actual next token
    prompt_num_logprobs: int = 0  # top-n for prompt rows (max over requests in the step)
    # --- logits processors of the sample rows; None when no row has one (the common case) ---
    procs: ProcessorRows | None = None
    # --- drafts a proposer left to the device (engine.speculative.DeviceDrafts): per span,
    # (its block in the step's draft launch, token row of its first draft, k); the executor
    # writes them over the placeholder input ids before the forward and returns them in
    # ``StepOutput.drafts``, in this order
    device_drafts: np.ndarray = field(
        default_factory=lambda: np.zeros((0, 3), np.int32))  # int32 [D, 3]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q)

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token (a graph-replayable step)."""
        return self.num_tokens == self.num_seqs and self.num_seqs > 0


# ProcessorRows.flags: which processors a sample row runs, in this order (vLLM's: the grammar
# mask, then logprobs' copy of the row, then allowed ids, bad words, min_tokens and logit_bias,
# then the penalties; masking to -inf commutes with adding a finite bias, so the kernel takes
# the sparse adds before the dense pass)
FLAG_GRAMMAR = 1  # the row's grammar bitmask: disallowed tokens -> -inf
FLAG_SAVE_RAW = 2  # keep the row as it is after the grammar mask: its logprobs are of that
FLAG_SPARSE = 4  # logits[ids] += vals (logit_bias; -inf for bad words and min_tokens' stops)
FLAG_ALLOWED = 8  # the slot's allowed_token_ids bitmask
FLAG_PENALTY = 16  # repetition / frequency / presence from the slot's counts and prompt bits


@dataclass
class SlotInit:
    """(Re)start a device slot of per-request processor state: a slot holds a request's output
    token counts (``counts[V]``, ``counted`` = how many outputs they hold, ``last`` = the latest
    counted token), its prompt's token bitmask and its allowed-token bitmask."""

    slot: int
    prompt_bits: np.ndarray  # uint32 [W]
    allowed_bits: np.ndarray | None  # uint32 [W]; None: no allowed_token_ids
    output_ids: np.ndarray  # int32: the outputs generated before (counted at init)


def submit_started(submit: Callable[[Callable[[], None]], Any], fn: Callable[[], None]) -> Any:
    """``submit(fn)`` (an executor's), returning its future once the worker thread runs ``fn``:
    a busy main thread would otherwise hold the GIL for the interpreter's whole switch interval
    (5 ms) before the worker could start. The wait releases the GIL."""
    started = threading.Event()

    def run() -> None:
        started.set()
        fn()

    fut = submit(run)
    started.wait()
    return fut


@dataclass
class ProcessorRows:
    """The logits processors of one step's S sample rows (W = ceil(V / 32) bitmask words).

    The counts of a slot advance on the device, with the token sampled for it: a step that
    samples row r for slot s counts it once (``counted[s] == sample_steps[r]``), so running the
    same step twice (a graph replay of an eager step, a retried step) sees the same counts."""

    flags: np.ndarray  # uint32 [S] FLAG_* bits (0: the row is untouched)
    slot: np.ndarray  # int32 [S] device state slot (-1: none)
    penalties: np.ndarray  # float32 [S, 3] repetition, frequency, presence
    grammar_row: np.ndarray  # int32 [S] row of grammar_mask (-1: none)
    grammar_mask: np.ndarray  # uint32 [G, W] allowed-token bits of the constrained rows
    sparse_start: np.ndarray  # int32 [S + 1] row r's entries: sparse_start[r]:sparse_start[r+1]
    sparse_ids: np.ndarray  # int32 [K] token ids (unique within a row)
    sparse_vals: np.ndarray  # float32 [K] added to the logit (-inf bans the token)
    inits: list[SlotInit] = field(default_factory=list)  # applied before the step
    # computes grammar_mask in place; deferred so that the cuda executor can run it while the
    # GPU runs the step's forward (``fill_masks``: every reader of grammar_mask calls it first)
    fill: Callable[[], None] | None = None
    future: Any = None  # fill running elsewhere (fill_async, or started before: start_early)
    # a gated step's rows (``prepare(..., masks=False)``): the grammar worker's keys of the
    # grammar rows, in mask-row order; the masks come later, from the worker's gate slot
    grammar_keys: list[int] | None = None

    def fill_async(self, submit: Callable[[Callable[[], None]], Any]) -> None:
        """Start the masks on another thread (``submit``: an executor's); ``fill_masks`` then
        waits for them. llguidance computes them with the GIL released, but the thread needs
        the GIL to get there, and a busy main thread would hold it for the interpreter's whole
        switch interval (5 ms): this waits (GIL released) until the thread has started."""
        if self.fill is not None:
            fill, self.fill = self.fill, None
            self.future = submit_started(submit, fill)

    def fill_masks(self, wait_only: bool = False) -> None:
        """The grammar bitmasks, computed now (once), or waited for (``wait_only``: only
        wait for a computation started by ``fill_async``, ignoring its error)."""
        if self.future is not None:
            fut, self.future = self.future, None
            if wait_only:
                fut.exception()
            else:
                fut.result()
        if self.fill is not None and not wait_only:
            fill, self.fill = self.fill, None
            fill()


@dataclass
class Logprobs:
    """Logprobs of a set of rows: the chosen token's, plus the top-n (ids descending by value)."""

    token_logprob: np.ndarray  # float32 [R] logprob of the sampled / actual token
    token_rank: np.ndarray  # int32 [R] 1-based rank of that token
    top_ids: np.ndarray  # int32 [R, n]
    top_logprobs: np.ndarray  # float32 [R, n]


@dataclass
class StepOutput:
    sampled: np.ndarray  # int32 [S]
    logprobs: Logprobs | None = None  # for the S sample rows, when any asked
    prompt_logprobs: Logprobs | None = None  # for the P prompt rows
    graph: bool = False  # the forward replayed a captured CUDA graph
    # the drafts of ``StepBatch.device_drafts``' spans, in that order (None: no such span)
    drafts: list[list[int]] | None = None


# One row per request, packed once (``Request.sampling_row``): a request's sampling parameters
# and seed are fixed from admission on, so a step joins bytes instead of converting six Python
# numbers per sampled row (numpy converts a Python number in ~40 ns on the dev box).
SAMPLING_ROW = np.dtype([("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
                         ("min_p", np.float32), ("num_logprobs", np.int32), ("seed", np.uint64)])


def pack_sampling_row(params: SamplingParams, seed: int) -> bytes:
    """``params`` and ``seed`` as one ``SAMPLING_ROW`` (numpy's casts, as the arrays had)."""
    num_logprobs = -1 if params.logprobs is None else params.logprobs
    return np.array((params.temperature, params.top_k, params.top_p, params.min_p, num_logprobs,
                     seed), SAMPLING_ROW).tobytes()


def _sample_steps(sample_reqs: list[Request], step_add: list[tuple[int, int]]) -> np.ndarray:
    steps = np.array([len(r.output_token_ids) for r in sample_reqs], np.uint32)
    for row, k in step_add:
        steps[row] += k
    return steps


def build_batch(out: SchedulerOutput, procs: LogitsProcessorState | None = None) -> StepBatch:
    """Flatten a step's scheduled requests into the executor's arrays (a pure function).

    One Python pass gathers what is per sequence (a plain loop: in CPython 3.11 it beats
    ``map(attrgetter)`` 2x on slotted records); numpy does the rest. Page tables and sampling
    rows are stored packed and joined as bytes, so no page id or sampling parameter is
    converted per step. A decode step (one token per sequence) needs no cumulative sums.
    ``procs``: the engine's logits processor state, for the sample rows' processors (nothing
    while no live request has one).
    """
    seqs = out.seqs
    b = len(seqs)
    ids: list[int] = []
    starts: list[int] = []
    slots: list[int] = []
    tables: list[array[int]] = []
    sample_reqs: list[Request] = []
    sample_idx: list[int] = []
    pl_idx: list[int] = []
    pl_tgt: list[int] = []
    pl_n = 0
    t = 0  # tokens so far
    decode = True  # every sequence adds exactly one token
    step_add: list[tuple[int, int]] = []  # (sample row, +steps): a speculative span's rows
    dev: list[tuple[int, int, int]] = []  # device drafts: (slot, first draft row, k)
    for s in seqs:
        req, start, n = s.request, s.start, s.num_new
        if n == 1:  # index the one token: no slice, no list
            prompt = req.prompt_token_ids
            if start < len(prompt):
                ids.append(prompt[start])
            elif start - len(prompt) < len(req.output_token_ids):
                ids.append(req.output_token_ids[start - len(prompt)])
            else:  # async scheduling: the token the step in flight samples (on the device)
                ids.append(0)
                step_add.append((len(sample_reqs), 1))  # (its sample row is appended below)
            slots.append(s.slots[0])
        elif s.drafts:  # [pending, *drafts]: the drafts are not the request's tokens yet
            decode = False
            ids += req.token_slice(start, 1)
            ids += s.drafts  # (placeholders when they are on the device)
            if s.draft_slot >= 0:
                dev.append((s.draft_slot, t + 1, len(s.drafts)))
            slots += s.slots
        else:
            decode = False
            ids += req.token_slice(start, n)
            slots += s.slots
        starts.append(start)
        tables.append(s.page_table)
        if s.drafts:  # every row samples; row j at the request's step len(output) + j
            for j in range(n):
                if j:
                    step_add.append((len(sample_reqs), j))
                sample_idx.append(t + j)
                sample_reqs.append(req)
        elif s.sample:
            sample_idx.append(t + n - 1)
            sample_reqs.append(req)
        if s.prompt_logprob_positions:
            for p in s.prompt_logprob_positions:
                pl_idx.append(t + p - start)
                pl_tgt.append(req.prompt_token_ids[p + 1])
            pl_n = max(pl_n, req.params.prompt_logprobs or 0)
        t += n
    start_arr = np.array(starts, np.int32)
    if decode:
        cu = np.arange(b + 1, dtype=np.int32)
        positions = start_arr
        ctx = start_arr + 1
    else:
        num_new = np.array([s.num_new for s in seqs], np.int32)
        cu = np.zeros(b + 1, np.int32)
        np.cumsum(num_new, out=cu[1:])
        ctx = start_arr + num_new
        # token j of sequence i sits at position start_i + (j - cu_i)
        positions = np.repeat(start_arr - cu[:-1], num_new) + np.arange(t, dtype=np.int32)
    lens = [len(x) for x in tables]
    width = max(max(lens, default=1), 1)
    flat = np.frombuffer(b"".join(tables), np.int32)  # int32 tables (engine.kv PAGE_TYPECODE)
    if flat.size == b * width:  # no row to pad
        page_indices = flat.reshape(b, width).copy()
    else:
        page_indices = np.zeros((b, width), np.int32)
        page_indices[np.arange(width) < np.array(lens)[:, None]] = flat
    rows = np.frombuffer(b"".join([r.sampling_row for r in sample_reqs]), SAMPLING_ROW)
    return StepBatch(
        input_ids=np.array(ids, np.int32),
        positions=positions,
        slot_mapping=np.array(slots, np.int64),
        cu_seqlens_q=cu,
        context_lens=ctx,
        page_indices=page_indices,
        sample_token_idx=np.array(sample_idx, np.int32),
        temperature=rows["temperature"].copy(),  # each field contiguous, as before
        top_k=rows["top_k"].copy(),
        top_p=rows["top_p"].copy(),
        min_p=rows["min_p"].copy(),
        seeds=rows["seed"].copy(),
        sample_steps=_sample_steps(sample_reqs, step_add),
        num_logprobs=rows["num_logprobs"].copy(),
        prompt_logprob_idx=np.array(pl_idx, np.int32),
        prompt_logprob_targets=np.array(pl_tgt, np.int32),
        prompt_num_logprobs=pl_n,
        procs=procs.prepare(sample_reqs) if procs is not None and procs.active else None,
        device_drafts=np.array(dev, np.int32).reshape(-1, 3),
    )
