"""The per-step inputs through the pinned mirror (StagedInputs) land on the device exactly as the
one-copy-per-array path puts them: decode steps padded to a bucket, mixed prefill steps, with
the device buffers poisoned before each upload; one copy for both groups (``upload_step``) as two
(``upload`` + ``upload_sampling``); decode rows whose tokens come from the previous samples
(``src_rows``)."""

from __future__ import annotations

import numpy as np

from engine.executor.staged_inputs import ORDER
from engine.step import StepBatch


def _executor():
    from engine.args import EngineArgs
    from engine.config import ModelConfig
    from engine.executor.cuda_executor import CudaExecutor
    from engine.model.loader import Checkpoint
    from engine.model.synthetic import hf_config, make_weights

    mc = ModelConfig.from_dict(hf_config("tiny-qwen3"))
    ec = EngineArgs(num_gpu_blocks_override=128, max_num_seqs=16, max_num_batched_tokens=256,
                    max_model_len=256, enforce_eager=True).create_engine_config(mc, "cuda")
    return CudaExecutor(Checkpoint(None, mc, make_weights(mc, 0)), ec, verbose=False)


def _batch(rng, lens: list[int], ctx: list[int], num_pages: int, vocab: int) -> StepBatch:
    b, t = len(lens), sum(lens)
    width = max(-(-c // 16) for c in ctx)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    s = b  # every sequence samples
    return StepBatch(
        input_ids=rng.integers(0, vocab, t).astype(np.int32),
        positions=rng.integers(0, 200, t).astype(np.int32),
        slot_mapping=rng.integers(0, num_pages * 16, t).astype(np.int64), cu_seqlens_q=cu,
        context_lens=np.array(ctx, np.int32),
        page_indices=rng.integers(1, num_pages, (b, width)).astype(np.int32),
        sample_token_idx=(cu[1:] - 1).astype(np.int32),
        temperature=rng.random(s).astype(np.float32),
        top_k=rng.integers(0, 50, s).astype(np.int32), top_p=rng.random(s).astype(np.float32),
        min_p=rng.random(s).astype(np.float32), seeds=rng.integers(0, 2**63, s, np.uint64),
        sample_steps=rng.integers(0, 100, s).astype(np.uint32),
        num_logprobs=np.full(s, -1, np.int32))


def _device_state(ex) -> dict[str, np.ndarray]:
    out = {}
    for name in ORDER:
        d = getattr(ex.buf, name)
        out[name] = d.download(np.empty(d.shape, d.dtype), ex.stream)
    ex.stream.synchronize()
    return out


def _poison(ex) -> None:
    for name in ORDER:
        getattr(ex.buf, name).fill_bytes(0xA5, ex.stream)


def test_staged_uploads_equal_the_per_array_uploads():
    ex = _executor()
    assert ex.staged is not None
    rng = np.random.default_rng()
    cases = []
    for _ in range(6):  # decode steps padded to a bucket
        b = int(rng.integers(1, 12))
        cases.append((_batch(rng, [1] * b, rng.integers(1, 250, b).tolist(), ex.num_pages,
                             ex.mc.vocab_size), int(rng.integers(b, 17))))
    for _ in range(6):  # mixed prefill steps, no padding
        b = int(rng.integers(1, 6))
        lens = rng.integers(1, 40, b).tolist()
        ctx = [int(n + rng.integers(0, 100)) for n in lens]
        cases.append((_batch(rng, lens, ctx, ex.num_pages, ex.mc.vocab_size), None))
    staged = ex.staged
    for batch, pad_to in cases:
        src = None
        if pad_to is not None and rng.random() < 0.7:  # decode rows from previous samples
            src = rng.integers(-1, 16, batch.num_seqs).astype(np.int32)
        got = {}
        for mode in ("staged", "staged-one-copy", "per-array"):
            ex.staged = None if mode == "per-array" else staged
            _poison(ex)
            if mode == "staged-one-copy":
                ex.upload_step(batch, pad_to=pad_to, src_rows=src)
            else:
                ex.upload(batch, pad_to=pad_to, src_rows=src)
                ex.upload_sampling(batch, pad_to=pad_to)
            got[mode] = _device_state(ex)
        ex.staged = staged
        n, t = batch.num_seqs, batch.num_tokens
        rows = n if pad_to is None else pad_to
        toks = t if pad_to is None else t + pad_to - n
        width = batch.page_indices.shape[1]
        want_src = np.full(toks, -1, np.int32)
        if src is not None:
            want_src[:t] = src
        np.testing.assert_array_equal(got["per-array"]["input_src"][:toks], want_src)
        used = {"input_src": toks, "input_ids": toks, "positions": toks, "slot_mapping": toks,
                "cu_seqlens": rows + 1, "context_lens": rows, "logit_idx": rows,
                "temperature": rows, "top_k": rows, "top_p": rows, "min_p": rows,
                "seeds": rows, "steps": rows}
        for mode in ("staged", "staged-one-copy"):
            for name, k in used.items():
                np.testing.assert_array_equal(got[mode][name][:k], got["per-array"][name][:k],
                                              err_msg=f"{mode}: {name} (pad_to {pad_to})")
            np.testing.assert_array_equal(got[mode]["page_indices"][:rows, :width],
                                          got["per-array"]["page_indices"][:rows, :width])
    ex.shutdown()
