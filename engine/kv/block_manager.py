"""Paged KV block manager: per-request page tables over the page pool, with a prefix cache.

Pages and their states are ``engine.kv.pool``'s; hashing is ``engine.kv.prefix_cache``'s. Here:
the API the scheduler calls, the request tables, and the duplicate policy.

The manager keeps pages, hashes and refcounts, never a request's tokens or progress: the caller
(the scheduler, whose ``Request`` owns both) passes the token ids and the computed count to the
calls that need them. Per request it keeps the page table, how many of its slots are handed out
(``num_slots``: the table's fill), the salt and the chained hash of each full computed page.

Duplicates: a request completes a page whose prefix is already registered on another page, the
primary. ``allow`` keeps both; the duplicate stays unregistered and pins the primary, so that the
chain the request keeps registering under (it continues from the primary's entry) stays reachable
while the duplicate lives. ``reject`` swaps the primary into the table and frees the new page.
Either way the primary is released exactly once (``primaries_pinned == primaries_released`` once
the duplicates are gone). With the cache off nothing is registered, and release returns every
page to the free list ("reset on release").
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from engine.kv.errors import KVUsageError, OutOfPagesError, PageRefOverflowError
from engine.kv.pool import PagePool
from engine.kv.prefix_cache import ROOT_HASH, ROOT_ID, CachedPage, HashFn, PrefixCache, page_hash

DUPLICATE_POLICIES = ("allow", "reject")
_STATS = ("prefix_queries", "prefix_hit_requests", "prefix_hit_pages", "pages_allocated",
          "evictions", "pages_registered", "duplicates_allowed", "duplicates_rejected",
          "primaries_pinned", "primaries_released", "hash_collisions", "rollback_tokens",
          "rollback_pages", "releases", "inactive_drained", "out_of_pages")


# A page table is an array of C ints, not a list: the step builder joins the tables of a batch
# as bytes (one C call) instead of converting every page id of every table at every step.
PAGE_TYPECODE = "i"
if array(PAGE_TYPECODE).itemsize != 4:  # C int is 32 bits on every platform CPython runs on
    raise ImportError(f"array typecode {PAGE_TYPECODE!r} is not 32 bits here")


def _new_table() -> array[int]:
    return array(PAGE_TYPECODE)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_page_refs(max_batch: int, max_model_len: int, page_size: int) -> int:
    """Size of the decode page-index buffer: every sequence of a full batch at full length, with
    shared pages counted once per table (by reference). Never derive it from the physical pool:
    prefix sharing makes the by-reference total exceed the pool."""
    return max_batch * _cdiv(max_model_len, page_size)


@dataclass(eq=False, slots=True)
class _Seq:
    salt: str | None  # the prefix-cache namespace its pages are hashed under
    pages: array[int] = field(default_factory=_new_table)  # the page table (int32)
    num_slots: int = 0  # positions with a slot (computed + in flight)
    # chained hash of each full computed page: len(hashes) == num_computed_tokens // page_size
    hashes: list[bytes] = field(default_factory=list)
    chain: list[CachedPage | None] = field(default_factory=list)  # its entry (None: unregistered)


@dataclass(frozen=True)
class KVSnapshot:
    """Complete observable state, for invariant checks and "an error changed nothing" tests."""

    free: tuple[int, ...]
    inactive: tuple[int, ...]  # LRU order, oldest first
    refcounts: tuple[int, ...]  # indexed by physical page id
    pins: tuple[tuple[int, int], ...]  # (primary, number of duplicates pinning it)
    duplicates: tuple[tuple[int, int], ...]  # (duplicate page, its primary)
    registered: tuple[int, ...]
    # rid, pages, slots, full computed pages (hashed: registered when the cache is on)
    tables: tuple[tuple[Hashable, tuple[int, ...], int, int], ...]
    prefix_caching: bool


class BlockManager:
    """Pages, page tables and prefix cache of one KV pool. Single-threaded: the scheduler owns it.

    A step, the scheduler's way (check, then allocate, one request at a time: an allocation may
    evict cached pages that another request's estimate counted on)::

        admit:    n = pages_needed_for_new(prompt, salt, num_new_tokens=chunk)
                  if can_allocate(n): create(rid, prompt, salt); slots = append_slots(rid, chunk)
        running:  if can_allocate(pages_needed(rid, k)): slots = append_slots(rid, k)
        after:    commit(rid, start, num_computed, token_ids)
                  rollback(rid, rejected_drafts, num_computed)
        failed:   rollback(rid, k, num_computed)
        done:     release(rid)  (finish, abort or preempt)

    ``token_ids`` is the request's whole token sequence (any ``Sequence[int]``: a list, or the
    ``Request``'s own view of it); ``start`` / ``num_computed`` are the request's computed count
    before / after the step. The manager checks them against what it holds (slots, hashed pages)
    and raises ``KVUsageError`` on a contradiction, changing nothing.
    """

    PADDING_PAGE: ClassVar[int] = 0
    hash_fn: ClassVar[HashFn] = staticmethod(page_hash)
    pool_cls: ClassVar[type[PagePool]] = PagePool

    def __init__(self, num_pages: int, page_size: int = 16, *, enable_prefix_caching: bool = True,
                 duplicate_policy: str = "allow", reserve_padding_page: bool = True) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        first = 1 if reserve_padding_page else 0
        if not isinstance(num_pages, int) or num_pages - first < 1:
            raise ValueError(f"num_pages={num_pages!r} leaves no usable page "
                             f"(reserve_padding_page={reserve_padding_page})")
        if duplicate_policy not in DUPLICATE_POLICIES:
            raise ValueError(f"duplicate_policy must be one of {DUPLICATE_POLICIES}, "
                             f"got {duplicate_policy!r}")
        self.page_size = page_size
        self.num_physical_pages = num_pages  # what the executor allocates, padding page included
        self.num_pages = num_pages - first  # usable pages: the accounting total
        self.reserve_padding_page = reserve_padding_page
        self.duplicate_policy = duplicate_policy
        self._stats: Counter[str] = Counter(dict.fromkeys(_STATS, 0))
        self._cache = PrefixCache(page_size, type(self).hash_fn)
        self._match_memo: tuple | None = None  # _match's last answer
        self._pool = self.pool_cls(num_pages, first, self._cache, self._stats,
                                   enable_prefix_caching)
        self._seqs: dict[Hashable, _Seq] = {}

    # -- accounting --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._pool.free)

    @property
    def num_inactive(self) -> int:
        return len(self._pool.inactive)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self._pool.num_reclaimable

    @property
    def prefix_caching(self) -> bool:
        return self._pool.caching

    def can_allocate(self, n_pages: int) -> bool:
        """True iff n new pages can be allocated now (``n <= num_free + num_inactive``)."""
        return n_pages <= self._pool.num_reclaimable

    def gauges(self) -> dict[str, int]:
        """live: referenced by a table; pinned: kept only by duplicates; cached: registered;
        reclaimable: inactive; page_refs: references over all tables (shared pages counted
        once per table)."""
        pool = self._pool
        pinned = pool.num_pinned_only()
        return {"pages": self.num_pages, "free": self.num_free, "reclaimable": self.num_inactive,
                "in_use": self.num_in_use, "live": self.num_in_use - pinned, "pinned": pinned,
                "cached": len(self._cache), "shared": pool.num_shared, "page_refs": pool.num_refs,
                "duplicates": len(pool.dup_of), "requests": len(self._seqs)}

    def stats(self) -> dict[str, int]:
        """Monotonic counters since construction."""
        return dict(self._stats)

    def max_page_refs(self, max_batch: int, max_model_len: int) -> int:
        return max_page_refs(max_batch, max_model_len, self.page_size)

    def set_prefix_caching(self, enabled: bool) -> None:
        """Turning the cache off drains the inactive pool to the free list and unregisters every
        page, once. Pages still in tables are freed at their release (a primary pinned by a
        duplicate, at the duplicate's release). Running requests register nothing more after it
        is turned back on (their chains were dropped); new requests do."""
        if enabled == self._pool.caching:
            return
        self._pool.caching = enabled
        if not enabled:
            self._stats["inactive_drained"] += self._pool.drain_inactive()
            self._cache.clear()

    # -- prefix lookup (dry runs) ------------------------------------------------------------
    def _match(self, token_ids: Sequence[int], salt: str | None) -> list[CachedPage]:
        if not self._pool.caching:
            return []
        # An admission asks three times about the same tokens (num_cached_prefix_tokens,
        # pages_needed_for_new, create): a 3,000-token prompt is 187 page hashes each time. The
        # last answer is kept while the index is unchanged, for the same list object (held
        # here, so its id cannot be reused) of the same length and salt.
        memo, cache = self._match_memo, self._cache
        if (memo is not None and memo[0] is token_ids and memo[1] == len(token_ids)
                and memo[2] == salt and memo[3] == cache.version):
            return memo[4]
        # Capped so that at least one prompt token is computed (its logits start decoding).
        out = cache.match(token_ids, salt, (len(token_ids) - 1) // self.page_size)
        self._match_memo = (token_ids, len(token_ids), salt, cache.version, out)
        return out

    def num_cached_prefix_tokens(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        return len(self._match(token_ids, salt)) * self.page_size

    def pages_needed_for_new(self, token_ids: Sequence[int], salt: str | None = None, *,
                             num_new_tokens: int | None = None) -> int:
        """What ``create`` then ``append_slots(num_new_tokens)`` takes from ``free + inactive``:
        new pages, plus cached pages that ``create`` pulls out of the inactive pool.
        ``num_new_tokens`` defaults to the whole uncached rest of the prompt."""
        matched = self._match(token_ids, salt)
        cached = len(matched) * self.page_size
        n_new = len(token_ids) - cached if num_new_tokens is None else num_new_tokens
        if n_new < 0:
            raise KVUsageError(f"num_new_tokens must be >= 0, got {n_new}")
        inactive = self._pool.inactive
        revived = sum(1 for e in matched if e.page in inactive) if inactive else 0
        return revived + _cdiv(cached + n_new, self.page_size) - len(matched)

    # -- per request -------------------------------------------------------------------------
    def create(self, request_id: Hashable, token_ids: Sequence[int],
               salt: str | None = None) -> int:
        """Register a request; take the longest cached prefix of its tokens by reference (the
        tokens are matched, not kept). Returns num_cached_tokens (a multiple of page_size,
        <= len(token_ids) - 1). Allocates no new page, but revives matched inactive pages (see
        ``pages_needed_for_new``)."""
        if request_id in self._seqs:
            raise KVUsageError(f"request {request_id!r} already exists; release it first")
        if len(token_ids) == 0:
            raise KVUsageError(f"request {request_id!r}: empty prompt")
        matched = self._match(token_ids, salt)
        n = len(matched) * self.page_size
        seq = _Seq(salt, num_slots=n)
        if matched:
            pages = [e.page for e in matched]
            self._pool.take_many(pages)
            seq.pages.extend(pages)
            seq.hashes.extend([e.hash for e in matched])
            seq.chain.extend(matched)
        self._seqs[request_id] = seq
        if self._pool.caching:
            self._stats["prefix_queries"] += 1
            self._stats["prefix_hit_requests"] += bool(matched)
            self._stats["prefix_hit_pages"] += len(matched)
        return n

    def pages_needed(self, request_id: Hashable, num_new_tokens: int) -> int:
        seq = self._get(request_id)
        if num_new_tokens < 0:
            raise KVUsageError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return max(0, _cdiv(seq.num_slots + num_new_tokens, self.page_size) - len(seq.pages))

    def append_slots(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Slots (page * page_size + offset) for the next num_tokens positions: a prefill chunk,
        a decode token, or a speculative span (later ``commit``/``rollback``). Raises
        OutOfPagesError, changing nothing, when the new pages exceed ``free + inactive``."""
        ps = self.page_size
        seq = self._seqs.get(request_id)
        if seq is not None:
            start = seq.num_slots
            off = start % ps
            if off and 0 < num_tokens <= ps - off:  # fits the last page: no page work (decode)
                seq.num_slots = start + num_tokens
                base = seq.pages[-1] * ps + off
                return [base] if num_tokens == 1 else list(range(base, base + num_tokens))
        need = self.pages_needed(request_id, num_tokens)
        seq = self._seqs[request_id]
        if not self.can_allocate(need):
            self._stats["out_of_pages"] += 1
            raise OutOfPagesError(f"request {request_id!r} needs {need} new pages for "
                                  f"{num_tokens} tokens; {self.num_free} free + "
                                  f"{self.num_inactive} reclaimable")
        for _ in range(need):
            seq.pages.append(self._pool.allocate())
        start = seq.num_slots
        seq.num_slots += num_tokens
        pages = seq.pages
        return [pages[p // ps] * ps + p % ps for p in range(start, start + num_tokens)]

    def commit(self, request_id: Hashable, start: int, num_computed_tokens: int,
               token_ids: Sequence[int]) -> None:
        """The KV of positions [start, num_computed_tokens) is now real (``start``: the computed
        count before). Registers each newly full page in the prefix cache (cache on), hashing
        its tokens from ``token_ids`` (the request's tokens, at least [0, num_computed_tokens);
        only the pages completed here are read), applying the duplicate policy; under
        ``reject`` the table may then list the primary instead: re-read ``page_table``."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KVUsageError(f"request {request_id!r} is unknown or already released")
        n, ps, done = num_computed_tokens, self.page_size, len(seq.hashes)
        if not done * ps <= start <= n <= seq.num_slots:
            raise KVUsageError(f"request {request_id!r}: commit [{start}, {n}) outside "
                               f"[{done * ps}, {seq.num_slots}] (full computed pages, slots)")
        if len(token_ids) < n:
            raise KVUsageError(f"request {request_id!r}: commit({n}) with {len(token_ids)} "
                               f"token_ids: the tokens of positions [{len(token_ids)}, {n}) "
                               f"are unknown")
        if n // ps == done:  # no page completed (most decode steps): nothing to hash
            return
        for i in range(done, n // ps):
            page_tokens = tuple(token_ids[i * ps:(i + 1) * ps])
            parent = seq.chain[i - 1] if i else None
            h = self._cache.hash_fn(seq.hashes[i - 1] if i else ROOT_HASH, page_tokens, seq.salt)
            seq.hashes.append(h)
            seq.chain.append(self._register(seq, i, parent, page_tokens, h))

    def rollback(self, request_id: Hashable, num_tokens: int, num_computed_tokens: int) -> None:
        """Drop the last num_tokens slots (rejected speculation, failed step); they must all lie
        past ``num_computed_tokens`` (the request's computed count). Pages left empty return to
        the free list (they were never registered or shared)."""
        seq = self._get(request_id)
        lo = max(num_computed_tokens, len(seq.hashes) * self.page_size)
        if not 0 <= num_tokens <= seq.num_slots - lo:
            raise KVUsageError(f"request {request_id!r}: rollback({num_tokens}) but only "
                               f"{seq.num_slots - lo} slots are past the computed tokens")
        seq.num_slots -= num_tokens
        keep = _cdiv(seq.num_slots, self.page_size)
        self._stats["rollback_tokens"] += num_tokens
        self._stats["rollback_pages"] += len(seq.pages) - keep
        while len(seq.pages) > keep:
            self._pool.decref(seq.pages.pop())

    def release(self, request_id: Hashable) -> None:
        """Finish or preempt. Tail pages are released first so the LRU evicts leaves first."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            raise KVUsageError(f"request {request_id!r} is unknown or already released")
        self._stats["releases"] += 1
        for page in reversed(seq.pages):
            self._pool.decref(page)

    def page_table(self, request_id: Hashable) -> list[int]:
        return list(self._get(request_id).pages)

    def page_table_view(self, request_id: Hashable) -> array[int]:
        """The table itself (int32, ``PAGE_TYPECODE``), not a copy: the step builder reads it at
        once. Never mutate it."""
        try:  # once per request per step: no _get call
            return self._seqs[request_id].pages
        except KeyError:
            raise KVUsageError(f"request {request_id!r} is unknown or already released") from None

    def num_tokens(self, request_id: Hashable) -> int:
        return self._get(request_id).num_slots

    def num_computed_pages(self, request_id: Hashable) -> int:
        """Full pages whose KV is computed (hashed; registered when the cache is on)."""
        return len(self._get(request_id).hashes)

    def request_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def refcount(self, page: int) -> int:
        return self._pool.ref[page]

    def check_step_refs(self, request_ids: Iterable[Hashable], max_batch: int,
                        max_model_len: int) -> int:
        """Total page references of one step's batch; raises PageRefOverflowError if it would not
        fit the decode page-index buffer (or a row of it, or the batch is too large)."""
        ids = list(request_ids)
        if len(ids) > max_batch:
            raise PageRefOverflowError(f"{len(ids)} sequences > max_batch={max_batch}")
        per_seq = _cdiv(max_model_len, self.page_size)
        seqs = self._seqs
        try:
            lens = [len(seqs[rid].pages) for rid in ids]
        except KeyError as e:
            raise KVUsageError(f"request {e.args[0]!r} is unknown or already released") from None
        if lens and max(lens) > per_seq:
            i = next(i for i, n in enumerate(lens) if n > per_seq)
            raise PageRefOverflowError(f"request {ids[i]!r} holds {lens[i]} pages > {per_seq} "
                                       f"(max_model_len={max_model_len})")
        total = sum(lens)
        limit = self.max_page_refs(max_batch, max_model_len)
        if total > limit:
            raise PageRefOverflowError(f"{total} page references > max_page_refs={limit}")
        return total

    def snapshot(self) -> KVSnapshot:
        pool = self._pool
        return KVSnapshot(
            tuple(pool.free), tuple(pool.inactive), tuple(pool.ref),
            tuple(sorted(pool.pins.items())), tuple(sorted(pool.dup_of.items())),
            tuple(sorted(self._cache.registered_pages())),
            tuple((rid, tuple(s.pages), s.num_slots, len(s.hashes))
                  for rid, s in self._seqs.items()),
            pool.caching)

    # -- internals (small hooks, so tests can build deliberately broken variants) -------------
    def _get(self, request_id: Hashable) -> _Seq:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KVUsageError(f"request {request_id!r} is unknown or already released")
        return seq

    def _registration_enabled(self) -> bool:
        return self._pool.caching

    def _register(self, seq: _Seq, i: int, parent: CachedPage | None,
                  tokens: tuple[int, ...], h: bytes) -> CachedPage | None:
        """Register the request's newly full page i; returns the entry its chain continues from."""
        if not self._registration_enabled():
            return None
        if i and (parent is None or not self._cache.is_registered(parent)):
            return None  # chain broken (collision, cache toggled): unreachable, so not cached
        parent_id = parent.node_id if parent is not None else ROOT_ID
        page = seq.pages[i]
        primary = self._cache.get(h)
        if primary is None:
            self._stats["pages_registered"] += 1
            return self._cache.register(page, parent_id, tokens, seq.salt, h)
        if not primary.matches(parent_id, tokens, seq.salt):
            self._stats["hash_collisions"] += 1
            return None
        if self.duplicate_policy == "reject":
            self._stats["duplicates_rejected"] += 1
            self._pool.take(primary.page)
            seq.pages[i] = primary.page
            self._pool.decref(page)  # refcount 1 -> 0, unregistered: back to the free list
        else:
            self._stats["duplicates_allowed"] += 1
            self._pool.add_duplicate(page, primary.page)
        return primary
