"""Per-request logits processors, host side: what each request asks for, and one step's rows.

vLLM's processors and order (its v1 sampler): the structured-output grammar mask, then (logprobs
are taken here: they see the grammar mask and nothing after it) allowed_token_ids, bad_words,
min_tokens (EOS and stop_token_ids masked while fewer outputs exist), logit_bias, and the
penalties: repetition over prompt and output tokens (a positive logit is divided by it, a
negative one multiplied), frequency (times the output count) and presence (once if the output
holds the token). The math is ``engine.sampling.process_logits`` (numpy, the reference) and
``cutlass_kernels/logits_process.py`` (inside the decode graphs).

What lives where:
- static per request (``RequestProcessors``, made at admission): penalties, the merged
  logit_bias, the stop ids min_tokens masks, the bad words' token sequences, the matcher;
- on the device per request, in a slot (``SlotPool``, ``max_num_seqs`` slots): output token
  counts (advanced on the device by the token sampled for the slot), the prompt's token bitmask,
  the allowed-token bitmask. A slot is taken on the request's first sampled step, kept across
  preemption and released when the request finishes; when every slot is held, one held by a
  request outside this step is taken over, and that request's slot is rebuilt from its token ids
  when it next samples (``SlotInit``);
- per step (``ProcessorRows``, built by ``LogitsProcessorState.prepare``): flags, penalties,
  the sparse (token, value) lists (logit_bias, bans) and the grammar bitmasks of the rows.
"""

from __future__ import annotations

import itertools
import warnings
from typing import TYPE_CHECKING

import numpy as np

from engine import envs
from engine.request import RequestStatus
from engine.step import (
    FLAG_ALLOWED,
    FLAG_GRAMMAR,
    FLAG_PENALTY,
    FLAG_SAVE_RAW,
    FLAG_SPARSE,
    ProcessorRows,
    SlotInit,
    submit_started,
)
from engine.structured.grammar import GrammarError
from engine.structured.matcher import Advance, GrammarCache, StructuredRequest, bitmask_words
from engine.structured.remote import OUTCOMES, GrammarWorker, Job, RemoteStructured

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any

    from engine.request import FinishReason, Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import SchedulerOutput
    from engine.tokenizer import Tokenizer

NEG_INF = np.float32(-np.inf)


class EarlyMasks:
    """A pipelined step's grammar masks, started as soon as the step before it is sampled:
    its matchers advanced (``advanced``: id(request) -> (request, Advance), applied to the
    requests by ``after_step`` once that step's outputs are committed) and the next step's masks
    computing on the mask thread (``future``) while the main thread commits the outputs.
    ``rows``: id(StructuredRequest) -> its row of ``mask``. A request that the commit then
    finishes keeps its row, unused."""

    __slots__ = ("advanced", "mask", "rows", "future", "job", "adv_reqs")

    def __init__(self, advanced: dict[int, tuple[Request, Advance]]) -> None:
        self.advanced = advanced
        self.mask: np.ndarray | None = None
        self.rows: dict[int, int] = {}
        self.future: Any = None
        # the grammar worker's job (CUTEINFER_GRAMMAR_PROCESS): ``advanced`` comes from its
        # outcomes, for ``adv_reqs`` in order (``outcomes``)
        self.job: Job | None = None
        self.adv_reqs: list[Request] = []

    def outcomes(self) -> list[tuple[Request, Advance]]:
        """The advanced requests and their outcomes (waiting for the worker's, if remote)."""
        if self.job is None:
            return list(self.advanced.values())
        return _remote_outcomes(self.job, self.adv_reqs)


def _worker_of(structured: list[RemoteStructured]) -> GrammarWorker:
    """The worker holding these matchers (GrammarError: it died, so their states are gone)."""
    w = structured[0].worker
    if w.dead is not None or any(st.worker is not w for st in structured):
        raise GrammarError(w.dead or "the grammar worker was restarted")
    return w


_ADVANCE = {name: Advance(name) for name in OUTCOMES}


def _all_failed(reqs: list[Request], why: str) -> list[tuple[Request, Advance]]:
    """``reqs``' advances when the worker could not make them: errors, ``why`` the message."""
    for req in reqs:
        if req.procs is not None and req.procs.structured is not None:
            req.procs.structured.error = why
    return [(req, Advance.ERROR) for req in reqs]


def _remote_outcomes(job: Job, reqs: list[Request]) -> list[tuple[Request, Advance]]:
    """A worker job's advances of ``reqs``: their outcomes (every one ERROR, with the reason, when
    the worker failed), llguidance's messages put on the requests' ``RemoteStructured``."""
    try:
        codes, errors = job.outcomes()
    except GrammarError as e:
        return _all_failed(reqs, str(e))
    out = []
    for i, req in enumerate(reqs):
        res = _ADVANCE[OUTCOMES[codes[i]]]
        if res is Advance.ERROR and req.procs is not None and req.procs.structured is not None:
            req.procs.structured.error = errors.get(i, "")
        out.append((req, res))
    return out


class ProcessorError(ValueError):
    """A processor a request asks for that this model cannot give it (names the field)."""


def token_bits(ids: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """uint32 [ceil(V/32)]: bit ``v & 31`` of word ``v >> 5`` set for each id."""
    w = bitmask_words(vocab_size)
    flat = np.zeros(w * 32, np.bool_)
    flat[np.asarray(ids, np.int64)] = True
    return np.packbits(flat, bitorder="little").view(np.uint32)


def bits_to_mask(bits: np.ndarray, vocab_size: int) -> np.ndarray:
    """The inverse of ``token_bits`` for a [.., W] array: bool [.., V]."""
    b = np.ascontiguousarray(bits, np.uint32)
    return np.unpackbits(b.view(np.uint8), axis=-1, bitorder="little")[..., :vocab_size] \
        .astype(bool)


def check_params(params: SamplingParams, vocab_size: int, tokenizer: Tokenizer | None) -> None:
    """What SamplingParams cannot check alone: token ids inside the vocabulary, a tokenizer
    for bad words and structured output. Raises ProcessorError naming the field."""
    for name, ids in (("logit_bias", params.logit_bias or {}),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ProcessorError(f"{name}: token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {vocab_size})")
    for name in ("bad_words", "structured_outputs"):
        if getattr(params, name) and tokenizer is None:
            raise ProcessorError(f"{name} needs the model's tokenizer (tokenizer.json), which "
                                 "this checkpoint does not have")


def bad_word_ids(words: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word as is (left-stripped) and with a leading
    space, the second kept only when it is a different token sequence of the same length."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


class RequestProcessors:
    """A request's processors, fixed at admission (the matcher's state and the slot aside)."""

    def __init__(self, req: Request, bad_words: list[list[int]],
                 structured: StructuredRequest | None, owner: LogitsProcessorState) -> None:
        p = req.params
        self.request = req
        self.owner = owner
        self.penalties = np.array([p.repetition_penalty, p.frequency_penalty,
                                   p.presence_penalty], np.float32)
        self.has_penalties = bool(p.repetition_penalty != 1.0 or p.frequency_penalty
                                  or p.presence_penalty)
        self.allowed = None if p.allowed_token_ids is None else sorted(set(p.allowed_token_ids))
        self.bias = dict(p.logit_bias or {})
        self.min_tokens = p.min_tokens
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops.update(req.eos_token_ids)
        self.stop_ids = sorted(stops)
        self.bad_single = sorted({w[0] for w in bad_words if len(w) == 1})
        self.bad_multi = [w for w in bad_words if len(w) > 1]
        self.structured = structured
        self.slot: int | None = None
        self.needs_slot = self.has_penalties or self.allowed is not None
        self._static = self._sparse_static()

    def _sparse_static(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The sparse list when nothing per step changes it (logit_bias, single-token bans)."""
        if self.min_tokens or self.bad_multi:
            return None
        return self._pack({**self.bias, **dict.fromkeys(self.bad_single, NEG_INF)})

    @staticmethod
    def _pack(entries: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
        return (np.fromiter(entries.keys(), np.int32, len(entries)),
                np.fromiter(entries.values(), np.float32, len(entries)))

    def sparse(self) -> tuple[np.ndarray, np.ndarray]:
        """This step's (token ids, values): logit_bias, then -inf for bans (a ban wins)."""
        if self._static is not None:
            return self._static
        entries: dict[int, float] = dict(self.bias)
        out = self.request.output_token_ids
        if len(out) < self.min_tokens:
            entries.update(dict.fromkeys(self.stop_ids, NEG_INF))
        entries.update(dict.fromkeys(self.bad_single, NEG_INF))
        for w in self.bad_multi:  # the word's last token, when the output ends with the rest
            k = len(w) - 1
            if len(out) >= k and out[-k:] == w[:-1]:
                entries[w[-1]] = NEG_INF
        return self._pack(entries)

    def known_ahead(self) -> bool:
        """Whether this request's row for the step after the one in flight can be built before
        that step completes (async scheduling): nothing in it depends on the token in flight.
        Penalties (their counts advance on the device), logit_bias, allowed ids and
        single-token bans qualify; a grammar, a multi-token bad word (it looks at the last
        tokens) and a min_tokens still unmet (the output count, one short here, decides the
        stop ban; once met it stays met) do not, nor a row whose slot would be rebuilt from
        the token ids (the one in flight is not among them yet)."""
        return self.structured is None and self.gated_ahead()

    def gated_ahead(self) -> bool:
        """Whether only the grammar mask of this request's next row waits for the token in
        flight (the rest as ``known_ahead``): such a row can be launched gated."""
        return (not self.bad_multi and len(self.request.output_token_ids) >= self.min_tokens
                and (self.slot is not None or not self.needs_slot))

    def slot_init(self, vocab_size: int) -> SlotInit:
        req = self.request
        return SlotInit(self.slot, token_bits(req.prompt_token_ids, vocab_size),  # type: ignore
                        None if self.allowed is None else token_bits(self.allowed, vocab_size),
                        np.array(req.output_token_ids, np.int32))

    def release(self) -> None:
        """The request finished (``Request.finish``): its slot and matcher go."""
        if isinstance(self.structured, RemoteStructured):
            self.structured.close()
        self.structured = None
        self.owner.pool.release(self)
        self.owner.live.discard(id(self))


class SlotPool:
    """``size`` device slots of per-request state (see the module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = list(range(size - 1, -1, -1))
        self.holders: dict[int, RequestProcessors] = {}

    def acquire(self, rp: RequestProcessors, in_step: set[int]) -> int:
        """A slot for ``rp``; ``in_step``: slots this step's rows hold (never taken over)."""
        if self.free:
            s = self.free.pop()
        else:
            s = next(k for k in self.holders if k not in in_step)
            self.holders.pop(s).slot = None  # rebuilt from its token ids when it next samples
        self.holders[s] = rp
        rp.slot = s
        return s

    def release(self, rp: RequestProcessors) -> None:
        s = rp.slot
        if s is not None and self.holders.get(s) is rp:
            del self.holders[s]
            self.free.append(s)
        rp.slot = None


class LogitsProcessorState:
    """The engine's processor state: attaches processors to requests, builds each step's
    ``ProcessorRows`` and advances the matchers after it."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], num_slots: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.pool = SlotPool(num_slots)
        self.grammars = GrammarCache(tokenizer, vocab_size, eos_token_ids)
        self.live: set[int] = set()  # id() of the live RequestProcessors
        # CUTEINFER_GRAMMAR_PROCESS: the matchers live in a worker process (started on the
        # first constrained request; a fresh one after a worker died)
        self.remote = envs.grammar_process()
        self.warm = False  # ``warm_up`` ran: the worker (or this process) has its tokenizer
        self.worker: GrammarWorker | None = None
        self._keys = itertools.count(1)
        self.num_rows = num_slots
        # the last steady step's rows (``prepare``): key, rows, arrays
        self._steady: tuple | None = None

    def _worker(self) -> GrammarWorker | None:
        """The grammar worker (started now if none runs). None: the first one could not start
        (no process can be spawned here): this engine's matchers stay in this process."""
        w = self.worker
        if w is None or w.dead is not None:
            if w is not None:
                w.close()
            g = self.grammars
            if g.tokenizer is None:
                raise GrammarError("structured output needs the model's tokenizer "
                                   "(tokenizer.json)")
            try:
                w = GrammarWorker(g.tokenizer.backend_tokenizer.to_str(),  # type: ignore
                                  self.vocab_size, g.eos, self.num_rows, g.threads)
            except OSError as e:
                if self.worker is not None:  # (its requests are failing: no mixing modes)
                    raise GrammarError(f"the grammar worker could not restart: {e}") from None
                warnings.warn(f"cuteinfer: the grammar worker process could not start ({e}); "
                              "structured output runs in this process", stacklevel=2)
                self.remote = False
                return None
            self.worker = w
        return w

    def _remote(self, text: str) -> RemoteStructured | None:
        """A matcher of ``text`` in the grammar worker, which compiles it first (GrammarError:
        it does not compile); a worker found dead is replaced once. None: no worker could be
        started (the matchers stay in this process)."""
        for attempt in (0, 1):
            w = self._worker()
            if w is None:
                return None
            key = next(self._keys)
            try:
                w.add(key, text)
                return RemoteStructured(key, w)
            except GrammarError:
                if w.dead is None or attempt:
                    raise
        return None

    def warm_up(self) -> bool:
        """Make structured output ready before the first constrained request arrives: start the
        grammar worker and wait until it has built its llguidance tokenizer (a first grammar
        compiled there), or, with the matchers in this process, build that tokenizer here.
        Lazily, the first constrained request waits for it (~2 s for Qwen3's vocabulary), and
        with it every running request (in this process llguidance holds the GIL meanwhile).
        False when structured output cannot run here (no tokenizer, no llguidance); the first
        request then says why."""
        if self.grammars.tokenizer is None:
            return False
        try:
            from llguidance import LLMatcher
        except ImportError:
            return False
        s = self._remote(LLMatcher.grammar_from_regex("a")) if self.remote else None
        if s is not None:  # (the worker answered a first compile: its tokenizer is built)
            s.close()
        else:  # (in this process, or no worker could start)
            self.grammars.ll_tokenizer()
        self.warm = True
        return True

    def close(self) -> None:
        """Stop the grammar worker, if one runs."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    @property
    def active(self) -> bool:
        return bool(self.live)

    def attach(self, req: Request) -> None:
        """Give ``req`` its processors (none when it asks for none). ProcessorError when the
        model cannot give them (a grammar that does not compile against its tokenizer)."""
        p = req.params
        if not p.has_processors:
            return
        check_params(p, self.vocab_size, self.tokenizer)
        structured = None
        if p.structured_outputs is not None:
            text = p.structured_outputs.grammar_text
            try:
                structured = self._remote(text) if self.remote else None
                if structured is None:
                    structured = self.grammars.matcher(text)
            except GrammarError as e:
                raise ProcessorError(f"structured_outputs: {e}") from None
        bad = bad_word_ids(p.bad_words, self.tokenizer) if p.bad_words else []  # type: ignore
        rp = RequestProcessors(req, bad, structured, self)
        req.procs = rp
        self.live.add(id(rp))

    def start_early(self, done: SchedulerOutput, sampled: np.ndarray,
                    sample_reqs: Sequence[Request],
                    submit: Callable[[Callable[[], None]], Any],
                    gate: tuple[int, list[int]] | None = None) -> EarlyMasks | None:
        """Async scheduling, before ``done``'s outputs are committed: advance the matchers of
        ``done``'s constrained rows by their tokens (``sampled``, one per row: a decode step)
        and start the masks of the next step's rows (``sample_reqs``) on the mask thread
        (``submit``), so they compute while the commit runs. None when no row is
        constrained. ``after_step(..., early=)`` then applies the advances; ``prepare(...,
        early=)`` takes the masks."""
        if self.remote:
            return self._start_early_remote(done, sampled, sample_reqs, gate)
        finished = RequestStatus.FINISHED
        advanced: dict[int, tuple[Request, Advance]] = {}
        for row, sr in enumerate(done.seqs):
            req = sr.request
            rp = req.procs
            if rp is None or not sr.sample or rp.structured is None or req.status == finished:
                continue
            try:
                res = rp.structured.accept(int(sampled[row]))
            except Exception:  # noqa: BLE001 -- (as a grammar that cannot continue)
                res = Advance.ERROR
            advanced[id(req)] = (req, res)
        cont = Advance.CONTINUE
        structured = []
        for req in sample_reqs:
            rp = req.procs
            if (rp is None or rp.structured is None or req.status == finished
                    or advanced.get(id(req), (req, cont))[1] is not cont):
                continue
            structured.append(rp.structured)
        if not advanced and not structured:
            return None
        early = EarlyMasks(advanced)
        if structured:  # (should this fail, ``prepare`` computes the masks itself)
            mask = np.empty((len(structured), self.words), np.uint32)
            grammars = self.grammars
            early.future = submit_started(
                submit, lambda: grammars.fill_bitmasks(structured, mask))
            early.rows = {id(st): k for k, st in enumerate(structured)}
            early.mask = mask
        return early

    def _start_early_remote(self, done: SchedulerOutput, sampled: np.ndarray,
                            sample_reqs: Sequence[Request],
                            gate: tuple[int, list[int]] | None = None) -> EarlyMasks | None:
        """``start_early`` with the matchers in the worker: one job advances ``done``'s rows and
        masks the next step's (the worker leaves out a row whose advance did not continue).
        ``gate``: (sequence, keys): the next step was launched gated (``prepare(...,
        masks=False)`` gave its rows' keys): the masks go to the gate's rows, in that order."""
        finished = RequestStatus.FINISHED
        adv_reqs: list[Request] = []
        keys: list[int] = []
        toks: list[int] = []
        for row, sr in enumerate(done.seqs):
            req = sr.request
            rp = req.procs
            if rp is None or not sr.sample or rp.structured is None or req.status == finished:
                continue
            adv_reqs.append(req)
            keys.append(rp.structured.key)
            toks.append(int(sampled[row]))
        structured = [req.procs.structured for req in sample_reqs
                      if req.procs is not None and req.procs.structured is not None
                      and req.status != finished]
        if not adv_reqs and not structured:
            return None
        early = EarlyMasks({})
        early.adv_reqs = adv_reqs
        try:
            w = _worker_of([r.procs.structured for r in adv_reqs] + structured)
            job = w.submit(keys, toks, [st.key for st in structured] if gate is None
                           else gate[1], gate=0 if gate is None else gate[0])
        except GrammarError as e:  # (the worker is gone: these requests fail in after_step)
            early.advanced = {id(r): (r, res) for r, res in _all_failed(adv_reqs, str(e))}
            return early
        early.job = job
        if structured and gate is None:
            early.mask, early.future = job.mask, job
            early.rows = {id(st): k for k, st in enumerate(structured)}
        return early

    def prepare(self, sample_reqs: Sequence[Request],
                early: EarlyMasks | None = None, masks: bool = True) -> ProcessorRows | None:
        """The step's rows (one per sample row, in order), or None when none has a processor.
        A request already finished (async scheduling: by the step before this one, whose row
        here is dropped) samples unconstrained. ``early``: the masks ``start_early`` started
        for these rows (a constrained row it lacks: they are computed here instead).
        ``masks=False``: a gated step's rows (no masks: ``grammar_keys`` says which worker
        rows they will be).

        A steady batch (the same requests in the same rows, none finished, every row's slot
        held and its sparse list fixed) reuses the previous step's rows (``_steady``): only the
        grammar masks are new. Those rows' arrays are read-only."""
        key = list(map(id, sample_reqs))
        c = self._steady
        if c is not None and c[0] == key and self._steady_holds(c[1]):
            _key, _have, flags, slot, pen, grow0, structured, sparse = c
            grow = grow0.copy()
            mask, fill, future, keys = self._masks(structured, grow, early, masks)
            return ProcessorRows(flags=flags, slot=slot, penalties=pen, grammar_row=grow,
                                 grammar_mask=mask, sparse_start=sparse[0],
                                 sparse_ids=sparse[1], sparse_vals=sparse[2], inits=[],
                                 fill=fill, future=future, grammar_keys=keys)
        self._steady = None
        finished = RequestStatus.FINISHED
        # the rows with processors (a few of the step's, usually)
        have = [(i, r, r.procs) for i, r in enumerate(sample_reqs)
                if r.procs is not None and r.status != finished]
        if not have:
            return None
        s, v = len(sample_reqs), self.vocab_size
        flags = np.zeros(s, np.uint32)
        slot = np.full(s, -1, np.int32)
        pen = np.zeros((s, 3), np.float32)
        pen[:, 0] = 1.0
        grow = np.full(s, -1, np.int32)
        counts = np.zeros(s + 1, np.int32)
        ids: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        structured: list[StructuredRequest] = []
        inits: list[SlotInit] = []
        in_step = {rp.slot for _i, _r, rp in have if rp.slot is not None}
        steady = True  # every row's sparse list fixed, no slot (re)built
        for i, req, rp in have:
            f = 0
            if rp.structured is not None:
                f |= FLAG_GRAMMAR
                grow[i] = len(structured)
                structured.append(rp.structured)
            if rp.needs_slot:
                if rp.slot is None:
                    in_step.add(self.pool.acquire(rp, in_step))
                    inits.append(rp.slot_init(v))
                    steady = False
                slot[i] = rp.slot
                if rp.allowed is not None:
                    f |= FLAG_ALLOWED
                if rp.has_penalties:
                    f |= FLAG_PENALTY
                    pen[i] = rp.penalties
            steady = steady and rp._static is not None
            si, sv = rp.sparse()
            if si.size:
                f |= FLAG_SPARSE
                ids.append(si)
                vals.append(sv)
                counts[i + 1] = si.size
            if f & ~FLAG_GRAMMAR and req.params.logprobs is not None:
                f |= FLAG_SAVE_RAW  # its logprobs are of the row before these processors
            flags[i] = f
        sparse = (np.cumsum(counts, dtype=np.int32),
                  np.concatenate(ids) if ids else np.zeros(0, np.int32),
                  np.concatenate(vals) if vals else np.zeros(0, np.float32))
        if steady:  # (strong references in ``have``: no id in ``key`` is reused meanwhile)
            snap = [(r, rp, rp.slot, rp.structured) for _i, r, rp in have]
            for a in (flags, slot, pen, *sparse):
                a.flags.writeable = False
            self._steady = (key, snap, flags, slot, pen, grow.copy(), structured, sparse)
        mask, fill, future, keys = self._masks(structured, grow, early, masks)
        return ProcessorRows(
            flags=flags, slot=slot, penalties=pen, grammar_row=grow, grammar_mask=mask,
            sparse_start=sparse[0], sparse_ids=sparse[1], sparse_vals=sparse[2],
            inits=inits, fill=fill, future=future, grammar_keys=keys)

    @staticmethod
    def _steady_holds(snap: list) -> bool:
        """The rows of ``snap`` are still what they were: running, their slot and matcher the
        same."""
        finished = RequestStatus.FINISHED
        for r, rp, slot, st in snap:
            if r.status == finished or r.procs is not rp or rp.slot != slot \
                    or rp.structured is not st:
                return False
        return True

    def _masks(self, structured: list, grow: np.ndarray, early: EarlyMasks | None,
               masks: bool = True) -> tuple[np.ndarray, Callable[[], None] | None, Any, Any]:
        """The grammar masks of rows ``structured`` (``grow``: their rows, remapped in place
        onto an early start's): (mask, fill, future, None); ``masks=False``: (no rows, None,
        None, the worker's keys of ``structured``)."""
        fill = future = None
        if not masks:
            return (np.zeros((0, self.words), np.uint32), None, None,
                    [st.key for st in structured])
        if (structured and early is not None and early.mask is not None
                and all(id(st) in early.rows for st in structured)):
            mask, future = early.mask, early.future  # (rows of finished requests: unused)
            took = grow >= 0
            grow[took] = [early.rows[id(structured[g])] for g in grow[took]]
        else:
            if early is not None and early.future is not None:
                early.future.exception()  # (not used: let the mask thread finish it first)
            mask = np.empty((len(structured), self.words), np.uint32)
            if structured and self.remote:  # the worker starts them now
                try:
                    job = _worker_of(structured).submit([], [], [st.key for st in structured])
                    mask, future = job.mask, job
                except GrammarError:  # the worker died: these rows run unconstrained, and
                    mask[:] = 0xFFFFFFFF  # the step's advance finishes their requests (error)
            elif structured:  # computed by the executor (ProcessorRows.fill_masks), maybe
                grammars = self.grammars  # overlapped

                def fill() -> None:
                    grammars.fill_bitmasks(structured, mask)

        return mask, fill, future, None

    def step_failed(self, out: SchedulerOutput) -> None:
        """A step that did not run may have lost its slot inits: its requests' slots are
        rebuilt from their token ids when they next sample."""
        for sr in out.seqs:
            rp = sr.request.procs
            if rp is not None and rp.slot is not None:
                self.pool.release(rp)

    def after_step(self, out: SchedulerOutput,
                   finish: Callable[..., None], stop: FinishReason,
                   error: FinishReason, early: EarlyMasks | None = None) -> None:
        """The step's sampled tokens are appended: advance the matchers (``early``: they were
        advanced by ``start_early``; only the outcomes are applied here). A grammar completed
        finishes its request (``stop``: only EOS could follow); one that cannot continue
        finishes it with ``error``. A request the commit finished is left as it is."""
        if not self.live:
            return
        finished = RequestStatus.FINISHED
        if early is not None:
            done = [(req, res) for req, res in early.outcomes() if req.status != finished]
        else:
            reqs = [sr.request for sr in out.seqs
                    if sr.sample and sr.request.procs is not None
                    and sr.request.procs.structured is not None
                    and sr.request.status != finished]
            if self.remote:
                done = self._advance_remote(reqs) if reqs else []
            else:
                done = [(req, req.procs.structured.accept(req.output_token_ids[-1]))
                        for req in reqs]
        for req, res in done:
            rp = req.procs
            if res is Advance.DONE:
                finish(req, stop)
            elif res is Advance.ERROR:
                finish(req, error, error=f"structured output: the grammar cannot continue "
                                         f"({rp.structured.error})")

    def _advance_remote(self, reqs: list[Request]) -> list[tuple[Request, Advance]]:
        """Advance ``reqs``' matchers in the worker by their last tokens (and wait)."""
        try:
            job = _worker_of([r.procs.structured for r in reqs]).submit(
                [r.procs.structured.key for r in reqs], [r.output_token_ids[-1] for r in reqs],
                [])
        except GrammarError as e:
            return _all_failed(reqs, str(e))
        return _remote_outcomes(job, reqs)
