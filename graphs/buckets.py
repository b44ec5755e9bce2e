"""Batch buckets for decode graphs: 1, 2, 4, 8, then steps of 8 up to 256, capped by max_num_seqs.

A step of B sequences pads to the smallest bucket >= B. Padding rows read the padding page
(page 0) with context length 1, write no KV (slot -1), and their outputs are dropped.
"""

from __future__ import annotations

import bisect

DEFAULT_MAX = 256


def bucket_sizes(max_num_seqs: int, max_bucket: int | None = None) -> list[int]:
    top = min(max_num_seqs, max_bucket or DEFAULT_MAX)
    sizes = [b for b in (1, 2, 4, 8) if b <= top]
    sizes += list(range(16, top + 1, 8))
    if not sizes or sizes[-1] < top:
        sizes.append(top)  # max_num_seqs between two steps of 8 gets its own bucket
    return sizes


def bucket_for(batch: int, sizes: list[int]) -> int | None:
    """Smallest bucket >= batch, or None when the batch is larger than every bucket."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None
