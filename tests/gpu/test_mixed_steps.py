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
from tests.gpu.helpers import distinct_pages, report, span_batch
from tests.tolerances import TOL


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
    _noise_kv(ex, np.random.default_rng(int(rng.integers(1 << 30))))  # a context of noise
    cases = []
    for n_dec, chunks in ((1, [37]), (5, [64, 3]), (12, [200])):
        starts = np.concatenate([rng.integers(1, 600, n_dec),
                                 rng.integers(0, 300, len(chunks))]).astype(np.int32)
        qs = [1] * n_dec + chunks
        pages = distinct_pages(rng, ex.num_pages, starts, qs)
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


@pytest.fixture(scope="module")
def gex(tmp_path_factory):
    """The same model with graphs (lazily captured): mixed steps of <= 128 tokens replay the
    row graph of their bucket (``CudaExecutor.mixed_rows``)."""
    d = write_checkpoint(tmp_path_factory.mktemp("mixedg") / "m", "small-qwen3", seed=6,
                         overrides={"num_hidden_layers": 3}, quiet=True)
    mc = ModelConfig.from_pretrained(d)
    ec = EngineArgs(model=str(d), backend="cuda", max_num_seqs=64, max_model_len=1024,
                    num_gpu_blocks_override=2400, lazy_graph_capture=True
                    ).create_engine_config(mc)
    return CudaExecutor(load_checkpoint(d, mc), ec, verbose=False)


def _mixed_case(ex, rng, n_dec: int, chunks: list[int]) -> StepBatch:
    n = n_dec + len(chunks)
    starts = np.concatenate([rng.integers(1, 400, n_dec),  # prompt rows: <= 16,384 KV reads
                             rng.integers(0, 60, len(chunks))]).astype(np.int32)
    qs = [1] * n_dec + chunks
    pages = distinct_pages(rng, ex.num_pages, starts, qs)
    toks = [rng.integers(0, ex.mc.vocab_size, qq) for qq in qs]
    temps = np.where(rng.random(n) < 0.5, 0.0, 0.9)
    return span_batch(pages, starts, toks, every_token=False, temps=temps,
                      seeds=rng.integers(0, 1 << 40, n), steps=rng.integers(0, 50, n))


def _noise_kv(ex, rng) -> None:
    import ml_dtypes

    shape = (ex.num_pages, ex.mc.num_key_value_heads, 16, ex.mc.head_dim)
    for cache in ex.k_cache + ex.v_cache:
        cache.upload(rng.standard_normal(shape, np.float32).astype(ml_dtypes.bfloat16),
                     ex.stream)


def _step_kv(ex, b: StepBatch) -> np.ndarray:
    """Layer 0's K of the step's token slots (fp32)."""
    c = ex.k_cache[0]
    k = c.download(np.empty(c.shape, c.dtype), ex.stream)
    ex.stream.synchronize()
    s = b.slot_mapping
    return k[s // 16, :, s % 16, :].astype(np.float32)


def _read(ex, s: int) -> tuple[np.ndarray, np.ndarray]:
    lg = ex.buf.logits.download(np.empty((s, ex.mc.vocab_size), np.float32), ex.stream)
    tok = ex.buf.sampled.download(np.empty(s, np.int32), ex.stream)
    ex.stream.synchronize()
    return lg, tok


def test_mixed_step_graph_equals_its_rows_eager_and_the_prefill_path(gex):
    """A mixed step through ``execute`` replays its bucket's row graph: logits and samples
    are the bits of the same rows run eagerly (``verify_body``); against the eager mixed path
    (prefill kernel for the chunks) its logits agree within the tolerance of two cuda paths,
    greedy tokens agree where the top two logits are apart, and layer 0's K agrees."""
    ex = gex
    assert ex.mixed is not None and ex.mixed.buckets == (16, 32, 64, 96, 128)
    rng = np.random.default_rng()
    cases = []
    for n_dec, chunks in ((1, [9]), (5, [64, 3]), (30, [33]), (64, [64]), (0, [100]),
                          (12, [20, 20, 20])):
        seed = int(rng.integers(1 << 30))
        b = _mixed_case(ex, np.random.default_rng(seed), n_dec, chunks)
        t, s = b.num_tokens, b.sample_token_idx.shape[0]
        rows = ex.mixed_rows(b)
        assert rows is not None, (n_dec, chunks)
        _noise_kv(ex, np.random.default_rng(seed + 1))
        ex.buf.logits.fill_bytes(0xFF, ex.stream)  # poison
        ex.buf.sampled.fill_bytes(0xFF, ex.stream)
        out = ex.execute(b)
        assert out.graph
        g_lg, g_tok = _read(ex, s)
        assert np.array_equal(out.sampled, g_tok)
        kv_graph = _step_kv(ex, b)
        # the same rows eagerly, padded to the bucket as the graph runs them
        bk = ex.mixed.pad(t)
        _noise_kv(ex, np.random.default_rng(seed + 1))
        ex.buf.logits.fill_bytes(0xFF, ex.stream)
        ex.upload(rows, pad_to=bk)
        ex.upload_sampling(rows, pad_to=bk)
        ex.verify_body(bk, bk)
        e_lg, e_tok = _read(ex, s)
        assert np.isfinite(g_lg).all()
        assert np.array_equal(g_lg.view(np.uint32), e_lg.view(np.uint32)), (n_dec, chunks)
        assert np.array_equal(g_tok, e_tok), (n_dec, chunks)
        # the eager mixed path (decode kernel for the one-token rows, prefill for the chunks)
        _noise_kv(ex, np.random.default_rng(seed + 1))
        mixed, ex.mixed = ex.mixed, None
        try:
            ex.buf.logits.fill_bytes(0xFF, ex.stream)
            out_p = ex.execute(b)
        finally:
            ex.mixed = mixed
        assert not out_p.graph
        p_lg, _ = _read(ex, s)
        kv_eager = _step_kv(ex, b)
        # two bf16 forwards of the step through other kernels (decode vs prefill attention,
        # other GEMM tiles): within the tolerance of such a pair (tests/tolerances.py)
        err = float(np.linalg.norm(g_lg - p_lg) / np.linalg.norm(p_lg))
        assert err <= TOL["cuda_paths"]["rtol_norm"], (n_dec, chunks, err)
        top2 = np.sort(p_lg, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0] > 0.25) & (b.temperature == 0)
        assert np.array_equal(g_lg.argmax(1)[clear], p_lg.argmax(1)[clear])
        # layer 0's K of the step's tokens: the qkv GEMM (another kernel) and the same rope
        kv_err = np.linalg.norm(kv_graph - kv_eager) / np.linalg.norm(kv_eager)
        assert kv_err <= TOL["gemm"]["rtol_norm"], kv_err
        cases.append({"decode_rows": n_dec, "chunks": chunks, "bucket": bk,
                      "rel_err_vs_prefill_path": err, "k0_rel_err": float(kv_err)})
    report({"test": "mixed_step_graph", "cases": cases})


def test_mixed_steps_that_stay_eager(gex):
    """Steps the row graphs do not take: more tokens than the largest bucket, prompt rows that
    read more KV than the limit and than the decode rows, prompt logprobs."""
    ex = gex
    rng = np.random.default_rng()
    assert ex.mixed_rows(_mixed_case(ex, rng, 4, [125])) is None  # 129 tokens
    long = _mixed_case(ex, rng, 2, [100])
    long.context_lens[-1] += 600  # 100 rows at contexts ~700: > 16,384 KV tokens
    assert ex.mixed_rows(long) is None
    out = ex.execute(_mixed_case(ex, rng, 3, [40]))
    assert out.graph and out.sampled.shape == (4,)
