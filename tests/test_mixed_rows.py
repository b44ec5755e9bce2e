"""A cuda mixed step as one decode row per token (``CudaExecutor.token_rows`` /
``mixed_rows``, the layout its row graphs replay): on the numpy reference the rows give the
step's own logits; which steps take the graphs and which stay eager."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import numpy as np
import pytest

from engine import LLM
from engine.executor.cuda_executor import MIXED_KV_TOKENS, CudaExecutor
from engine.model.synthetic import write_checkpoint
from tests.gpu.helpers import distinct_pages, span_batch


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    d = write_checkpoint(tmp_path_factory.mktemp("rows") / "m", "tiny-qwen3", seed=11,
                         quiet=True)
    return LLM(str(d), backend="numpy")


def _mixed(rng: np.random.Generator, num_pages: int, vocab: int, n_dec: int,
           chunks: list[int], dec_ctx: tuple[int, int] = (1, 200),
           chunk_start: tuple[int, int] = (0, 40)):
    starts = np.concatenate([rng.integers(*dec_ctx, n_dec),
                             rng.integers(*chunk_start, len(chunks))]).astype(np.int32)
    qs = [1] * n_dec + chunks
    pages = distinct_pages(rng, num_pages, starts, qs)
    return span_batch(pages, starts, [rng.integers(0, vocab, q) for q in qs],
                      every_token=False)


def test_token_rows_give_the_mixed_steps_logits(llm: LLM) -> None:
    ex = llm.engine.executor
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng()
    for n_dec, chunks in ((3, [17]), (0, [30, 5]), (6, [1, 9, 2])):
        for cache in ex.k_cache + ex.v_cache:
            cache[:] = rng.standard_normal(cache.shape)
        b = _mixed(rng, ex.num_pages, vocab, n_dec, chunks)
        kv = [c.copy() for c in ex.k_cache]
        rows = CudaExecutor.token_rows(b)
        t = b.num_tokens
        assert rows.is_decode and rows.num_seqs == t
        seq = np.repeat(np.arange(b.num_seqs), b.query_lens)
        j = np.arange(t) - b.cu_seqlens_q[:-1][seq]
        assert np.array_equal(rows.context_lens, b.context_lens[seq] - b.query_lens[seq] + 1 + j)
        assert np.array_equal(rows.page_indices, b.page_indices[seq])
        assert np.array_equal(rows.sample_token_idx, b.sample_token_idx)
        assert np.array_equal(rows.slot_mapping, b.slot_mapping)
        want = ex.logits(b, b.sample_token_idx)
        for c, k in zip(ex.k_cache, kv, strict=True):  # the same context for the rows
            c[:] = k
        got = ex.logits(rows, rows.sample_token_idx)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _fake(buckets: tuple[int, ...] | None, eager: tuple[int, ...] = ()) -> types.SimpleNamespace:
    mixed = None if buckets is None else types.SimpleNamespace(
        buckets=buckets, can_replay=lambda t: t <= buckets[-1])
    return types.SimpleNamespace(mixed=mixed, mixed_eager=eager,
                                 token_rows=CudaExecutor.token_rows)


def test_which_mixed_steps_take_the_row_graphs() -> None:
    rng = np.random.default_rng()
    on = _fake((16, 32, 64, 96, 128))

    def take(ex, b) -> bool:
        return CudaExecutor.mixed_rows(ex, b) is not None

    b = _mixed(rng, 4000, 1000, 64, [64])
    assert take(on, b)
    assert not take(_fake(None), b)  # rows off (CUTEINFER_MIXED_GRAPHS=0), or a graph engine's
    # test forcing the prefill path
    eager = _fake(None, (16, 32, 64, 96, 128))  # enforce_eager: the same steps, rows eagerly
    assert take(eager, b) and not take(eager, _mixed(rng, 4000, 1000, 64, [65]))
    assert not take(on, _mixed(rng, 4000, 1000, 64, [65]))  # 129 tokens
    assert take(on, _mixed(rng, 4000, 1000, 0, [128]))  # a prompt chunk alone
    # plain decode steps replay the decode graphs; verify steps their own
    assert not take(on, _mixed(rng, 4000, 1000, 8, []))
    # no prompt logprobs, no device drafts
    assert not take(on, dataclasses.replace(b, prompt_logprob_idx=np.zeros(1, np.int32)))
    assert not take(on, dataclasses.replace(b, device_drafts=np.zeros((1, 3), np.int32)))
    # prompt rows' KV reads: up to MIXED_KV_TOKENS, or up to the decode rows'
    far = _mixed(rng, 4000, 1000, 2, [100], chunk_start=(900, 901))
    reads = int(CudaExecutor.token_rows(far).context_lens[2:].sum())
    assert reads > MIXED_KV_TOKENS and not take(on, far)
    many = _mixed(rng, 8000, 1000, 28, [100], dec_ctx=(3500, 3501), chunk_start=(900, 901))
    assert int(many.context_lens[:28].sum()) >= reads and take(on, many)
    near = _mixed(rng, 4000, 1000, 2, [100], chunk_start=(100, 101))
    assert int(CudaExecutor.token_rows(near).context_lens[2:].sum()) <= MIXED_KV_TOKENS
    assert take(on, near)


def test_mixed_buckets_follow_the_config(tmp_path: Path, monkeypatch) -> None:
    """Mixed steps run as rows within the step buffers; the buffers hold 128 rows then even at
    fewer sequences. Under enforce_eager too (the same rows, eagerly: an eager engine computes
    a graph engine's bits); none with CUTEINFER_MIXED_GRAPHS=0. With speculation too (its
    prompt chunks and mixed steps run as the plain engine's do, so its outputs can equal plain
    decoding's), the buffers holding both the verify rows and the largest mixed bucket."""
    from engine.args import EngineArgs
    from engine.config import ModelConfig
    from engine.executor.cuda_model import MIXED_BUCKETS, Sizes, mixed_buckets

    d = write_checkpoint(tmp_path / "m", "tiny-qwen3", seed=1, quiet=True)
    mc = ModelConfig.from_pretrained(d)

    def cfg(**kw):
        return EngineArgs(model=str(d), backend="cuda", max_model_len=512,
                          **kw).create_engine_config(mc)

    ec = cfg(max_num_seqs=8)
    s = Sizes.of(mc, ec)
    assert s.b_max == 128 and mixed_buckets(ec, s) == list(MIXED_BUCKETS)
    ec = cfg(max_num_seqs=8, max_num_batched_tokens=64)
    assert mixed_buckets(ec, Sizes.of(mc, ec)) == [16, 32, 64]
    ec = cfg(max_num_seqs=8, enforce_eager=True)
    assert Sizes.of(mc, ec).b_max == 128 and mixed_buckets(ec, Sizes.of(mc, ec)) == list(
        MIXED_BUCKETS)
    ec = cfg(max_num_seqs=8, speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert mixed_buckets(ec, Sizes.of(mc, ec)) == list(MIXED_BUCKETS)
    assert Sizes.of(mc, ec).b_max == 128
    # verify rows past the largest mixed bucket: 64 sequences x (15 + 1) within the budget
    ec = cfg(max_num_seqs=64, max_num_batched_tokens=2048, speculative_config=(
        '{"method": "ngram", "num_speculative_tokens": 15, "disable_by_batch_size": 65}'))
    assert Sizes.of(mc, ec).b_max == 1024 and mixed_buckets(ec, Sizes.of(mc, ec)) == list(
        MIXED_BUCKETS)
    ec = cfg(max_num_seqs=8, enforce_eager=True,
             speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert mixed_buckets(ec, Sizes.of(mc, ec)) == list(MIXED_BUCKETS)
    monkeypatch.setenv("CUTEINFER_MIXED_GRAPHS", "0")
    ec = cfg(max_num_seqs=8, enforce_eager=True)
    assert Sizes.of(mc, ec).b_max == 8 and mixed_buckets(ec, Sizes.of(mc, ec)) == []
    ec = cfg(max_num_seqs=8)
    assert Sizes.of(mc, ec).b_max == 8 and mixed_buckets(ec, Sizes.of(mc, ec)) == []


def _async_fake(captured: tuple[int, ...], dflash: object = None):
    """A stand-in of the cuda executor's mixed-step parts: buckets 16-128, ``captured`` of
    them captured; records the uploads, replays and downloads ``launch`` makes."""
    bks = (16, 32, 64, 96, 128)
    calls: list[tuple] = []
    plan = types.SimpleNamespace(bucket=lambda t: next((b for b in bks if b >= t), None))
    mixed = types.SimpleNamespace(buckets=bks, can_replay=lambda t: t <= bks[-1], plan=plan,
                                  graphs=dict.fromkeys(captured),
                                  replay=lambda bk: calls.append(("replay", bk)))
    ex = types.SimpleNamespace(
        mixed=mixed, mixed_eager=(), token_rows=CudaExecutor.token_rows, dflash=dflash,
        graphs=None, _mixed_memo=None, _async_ok=CudaExecutor._async_ok,
        _check=lambda b: None,
        upload_step=lambda rows, pad_to, src_rows: calls.append(
            ("upload", rows.num_tokens, pad_to, src_rows)),
        _download_async=lambda n: calls.append(("download", n)) or "in flight")
    ex.mixed_rows = lambda b: CudaExecutor.mixed_rows(ex, b)
    ex._mixed_async = lambda b: CudaExecutor._mixed_async(ex, b)
    ex._decode_async = lambda b: CudaExecutor._decode_async(ex, b)
    return ex, calls


def test_a_mixed_step_is_launched_behind_the_step_in_flight() -> None:
    """Async scheduling (``launch``): a mixed step whose bucket's graph is captured goes up as
    its token rows, its decode rows' tokens gathered from the previous samples (``src_rows``,
    per token), and replays without waiting; its samples come back behind an event. One with
    processors, logprobs, a drafter, nothing to sample or an uncaptured bucket runs at once."""
    rng = np.random.default_rng()
    b = _mixed(rng, 4000, 1000, 64, [40])
    t, n = b.num_tokens, b.sample_token_idx.shape[0]
    src = np.concatenate([np.arange(64), np.full(40, -1)]).astype(np.int64)
    rng.shuffle(src[:64])
    ex, calls = _async_fake((64, 128))
    assert CudaExecutor.launches_async(ex, b)
    assert CudaExecutor.launch(ex, b, src) == "in flight"
    (up, up_t, pad, got_src), replay, down = calls
    assert up == "upload" and up_t == t == 104 and pad == 128 and got_src is src
    assert replay == ("replay", 128) and down == ("download", n)
    assert not CudaExecutor.launches_async(_async_fake((64, 96))[0], b)  # 128 not captured
    assert not CudaExecutor.launches_async(_async_fake((128,), dflash=object())[0], b)
    assert not CudaExecutor.launches_async(ex, dataclasses.replace(
        b, num_logprobs=np.zeros(n, np.int32)))
    assert not CudaExecutor.launches_async(ex, dataclasses.replace(b, procs=object()))
    alone = _mixed(rng, 4000, 1000, 0, [30])  # a chunk that finishes no prompt: no sample row
    alone = dataclasses.replace(alone, sample_token_idx=np.zeros(0, np.int32))
    assert not CudaExecutor.launches_async(ex, alone)
