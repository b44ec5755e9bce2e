"""What the block manager's state machine runs against, and what it counts: random workloads
(tiny pools near capacity, prompts that share prefixes, an optional colliding hash) and the
coverage summed over a run.

Shared by the state machine (``engine.kv.machine``) and its public entry points
(``engine.kv.testing``), which both import it; it imports neither. Needs Hypothesis.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import strategies as st

from engine.kv.block_manager import DUPLICATE_POLICIES, BlockManager


# -- workloads ---------------------------------------------------------------------------------
def weak_hash(parent_hash: bytes, tokens: tuple[int, ...], salt: str | None) -> bytes:
    """A deliberately terrible hash (3 values, ignores parent and salt) to exercise the
    collision path: the cache must miss, never alias."""
    return bytes([sum(tokens) % 3]) * 16


# How often each action of the state machine is drawn (among those applicable). Mostly steps,
# so requests live long enough to complete, share and duplicate pages; a few of everything else.
DEFAULT_MIX: tuple[tuple[str, int], ...] = (
    ("admit", 3), ("fork", 2), ("resume", 1), ("schedule", 6), ("complete", 5), ("finish", 1),
    ("preempt", 1), ("toggle_cache", 1), ("misuse", 1))


@dataclass(frozen=True)
class Workload:
    """One random configuration the state machine runs against."""

    num_pages: int  # usable pages (the padding page, if reserved, comes on top)
    page_size: int
    reserve_padding_page: bool
    duplicate_policy: str
    prefix_caching: bool
    weak_hash: bool
    alphabet: int  # tokens are 0..alphabet-1: small, so prefixes collide
    salts: tuple[str | None, ...]
    max_batch: int
    max_model_len: int
    max_chunk: int  # prefill chunk limit (tokens per step)
    max_spec: int  # speculative lookahead limit (draft tokens per decode step)
    mix: tuple[tuple[str, int], ...] = DEFAULT_MIX  # (action, weight) of the state machine

    def make_manager(self, cls: type[BlockManager] = BlockManager) -> BlockManager:
        if self.weak_hash:
            cls = _weak_hash_subclass(cls)
        return cls(self.num_pages + self.reserve_padding_page, self.page_size,
                   enable_prefix_caching=self.prefix_caching,
                   duplicate_policy=self.duplicate_policy,
                   reserve_padding_page=self.reserve_padding_page)


_WEAK: dict[type[BlockManager], type[BlockManager]] = {}


def _weak_hash_subclass(cls: type[BlockManager]) -> type[BlockManager]:
    if cls not in _WEAK:
        _WEAK[cls] = type(f"WeakHash{cls.__name__}", (cls,), {"hash_fn": staticmethod(weak_hash)})
    return _WEAK[cls]


@st.composite
def workloads(draw: st.DrawFn, max_pool: int = 16, page_sizes: tuple[int, ...] = (1, 2, 3, 4),
              max_pages_per_seq: int = 8) -> Workload:
    """Tiny pools near capacity: most steps are a few pages away from running out."""
    page_size = draw(st.sampled_from(page_sizes))
    return Workload(
        num_pages=draw(st.integers(2, max_pool)),
        page_size=page_size,
        reserve_padding_page=draw(st.booleans()),
        duplicate_policy=draw(st.sampled_from(DUPLICATE_POLICIES)),
        prefix_caching=draw(st.integers(0, 3)) > 0,
        weak_hash=draw(st.sampled_from([False, False, False, True])),
        alphabet=draw(st.integers(2, 3)),
        salts=draw(st.sampled_from([(None,), (None, "adapter-a")])),
        max_batch=draw(st.integers(1, 4)),
        max_model_len=draw(st.integers(2 * page_size + 1, page_size * max_pages_per_seq)),
        max_chunk=draw(st.integers(1, 3 * page_size)),
        max_spec=draw(st.integers(0, 4)),
    )


def prompts(alphabet: int, max_len: int, history: list[list[int]]) -> st.SearchStrategy[list[int]]:
    """Mostly a cut of an earlier sequence (prompt + generated: a conversation going on) plus a
    tail, so that prefixes are shared and pages duplicated; sometimes a fresh prompt."""
    tok = st.integers(0, alphabet - 1)
    fresh = st.lists(tok, min_size=1, max_size=max_len)
    if not history:
        return fresh
    derived = st.tuples(st.sampled_from(history), st.integers(0, max_len),
                        st.lists(tok, max_size=max_len)).map(
        lambda t: (t[0][:len(t[0]) - t[1]] + t[2])[:max_len] or [0])
    return st.one_of(derived, derived, fresh)


# -- coverage ----------------------------------------------------------------------------------
@dataclass
class Coverage:
    """What the runs exercised, summed over examples (shrinking included)."""

    examples: int = 0
    steps: int = 0
    workloads: Counter[str] = field(default_factory=Counter)
    rules: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    manager: Counter[str] = field(default_factory=Counter)  # BlockManager.stats(), summed
    max_pages_in_use: int = 0
    max_byref_over_pool: float = 0.0  # by-reference total / usable pages

    def report(self) -> str:
        lines = [f"examples: {self.examples}   steps: {self.steps}",
                 f"max pages in use: {self.max_pages_in_use}   "
                 f"max by-reference total / pool: {self.max_byref_over_pool:.2f}",
                 ]
        for title, counts in (("workloads", self.workloads), ("actions (rules fired)", self.rules),
                              ("events", self.events),
                              ("block manager counters (summed)", self.manager)):
            lines.append(f"{title}:")
            lines += [f"  {k:<40}{v:>10}" for k, v in sorted(counts.items())]
        return "\n".join(lines)


COVERAGE = Coverage()


def reset_coverage() -> Coverage:
    COVERAGE.__init__()  # type: ignore[misc]  # in place: the machine holds this object
    return COVERAGE
