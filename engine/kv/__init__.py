"""Pure-Python paged-KV block manager (no numpy, no CUDA; imports nothing else from ``engine``).

``BlockManager`` owns the page pool, the per-request page tables and the prefix cache.
``engine.kv.testing`` holds the Hypothesis strategies and state machine that prove its invariants
(Hypothesis is imported there only); ``cuteinfer check-kv`` runs them
(``engine.commands.check_kv``).
"""

from __future__ import annotations

from engine.kv.block_manager import DUPLICATE_POLICIES, BlockManager, KVSnapshot, max_page_refs
from engine.kv.errors import KVCacheError, KVUsageError, OutOfPagesError, PageRefOverflowError
from engine.kv.invariants import KVInvariantError, check_invariants
from engine.kv.prefix_cache import page_hash

__all__ = ["BlockManager", "DUPLICATE_POLICIES", "KVCacheError", "KVInvariantError", "KVSnapshot",
           "KVUsageError", "OutOfPagesError", "PageRefOverflowError", "check_invariants",
           "max_page_refs", "page_hash"]
