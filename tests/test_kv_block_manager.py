"""Unit tests of the block manager's API: one behaviour each, small pools, page size 4."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.kv import (
    BlockManager,
    KVCacheError,
    KVInvariantError,
    KVUsageError,
    OutOfPagesError,
    PageRefOverflowError,
    check_invariants,
    max_page_refs,
)

PS = 4


def weak_hash(parent_hash: bytes, tokens: tuple[int, ...], salt: str | None) -> bytes:
    return bytes([sum(tokens) % 3]) * 16  # collides all the time, on purpose


def _run(bm: BlockManager, rid: object, tokens: list[int], salt: str | None = None) -> int:
    """create + prefill the whole prompt + commit; returns num_cached_tokens."""
    cached = bm.create(rid, tokens, salt)
    bm.append_slots(rid, len(tokens) - cached)
    bm.commit(rid, cached, len(tokens), tokens)
    check_invariants(bm)
    return cached


def test_construction_and_padding_page() -> None:
    bm = BlockManager(5, PS)
    assert (bm.num_pages, bm.num_physical_pages, bm.num_free) == (4, 5, 4)
    bm.create("a", [1] * 16)
    slots = bm.append_slots("a", 16)
    assert BlockManager.PADDING_PAGE not in bm.page_table("a")
    assert slots == [p * PS + o for p in bm.page_table("a") for o in range(PS)]
    nopad = BlockManager(4, PS, reserve_padding_page=False)
    assert nopad.num_pages == 4 and nopad.can_allocate(4) and not nopad.can_allocate(5)
    with pytest.raises(ValueError, match="no usable page"):
        BlockManager(1, PS)
    with pytest.raises(ValueError, match="duplicate_policy"):
        BlockManager(8, PS, duplicate_policy="keep")
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(8, 0)


def test_max_page_refs() -> None:
    assert max_page_refs(256, 4096, 16) == 256 * 256
    assert max_page_refs(3, 33, 16) == 9
    assert BlockManager(5, 16).max_page_refs(3, 33) == 9  # not the pool size (5)


def test_prefix_hit_is_capped_and_shared() -> None:
    bm = BlockManager(9, PS)
    prompt = list(range(8))  # exactly two pages
    assert _run(bm, "a", prompt) == 0
    assert bm.num_cached_prefix_tokens(prompt) == 4  # capped: the last token is computed
    assert bm.num_cached_prefix_tokens(prompt + [9]) == 8
    before = bm.snapshot()
    bm.pages_needed_for_new(prompt + [9])
    assert bm.snapshot() == before  # dry runs change nothing
    assert bm.create("b", prompt + [9]) == 8
    assert bm.page_table("b") == bm.page_table("a")
    assert [bm.refcount(p) for p in bm.page_table("a")] == [2, 2]
    assert bm.gauges()["shared"] == 2 and bm.gauges()["page_refs"] == 4


def test_salt_separates_prefixes() -> None:
    bm = BlockManager(9, PS)
    prompt = list(range(9))
    _run(bm, "a", prompt, salt="adapter-a")
    assert bm.num_cached_prefix_tokens(prompt) == 0
    assert bm.num_cached_prefix_tokens(prompt, "adapter-b") == 0
    assert bm.num_cached_prefix_tokens(prompt, "adapter-a") == 8


def test_release_to_inactive_then_revive_and_evict_leaves_first() -> None:
    bm = BlockManager(5, PS)
    prompt = list(range(12))
    _run(bm, "a", prompt)
    a_pages = bm.page_table("a")
    bm.release("a")
    assert (bm.num_free, bm.num_inactive, bm.num_in_use) == (1, 3, 0)
    # Reviving cached pages consumes reclaimable capacity: admission must count it.
    assert bm.pages_needed_for_new(prompt + [1], num_new_tokens=1) == 3 + 1
    assert bm.create("b", prompt[:4] + [99] * 5) == 4  # revives the first page only
    assert bm.num_inactive == 2
    bm.append_slots("b", 5)  # 2 new pages: the free one, then evict the LRU leaf
    assert bm.stats()["evictions"] == 1
    assert a_pages[2] not in bm.snapshot().registered  # the deepest page went first
    assert bm.num_cached_prefix_tokens(prompt + [1]) == 8


def test_out_of_pages_changes_nothing() -> None:
    bm = BlockManager(3, PS)
    bm.create("a", [1] * 5)
    before = bm.snapshot()
    with pytest.raises(OutOfPagesError):
        bm.append_slots("a", 9)
    assert bm.snapshot() == before
    assert bm.pages_needed("a", 8) == 2 and bm.can_allocate(2)
    bm.append_slots("a", 8)


def test_misuse_raises_and_changes_nothing() -> None:
    bm = BlockManager(5, PS)
    _run(bm, "a", [1] * 6)
    bm.create("c", [1, 2, 3])
    bm.append_slots("c", 3)
    before = bm.snapshot()
    for call in (lambda: bm.create("a", [1]), lambda: bm.create("z", []),
                 lambda: bm.rollback("a", 1, 6), lambda: bm.commit("a", 6, 7, [1] * 7),
                 lambda: bm.commit("a", 6, 5, [1] * 6), lambda: bm.append_slots("a", -1),
                 lambda: bm.rollback("a", 0, 7), lambda: bm.commit("a", 2, 6, [1] * 6),
                 lambda: bm.commit("c", 0, 3, [1, 2]), lambda: bm.page_table("nope")):
        with pytest.raises(KVUsageError):
            call()
        assert bm.snapshot() == before
    bm.release("a")
    after_release = bm.snapshot()
    for call in (lambda: bm.release("a"), lambda: bm.append_slots("a", 1),
                 lambda: bm.commit("a", 0, 1, [1])):
        with pytest.raises(KVUsageError, match="unknown or already released"):
            call()
    assert bm.snapshot() == after_release
    assert issubclass(OutOfPagesError, KVCacheError) and issubclass(KVUsageError, KVCacheError)


def test_speculative_append_commit_rollback() -> None:
    bm = BlockManager(9, PS, enable_prefix_caching=False)
    bm.create("a", [5, 6, 7])
    bm.append_slots("a", 3)
    bm.commit("a", 0, 3, [5, 6, 7])
    slots = bm.append_slots("a", 1 + 5)  # last token + 5 drafts: [8, 1, 2, 3, 4, 5]
    assert len(bm.page_table("a")) == 3 and len(slots) == 6
    tokens = [5, 6, 7, 8, 1, 2]  # the caller's tokens: 2 drafts accepted
    bm.commit("a", 3, 3 + 1 + 2, tokens)
    bm.rollback("a", 3, 6)
    assert bm.num_tokens("a") == 6 and bm.num_computed_pages("a") == 6 // PS
    assert len(bm.page_table("a")) == 2 and bm.num_free == 6
    bm.append_slots("a", 1)
    with pytest.raises(KVUsageError, match="unknown"):
        bm.commit("a", 6, 7, tokens)  # position 6's token is not known (any more)


def _duplicate(policy: str, caching_at_release: bool) -> BlockManager:
    """a and b prefill the same prompt concurrently; a commits first, b's page duplicates."""
    bm = BlockManager(9, PS, duplicate_policy=policy)
    prompt = [3, 1, 4, 1, 5]
    for rid in ("a", "b"):
        assert bm.create(rid, prompt) == 0
        bm.append_slots(rid, 5)
    bm.commit("a", 0, 5, prompt)
    bm.commit("b", 0, 5, prompt)
    bm.set_prefix_caching(caching_at_release)
    return bm


def test_duplicate_allow_pins_primary_until_duplicate_released() -> None:
    bm = _duplicate("allow", True)
    primary, dup = bm.page_table("a")[0], bm.page_table("b")[0]
    assert primary != dup and bm.gauges()["duplicates"] == 1
    bm.release("a")
    assert bm.gauges()["pinned"] == 1 and bm.num_inactive == 0  # kept alive by b's duplicate
    bm.release("b")
    check_invariants(bm)
    assert bm.snapshot().inactive == (primary,) and dup in bm.snapshot().free
    assert bm.stats()["primaries_pinned"] == bm.stats()["primaries_released"] == 1


@pytest.mark.parametrize("policy", ["allow", "reject"])
def test_cache_off_release_returns_every_page(policy: str) -> None:
    bm = _duplicate(policy, False)
    assert bm.gauges()["cached"] == 0 and bm.num_inactive == 0
    bm.release("b")
    bm.release("a")
    check_invariants(bm)
    assert bm.num_free == bm.num_pages
    assert bm.stats()["primaries_pinned"] == bm.stats()["primaries_released"]


def test_duplicate_reject_swaps_in_primary() -> None:
    bm = _duplicate("reject", True)
    primary = bm.page_table("a")[0]
    assert bm.page_table("b")[0] == primary and bm.refcount(primary) == 2
    assert bm.num_in_use == 3 and bm.stats()["duplicates_rejected"] == 1
    bm.release("a")
    bm.release("b")
    assert bm.snapshot().inactive == (primary,) and bm.num_free == bm.num_pages - 1


def test_cache_off_registers_nothing_and_toggle_drains_once() -> None:
    bm = BlockManager(9, PS, enable_prefix_caching=False)
    _run(bm, "a", list(range(9)))
    assert bm.gauges()["cached"] == 0 and bm.num_cached_prefix_tokens(list(range(9))) == 0
    bm.release("a")
    assert bm.num_free == 8
    bm.set_prefix_caching(True)
    _run(bm, "b", list(range(9)))
    bm.release("b")
    assert bm.num_inactive == 2
    bm.set_prefix_caching(False)
    assert (bm.num_free, bm.num_inactive, bm.gauges()["cached"]) == (8, 0, 0)
    assert bm.stats()["inactive_drained"] == 2


def test_hash_collision_misses_never_aliases() -> None:
    weak = type("WeakBM", (BlockManager,), {"hash_fn": staticmethod(weak_hash)})
    bm = weak(9, PS)
    _run(bm, "a", [0, 0, 1, 2, 9])  # page hash: sum 3 % 3
    assert weak_hash(b"", (1, 1, 1, 0), None) == weak_hash(b"", (0, 0, 1, 2), None)
    assert bm.num_cached_prefix_tokens([1, 1, 1, 0, 9]) == 0
    _run(bm, "b", [1, 1, 1, 0, 9])  # same hash, other tokens: not registered over "a"
    assert bm.stats()["hash_collisions"] == 1
    assert bm.num_cached_prefix_tokens([0, 0, 1, 2, 7]) == 4


def test_check_step_refs_is_a_typed_step_error() -> None:
    bm = BlockManager(9, PS)
    for rid in "ab":
        bm.create(rid, [1] * 8)
        bm.append_slots(rid, 8)
    assert bm.check_step_refs(["a", "b"], max_batch=2, max_model_len=8) == 4
    with pytest.raises(PageRefOverflowError):
        bm.check_step_refs(["a", "b"], max_batch=1, max_model_len=8)
    with pytest.raises(PageRefOverflowError):
        bm.check_step_refs(["a"], max_batch=2, max_model_len=4)


def test_engine_kv_is_pure_python_and_standalone() -> None:
    code = ("import sys, engine.kv; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('numpy', 'cuda', 'hypothesis') or (m.startswith('engine.') and "
            "not m.startswith('engine.kv'))]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_check_invariants_names_a_corruption() -> None:
    bm = BlockManager(5, PS)
    _run(bm, "a", [1] * 6)
    bm._pool.ref[bm.page_table("a")[0]] += 1  # a reference no table holds
    with pytest.raises(KVInvariantError, match="refcount != number of tables"):
        check_invariants(bm)
