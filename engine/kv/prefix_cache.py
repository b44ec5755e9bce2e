"""Prefix-cache index: chained hashes of full pages -> the registered page holding that prefix.

``h_i = blake2b(h_{i-1}, tokens of page i, salt)``. The hash is only an index key: a hit is
accepted when the stored entry has the same tokens, the same salt and, as parent, *the very entry*
matched for page ``i - 1`` (compared by a never-reused id). By induction from the root, a matched
chain holds exactly the requested token prefix, so a hash collision can cost a cache miss but can
never alias two different prefixes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HashFn = Callable[[bytes, tuple[int, ...], "str | None"], bytes]

ROOT_ID = 0  # parent id of a sequence's first page
ROOT_HASH = bytes(16)  # parent hash of a sequence's first page


def page_hash(parent_hash: bytes, tokens: tuple[int, ...], salt: str | None) -> bytes:
    """Chained hash of one full page. The encoding is unambiguous: fixed-width parent hash,
    length-prefixed salt (absent != empty), fixed-width token ids."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    if salt is None:
        h.update(b"\x00")
    else:
        s = salt.encode()
        h.update(b"\x01" + len(s).to_bytes(4, "little") + s)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(eq=False, slots=True)
class CachedPage:
    """One registered page: the KV of ``tokens`` following the prefix of entry ``parent_id``."""

    node_id: int
    page: int
    parent_id: int
    tokens: tuple[int, ...]
    salt: str | None
    hash: bytes

    def matches(self, parent_id: int, tokens: tuple[int, ...], salt: str | None) -> bool:
        return self.parent_id == parent_id and self.tokens == tokens and self.salt == salt


class PrefixCache:
    """The index only; refcounts, the inactive LRU and the free list belong to the BlockManager."""

    def __init__(self, page_size: int, hash_fn: HashFn = page_hash) -> None:
        self.page_size = page_size
        self.hash_fn = hash_fn
        self._by_hash: dict[bytes, CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}
        # (parent id, tokens, salt) -> entry: the same entries as _by_hash (a key determines
        # the hash), looked up without hashing -- a 3,000-token prompt's 187 page hashes cost
        # ~1 ms of Python per admission
        self._by_key: dict[tuple[int, tuple[int, ...], str | None], CachedPage] = {}
        self._next_id = ROOT_ID + 1  # ids are never reused, so a stale parent can never match
        self.version = 0  # grows whenever the index changes (BlockManager's match memo)

    def __len__(self) -> int:
        return len(self._by_page)

    def match(self, token_ids: Sequence[int], salt: str | None, max_pages: int) -> list[CachedPage]:
        """Longest registered chain holding ``token_ids[:k * page_size]``, k <= max_pages.

        The same chain the hashes would find: the entry registered under
        h(parent's hash, tokens, salt) with that parent, tokens and salt is the one keyed so."""
        ps = self.page_size
        out: list[CachedPage] = []
        parent_id = ROOT_ID
        get = self._by_key.get
        # the pages' token tuples, made lazily in C (zip over one iterator: ps items each)
        it = iter(token_ids[:max(0, max_pages) * ps])
        for tokens in zip(*[it] * ps, strict=False):  # (full pages only: the slice)
            entry = get((parent_id, tokens, salt))
            if entry is None:
                break
            out.append(entry)
            parent_id = entry.node_id
        return out

    def get(self, h: bytes) -> CachedPage | None:
        return self._by_hash.get(h)

    def entry_of(self, page: int) -> CachedPage | None:
        return self._by_page.get(page)

    def is_registered(self, entry: CachedPage) -> bool:
        return self._by_page.get(entry.page) is entry

    def register(self, page: int, parent_id: int, tokens: tuple[int, ...], salt: str | None,
                 h: bytes) -> CachedPage:
        assert h not in self._by_hash and page not in self._by_page, (page, h)
        entry = CachedPage(self._next_id, page, parent_id, tokens, salt, h)
        self._next_id += 1
        self._by_hash[h] = entry
        self._by_key[(parent_id, tokens, salt)] = entry
        self.version += 1
        self._by_page[page] = entry
        return entry

    def unregister(self, page: int) -> None:
        entry = self._by_page.pop(page)
        del self._by_hash[entry.hash]
        del self._by_key[(entry.parent_id, entry.tokens, entry.salt)]
        self.version += 1

    def registered_pages(self) -> list[int]:
        return list(self._by_page)

    def clear(self) -> None:
        self._by_hash.clear()
        self._by_key.clear()
        self.version += 1
        self._by_page.clear()
