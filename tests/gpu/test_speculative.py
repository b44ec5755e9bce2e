"""Speculative verify on the GPU (CudaExecutor.verify_rows / verify_body): every verify row's
logits are the bits plain decoding computes at that position, eagerly and from the verify
graphs, at batch buckets 1..8 with spans of any length; end to end, speculative outputs equal
plain outputs token for token (greedy and seeded), an oracle proposer gets every draft accepted
and an adversarial one none."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.executor.cuda_executor import CudaExecutor
from engine.model.loader import load_checkpoint
from engine.model.synthetic import write_checkpoint
from tests.gpu.helpers import report, span_batch

K = 15  # drafts per speculating sequence: verify spans of up to 16 rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("spec") / "m", "small-qwen3", seed=9,
                            overrides={"num_hidden_layers": 3}, quiet=True)


def test_verify_rows_are_the_bits_of_plain_decode(model_dir):
    mc = ModelConfig.from_pretrained(model_dir)
    ec = EngineArgs.from_kwargs(
        model=str(model_dir), backend="cuda", max_num_seqs=256, max_model_len=1024,
        num_gpu_blocks_override=600, speculative_config={
                        "method": "ngram", "num_speculative_tokens": K,
                        "disable_by_batch_size": 9}).create_engine_config(mc)
    ex = CudaExecutor(load_checkpoint(model_dir, mc), ec, verbose=False)
    assert ex.verify is not None and ex.verify.buckets == (1, 2, 4, 8)
    rng = np.random.default_rng()
    # random K/V everywhere: a verify row that read a span slot before its KV was written
    # would read these instead of what plain decoding wrote
    bf16 = np.dtype(ml_dtypes.bfloat16)
    shape = (ex.num_pages, mc.num_key_value_heads, 16, mc.head_dim)
    for cache in ex.k_cache + ex.v_cache:
        cache.upload(rng.standard_normal(shape, np.float32).astype(bf16), ex.stream)
    v = mc.vocab_size
    checked = []
    for b in (1, 3, 8):
        starts = rng.integers(1, 700, b)
        q = rng.integers(1, K + 2, b)  # span lengths 1..16 (1: a plain decode row beside)
        q[0] = K + 1
        width = -(-(starts + K + 1) // 16)
        perm = rng.permutation(np.arange(1, ex.num_pages))
        pages = np.zeros((b, int(width.max())), np.int32)
        off = 0
        for i in range(b):
            pages[i, :width[i]] = perm[off:off + width[i]]
            off += int(width[i])
        toks = [rng.integers(0, v, K + 1) for _ in range(b)]
        temps = np.where(rng.random(b) < 0.5, 0.0, 0.8)
        seeds = rng.integers(0, 1 << 40, b)
        steps = rng.integers(0, 100, b)
        # plain decoding: K + 1 steps of all b sequences (bucket graphs)
        plain_logits, plain_tok = [], []
        for j in range(K + 1):
            step = span_batch(pages, starts + j, [t[j:j + 1] for t in toks], temps=temps,
                              seeds=seeds, steps=steps + j)
            out = ex.execute(step)
            assert out.graph
            plain_tok.append(out.sampled)
            plain_logits.append(ex.buf.logits.download(np.empty((b, v), np.float32), ex.stream))
        ex.stream.synchronize()
        span = span_batch(pages, starts, [t[:n] for t, n in zip(toks, q, strict=True)],
                          temps=temps, seeds=seeds, steps=steps)
        rows = ex.verify_rows(span)
        assert rows is not None and rows.num_seqs == int(q.sum())
        seq = np.repeat(np.arange(b), q)
        j = np.concatenate([np.arange(n) for n in q])
        want = np.stack([plain_logits[jj][ii] for ii, jj in zip(seq, j, strict=True)])
        want_tok = np.array([plain_tok[jj][ii] for ii, jj in zip(seq, j, strict=True)])
        for mode in ("graph", "eager"):
            ex.buf.logits.fill_bytes(0xFF, ex.stream)  # poison
            ex.buf.sampled.fill_bytes(0xFF, ex.stream)
            if mode == "graph":
                out = ex.execute(span)
                assert out.graph
                tok = out.sampled
            else:
                ex.upload(rows)
                ex.upload_sampling(rows)
                ex.verify_body(rows.num_seqs, b)
                tok = ex._sampled(rows, rows.num_seqs)
            got = ex.buf.logits.download(np.empty((rows.num_seqs, v), np.float32), ex.stream)
            ex.stream.synchronize()
            assert np.isfinite(got).all()
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (b, mode)
            assert np.array_equal(tok, want_tok), (b, mode)
        checked.append({"batch": b, "rows": int(q.sum())})
    report({"test": "verify_rows_bit_identical_to_plain_decode", "cases": checked})


def _prompts(rng, n, vocab):
    # repeated phrases (prompt lookup finds drafts) and plain random prompts
    return ([rng.integers(5, vocab, int(rng.integers(4, 12))).tolist() * 6 for _ in range(n - 2)]
            + [rng.integers(5, vocab, int(rng.integers(20, 200))).tolist() for _ in range(2)])


def _params(rng, n):
    return [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, top_k=0 if i % 2 == 0 else 40,
                           seed=None if i % 2 == 0 else int(rng.integers(1 << 30)),
                           max_tokens=int(rng.integers(20, 60)), ignore_eos=True)
            for i in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_speculative_outputs_equal_plain_outputs(model_dir):
    """One request at a time (the default speculates while one request runs) and a mixed batch
    of 64: n-gram speculation at k = 4 and k = 15 gives plain decoding's tokens."""
    rng = np.random.default_rng()
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts, params = _prompts(rng, 10, vocab), _params(rng, 10)
    many = _prompts(rng, 64, vocab)
    many_params = _params(rng, 64)
    opts = dict(backend="cuda", max_num_seqs=64, max_model_len=1024,
                num_gpu_blocks_override=64 * 16 + 8)
    plain = LLM(str(model_dir), **opts)
    want_one = [_ids(plain.generate([p], [sp]))[0] for p, sp in zip(prompts, params, strict=True)]
    want_many = _ids(plain.generate(many, many_params))
    del plain
    res = {}
    for k in (4, K):
        spec = LLM(str(model_dir), speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": k}, **opts)
        outs = [spec.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
        assert _ids(outs) == want_one, k
        assert _ids(spec.generate(many, many_params)) == want_many, k
        drafted = sum(o.metrics.get("spec_draft_tokens", 0) for o in outs)
        accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in outs)
        assert drafted > 0 and accepted > 0
        assert spec.engine.block_manager.gauges()["live"] == 0
        res[k] = {"drafted": drafted, "accepted": accepted}
        del spec
    report({"test": "speculative_outputs_equal_plain", "ngram": res})


@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_and_adversarial_proposers_on_cuda(model_dir, wrong):
    rng = np.random.default_rng()
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    prompts, params = _prompts(rng, 6, vocab), _params(rng, 6)
    opts = dict(backend="cuda", max_num_seqs=16, max_model_len=1024,
                num_gpu_blocks_override=16 * 16 + 8)
    plain = LLM(str(model_dir), **opts)
    want = [_ids(plain.generate([p], [sp]))[0] for p, sp in zip(prompts, params, strict=True)]
    del plain
    future = {tuple(p): w for p, w in zip(prompts, want, strict=True)}

    def propose(req, k):
        true = future[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]
        return [(t + 1) % vocab for t in true] if wrong else true

    spec = LLM(str(model_dir), speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": K}, **opts)
    spec.engine.scheduler.proposer = propose
    outs = [spec.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert _ids(outs) == want
    drafted = sum(o.metrics.get("spec_draft_tokens", 0) for o in outs)
    accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in outs)
    assert drafted > 0
    assert accepted == (0 if wrong else drafted)
    report({"test": "oracle_adversarial_cuda", "wrong": wrong, "drafted": drafted,
             "accepted": accepted})


def test_issue_681_scenario_on_cuda(model_dir):
    """The seed's #681 capacity scenario (tests/test_speculative.py ``_issue_681``) on cuda:
    161 pages, prefix caching off, 20 requests of ~1,650 + 512 tokens, k = 15, greedy and
    T = 0.8: every request completes and the free pages return to the baseline after each."""
    from tests.test_speculative import _issue_681

    llm = LLM(str(model_dir), backend="cuda", num_gpu_blocks_override=161,
              enable_prefix_caching=False, max_model_len=2304, max_num_seqs=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": K})
    free = _issue_681(llm, np.random.default_rng(), llm.engine.model_config.vocab_size)
    g = llm.engine.gauges()["spec"]
    assert g["draft_tokens"] > 0
    report({"test": "issue_681_cuda", "free_after_each": free[:3], "spec": {
        k: g[k] for k in ("draft_tokens", "accepted_tokens", "drafts")}})
