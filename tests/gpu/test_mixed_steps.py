"""A mixed step (one-token decode rows first, then prefill chunks): the decode rows' attention
runs in the decode kernel, the chunks' in the prefill kernel. Each part's logits are the bits of
that part run alone with the same GEMM kernels (``tile_as``), so neither kernel reads the other's
rows."""

from __future__ import annotations

import numpy as np
import pytest

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.executor.cuda_executor import CudaExecutor
from engine.model.loader import load_checkpoint
from engine.model.synthetic import write_checkpoint
from engine.step import StepBatch
from tests.gpu.helpers import report, span_batch


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp("mixed") / "m", "small-qwen3", seed=4,
                         overrides={"num_hidden_layers": 3}, quiet=True)
    mc = ModelConfig.from_pretrained(d)
    ec = EngineArgs(model=str(d), backend="cuda", max_num_seqs=64, max_model_len=1024,
                    num_gpu_blocks_override=600, enforce_eager=True).create_engine_config(mc)
    return CudaExecutor(load_checkpoint(d, mc), ec, verbose=False)


def _logits(ex, b: StepBatch, rows: int, tile_as: int, decode: bool) -> np.ndarray:
    ex.upload(b)
    ex.upload_sampling(b)
    if decode:
        ex.forward(b.num_tokens, b.num_seqs, True, 1, ex.decode_splits(b.num_seqs), tile_as)
    else:
        ones = ex.stage_mixed(b)
        ex.forward(b.num_tokens, b.num_seqs, False, int(b.query_lens.max()), 1, tile_as,
                   decode_rows=ones)
    ex.buf.logits.fill_bytes(0xFF, ex.stream)  # poison
    ex.logits(b.num_tokens, 0, rows, tile_as)
    out = ex.buf.logits.download(np.empty((rows, ex.mc.vocab_size), np.float32), ex.stream)
    ex.stream.synchronize()
    return out


def test_mixed_step_parts_equal_each_part_alone(ex):
    rng = np.random.default_rng()
    v = ex.mc.vocab_size
    rng_k = np.random.default_rng(int(rng.integers(1 << 30)))
    import ml_dtypes

    shape = (ex.num_pages, ex.mc.num_key_value_heads, 16, ex.mc.head_dim)
    for cache in ex.k_cache + ex.v_cache:  # a context of noise
        cache.upload(rng_k.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16),
                     ex.stream)
    cases = []
    for n_dec, chunks in ((1, [37]), (5, [64, 3]), (12, [200])):
        n = n_dec + len(chunks)
        starts = np.concatenate([rng.integers(1, 600, n_dec),
                                 rng.integers(0, 300, len(chunks))]).astype(np.int32)
        qs = [1] * n_dec + chunks
        width = -(-(starts + np.array(qs)) // 16)
        perm = rng.permutation(np.arange(1, ex.num_pages))
        pages = np.zeros((n, int(width.max())), np.int32)
        off = 0
        for i in range(n):
            pages[i, :width[i]] = perm[off:off + width[i]]
            off += int(width[i])
        toks = [rng.integers(0, v, qq) for qq in qs]
        m = int(sum(qs))  # every part below runs the GEMM kernels of an m-row call
        # the decode rows alone, as a decode step
        dec = span_batch(pages[:n_dec], starts[:n_dec], toks[:n_dec], every_token=False)
        want_dec = _logits(ex, dec, n_dec, m, decode=True)
        # the chunks alone, as a prefill step (logits of every chunk token)
        pre = span_batch(pages[n_dec:], starts[n_dec:], toks[n_dec:])
        want_pre = _logits(ex, pre, pre.num_tokens, m, decode=False)
        got = _logits(ex, span_batch(pages, starts, toks), m, m, decode=False)
        assert np.isfinite(got).all()
        assert np.array_equal(got[:n_dec].view(np.uint32), want_dec.view(np.uint32)), n_dec
        assert np.array_equal(got[n_dec:].view(np.uint32), want_pre.view(np.uint32)), chunks
        # and the mixed step does run the decode rows apart (prefill kernel: other bits)
        assert ex.stage_mixed(span_batch(pages, starts, toks, every_token=False)) == n_dec
        cases.append({"decode_rows": n_dec, "chunks": chunks})
    report({"test": "mixed_step_parts_bit_identical", "cases": cases})
