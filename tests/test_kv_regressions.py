"""The two block-manager failures of the engine cuteinfer replaces, as named regression tests.

Each scenario is a function of the manager class, so the same code also runs against the
deliberately broken variants in tests/kv/mutants.py and must fail there.
"""

from __future__ import annotations

import pytest

from engine.kv import BlockManager, KVCacheError, check_invariants, max_page_refs
from tests.kv.mutants import OldEngineBlockManager, PoolSizedRefsBlockManager

PAGE = 16


def _append_admitted(bm: BlockManager, rid: object, n: int) -> list[int]:
    """The scheduler's way: ask for exactly what the step takes; then it must succeed."""
    need = bm.pages_needed(rid, n)
    assert bm.can_allocate(need), (
        f"admission refused {n} tokens ({need} pages) of request {rid!r} on a pool that fits "
        f"them: {bm.gauges()}")
    return bm.append_slots(rid, n)  # OutOfPagesError here would mean admission lied


# A system prompt shared by every request, so later requests recompute the same page hashes.
SYSTEM_PROMPT = [(7 * i) % 50_000 for i in range(1_600)]


def serve_sequential_cache_off(cls: type[BlockManager]) -> None:
    """161 pages (page 0 padding), cache off, 20 sequential requests of ~1,650 prompt tokens and
    512 generated ones, decoded in 17-token speculative spans (1 + 16 drafts) that are partly
    rejected. The peak (~2,190 tokens, 137 pages) fits the 160 usable pages, so every admitted
    allocation must succeed, and the pool must return to its baseline after each request."""
    bm = cls(161, PAGE, enable_prefix_caching=False)
    assert bm.num_pages == 160 and bm.num_free == 160
    baseline = bm.num_free
    for r in range(20):
        prompt = SYSTEM_PROMPT + [100_000 + 97 * r + j for j in range(40 + r)]  # 1,640-1,659
        assert bm.create(r, prompt) == 0, "cache off: nothing may be reused"
        tokens, computed = list(prompt), 0
        while computed < len(prompt):  # chunked prefill
            n = min(512, len(prompt) - computed)
            _append_admitted(bm, r, n)
            bm.commit(r, computed, computed + n, tokens)
            computed += n
        tokens.append(1)  # first sampled token
        step = 0
        while len(tokens) - len(prompt) < 512:
            drafts = [200_000 + step * 17 + j for j in range(16)]
            _append_admitted(bm, r, 17)  # verify: last token + 16 drafts
            accepted = min((7 * step) % 17, 512 - (len(tokens) - len(prompt)) - 1)
            bm.commit(r, computed, computed + 1 + accepted, tokens + drafts[:accepted])
            bm.rollback(r, 16 - accepted, computed + 1 + accepted)
            computed += 1 + accepted
            tokens += drafts[:accepted] + [2]  # accepted drafts + the bonus token
            step += 1
        assert bm.num_tokens(r) == computed == len(tokens) - 1
        check_invariants(bm)
        bm.release(r)
        g = bm.gauges()
        assert bm.num_free == baseline, f"request {r}: pool did not return to baseline: {g}"
        assert g["in_use"] == g["reclaimable"] == g["cached"] == 0, g


def test_cache_off_sequential_long_requests_return_to_baseline() -> None:
    serve_sequential_cache_off(BlockManager)


def test_cache_off_sequential_fails_on_old_engine_variant() -> None:
    """The fix removed (pages registered with the cache off, primaries pinned): it must fail."""
    with pytest.raises((AssertionError, KVCacheError)):
        serve_sequential_cache_off(OldEngineBlockManager)


def serve_256_sharing_one_cached_prefix(cls: type[BlockManager]) -> int:
    """256 concurrent requests over one warm ~4,000-token (3,000-word) prompt on a 1,024-page
    pool. By reference the decode batch lists ~64,500 pages, 60x the pool; it must fit
    max_page_refs(256, 4096) = 65,536 and the page-index buffer sized from it."""
    max_batch, max_model_len = 256, 4_096
    bm = cls(1_025, PAGE)
    prefix = [(13 * i) % 30_000 for i in range(4_000)]  # 250 full pages
    warm = prefix + [1]  # one more token: the last prompt token is always computed
    bm.create("warm", warm)
    _append_admitted(bm, "warm", len(warm))
    bm.commit("warm", 0, len(warm), warm)
    bm.release("warm")
    assert bm.num_inactive == 250
    ids = list(range(max_batch))
    for i in ids:
        prompt = prefix + [40_000 + 20 * i + j for j in range(20)]
        assert bm.num_cached_prefix_tokens(prompt) == 4_000
        assert bm.can_allocate(bm.pages_needed_for_new(prompt))
        assert bm.create(i, prompt) == 4_000
        _append_admitted(bm, i, 20)
        bm.commit(i, 4_000, len(prompt), prompt)
    for i in ids:  # one decode step for the whole batch
        _append_admitted(bm, i, 1)
    assert bm.refcount(bm.page_table(0)[0]) == max_batch
    assert bm.num_in_use == 250 + 2 * max_batch
    total = bm.check_step_refs(ids, max_batch, max_model_len)
    assert bm.num_physical_pages < total <= max_page_refs(max_batch, max_model_len, PAGE)
    # The decode page-index buffer, flattened, sized the way the executor sizes it.
    buf = [BlockManager.PADDING_PAGE] * bm.max_page_refs(max_batch, max_model_len)
    off = 0
    for i in ids:
        for page in bm.page_table(i):
            buf[off] = page  # IndexError = the worker crash of the replaced engine
            off += 1
    assert off == total == bm.gauges()["page_refs"]
    assert check_invariants(bm, max_batch=max_batch, max_model_len=max_model_len) == total
    return total


def test_256_requests_sharing_a_cached_prefix_fit_max_page_refs() -> None:
    assert serve_256_sharing_one_cached_prefix(BlockManager) == 256 * 252


def test_256_requests_fail_with_a_pool_sized_ref_buffer() -> None:
    with pytest.raises((AssertionError, KVCacheError, IndexError)):
        serve_256_sharing_one_cached_prefix(PoolSizedRefsBlockManager)
