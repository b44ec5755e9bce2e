"""numpy references for the CuTe DSL kernels (float64/float32), shared by the kernel tests.

Append-only: each kernel owner adds its ref_ functions in its own section.
"""

from __future__ import annotations

import numpy as np

# ---- attention (decode_attention.py, prefill_attention.py) ----------------------------------


def _gather_kv(cache: np.ndarray, pages: np.ndarray, kvh: int, n_tokens: int) -> np.ndarray:
    """[n_tokens, head_dim] float64 rows of one kv head, gathered through a page-table row."""
    page_size = cache.shape[2]
    n_pages = -(-n_tokens // page_size)
    tiles = cache[np.asarray(pages[:n_pages], dtype=np.int64), kvh].astype(np.float64)
    return tiles.reshape(n_pages * page_size, cache.shape[3])[:n_tokens]


def ref_paged_decode_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                               page_indices: np.ndarray, context_lens: np.ndarray,
                               scale: float) -> np.ndarray:
    """Decode attention, one query token per sequence (docs/kernels.md), in float64.

    q [B, nq * hd]; caches [num_pages, nkv, page_size, hd]; page_indices [B, >= pages];
    context_lens [B]. Returns float32 [B, nq * hd]."""
    nkv, hd = k_cache.shape[1], k_cache.shape[3]
    batch = q.shape[0]
    nq = q.shape[1] // hd
    group = nq // nkv
    out = np.zeros((batch, nq, hd), np.float64)
    qh = q.reshape(batch, nq, hd).astype(np.float64)
    for b in range(batch):
        ctx = int(context_lens[b])
        for h in range(nkv):
            k = _gather_kv(k_cache, page_indices[b], h, ctx)
            v = _gather_kv(v_cache, page_indices[b], h, ctx)
            s = qh[b, h * group:(h + 1) * group] @ k.T * scale  # [group, ctx]
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[b, h * group:(h + 1) * group] = (p @ v) / p.sum(axis=1, keepdims=True)
    return out.reshape(batch, nq * hd).astype(np.float32)


def ref_prefill_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                          cu_seqlens_q: np.ndarray, context_lens: np.ndarray,
                          page_indices: np.ndarray, scale: float) -> np.ndarray:
    """Causal varlen prefill over pages (docs/kernels.md), in float64.

    Query i of sequence b (q_len = cu[b+1] - cu[b], ctx = context_lens[b]) sits at position
    ctx - q_len + i and attends to KV positions 0..that. Returns float32 [T, nq * hd]."""
    nkv, hd = k_cache.shape[1], k_cache.shape[3]
    total = q.shape[0]
    nq = q.shape[1] // hd
    group = nq // nkv
    out = np.zeros((total, nq, hd), np.float64)
    qh = q.reshape(total, nq, hd).astype(np.float64)
    for b in range(len(context_lens)):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        q_len, ctx = hi - lo, int(context_lens[b])
        if q_len == 0:
            continue
        pos = ctx - q_len + np.arange(q_len)
        allowed = np.arange(ctx)[None, :] <= pos[:, None]  # [q_len, ctx]
        for h in range(nkv):
            k = _gather_kv(k_cache, page_indices[b], h, ctx)
            v = _gather_kv(v_cache, page_indices[b], h, ctx)
            for g in range(group):
                s = qh[lo:hi, h * group + g] @ k.T * scale
                s = np.where(allowed, s, -np.inf)
                p = np.exp(s - s.max(axis=1, keepdims=True))
                out[lo:hi, h * group + g] = (p @ v) / p.sum(axis=1, keepdims=True)
    return out.reshape(total, nq * hd).astype(np.float32)
