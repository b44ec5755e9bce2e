"""GPU: the logits-processor kernels (cutlass_kernels/logits_process.py) against
engine.sampling.process_logits, in a mixed batch (rows with penalties, logit_bias, min_tokens,
allowed_token_ids and grammar masks, rows with none); the sampled tokens of processed logits
against engine.sampling; the device counts after CountTokens against SlotState; a re-run of the
step is identical; and inside the decode graphs: replay bit-identical to eager with processors
active, and the engine's greedy output with graphs equal to eager."""

from __future__ import annotations

import dataclasses
import gc
import json

import numpy as np
import pytest

from tests.gpu.helpers import report
from tests.kernel_refs import ref_gumbel_margin
from tests.processor_cases import random_step
from tests.tolerances import TOL


@pytest.fixture
def seed() -> int:
    return int(np.random.default_rng().integers(2**31))


class _DeviceArena:
    """ProcessorBuffers' arena: standalone allocations (kept alive here)."""

    def __init__(self) -> None:
        self.keep: list = []

    def alloc(self, shape, dtype, name=""):
        from engine.cuda.driver import device_array

        buf = device_array(shape, dtype)
        self.keep.append(buf)
        return buf


def _assert_logits_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    # -inf exactly where numpy has it; elsewhere fp32 equal but for a fused multiply-add
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{what}: -inf differs"
    assert not np.isnan(got).any(), f"{what}: NaN"
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=TOL["logits_process"]["rtol"],
                               atol=TOL["logits_process"]["atol"], err_msg=what)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("vocab", [1000, 999, 151936])
def test_logits_process_matches_numpy(cuda_ctx, stream, seed, vocab, rows):
    from cutlass_kernels.logits_process import compile_count_tokens, compile_logits_process
    from cutlass_kernels.sampling import compile_sampler
    from engine.cuda.driver import to_device
    from engine.executor.cuda_logits import ProcessorBuffers
    from engine.sampling import SlotState, process_logits, sample

    rng = np.random.default_rng(seed)
    what = f"logits_process V={vocab} S={rows} seed={seed}"
    step, steps, reqs = random_step(rng, rows, vocab, num_slots=rows + 3)
    logits = (rng.standard_normal((rows, vocab)) * rng.choice([1.0, 4.0])).astype(np.float32)
    logits[:, rng.integers(0, vocab, 8)] = -np.inf
    slots = SlotState(vocab)
    slots.init(step.inits)
    want, _ = process_logits(logits, step, steps, slots)

    class K:  # the two launchers the buffers call, by the Kernels field names
        logits_process = compile_logits_process(vocab)
        count_tokens = compile_count_tokens(vocab)

    # the engine's arena (the rows go up through one pinned mirror), or buffers of their own
    # (one copy per array)
    from engine.cuda.driver import Arena

    mirrored = vocab != 999
    arena = Arena((rows + 3) * vocab * 12 + (rows + 1) * 8192 + (1 << 24)) if mirrored \
        else _DeviceArena()
    bufs = ProcessorBuffers(vocab, vocab, rows, rows + 3, arena, stream)
    bufs.stage(step, rows, stream)
    assert (bufs._mirror is not None) == mirrored
    d_logits = to_device(logits)
    d_steps = to_device(steps)
    bufs.apply(K, d_logits, d_steps, rows, stream)
    stream.synchronize()
    got = d_logits.download()
    _assert_logits_close(got, want, what)
    untouched = step.flags == 0
    assert np.array_equal(got[untouched].view(np.uint32), logits[untouched].view(np.uint32)), \
        f"{what}: a row without processors changed"
    from engine import envs

    # CUTEINFER_LOGITS_CHUNKS: CTAs a row, the same bits (``got`` ran the default count)
    for chunks in sorted({1, 3, 8} - {envs.logits_chunks()}):

        class KC:
            logits_process = compile_logits_process(vocab, chunks=chunks)

        d_chunked = to_device(logits)
        bufs.apply(KC, d_chunked, d_steps, rows, stream)
        stream.synchronize()
        assert np.array_equal(d_chunked.download().view(np.uint32), got.view(np.uint32)), \
            f"{what}: {chunks} CTAs a row differ from the default"

    # sample the processed rows (greedy and random) and count the tokens on the device
    temperature = rng.choice([0.0, 0.7, 1.0], rows).astype(np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    min_p = np.zeros(rows, np.float32)
    seeds = rng.integers(0, 2**63, rows).astype(np.uint64)
    d_tok = to_device(np.full(rows, -1, np.int32))
    compile_sampler(vocab)(d_logits, to_device(temperature), to_device(top_k), to_device(top_p),
                           to_device(min_p), to_device(seeds), d_steps, d_tok, rows, stream)
    bufs.count(K, d_steps, d_tok, rows, stream)
    stream.synchronize()
    tokens = d_tok.download()
    ref = sample(want, temperature, top_k, top_p, min_p, seeds, steps)
    def clear(r: int) -> bool:  # the draw is not decided by float noise (nor all -inf)
        if not np.isfinite(want[r]).any():
            return False
        if temperature[r] == 0:
            return bool(np.partition(want[r], -2)[-2] < want[r].max() - 1e-4)
        return ref_gumbel_margin(want[r], temperature[r], 0, 1.0, 0.0, int(seeds[r]),
                                 int(steps[r])) > TOL["sampling"]["gumbel_gap"]

    clear = np.array([clear(r) for r in range(rows)])
    bad = np.nonzero(clear & (tokens != ref))[0]
    assert bad.size == 0, f"{what}: rows {bad.tolist()} sampled {tokens[bad]}, want {ref[bad]}"
    slots.count(step, steps, tokens)
    counts = bufs.counts.download()
    counted = bufs.counted.download()
    for s in slots.counts:
        np.testing.assert_array_equal(counts[s], slots.counts[s], err_msg=f"{what}: slot {s}")
        assert counted[s] == slots.counted[s], f"{what}: counted[{s}]"

    # the same step again (a graph replay of it, a retry): its own token is not counted twice
    d_again = to_device(logits)
    bufs.apply(K, d_again, d_steps, rows, stream)
    bufs.count(K, d_steps, d_tok, rows, stream)
    stream.synchronize()
    assert np.array_equal(d_again.download().view(np.uint32), got.view(np.uint32)), \
        f"{what}: a re-run differs"
    np.testing.assert_array_equal(bufs.counts.download(), counts, err_msg=f"{what}: recounted")
    report({"test": "logits_process_vs_numpy", "vocab": vocab, "rows": rows,
             "processed_rows": int((step.flags != 0).sum()), "seed": seed})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.model.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("lp") / "m", "small-qwen3", seed=7,
                            overrides={"num_hidden_layers": 2}, quiet=True)


def test_replay_bit_identical_to_eager_with_processors(model_dir):
    from engine.args import EngineArgs
    from engine.config import ModelConfig
    from engine.executor.cuda_executor import CudaExecutor
    from engine.model.loader import load_checkpoint
    from graphs.buckets import bucket_for
    from graphs.profile import make_batch

    mc = ModelConfig.from_pretrained(model_dir)
    ec = EngineArgs(model=str(model_dir), backend="cuda", max_num_seqs=64, max_model_len=512,
                    num_gpu_blocks_override=64 * 20 + 8,
                    lazy_graph_capture=True).create_engine_config(mc)
    ex = CudaExecutor(load_checkpoint(model_dir, mc), ec, verbose=False)
    buf, v = ex.buf, mc.vocab_size
    sizes = [1, 3, 8, 17, 64]
    for b in sizes:
        rng = np.random.default_rng(b)
        batch = make_batch(b, 200, 16, ex.num_pages, v, seed=b)
        batch.temperature[:] = rng.choice([0.0, 0.8], b).astype(np.float32)
        batch.seeds[:] = np.arange(b) + 1000
        step, steps, _ = random_step(rng, b, v, num_slots=ec.max_num_seqs)
        batch.sample_steps[:] = steps
        batch.procs = step
        ex.upload(batch)
        ex.upload_sampling(batch)
        ex.decode_body(b, ex.decode_splits(b))
        eager_logits = buf.logits.download(np.empty((b, v), np.float32), ex.stream)
        eager_tok = buf.sampled.download(np.empty(b, np.int32), ex.stream)
        eager_counts = buf.procs.counts.download()
        ex.stream.synchronize()
        buf.logits.fill_bytes(0xFF, ex.stream)
        buf.sampled.fill_bytes(0xFF, ex.stream)
        bk = bucket_for(b, ex.graphs.buckets)
        assert ex.graphs.can_replay(b) and ex.graphs.pad(b) == bk
        # the same step again, without its slot inits: the counts it advanced stay exact
        batch.procs = dataclasses.replace(step, inits=[])
        ex.upload(batch, pad_to=bk)
        ex.upload_sampling(batch, pad_to=bk)
        ex.graphs.replay(bk)
        g_logits = buf.logits.download(np.empty((b, v), np.float32), ex.stream)
        g_tok = buf.sampled.download(np.empty(b, np.int32), ex.stream)
        g_counts = buf.procs.counts.download()
        ex.stream.synchronize()
        assert np.array_equal(eager_logits.view(np.uint32), g_logits.view(np.uint32)), b
        assert np.array_equal(eager_tok, g_tok), b
        assert np.array_equal(eager_counts, g_counts), b
        assert (step.flags != 0).any() and ((step.flags == 0).any() or b == 1)
    report({"test": "graph_replay_bit_identical_with_processors", "batches": sizes})


def test_greedy_processors_with_graphs_equal_eager(model_dir):
    from engine import LLM, SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 151000, int(rng.integers(1, 200))).tolist() for _ in range(24)]
    sp = []
    for i in range(24):
        kw = {}
        if i % 4 == 1:
            kw = dict(repetition_penalty=1.4, frequency_penalty=0.5, presence_penalty=0.3)
        elif i % 4 == 2:
            kw = dict(logit_bias={int(t): 4.0 for t in rng.integers(0, 151000, 20)},
                      min_tokens=8, allowed_token_ids=rng.integers(0, 151000, 5000).tolist())
        elif i % 4 == 3:
            kw = dict(repetition_penalty=0.8, logprobs=3, logit_bias={5: -100.0})
        sp.append(SamplingParams(max_tokens=int(rng.integers(9, 32)), temperature=0.0,
                                 ignore_eos=True, **kw))
    opts = dict(backend="cuda", max_num_seqs=32, max_model_len=512,
                num_gpu_blocks_override=32 * 32 + 8)
    g = LLM(str(model_dir), **opts)
    e = LLM(str(model_dir), enforce_eager=True, **opts)
    a = g.generate(prompts, sp)
    b = e.generate(prompts, sp)
    assert g.engine.stats.graph_steps > 0 and e.engine.stats.graph_steps == 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for i in range(2, 24, 4):  # allowed_token_ids held
        allowed = set(sp[i].allowed_token_ids)
        assert set(a[i].outputs[0].token_ids) <= allowed
    for i in range(3, 24, 4):  # logprobs are of the logits before the processors: the banned
        for d in a[i].outputs[0].logprobs:  # token keeps a finite logprob where it ranks
            assert all(np.isfinite(lp.logprob) for lp in d.values())
    report({"test": "greedy_processors_graphs_vs_eager", "requests": 24,
             "graph_steps": g.engine.stats.graph_steps})


REGEX = r"[a-z]{3,8}-[0-9]{2,4}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "tag"], "additionalProperties": False}  # closes in 24 tokens


def _structured_case(tmp_path, penalties: bool = False):
    """The chat checkpoint (the real Qwen3 tokenizer), 12 random prompts, greedy params: every
    third request under ``REGEX``, every third under ``SCHEMA``, the rest plain (``penalties``:
    every fourth with a repetition penalty), and the engine options."""
    from engine import SamplingParams
    from engine.sampling_params import StructuredOutputsParams
    from engine.server.testing import write_test_checkpoint

    d = write_test_checkpoint(tmp_path / "chat", "chat")
    rng = np.random.default_rng()
    prompts = [rng.integers(0, 150000, int(rng.integers(4, 60))).tolist() for _ in range(12)]
    sp = []
    for i in range(12):
        so = None
        if i % 3 == 1:
            so = StructuredOutputsParams(regex=REGEX)
        elif i % 3 == 2:
            so = StructuredOutputsParams(json=SCHEMA)
        sp.append(SamplingParams(max_tokens=24, temperature=0.0, structured_outputs=so,
                                 repetition_penalty=1.2 if penalties and i % 4 == 0 else 1.0))
    opts = dict(backend="cuda", max_num_seqs=16, max_model_len=256,
                num_gpu_blocks_override=16 * 16 + 8)
    return d, prompts, sp, opts


def _assert_grammars_hold(outs) -> None:
    import re

    for i in range(1, 12, 3):
        assert re.fullmatch(REGEX, outs[i].outputs[0].text), outs[i].outputs[0].text
    for i in range(2, 12, 3):
        obj = json.loads(outs[i].outputs[0].text)
        assert isinstance(obj["ok"], bool) and obj["tag"] in ("red", "green", "blue")


def test_structured_rows_overlap_their_masks_and_match_eager(tmp_path):
    """Steps with grammar rows replay the head graph (forward + LM head), compute the masks on
    the host meanwhile and sample eagerly: greedy outputs equal eager mode's token for token,
    every constrained output holds its grammar, and the plain rows batched with them too."""
    pytest.importorskip("llguidance")
    from engine import LLM

    d, prompts, sp, opts = _structured_case(tmp_path)
    g = LLM(str(d), **opts)
    e = LLM(str(d), enforce_eager=True, **opts)
    a = g.generate(prompts, sp)
    b = e.generate(prompts, sp)
    assert g.engine.executor.heads.replays > 0, "no step took the overlapped path"
    assert g.engine.executor.tails.replays == g.engine.executor.heads.replays
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    _assert_grammars_hold(a)
    report({"test": "structured_overlap_vs_eager", "requests": 12,
             "head_replays": g.engine.executor.heads.replays})


def test_gated_structured_steps_match_eager(tmp_path, monkeypatch):
    """``CUTEINFER_GRAMMAR_GATE=1``: a continuation whose only late rows are grammar rows is
    launched whole (``launch_gated``): the stream waits on the grammar worker's flag in host
    memory, copies the masks and samples. Greedy outputs equal eager mode's token for token,
    and every constrained output holds its grammar."""
    pytest.importorskip("llguidance")
    from engine import LLM

    monkeypatch.setenv("CUTEINFER_GRAMMAR_GATE", "1")
    monkeypatch.setenv("CUTEINFER_GRAMMAR_PROCESS", "1")
    d, prompts, sp, opts = _structured_case(tmp_path, penalties=True)
    # an engine dropped without shutdown leaves its worker's shared memory registered with the
    # device; the next worker's mapping may reuse those addresses (registered again anyway)
    first = LLM(str(d), **opts)
    assert all(o.outputs[0].error is None for o in first.generate(prompts[:3], sp[:3]))
    del first
    gc.collect()
    g = LLM(str(d), **opts)
    ex = g.engine.executor
    inner, gated = ex.launch_gated, [0]

    def spy(*a, **k):
        gated[0] += 1
        return inner(*a, **k)

    ex.launch_gated = spy
    a = g.generate(prompts, sp)
    e = LLM(str(d), enforce_eager=True, **opts)
    b = e.generate(prompts, sp)
    assert gated[0] > 0, "no step was launched gated"
    for x in a:
        assert x.outputs[0].finish_reason in ("length", "stop") and x.outputs[0].error is None, \
            x.outputs[0]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    _assert_grammars_hold(a)
    assert g.engine._gate is None
    report({"test": "gated_structured_vs_eager", "requests": 12, "gated_launches": gated[0]})
