"""Deliberately broken block managers: each puts back one failure the real one must not have.

The tests run them to show that the checks (the state machine, the named regressions) catch
the failure, i.e. that the tests fail when the fix is removed.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv import BlockManager
from engine.kv.block_manager import _Seq
from engine.kv.pool import PagePool
from engine.kv.prefix_cache import ROOT_HASH, ROOT_ID, CachedPage


class _OldEnginePool(PagePool):
    """The replaced engine's pool: freed pages keep their hash until reused, a duplicate pulls
    its primary back out of the free list, and with the cache off that pin is never dropped."""

    def allocate(self) -> int:
        if self.free and self.cache.entry_of(self.free[0]) is not None:
            self.cache.unregister(self.free[0])  # lazy: the stale hash goes at reuse
        return super().allocate()

    def retire(self, page: int) -> None:
        if not self.caching and self.cache.entry_of(page) is not None:
            self.free.append(page)  # "freed", but still registered
            primary = self.dup_of.pop(page, None)
            if primary is not None:
                self.unpin(primary)
            return
        super().retire(page)

    def pin(self, primary: int) -> None:
        if primary in self.free:
            self.free.remove(primary)  # resident again, and no table holds it
        super().pin(primary)

    def unpin(self, primary: int) -> None:
        if not self.caching:
            return  # the duplicate "kept the primary alive": forever
        super().unpin(primary)


class OldEngineBlockManager(BlockManager):
    """Failure 1: with prefix caching off, completed pages are still registered, and duplicates
    pin primaries that nothing counts: hidden capacity, then a failed speculative allocation."""

    pool_cls = _OldEnginePool

    def _registration_enabled(self) -> bool:
        return True


class PoolSizedRefsBlockManager(BlockManager):
    """Failure 2: the decode page-index buffer sized from the physical pool."""

    def max_page_refs(self, max_batch: int, max_model_len: int) -> int:
        return self.num_physical_pages


class LyingAdmissionBlockManager(BlockManager):
    """Admission forgets that reviving cached pages takes them out of the reclaimable pool."""

    def pages_needed_for_new(self, token_ids: Sequence[int], salt: str | None = None, *,
                             num_new_tokens: int | None = None) -> int:
        matched = self._match(token_ids, salt)
        cached = len(matched) * self.page_size
        n_new = len(token_ids) - cached if num_new_tokens is None else num_new_tokens
        return -(-(cached + n_new) // self.page_size) - len(matched)


class TrustingHashBlockManager(BlockManager):
    """Prefix lookup trusts the hash and never compares the stored tokens."""

    def _match(self, token_ids: Sequence[int], salt: str | None) -> list[CachedPage]:
        if not self.prefix_caching:
            return []
        ps, out, h = self.page_size, list[CachedPage](), ROOT_HASH
        for i in range((len(token_ids) - 1) // ps):
            h = self.hash_fn(h, tuple(token_ids[i * ps:(i + 1) * ps]), salt)
            entry = self._cache.get(h)
            if entry is None:
                break
            out.append(entry)
        return out


class UncountedSwapBlockManager(BlockManager):
    """Duplicate policy ``reject`` swaps the primary in without counting the new reference."""

    def _register(self, seq: _Seq, i: int, parent: CachedPage | None,
                  tokens: tuple[int, ...], h: bytes) -> CachedPage | None:
        primary = self._cache.get(h)
        parent_ok = i == 0 or (parent is not None and self._cache.is_registered(parent))
        parent_id = parent.node_id if parent is not None else ROOT_ID
        if (self.duplicate_policy == "reject" and self.prefix_caching and parent_ok
                and primary is not None and primary.matches(parent_id, tokens, seq.salt)):
            page, seq.pages[i] = seq.pages[i], primary.page  # no reference taken on the primary
            self._pool.decref(page)
            return primary
        return super()._register(seq, i, parent, tokens, h)


ALL = [OldEngineBlockManager, PoolSizedRefsBlockManager, LyingAdmissionBlockManager,
       TrustingHashBlockManager, UncountedSwapBlockManager]
