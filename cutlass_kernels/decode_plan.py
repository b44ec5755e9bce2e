"""The decode attention's launch plan in plain Python: how many KV splits a bucket uses and the
workspace they need. Kept apart from decode_attention.py (which imports the CuTe DSL, ~1 s) so the
executor can plan memory while the DSL still loads."""

from __future__ import annotations

MAX_SPLITS = 64  # the fused combine gives each lane at most MAX_SPLITS / 32 splits
MIN_PAGES_PER_SPLIT = 8
ALIGN = 128  # bytes


def decode_workspace_bytes(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """Bytes of workspace a decode launch with `num_splits` > 1 needs (0 when 1 split): fp32
    partials from its start, and room past them (1/128 of them, plus 2 * ALIGN) for the split
    counters (`split_counters_offset`), zero before the first launch."""
    if num_splits <= 1:
        return 0
    partials = 4 * batch * num_q_heads * num_splits * (head_dim + 2)
    return -(-(partials + partials // 128 + 2 * ALIGN) // ALIGN) * ALIGN


def split_counters_offset(workspace_nbytes: int) -> int:
    """Where the split counters (int32, one per (sequence, kv head)) start in a workspace of
    this many bytes: its last 1/129, ALIGN-aligned. The place depends on the buffer alone, not
    on a launch's batch or split count, so no launch writes partials over a counter: for every
    launch with decode_workspace_bytes(...) <= workspace_nbytes, its partials end at or before
    this offset and its B * nkv counters (nkv <= nq, splits >= 2: at most 1/132 of its
    partials' bytes) fit after it. Zeroed once, they stay zero (each launch resets its own)."""
    return (workspace_nbytes - workspace_nbytes // 129) // ALIGN * ALIGN


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int = 132,
                      page_size: int = 16, mma: bool = False) -> int:
    """Splits per sequence for a decode bucket: about two CTAs per SM over the launch.

    Measured on the H200 (tools/tune_attention.py, docs/perf.md): back-to-back in a graph the
    kernel reads K/V at 3.3-3.7 TB/s once B * nkv covers the SMs (qwen3-8b shape: B = 64 at one
    split 81.6 us, at three 83.4 us; B = 8: four splits 15.4 us, eight 18.3 us), and a deeper
    cp.async ring (6, 8, 12 stages) only lowers occupancy. A split still covers at least
    MIN_PAGES_PER_SPLIT pages of max_context, or the combine costs more than it saves; sequences
    shorter than max_context spread their pages over the same splits (some stay empty, cheap).
    ``mma``: the tensor-core loop, which reads one split at B * nkv = 1024 faster (qwen3-8b
    shape, B = 128: 124.6 us vs 132.3 at two splits; docs/perf.md v22).
    """
    ctas = max(1, batch * num_kv_heads)
    pages = max(1, -(-max_context // page_size))
    want = -(-2 * num_sms // ctas)
    if 1024 <= ctas < 2048 and not mma:
        # measured, not modelled: at B * nkv = 1024 two splits beat one for qwen3-0.6b (GQA 2:
        # 138 vs 151 us, three repeats) and tie end-to-end for qwen3-8b; at 512 one split wins,
        # and at 2048 (bucket 256) one split is what v1-v3 measured
        want = max(want, 2)
    return max(1, min(want, pages // MIN_PAGES_PER_SPLIT, MAX_SPLITS))
