"""The numpy simulation of the tensor-parallel forward against TP=1: logits, sampled tokens and
logprobs equal within float32 tolerance at N = 1, 2, 4, over Qwen3 (q/k norm) and Llama shapes
with GQA, MQA and MHA, tied and untied heads, padded vocabularies; chunked prefill then decode on
a paged KV cache. Then faults (a failing rank, a hung rank) and the engine option end to end."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.executor.base import ExecutorError
from engine.executor.numpy_executor import NumpyExecutor
from engine.model.loader import Checkpoint
from engine.model.reference import ReferenceModel
from engine.model.synthetic import hf_config, write_checkpoint
from engine.model.synthetic import make_weights as random_weights
from engine.parallel.comm import CollectiveTimeoutError
from engine.parallel.sim import RankFailedError, TensorParallelNumpyExecutor
from engine.step import StepBatch
from tests.tolerances import TOL

ATOL = TOL["tp_sim_vs_tp1"]["max_abs"]
PAGE = 16
NUM_PAGES = 40

SHAPES = {
    # 4 q heads / 2 KV heads, tied, vocab 1024: KV heads replicated at N=4
    "qwen3-gqa-tied": ("tiny-qwen3", {}),
    # 4 q heads / 1 KV head, untied, vocab 1000 (not a multiple of 64: padded shards)
    "llama-mqa-untied": ("tiny-llama", {}),
    # 8 q / 2 KV heads of 32, untied, vocab 517, three layers
    "qwen3-gqa4-untied": ("tiny-qwen3", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=64,
        intermediate_size=128, vocab_size=517, tie_word_embeddings=False, num_hidden_layers=3)),
    # multi-head (4 / 4), tied, vocab 300, head_dim 16
    "llama-mha-tied": ("tiny-llama", dict(
        num_attention_heads=4, num_key_value_heads=4, hidden_size=64, intermediate_size=96,
        vocab_size=300, tie_word_embeddings=True)),
}


def make_ckpt(shape: str, seed: int = 0) -> Checkpoint:
    preset, overrides = SHAPES[shape]
    mc = ModelConfig.from_dict(hf_config(preset, overrides=overrides))
    return Checkpoint(Path("/in-memory"), mc, random_weights(mc, seed))


@dataclass
class Seq:
    tokens: list[int]  # every token known so far (prompt, then sampled)
    pages: list[int]
    done: int = 0  # tokens whose KV is written
    fed: list[int] = field(default_factory=list)


def build(work: list[tuple[Seq, int, bool]], prompt_logprobs: bool) -> StepBatch:
    """A step: per sequence (its next ``n`` tokens, whether its last row samples)."""
    ids, pos, slots, cu, ctx, sample_idx, pl_idx, pl_tgt = [], [], [], [0], [], [], [], []
    width = max(len(s.pages) for s, _, _ in work)
    table = np.zeros((len(work), width), np.int32)
    for i, (s, n, samples) in enumerate(work):
        t0 = len(ids)
        for p in range(s.done, s.done + n):
            ids.append(s.tokens[p])
            pos.append(p)
            slots.append(s.pages[p // PAGE] * PAGE + p % PAGE)
            if prompt_logprobs and p + 1 < len(s.tokens):
                pl_idx.append(t0 + p - s.done)
                pl_tgt.append(s.tokens[p + 1])
        s.fed += s.tokens[s.done:s.done + n]
        s.done += n
        cu.append(len(ids))
        ctx.append(s.done)
        table[i, :len(s.pages)] = s.pages
        if samples:
            sample_idx.append(len(ids) - 1)
    k = len(sample_idx)
    return StepBatch(
        input_ids=np.array(ids, np.int32), positions=np.array(pos, np.int32),
        slot_mapping=np.array(slots, np.int64), cu_seqlens_q=np.array(cu, np.int32),
        context_lens=np.array(ctx, np.int32), page_indices=table,
        sample_token_idx=np.array(sample_idx, np.int32), temperature=np.zeros(k, np.float32),
        top_k=np.zeros(k, np.int32), top_p=np.ones(k, np.float32), min_p=np.zeros(k, np.float32),
        seeds=np.arange(k, dtype=np.uint64), sample_steps=np.zeros(k, np.uint32),
        num_logprobs=np.full(k, 5, np.int32), prompt_logprob_idx=np.array(pl_idx, np.int32),
        prompt_logprob_targets=np.array(pl_tgt, np.int32), prompt_num_logprobs=5 if pl_idx else 0)


def compare_step(tp1: NumpyExecutor, tp: TensorParallelNumpyExecutor, b: StepBatch
                 ) -> np.ndarray:
    """Logits of every row, then the step's outputs, of both; returns TP=1's sampled tokens."""
    rows = np.arange(b.num_tokens)
    want, got = tp1.logits(b, rows), tp.logits(b, rows)
    assert got.shape == want.shape == (b.num_tokens, tp1.config.vocab_size)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    o1, o = tp1.execute(b), tp.execute(b)  # the same KV written again: idempotent
    lg = want[b.sample_token_idx]
    top2 = np.sort(lg, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    np.testing.assert_array_equal(o.sampled[clear], o1.sampled[clear])
    if b.sample_token_idx.size:
        assert o.logprobs is not None and o1.logprobs is not None
        np.testing.assert_allclose(o.logprobs.top_logprobs, o1.logprobs.top_logprobs, atol=ATOL)
        np.testing.assert_allclose(o.logprobs.token_logprob[clear],
                                   o1.logprobs.token_logprob[clear], atol=ATOL)
    if b.prompt_logprob_idx.size:
        assert o.prompt_logprobs is not None and o1.prompt_logprobs is not None
        np.testing.assert_allclose(o.prompt_logprobs.token_logprob,
                                   o1.prompt_logprobs.token_logprob, atol=ATOL)
        np.testing.assert_allclose(o.prompt_logprobs.top_logprobs,
                                   o1.prompt_logprobs.top_logprobs, atol=ATOL)
    return o1.sampled


def run_scenario(ckpt: Checkpoint, tp: TensorParallelNumpyExecutor, seed: int = 0) -> list[Seq]:
    """Chunked prefill of four prompts (1 to 40 tokens) on shuffled pages, then decode; each
    step compared with TP=1. Returns the sequences."""
    rng = np.random.default_rng(seed)
    v = ckpt.config.vocab_size
    tp1 = NumpyExecutor(ckpt, NUM_PAGES, PAGE)
    free = (rng.permutation(NUM_PAGES - 1) + 1).tolist()  # page 0 is the padding page
    lens = [20, 40, 1, 33]
    seqs = [Seq(rng.integers(0, v, n).tolist(), [free.pop() for _ in range(-(-(n + 8) // PAGE))])
            for n in lens]
    steps = [
        [(seqs[0], 20, True), (seqs[1], 16, False), (seqs[2], 1, True), (seqs[3], 17, False)],
        [(seqs[1], 24, True), (seqs[0], 1, True), (seqs[3], 16, True), (seqs[2], 1, True)],
    ]
    for i, work in enumerate(steps + [None] * 4):
        if work is None:  # decode: every sequence its last sampled token
            work = [(s, 1, True) for s in seqs]
        sampled = compare_step(tp1, tp, build(work, prompt_logprobs=i < 2))
        for (s, _, _), t in zip([w for w in work if w[2]], sampled, strict=True):
            if s.done == len(s.tokens):
                s.tokens.append(int(t))
    # and the last logits equal the dense whole-sequence reference forward
    ref = ReferenceModel(ckpt)
    for s in seqs:
        dense = ref.forward(s.fed)[-1]
        b = build([(Seq(s.fed, s.pages, done=len(s.fed) - 1), 1, True)], False)
        np.testing.assert_allclose(tp.logits(b, np.zeros(1, np.int64))[0], dense, atol=ATOL)
    return seqs


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_sharded_forward_equals_tp1(shape: str, n: int) -> None:
    ckpt = make_ckpt(shape, seed=n)
    tp = TensorParallelNumpyExecutor(ckpt, NUM_PAGES, PAGE, n)
    if n > ckpt.config.num_key_value_heads:
        assert tp.plan.kv_head_replicas > 1  # some cases replicate KV heads
    # each rank's KV cache holds its KV heads only
    for w in tp.workers:
        assert w.local.k_cache[0].shape == (NUM_PAGES, tp.plan.kv_heads_per_rank, PAGE,
                                            ckpt.config.head_dim)
    beat = tp.heartbeat
    run_scenario(ckpt, tp)
    assert tp.heartbeat > beat


def _patch_mlp(tp: TensorParallelNumpyExecutor, rank: int, hook):
    model = tp.workers[rank].local.model
    orig = model.mlp

    def mlp(li, x):
        hook(li)
        return orig(li, x)

    model.mlp = mlp
    return lambda: setattr(model, "mlp", orig)


def test_ranks_run_in_named_threads() -> None:
    tp = TensorParallelNumpyExecutor(make_ckpt("qwen3-gqa-tied"), NUM_PAGES, PAGE, 2)
    names: set[str] = set()
    for r in range(2):
        _patch_mlp(tp, r, lambda li: names.add(threading.current_thread().name))
    b = build([(Seq([1, 2, 3], [5]), 3, True)], False)
    tp.execute(b)
    assert names == {"qwen3-tp-rank-0", "qwen3-tp-rank-1"}


def test_a_failing_rank_fails_the_step_and_the_next_runs() -> None:
    ckpt = make_ckpt("qwen3-gqa-tied")
    tp = TensorParallelNumpyExecutor(ckpt, NUM_PAGES, PAGE, 2, timeout_s=30)

    def boom(li):
        if li == 1:
            raise RuntimeError("injected failure")

    undo = _patch_mlp(tp, 1, boom)
    group = tp.group
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed: RuntimeError: injected") as e:
        tp.execute(build([(Seq([1, 2, 3], [5]), 3, True)], False))
    assert time.monotonic() - t0 < 5  # the peers are aborted, not left to the 30 s timeout
    assert e.value.rank == 1 and isinstance(e.value, ExecutorError)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert tp.broken is None and tp.group is not group  # a new group for the next step
    undo()
    run_scenario(ckpt, tp, seed=3)


def test_a_hung_rank_times_out_and_breaks_the_executor() -> None:
    tp = TensorParallelNumpyExecutor(make_ckpt("qwen3-gqa-tied"), NUM_PAGES, PAGE, 2,
                                     timeout_s=0.3)
    release = threading.Event()
    _patch_mlp(tp, 1, lambda li: release.wait(30))
    t0 = time.monotonic()
    try:
        with pytest.raises(CollectiveTimeoutError, match=r"rank\(s\) \[1\] never joined") as e:
            tp.execute(build([(Seq([1, 2, 3], [5]), 3, True)], False))
        assert time.monotonic() - t0 < 5
        assert e.value.missing == [1] and e.value.rank == 0
        assert tp.broken is not None and "restart the engine" in tp.broken
        with pytest.raises(ExecutorError, match=r"rank\(s\) \[1\] still running"):
            tp.execute(build([(Seq([4], [6]), 1, True)], False))
    finally:
        release.set()
    deadline = time.monotonic() + 10  # the released rank meets an aborted group and ends
    while any(t.name == "qwen3-tp-rank-1" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_slow_rank_within_the_timeout_is_only_slow() -> None:
    ckpt = make_ckpt("llama-mqa-untied")
    tp = TensorParallelNumpyExecutor(ckpt, NUM_PAGES, PAGE, 2, timeout_s=10)
    _patch_mlp(tp, 1, lambda li: time.sleep(0.05))
    run_scenario(ckpt, tp, seed=1)


def test_engine_option_runs_the_simulation(tmp_path: Path) -> None:
    d = write_checkpoint(tmp_path / "m", "tiny-qwen3", seed=11, quiet=True)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 1000, n).tolist() for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    outs = {}
    for n in (1, 2):
        llm = LLM(str(d), backend="numpy", tensor_parallel_size=n, max_num_batched_tokens=32)
        ex = llm.engine.executor
        assert isinstance(ex, TensorParallelNumpyExecutor) == (n > 1)
        outs[n] = llm.generate(prompts, params)
    for a, b in zip(outs[1], outs[2], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert abs(pa[t].logprob - pb[t].logprob) <= ATOL
