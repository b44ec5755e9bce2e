"""CUDA graphs per bucket: bit-identical replay, padded batches, the by-reference regression,
greedy equality with and without graphs, and fresh randomness per replay."""


import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.executor.cuda_executor import CudaExecutor
from engine.model.loader import load_checkpoint
from engine.model.synthetic import write_checkpoint
from graphs.buckets import bucket_for
from graphs.profile import make_batch
from tests.gpu.helpers import report


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("g") / "m", "small-qwen3", seed=5,
                            overrides={"num_hidden_layers": 3}, quiet=True)


def test_replay_bit_identical_to_eager_padded(model_dir):
    mc = ModelConfig.from_pretrained(model_dir)
    ec = EngineArgs(model=str(model_dir), backend="cuda", max_num_seqs=256,
                    max_model_len=1024, num_gpu_blocks_override=256 * 20 + 8,
                    lazy_graph_capture=True).create_engine_config(mc)
    ex = CudaExecutor(load_checkpoint(model_dir, mc), ec, verbose=False)
    buf = ex.buf
    # every bucket of the default list (1, 2, 4, 8, 16, ..., 256) exactly, and padded batches
    # (3 -> 4, 5 -> 8, 9 -> 16, 17 -> 24, 33 -> 40, 100 -> 104)
    assert ex.graphs.buckets[-1] == 256 and len(ex.graphs.buckets) == 35
    sizes = sorted(set(ex.graphs.buckets) | {3, 5, 9, 17, 33, 100})
    for b in sizes:
        batch = make_batch(b, 300, 16, ex.num_pages, mc.vocab_size, seed=b)
        batch.temperature[:] = 0.8  # sampled rows: the sampler runs inside the graph too
        batch.seeds[:] = np.arange(b) + 1000
        ex.upload(batch)
        ex.upload_sampling(batch)
        ex.decode_body(b, ex.decode_splits(b))
        eager_logits = buf.logits.download(np.empty((b, mc.vocab_size), np.float32), ex.stream)
        eager_tok = buf.sampled.download(np.empty(b, np.int32), ex.stream)
        ex.stream.synchronize()
        buf.logits.fill_bytes(0xFF, ex.stream)  # poison
        buf.sampled.fill_bytes(0xFF, ex.stream)
        bk = bucket_for(b, ex.graphs.buckets)
        assert ex.graphs.can_replay(b) and ex.graphs.pad(b) == bk  # lazy capture of this bucket
        ex.upload(batch, pad_to=bk)
        ex.upload_sampling(batch, pad_to=bk)
        ex.graphs.replay(bk)
        g_logits = buf.logits.download(np.empty((b, mc.vocab_size), np.float32), ex.stream)
        g_tok = buf.sampled.download(np.empty(b, np.int32), ex.stream)
        ex.stream.synchronize()
        assert np.array_equal(eager_logits.view(np.uint32), g_logits.view(np.uint32)), b
        assert np.array_equal(eager_tok, g_tok), b
    report({"test": "graph_replay_bit_identical", "batches": sizes})


def _workload(n, rng, vocab):
    return [rng.integers(0, vocab, int(rng.integers(1, 300))).tolist() for _ in range(n)]


def test_greedy_with_graphs_equals_without(model_dir):
    rng = np.random.default_rng(0)
    prompts = _workload(64, rng, 151000)
    sp = [SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=0.0, ignore_eos=True)
          for _ in prompts]
    opts = dict(backend="cuda", max_num_seqs=64, max_model_len=512,
                num_gpu_blocks_override=64 * 32 + 8)
    g = LLM(str(model_dir), **opts)
    e = LLM(str(model_dir), enforce_eager=True, **opts)
    a = [o.outputs[0].token_ids for o in g.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in e.generate(prompts, sp)]
    assert g.engine.stats.graph_steps > 0 and e.engine.stats.graph_steps == 0
    assert a == b
    report({"test": "greedy_graphs_vs_eager", "requests": 64,
             "graph_steps": g.engine.stats.graph_steps, "eager_steps": g.engine.stats.eager_steps})


def test_sampling_in_graphs_fresh_and_seeded(model_dir):
    llm = LLM(str(model_dir), backend="cuda", max_num_seqs=16, max_model_len=512,
              num_gpu_blocks_override=16 * 32 + 8)
    p = [5, 6, 7, 8]
    sp = SamplingParams(max_tokens=48, temperature=1.5, seed=77, ignore_eos=True)
    alone = llm.generate(p, sp)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=48, temperature=1.0, ignore_eos=True)] * 6
    batch = llm.generate([p] * 7, [sp] + others)
    assert batch[0].outputs[0].token_ids == alone  # the seed reproduces across buckets
    assert len(set(alone)) > 8  # fresh randomness at every replay, not one frozen draw
    assert llm.engine.stats.graph_steps > 0


def test_by_reference_regression_256_on_one_cached_prompt(model_dir, monkeypatch):
    """A long prompt is cached; 256 concurrent requests on it decode through graphs. The by-
    reference page total exceeds the physical pool yet fits the page-index buffer."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 151000, 3000).tolist()
    pool = 188 + 256 * 2 + 40
    llm = LLM(str(model_dir), backend="cuda", max_num_seqs=256, max_model_len=4096,
              max_num_batched_tokens=4096, num_gpu_blocks_override=pool)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))  # warm the cache
    outs = llm.generate([prompt] * 256, sp)
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 16
               for o in outs)
    assert all(o.num_cached_tokens >= 2992 for o in outs)
    eng = llm.engine
    refs_peak = 256 * (-(-3016 // 16))
    assert refs_peak > pool  # by reference, far more than the physical pool
    assert eng.stats.graph_steps > 0
    fresh = llm.generate([1, 2, 3], sp)[0].outputs[0]
    assert fresh.finish_reason == "length"
    report({"test": "by_reference_256", "pool_pages": pool, "refs_peak": refs_peak,
             "graph_steps": eng.stats.graph_steps})


def test_undersized_page_buffer_is_a_step_error_not_a_crash(model_dir, monkeypatch):
    import engine.executor.cuda_model as cm

    real = cm.Sizes.of

    def small(mc, ec):  # a page-index buffer deliberately too small: 8 pages per sequence
        s = real(mc, ec)
        return cm.Sizes(s.t_max, s.b_max, 8, s.logit_rows, s.max_pos)

    monkeypatch.setattr(cm.Sizes, "of", staticmethod(small))
    llm = LLM(str(model_dir), backend="cuda", max_num_seqs=8, max_model_len=1024,
              num_gpu_blocks_override=512)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long_p = list(range(10, 10 + 300))  # 19 pages > 8
    outs = llm.generate([long_p, [1, 2, 3]], sp)
    assert outs[0].outputs[0].finish_reason == "error"
    assert "page-index buffer" in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length"  # the other request was unharmed
    again = llm.generate([4, 5, 6], sp)[0].outputs[0]
    assert again.finish_reason == "length"
    assert llm.engine.block_manager.num_in_use == 0
