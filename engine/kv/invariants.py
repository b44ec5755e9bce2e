"""The block manager's invariants, checked from the outside (its snapshot and public API).

``check_invariants(bm)`` is what the state machine runs after every step; the scheduler's own
property tests can run it after each scheduler step too. It raises ``KVInvariantError`` (an
``AssertionError``, raised explicitly so that ``python -O`` keeps the checks) naming the broken
invariant. Pure Python, like the rest of ``engine.kv``.
"""

from __future__ import annotations

from collections import Counter

from engine.kv.block_manager import BlockManager


class KVInvariantError(AssertionError):
    """A block-manager invariant does not hold: a bug in the block manager (or its caller)."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KVInvariantError(message)


def check_invariants(bm: BlockManager, *, max_batch: int | None = None,
                     max_model_len: int | None = None) -> int:
    """Check every invariant that the manager's state alone determines; returns the
    by-reference total of all its tables (checked against ``max_page_refs`` when ``max_batch``
    and ``max_model_len`` are given, for a batch of every live request)."""
    s = bm.snapshot()
    first = int(bm.reserve_padding_page)
    usable = set(range(first, bm.num_physical_pages))
    free, inactive, registered = set(s.free), set(s.inactive), set(s.registered)
    pins, dups = dict(s.pins), dict(s.duplicates)
    holders = Counter(p for _, pages, _, _ in s.tables for p in pages)
    in_use = {p for p in usable if s.refcounts[p] > 0 or p in pins}
    # Exact accounting: free, inactive and in use partition the usable pages.
    _require(len(free) == len(s.free) and len(inactive) == len(s.inactive),
             "a page is listed twice in the free list or the inactive pool")
    _require(free | inactive | in_use == usable, "a page is in no state, or out of range")
    _require(len(free) + len(inactive) + len(in_use) == bm.num_pages, "a page is in two states")
    _require((bm.num_free, bm.num_inactive, bm.num_in_use) == (len(free), len(inactive),
                                                                len(in_use)),
             "num_free / num_inactive / num_in_use disagree with the pages' states")
    if first:
        _require(bm.PADDING_PAGE not in set(holders) | free | inactive | registered,
                 "the padding page was handed out")
    # Refcount == number of tables holding the page; nothing free (or inactive) is referenced.
    bad = [p for p in range(bm.num_physical_pages) if s.refcounts[p] != holders.get(p, 0)]
    _require(not bad, f"refcount != number of tables holding the page, pages {bad}")
    _require(not set(holders) & (free | inactive), "a page is both free and referenced")
    # Duplicates pin their primary once each; a duplicate is in one table and unregistered.
    _require(dict(Counter(dups.values())) == pins, "pins != live duplicates")
    _require(all(holders[d] == 1 and d not in registered for d in dups),
             "a duplicate page is shared or registered")
    _require(not registered & free, "a free page is still registered")
    _require(inactive <= registered, "an inactive page is not registered")
    if not s.prefix_caching:
        _require(not registered and not inactive, "prefix cache off, yet pages are retained")
    if not s.tables:
        _require(not in_use, f"pages resident with no request: {sorted(in_use)}")
        if not s.prefix_caching:
            _require(len(free) == bm.num_pages, "cache off and no request, yet pages not free")
    g = bm.gauges()
    pinned = sum(1 for p in pins if s.refcounts[p] == 0)
    expected = {"pages": bm.num_pages, "free": len(free), "reclaimable": len(inactive),
                "in_use": len(in_use), "live": len(in_use) - pinned, "pinned": pinned,
                "cached": len(registered), "shared": sum(1 for c in holders.values() if c > 1),
                "page_refs": sum(holders.values()), "duplicates": len(dups),
                "requests": len(s.tables)}
    _require(g == expected, f"gauges {g} != {expected}")
    # Tables: sized to their slots; pages not fully computed are written, so exclusive.
    ps = bm.page_size
    for rid, pages, num_slots, num_full in s.tables:
        _require(len(pages) == -(-num_slots // ps), f"request {rid!r}: table size != slots")
        _require(num_full * ps <= num_slots, f"request {rid!r}: more full pages than slots")
        for page in pages[num_full:]:
            _require(s.refcounts[page] == 1 and page not in registered,
                     f"request {rid!r}: page {page} is written to but shared or registered")
    # By reference: every live request in one decode batch fits the page-index buffer.
    total = sum(holders.values())
    if max_batch is not None and max_model_len is not None:
        _require(bm.check_step_refs([t[0] for t in s.tables], max_batch, max_model_len) == total,
                 "check_step_refs disagrees with the tables")
    return total
