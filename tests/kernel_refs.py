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


# ---- pointwise ops (embedding.py, rmsnorm.py, rope_kv.py, silu_mul.py, sampling.py) ----------
# Inputs may be bf16 (ml_dtypes) or float arrays; the math is float32 (float64 for sums), and
# every step the kernel rounds to bf16 is rounded here too (docs/kernels.md).


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bf16 (nearest even), returned as float32."""
    import ml_dtypes

    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def ref_embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``out[t] = table[ids[t]]``; ids outside [0, rows) give a row of zeros."""
    ids = np.asarray(ids, np.int64)
    ok = (ids >= 0) & (ids < table.shape[0])
    out = table[np.where(ok, ids, 0)].copy()
    out[~ok] = 0
    return out


def ref_embedding_from_samples(ids: np.ndarray, src: np.ndarray, samples: np.ndarray,
                               table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cutlass_kernels/embedding.py ``EmbeddingFromSamples``: ``ids[t] = samples[src[t]]``
    where ``0 <= src[t] < len(samples)`` (else ``ids[t]`` stays), then ``table[ids]``; returns
    (the rows, the ids as the kernel leaves them)."""
    ids = ref_place_tokens(src, samples, ids)
    return ref_embedding(ids, table), ids


def ref_place_tokens(src: np.ndarray, tokens: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """cutlass_kernels/place_tokens.py: ``ids[t] = tokens[src[t]]`` where ``0 <= src[t] <
    len(tokens)``; every other row keeps its id."""
    out = ids.copy()
    ok = (src >= 0) & (src < tokens.shape[0])
    out[ok] = tokens[src[ok]]
    return out


def ref_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float,
                residual: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """RMSNorm rows (float32 out holding bf16 values) and, fused, the new residual."""
    xf = np.asarray(x, np.float32)
    new_res = None
    if residual is not None:
        xf = _bf16(xf + np.asarray(residual, np.float32))
        new_res = xf
    ms = (xf.astype(np.float64) ** 2).mean(axis=-1, keepdims=True)
    rstd = (1.0 / np.sqrt(ms + eps)).astype(np.float32)
    return _bf16(_bf16(xf * rstd) * np.asarray(w, np.float32)), new_res


def ref_silu_mul(x: np.ndarray, block: int | None = None) -> np.ndarray:
    """``bf16(bf16(g * sigmoid(g)) * u)`` with g, u the two halves of the last axis, or, with
    ``block``, its alternating blocks of that many gate and up columns."""
    xf = np.asarray(x, np.float64)
    inter = xf.shape[-1] // 2
    if block is None:
        g, u = xf[..., :inter], xf[..., inter:]
    else:
        xb = xf.reshape(*xf.shape[:-1], inter // block, 2, block)
        g = xb[..., 0, :].reshape(*xf.shape[:-1], inter)
        u = xb[..., 1, :].reshape(*xf.shape[:-1], inter)
    return _bf16(_bf16(g / (1.0 + np.exp(-g))) * u)


def ref_scale_cols(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``bf16(w * g)`` per column (float32 product), as bf16."""
    import ml_dtypes

    return (np.asarray(w, np.float32) * np.asarray(g, np.float32)).astype(ml_dtypes.bfloat16)


def ref_fused_gemm(a: np.ndarray, w: np.ndarray, epilogue: str = "store", norm_size: int = 0,
                   eps: float = 0.0, c_old: np.ndarray | None = None) -> np.ndarray:
    """The fused skinny GEMM (gemm_skinny.py), float32 holding bf16 values: ``y = A @ W^T``,
    times ``rsqrt(sum(A[t]^2) / norm_size + eps)`` per row when ``norm_size``; then store
    ``bf16(y)``, ``bf16(c_old + bf16(y))`` (residual) or SiLU-and-mul of y's alternating blocks
    of 32 gate and 32 up columns (silu: ``[M, N/2]``)."""
    y = ref_gemm(a, w)
    if norm_size:
        ss = (np.asarray(a, np.float64) ** 2).sum(axis=-1, keepdims=True)
        y = y * (1.0 / np.sqrt(ss / norm_size + eps)).astype(np.float32)
    if epilogue == "silu":
        return ref_silu_mul(_bf16(y), block=32)
    if epilogue == "residual":
        return _bf16(np.asarray(c_old, np.float32) + _bf16(y))
    return _bf16(y)


def ref_cos_sin(max_pos: int, head_dim: int, theta: float) -> np.ndarray:
    """HF's float32 RoPE table: ``[max_pos, head_dim]`` = (cos | sin) of ``pos * inv_freq``."""
    inv_freq = (1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64)
                                 .astype(np.float32) / head_dim))).astype(np.float32)
    freqs = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(freqs), np.sin(freqs)], axis=1).astype(np.float32)


def ref_rope_kv(qkv: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                cos_sin: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, num_q_heads: int,
                num_kv_heads: int, head_dim: int, eps: float = 1e-6,
                q_norm_w: np.ndarray | None = None, k_norm_w: np.ndarray | None = None,
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q/k norm (when weights are given) + neox RoPE + KV write (docs/kernels.md).

    Returns (q_out float32 [T, nq*d], new k_cache, new v_cache); the caches are copied and only
    the slots of tokens with slot >= 0 change."""
    t_n, d, half = qkv.shape[0], head_dim, head_dim // 2
    heads = np.asarray(qkv, np.float32).reshape(t_n, num_q_heads + 2 * num_kv_heads, d)
    q = heads[:, :num_q_heads]
    k = heads[:, num_q_heads:num_q_heads + num_kv_heads]
    v = heads[:, num_q_heads + num_kv_heads:]
    if q_norm_w is not None:
        q = ref_rmsnorm(q, q_norm_w, eps)[0]
        k = ref_rmsnorm(k, k_norm_w, eps)[0]
    cs = np.asarray(cos_sin, np.float32)[np.asarray(positions, np.int64)]
    c = _bf16(cs[:, None, :half])
    s = _bf16(cs[:, None, half:])

    def rope(x: np.ndarray) -> np.ndarray:
        x1, x2 = x[..., :half], x[..., half:]
        o1 = _bf16(_bf16(x1 * c) - _bf16(x2 * s))
        o2 = _bf16(_bf16(x2 * c) + _bf16(x1 * s))
        return np.concatenate([o1, o2], axis=-1)

    q_out = rope(q).reshape(t_n, num_q_heads * d)
    k_new, v_new = k_cache.copy(), v_cache.copy()
    page_size = k_cache.shape[2]
    kr = rope(k)
    for t, slot in enumerate(np.asarray(slot_mapping, np.int64)):
        if slot < 0:
            continue
        page, off = divmod(int(slot), page_size)
        k_new[page, :, off] = kr[t].astype(k_cache.dtype)
        v_new[page, :, off] = v[t].astype(v_cache.dtype)
    return q_out, k_new, v_new


def ref_gumbel_margin(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                      min_p: float, seed: int, step: int) -> float:
    """Gap between the best and second-best kept Gumbel scores of a row (inf if < 2 kept).

    Rows whose gap is tiny may legitimately sample differently on the GPU (fp32 log)."""
    from engine.sampling import gumbel, keep_mask

    z = np.asarray(logits, np.float32) / np.float32(temperature)
    keep = keep_mask(z, top_k, top_p, min_p)
    score = np.sort(np.where(keep, z + gumbel(seed, step, z.shape[-1]), -np.inf))
    return float(score[-1] - score[-2]) if keep.sum() >= 2 else float("inf")


def ref_filter_margin(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                      min_p: float) -> float:
    """Relative distance of the row's top-p and min-p decisions from their boundaries.

    Small values mean fp32 (GPU) and float64 (numpy) may keep different sets."""
    z = np.asarray(logits, np.float32) / np.float32(temperature)
    p = np.exp((z - z.max()).astype(np.float64))
    margin = float("inf")
    if min_p > 0.0:
        margin = min(margin, float(np.abs(p / p.max() - min_p).min()) / max(min_p, 1e-30))
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        if 0 < top_k < p.shape[0]:
            order = order[:top_k]
        pk = p[order] / p[order].sum()
        before = np.cumsum(pk) - pk
        margin = min(margin, float(np.abs(before - top_p).min()))
    return margin


# ---- gemm (gemm.py) ----------------------------------------------------------------------------


def ref_gemm(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``C = A @ W^T`` in float32: a [M, K], w [N, K] (bf16 or float) -> float32 [M, N]."""
    return np.asarray(a, np.float32) @ np.asarray(w, np.float32).T
