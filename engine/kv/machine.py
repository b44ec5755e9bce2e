"""The block manager's RuleBasedStateMachine: a scheduler-shaped driver, and every invariant.

The driver behaves like the scheduler: it asks ``can_allocate`` for exactly what a step will
take (``pages_needed_for_new`` on admission, ``pages_needed`` afterwards) and, when admission says
yes, the allocation must succeed and consume exactly that. Steps are split like real ones:
``schedule`` appends slots (prefill chunk, or decode token plus speculative drafts), the step
"executes" (writes a content record into each slot), and ``complete`` commits what was accepted
and rolls back the rest, or rolls the whole step back when it failed (writing garbage first).

After every step ``invariants_hold`` runs ``engine.kv.invariants.check_invariants`` (the free /
inactive / in-use partition and its counts; refcount == tables holding the page; no page both
free and referenced; pins == live duplicates; nothing registered with the cache off; nothing
resident once all requests are gone, all free with the cache off; in-flight pages exclusive;
gauges; the by-reference total within ``max_page_refs``), then checks the manager against the
model: each request's progress and in-flight slots, and a content oracle: every committed
position of every live request reads, through its page table, the KV of exactly its own token
prefix and salt, so no aliasing, stale page or wrong swap can go unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.kv.block_manager import BlockManager, max_page_refs
from engine.kv.errors import KVCacheError, KVUsageError, OutOfPagesError
from engine.kv.invariants import check_invariants
from engine.kv.workloads import COVERAGE, Workload, prompts, workloads

Content = tuple[object, ...]  # what "execute" wrote into a slot: (salt, token prefix) or garbage


@dataclass
class _Pending:
    n: int  # real tokens of the step
    drafts: list[int]  # speculative tokens appended after them
    slots: list[int]


@dataclass
class _Req:
    rid: int
    salt: str | None
    tokens: list[int]  # prompt + generated; tokens[computed:] still need their KV computed
    # (the model owns the tokens and the progress, as the scheduler's Request does: the block
    # manager is given them, never keeps them)
    prompt_len: int  # at (re)admission
    computed: int = 0
    pending: _Pending | None = None


@dataclass
class _Model:
    live: dict[int, _Req] = field(default_factory=dict)
    preempted: list[_Req] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    history: list[list[int]] = field(default_factory=list)
    content: dict[int, Content] = field(default_factory=dict)  # slot -> what was written
    next_rid: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVStateMachine(RuleBasedStateMachine):
    manager_cls: type[BlockManager] = BlockManager
    workload_strategy: st.SearchStrategy[Workload] = workloads()

    def __init__(self) -> None:
        super().__init__()
        self.m = _Model()
        self.w: Workload
        self.bm: BlockManager
        COVERAGE.examples += 1

    def _event(self, name: str) -> None:
        COVERAGE.events[name] += 1

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.w = data.draw(self.workload_strategy, label="workload")
        self.bm = self.w.make_manager(self.manager_cls)
        w, seen = self.w, COVERAGE.workloads
        for key in (f"duplicate_policy={w.duplicate_policy}", f"page_size={w.page_size}",
                    f"prefix_caching at start={w.prefix_caching}", f"weak_hash={w.weak_hash}",
                    f"padding page={w.reserve_padding_page}", f"max_batch={w.max_batch}"):
            seen[key] += 1

    # -- admission and steps, the way the scheduler does them ---------------------------------
    def _admit(self, data: st.DataObject, req: _Req) -> bool:
        bm, w = self.bm, self.w
        before = bm.snapshot()
        cached = bm.num_cached_prefix_tokens(req.tokens, req.salt)
        assert cached % w.page_size == 0 and cached <= len(req.tokens) - 1, cached
        chunk = data.draw(st.integers(1, min(w.max_chunk, len(req.tokens) - cached)), "chunk")
        cost = bm.pages_needed_for_new(req.tokens, req.salt, num_new_tokens=chunk)
        assert bm.snapshot() == before, "a dry run changed the state"
        if not bm.can_allocate(cost):
            self._event("admission refused (pool full)")
            return False
        avail = bm.num_free + bm.num_inactive
        assert bm.create(req.rid, req.tokens, req.salt) == cached
        self._event("prefix hit" if cached else "prefix miss")
        req.computed, req.pending = cached, None
        self.m.live[req.rid] = req
        assert self._append(data, req, chunk, []), "admission accepted, then the step did not fit"
        assert avail - bm.num_free - bm.num_inactive == cost, "admission cost was not exact"
        return True

    def _append(self, data: st.DataObject, req: _Req, n: int, drafts: list[int]) -> bool:
        bm = self.bm
        need = bm.pages_needed(req.rid, n + len(drafts))
        if not bm.can_allocate(need):
            return False
        avail = bm.num_free + bm.num_inactive
        try:
            slots = bm.append_slots(req.rid, n + len(drafts))
        except OutOfPagesError as e:
            raise AssertionError(f"can_allocate({need}) said yes, then: {e}") from e
        assert avail - bm.num_free - bm.num_inactive == need, "pages_needed was not exact"
        assert len(slots) == len(set(slots)) == n + len(drafts)
        req.pending = _Pending(n, drafts, slots)
        return True

    def _pick(self, data: st.DataObject, reqs: list[_Req]) -> _Req:
        return data.draw(st.sampled_from(sorted(reqs, key=lambda r: r.rid)), "request")

    # -- actions: ``step`` draws one of those applicable, weighted by the workload's mix --------
    def _applicable(self) -> dict[str, bool]:
        m, room = self.m, len(self.m.live) < self.w.max_batch
        return {"admit": room, "resume": room and bool(m.preempted),
                "fork": room and any(r.computed for r in m.live.values()),
                "schedule": bool(self._schedulable()),
                "complete": any(r.pending for r in m.live.values()),
                "finish": any(r.computed >= r.prompt_len for r in m.live.values()),
                "preempt": bool(m.live)}

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        ok = self._applicable()
        mix = [a for a, weight in self.w.mix if ok.get(a, True) for _ in range(weight)]
        action = data.draw(st.sampled_from(mix), "action")
        COVERAGE.rules[action] += 1
        getattr(self, action)(data)

    def admit(self, data: st.DataObject) -> None:
        w, m = self.w, self.m
        prompt = data.draw(prompts(w.alphabet, w.max_model_len, m.history), "prompt")
        m.history = (m.history + [prompt])[-8:]
        req = _Req(m.next_rid, data.draw(st.sampled_from(w.salts), "salt"), list(prompt),
                   len(prompt))
        m.next_rid += 1
        self._admit(data, req)

    def fork(self, data: st.DataObject) -> None:
        """A new request sharing a live one's tokens (parallel sampling, a shared conversation):
        the computed part is a prefix hit, the rest is computed twice at once (duplicates)."""
        w, m = self.w, self.m
        base = self._pick(data, [r for r in m.live.values() if r.computed])
        cut = data.draw(st.integers(base.computed, len(base.tokens)), "shared tokens")
        tail = data.draw(st.lists(st.integers(0, w.alphabet - 1), min_size=1,
                                  max_size=max(1, w.max_model_len - cut)), "tail")
        prompt = (base.tokens[:cut] + tail)[:w.max_model_len]
        self._admit(data, _Req(m.next_rid, base.salt, prompt, len(prompt)))
        m.next_rid += 1

    def resume(self, data: st.DataObject) -> None:
        """A preempted request comes back and recomputes (its prompt is now all its tokens)."""
        req = self._pick(data, self.m.preempted)
        if self._admit(data, req):
            self.m.preempted.remove(req)

    def _schedulable(self) -> list[_Req]:
        return [r for r in self.m.live.values() if r.pending is None and len(r.tokens) > r.computed]

    def schedule(self, data: st.DataObject) -> None:
        """One request's part of a step: a prefill chunk, or a decode token + drafts."""
        w, req = self.w, self._pick(data, self._schedulable())
        remaining = len(req.tokens) - req.computed
        n = data.draw(st.integers(1, min(w.max_chunk, remaining)), "n")
        k_max = min(w.max_spec, w.max_model_len - req.computed - n) if n == remaining else 0
        drafts = data.draw(st.lists(st.integers(0, w.alphabet - 1), max_size=max(k_max, 0)))
        if self._append(data, req, n, drafts):
            self._event("speculative step" if drafts else "step")
            return
        # The scheduler would now preempt someone. Show that the refusal was true and harmless.
        self._event("step refused (pool full)")
        before = self.bm.snapshot()
        try:
            self.bm.append_slots(req.rid, n + len(drafts))
        except OutOfPagesError:
            assert self.bm.snapshot() == before, "a failed allocation changed the state"
        else:
            raise AssertionError("can_allocate said no, but the allocation succeeded")
        others = [r for r in self.m.live.values() if r is not req]
        if others and data.draw(st.booleans(), "preempt the newest other request"):
            self._event("preempted for space")
            self._release(max(others, key=lambda r: r.rid), preempt=True)

    def complete(self, data: st.DataObject) -> None:
        """The step ran: commit what was accepted, roll back the rest (or all, if it failed)."""
        bm, w, m = self.bm, self.w, self.m
        req = self._pick(data, [r for r in m.live.values() if r.pending])
        p, start = req.pending, req.computed
        assert p is not None
        k = len(p.drafts)
        if data.draw(st.sampled_from([False] * 7 + [True]), "step fails"):
            for slot in p.slots:
                m.content[slot] = ("garbage",)
            bm.rollback(req.rid, p.n + k, start)
            req.pending = None
            self._event("failed step rolled back")
            return
        inputs = req.tokens + p.drafts
        for j, slot in enumerate(p.slots):
            m.content[slot] = (req.salt, tuple(inputs[:start + j + 1]))
        accepted = min(data.draw(st.integers(0, k), "accepted"), w.max_model_len - len(req.tokens))
        tokens = req.tokens + p.drafts[:accepted]
        computed = start + p.n + accepted
        if data.draw(st.booleans(), "rollback first"):
            bm.rollback(req.rid, k - accepted, start)
            bm.commit(req.rid, start, computed, tokens)
        else:
            bm.commit(req.rid, start, computed, tokens)
            bm.rollback(req.rid, k - accepted, computed)
        if k > accepted:
            self._event("speculative tokens rejected")
        req.tokens, req.computed, req.pending = tokens, computed, None
        if computed == len(tokens) and len(tokens) < w.max_model_len:  # sample the next token
            req.tokens.append(data.draw(st.integers(0, w.alphabet - 1), "sampled"))

    def finish(self, data: st.DataObject) -> None:
        """Finish a request past its prefill (possibly mid-step: an abort)."""
        live = [r for r in self.m.live.values() if r.computed >= r.prompt_len]
        self._release(self._pick(data, live), preempt=False)

    def preempt(self, data: st.DataObject) -> None:
        """Preempt for recomputation: release now, come back later through ``resume``."""
        self._release(self._pick(data, list(self.m.live.values())), preempt=True)

    def _release(self, req: _Req, preempt: bool) -> None:
        m = self.m
        if req.pending:
            self._event("released mid-step")
        self.bm.release(req.rid)
        del m.live[req.rid]
        m.released = (m.released + [req.rid])[-8:]
        m.history = (m.history + [list(req.tokens)])[-8:]
        if preempt:
            req.computed, req.pending, req.prompt_len = 0, None, len(req.tokens)
            m.preempted.append(req)

    def toggle_cache(self, data: st.DataObject) -> None:
        enabled = data.draw(st.sampled_from([True, True, False]), "enable prefix caching")
        bm, g = self.bm, self.bm.gauges()
        was = bm.prefix_caching
        bm.set_prefix_caching(enabled)
        if was and not enabled:
            self._event("cache switched off")
            assert bm.num_inactive == 0 and bm.gauges()["cached"] == 0
            assert bm.num_free == g["free"] + g["reclaimable"], "drain lost pages"
        elif enabled and not was:
            self._event("cache switched on")

    def misuse(self, data: st.DataObject) -> None:
        """Misuse raises a typed error and changes nothing."""
        bm, m = self.bm, self.m
        live = sorted(m.live.values(), key=lambda r: r.rid)
        kinds = ["release_released", "append_released"]
        if live:
            kinds += ["rollback_committed", "commit_past_slots", "commit_backwards",
                      "commit_unknown_tokens", "create_twice", "over_allocate"]
        kind = data.draw(st.sampled_from(kinds), "misuse")
        before = bm.snapshot()
        req = data.draw(st.sampled_from(live), "request") if live else None
        gone = next((r for r in reversed(m.released) if r not in m.live), -1)  # -1: never made
        expected: type[KVCacheError] = KVUsageError
        try:
            if kind == "release_released":
                bm.release(gone)
            elif kind == "append_released":
                bm.append_slots(gone, 1)
            elif kind == "over_allocate":
                expected = OutOfPagesError
                slots = bm.num_tokens(req.rid)  # type: ignore[union-attr]
                fill = _cdiv(slots, bm.page_size) * bm.page_size - slots
                bm.append_slots(req.rid, fill + (bm.num_free + bm.num_inactive + 1) * bm.page_size)
            elif kind == "rollback_committed":
                assert req is not None
                bm.rollback(req.rid, bm.num_tokens(req.rid) - req.computed + 1, req.computed)
            elif kind == "commit_past_slots":
                assert req is not None
                bm.commit(req.rid, req.computed, bm.num_tokens(req.rid) + 1,
                          req.tokens + [0] * 64)
            elif kind == "commit_backwards":
                assert req is not None
                if req.computed == 0:
                    return
                bm.commit(req.rid, req.computed, req.computed - 1, req.tokens)
            elif kind == "commit_unknown_tokens":  # fewer token ids than positions
                assert req is not None
                n = bm.num_tokens(req.rid)
                if n == 0:
                    return
                bm.commit(req.rid, req.computed, n, [0] * (n - 1))
            elif kind == "create_twice":
                assert req is not None
                bm.create(req.rid, req.tokens, req.salt)
        except expected:
            self._event(f"misuse refused: {kind}")
        else:
            raise AssertionError(f"{kind}: no {expected.__name__} raised")
        assert bm.snapshot() == before, f"{kind}: the refused call changed the state"

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def invariants_hold(self) -> None:
        bm, w, m = self.bm, self.w, self.m
        COVERAGE.steps += 1
        total = check_invariants(bm, max_batch=w.max_batch, max_model_len=w.max_model_len)
        assert total <= max_page_refs(w.max_batch, w.max_model_len, w.page_size)
        assert set(bm.request_ids()) == set(m.live), "requests lost or invented"
        # Per request, against the model: progress, in-flight slots, and the content oracle.
        ps = w.page_size
        for req in m.live.values():
            pages = bm.page_table(req.rid)
            in_flight = req.pending.n + len(req.pending.drafts) if req.pending else 0
            assert bm.num_computed_pages(req.rid) == req.computed // ps
            assert bm.num_tokens(req.rid) == req.computed + in_flight <= w.max_model_len
            if req.pending:
                assert req.pending.slots == [pages[q // ps] * ps + q % ps for q in
                                             range(req.computed, req.computed + in_flight)]
            for q in range(req.computed):
                got = m.content.get(pages[q // ps] * ps + q % ps)
                assert got == (req.salt, tuple(req.tokens[:q + 1])), (
                    f"request {req.rid} position {q} reads KV of {got}")
        cov = COVERAGE
        cov.max_pages_in_use = max(cov.max_pages_in_use, bm.num_in_use)
        cov.max_byref_over_pool = max(cov.max_byref_over_pool, total / bm.num_pages)
        if total > bm.num_pages:
            self._event("by-reference total > physical pool")

    def teardown(self) -> None:
        if hasattr(self, "bm"):
            COVERAGE.manager.update(self.bm.stats())
