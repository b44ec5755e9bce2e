"""Attention kernels compile for sm_90a on a CPU-only machine; the numpy references are right.

The GPU comparison lives in tests/gpu/test_kernels_attention.py. Here: every supported model's
attention shape (Qwen3 16/8 and 32/8 heads at head_dim 128, SmolLM2 9/3 at 64) and the GPU test's
extra shapes compile, the launch helpers behave, and the references in tests/kernel_refs.py agree
with a naive per-token loop.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.kernel_refs import ref_paged_decode_attention, ref_prefill_attention

# (nq, nkv, head_dim): model shapes first, then the GPU test's GQA / head_dim coverage
MODEL_SHAPES = [(16, 8, 128), (32, 8, 128), (9, 3, 64)]
TEST_SHAPES = [(4, 4, 128), (8, 2, 64)]


@pytest.mark.parametrize("shape", MODEL_SHAPES + TEST_SHAPES)
def test_decode_attention_compiles(shape):
    from cutlass_kernels.decode_attention import compile_decode_attention

    launcher = compile_decode_attention(*shape)
    assert launcher._single is not None and launcher._split is not None
    assert compile_decode_attention(*shape) is launcher  # cached on the compile-time key


@pytest.mark.parametrize("shape", MODEL_SHAPES + TEST_SHAPES)
def test_prefill_attention_compiles(shape):
    from cutlass_kernels.prefill_attention import compile_prefill_attention

    launcher = compile_prefill_attention(*shape)
    assert compile_prefill_attention(*shape) is launcher


def test_decode_helpers():
    from cutlass_kernels.decode_attention import (
        MAX_SPLITS,
        choose_num_splits,
        decode_workspace_bytes,
    )

    assert decode_workspace_bytes(4, 32, 128, 1) == 0
    assert decode_workspace_bytes(4, 32, 128, 3) == 4 * 4 * 32 * 3 * 130
    for batch in (1, 2, 8, 64, 256):
        for ctx in (1, 16, 100, 1024, 4096, 40960):
            s = choose_num_splits(batch, 8, ctx)
            assert 1 <= s <= MAX_SPLITS
            assert s == 1 or -(-ctx // 16) >= 8 * s  # no split shorter than 8 pages
    # about 2 CTAs per SM (measured on the H200, docs/perf.md)
    assert choose_num_splits(256, 8, 4096) == 1  # 2048 CTAs fill the GPU
    assert choose_num_splits(128, 8, 1024) == 2  # 1024 CTAs: two splits measured faster
    assert choose_num_splits(64, 8, 1024) == 1  # 512 CTAs: one split was fastest
    assert choose_num_splits(8, 8, 1024) == 5  # 64 CTAs: 4-5 splits, not 8
    assert choose_num_splits(1, 8, 40960) == 33
    assert choose_num_splits(1, 8, 1024) == 8  # capped at 8 pages per split
    assert choose_num_splits(1, 8, 100) == 1


def test_launchers_reject_bad_arguments():
    from cutlass_kernels._common import KernelArgError
    from cutlass_kernels.decode_attention import compile_decode_attention
    from cutlass_kernels.prefill_attention import compile_prefill_attention

    dec = compile_decode_attention(16, 8, 128)
    with pytest.raises(KernelArgError):  # split launch without a workspace
        dec(16, 16, 16, 16, 16, 16, None, 1, 4, 2, 0.1, None)
    with pytest.raises(KernelArgError):  # misaligned pointer
        dec(18, 16, 16, 16, 16, 16, None, 1, 4, 1, 0.1, None)
    with pytest.raises(KernelArgError):
        dec(16, 16, 16, 16, 16, 16, None, 0, 4, 1, 0.1, None)
    pre = compile_prefill_attention(16, 8, 128)
    with pytest.raises(KernelArgError):
        pre(16, 16, 16, 16, 16, 16, 16, 4, 1, 4, 0, 0.1, None)


# ---- references against a naive per-token loop ------------------------------------------------


def _naive_one(q_vec, k_cache, v_cache, pages, kvh, n_attend, scale):
    ps = k_cache.shape[2]
    scores, values = [], []
    for t in range(n_attend):
        page, off = int(pages[t // ps]), t % ps
        scores.append(float(np.dot(q_vec, k_cache[page, kvh, off])) * scale)
        values.append(v_cache[page, kvh, off].astype(np.float64))
    m = max(scores)
    w = [math.exp(s - m) for s in scores]
    return sum(wi * vi for wi, vi in zip(w, values, strict=True)) / sum(w)


def _random_cache(rng, num_pages, nkv, hd):
    k = rng.standard_normal((num_pages, nkv, 16, hd)).astype(np.float32)
    v = rng.standard_normal((num_pages, nkv, 16, hd)).astype(np.float32)
    return k, v


def test_ref_decode_matches_naive_loop():
    rng = np.random.default_rng(0)
    nq, nkv, hd = 6, 2, 8
    ctx = np.array([1, 16, 17, 40], np.int32)
    k, v = _random_cache(rng, 12, nkv, hd)
    pt = np.zeros((4, 5), np.int32)
    perm = rng.permutation(np.arange(1, 12))
    used = 0
    for b, c in enumerate(ctx):
        n = -(-int(c) // 16)
        pt[b, :n] = perm[used:used + n]
        used += n
    q = rng.standard_normal((4, nq * hd)).astype(np.float32)
    got = ref_paged_decode_attention(q, k, v, pt, ctx, 0.3)
    for b in range(4):
        for h in range(nq):
            want = _naive_one(q[b, h * hd:(h + 1) * hd].astype(np.float64), k, v, pt[b],
                              h // (nq // nkv), int(ctx[b]), 0.3)
            np.testing.assert_allclose(got[b, h * hd:(h + 1) * hd], want, rtol=1e-5, atol=1e-6)


def test_ref_prefill_matches_naive_loop():
    rng = np.random.default_rng(1)
    nq, nkv, hd = 4, 4, 8
    q_lens = [1, 5, 17, 3]
    ctx = np.array([1, 5, 30, 20], np.int32)  # 3rd: chunked (13 earlier tokens), 4th: prefix
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    k, v = _random_cache(rng, 10, nkv, hd)
    pt = np.array([[3, 0], [7, 0], [1, 9], [2, 5]], np.int32)
    q = rng.standard_normal((cu[-1], nq * hd)).astype(np.float32)
    got = ref_prefill_attention(q, k, v, cu, ctx, pt, 0.25)
    for b in range(4):
        for i in range(q_lens[b]):
            t = int(cu[b]) + i
            n_attend = int(ctx[b]) - q_lens[b] + i + 1
            for h in range(nq):
                want = _naive_one(q[t, h * hd:(h + 1) * hd].astype(np.float64), k, v, pt[b],
                                  h // (nq // nkv), n_attend, 0.25)
                np.testing.assert_allclose(got[t, h * hd:(h + 1) * hd], want, rtol=1e-5,
                                           atol=1e-6)
