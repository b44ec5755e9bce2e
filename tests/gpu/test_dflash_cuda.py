"""The DFlash drafter on cuda (engine/executor/cuda_dflash.py): its draft logits against the
numpy drafter (engine/model/dflash.py) over the features the GPU captured, at contexts that end
inside a page and on a page boundary, short and long (split-KV); speculative decoding with it
gives plain decoding's tokens (greedy and seeded, one request at a time and a batch of 64,
prefix caching off with chunked prefill, a pool small enough to preempt); the #681 capacity
scenario completes with the free pages back after each request."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.model.dflash import DFlashDrafter, load_drafter
from engine.model.loader import load_checkpoint
from engine.model.synthetic import write_checkpoint
from tests.gpu.helpers import report

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dflash") / "m", "small-qwen3", seed=9,
                            overrides={"num_hidden_layers": 3}, quiet=True)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    # small-qwen3's shapes; its layers 0 and 2 captured
    return write_checkpoint(
        tmp_path_factory.mktemp("dflash") / "d", "tiny-qwen3-dflash", seed=5, quiet=True,
        overrides={"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 151936,
                   "max_position_embeddings": 40960, "num_target_layers": 3,
                   "mask_token_id": 151669, "target_layer_ids": [0, 2]})


def _spec(drafter, **kw):
    return {"method": "dflash", "model": str(drafter), **kw}


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_cuda_draft_logits_match_the_numpy_drafter(target, drafter):
    """At each request's first proposal (right after its one-step prefill, whose captured
    features are still in ``feats``): the cuda block's logits against the numpy drafter's
    over those features, and the proposed drafts are the argmax of the cuda logits."""
    rng = np.random.default_rng()
    llm = LLM(str(target), backend="cuda", max_model_len=2048, speculative_config=_spec(drafter))
    ex = llm.engine.executor
    d, mc = ex.dflash, llm.engine.model_config
    assert d is not None
    ckpt = load_checkpoint(str(target))
    embed = np.asarray(ckpt["model.embed_tokens.weight"], np.float32)  # tied: also lm_head
    ref = DFlashDrafter(load_drafter(str(drafter), mc), embed, embed, mc.rope_scaling)
    prop, seen = llm.engine.scheduler.proposer, []
    s = d.shapes
    bb, h, v = s.block, s.hidden, mc.vocab_size

    def spy(req, k):
        n = req.num_computed_tokens
        if req.request_id not in {x["id"] for x in seen}:
            feats = d.buf.feats.download(np.empty(d.buf.feats.nbytes // 2, BF16))
            feats = feats.reshape(-1, s.n_capture * h)[:n].astype(np.float32)
            pending = req.token_slice(n, 1)[0]
            pages = np.frombuffer(llm.engine.block_manager.page_table_view(req.request_id),
                                  np.int32)
            d.logits(ex, n, pending, pages)
            full = d.buf.logits.download(np.empty((bb, s.vocab), np.float32), ex.stream)
            ex.stream.synchronize()
            got = full[1:bb, :v]  # (row 0: the pending token's, unused)
            want = ref.logits(feats, pending)
            # the captured block (run: stage + graph launch): the eager block's bits
            d.buf.logits.fill_bytes(0xFF, ex.stream)  # poison (NaN)
            d.run(ex, [(n, pending, pages)], 1)
            again = d.buf.logits.download(np.empty((bb, s.vocab), np.float32), ex.stream)
            ex.stream.synchronize()
            graph_bits = bool((again[1:bb].view(np.uint32)
                               == full[1:bb].view(np.uint32)).all())
            drafts = prop(req, k)
            device = type(drafts).__name__ == "DeviceDrafts"
            drafts = list(drafts)  # (DeviceDrafts: read from its slot; the span gets a list)
            scale = float(np.abs(want).max())
            err = float(np.abs(got - want).max())
            cos = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                   for a, b in zip(got, want, strict=True)]
            seen.append({"id": req.request_id, "n": n, "err": err, "scale": scale,
                         "graph_bits": graph_bits, "device": device,
                         "min_cos": min(cos), "argmax_agree": int(
                             (got.argmax(-1) == want.argmax(-1)).sum()),
                         "drafts_are_argmax": drafts == got.argmax(-1)[:len(drafts)].tolist()})
            return drafts
        return prop(req, k)

    llm.engine.scheduler.proposer = spy
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for n in (37, 48, 16, 700, 1025):  # inside a page, on boundaries, long (split-KV)
        llm.generate([rng.integers(5, v, n).tolist()], [sp])
    report({"test": "dflash_cuda_logits", "rows": seen})
    assert [x["n"] for x in seen] == [37, 48, 16, 700, 1025]
    assert 1 in d.graphs  # captured at start-up (CUTEINFER_DRAFT_GRAPH defaults on)
    for x in seen:
        assert x["graph_bits"] and x["device"], x
        assert x["err"] <= 0.03 * x["scale"] + 0.02, x
        assert x["min_cos"] > 0.999, x
        assert x["argmax_agree"] >= bb - 3, x
        assert x["drafts_are_argmax"], x


def _prompts(rng, n, vocab, lengths=(4, 300)):
    return [rng.integers(5, vocab, int(rng.integers(*lengths))).tolist() for _ in range(n)]


def _params(rng, n, tokens=(20, 60)):
    return [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, top_k=0 if i % 2 == 0 else 40,
                           seed=None if i % 2 == 0 else int(rng.integers(1 << 30)),
                           max_tokens=int(rng.integers(*tokens)), ignore_eos=True)
            for i in range(n)]


@pytest.mark.parametrize("opts", [
    {},
    {"enable_prefix_caching": False, "max_num_batched_tokens": 64},
    {"num_gpu_blocks_override": 40, "max_num_seqs": 4, "max_model_len": 512},
], ids=["prefix-cache", "no-cache-chunked", "preempting"])
def test_dflash_on_cuda_is_lossless(target, drafter, opts):
    """One request at a time, then a batch (64, or 8 through a 40-page pool that preempts):
    outputs with the cuda drafter equal plain decoding's (greedy and seeded), a second round
    over cached prefixes too; the drafter runs (draft tokens counted) and no page is left."""
    rng = np.random.default_rng()
    vocab = ModelConfig.from_pretrained(target).vocab_size
    # a pool of its own size (the plain engine's memory may not be back yet)
    base = {"backend": "cuda", "max_model_len": 1024, "max_num_seqs": 64,
            "num_gpu_blocks_override": 64 * 24 + 8, **opts}
    prompts, params = _prompts(rng, 6, vocab), _params(rng, 6)
    if "num_gpu_blocks_override" in opts:
        # 4 running requests of 4-7 prompt pages that grow by 10-13 pages each: more than the
        # 40 pages, so the pool preempts whatever the draw (random lengths once did not)
        many_n = 8
        many = _prompts(rng, many_n, vocab, (60, 100))
        many_params = _params(rng, many_n, (150, 200))
    else:
        many_n = 64
        many, many_params = _prompts(rng, many_n, vocab), _params(rng, many_n)
    again = [p + [7, 8] for p in prompts[::2]]
    plain = LLM(str(target), **base)
    want_one = [_ids(plain.generate([p], [sp]))[0] for p, sp in zip(prompts, params, strict=True)]
    want_again = [_ids(plain.generate([p], [sp]))[0]
                  for p, sp in zip(again, params[::2], strict=True)]
    want_many = _ids(plain.generate(many, many_params))
    del plain
    spec = LLM(str(target), speculative_config=_spec(drafter), **base)
    outs = [spec.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert _ids(outs) == want_one
    assert [_ids(spec.generate([p], [sp]))[0]
            for p, sp in zip(again, params[::2], strict=True)] == want_again
    before = dict(spec.engine.gauges()["spec"])
    got_many = _ids(spec.generate(many, many_params))
    after = spec.engine.gauges()["spec"]
    report({"test": "dflash_cuda_lossless_many", "opts": opts, "n": many_n,
            "drafted": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted_tokens"] - before["accepted_tokens"],
            "identical": sum(a == b for a, b in zip(got_many, want_many, strict=True))})
    assert got_many == want_many
    drafted = sum(o.metrics.get("spec_draft_tokens", 0) for o in outs)
    g = spec.engine.gauges()["spec"]
    assert drafted > 0 and g["draft_tokens"] > 0
    counts = spec.engine.scheduler.proposer.counts
    assert counts["device"] > 0 and counts["host"] == 0, counts  # drafts stayed on the GPU
    if "num_gpu_blocks_override" in opts:
        assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.block_manager.gauges()["live"] == 0
    report({"test": "dflash_cuda_lossless", "opts": opts, "drafted": drafted,
            "accepted": sum(o.metrics.get("spec_accepted_tokens", 0) for o in outs),
            "preemptions": spec.engine.scheduler.num_preemptions})


def _plain_then_spec(target, drafter):
    """Four random requests (half greedy, half seeded) decoded plainly one at a time, then an
    engine with the cuda drafter: (vocab, prompts, params, plain outputs, prompt -> plain
    output, the speculative LLM)."""
    rng = np.random.default_rng()
    vocab = ModelConfig.from_pretrained(target).vocab_size
    prompts, params = _prompts(rng, 4, vocab), _params(rng, 4)
    opts = dict(backend="cuda", max_model_len=1024, num_gpu_blocks_override=16 * 64 + 8)
    plain = LLM(str(target), **opts)
    want = [_ids(plain.generate([p], [sp]))[0] for p, sp in zip(prompts, params, strict=True)]
    del plain
    future = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
    return vocab, prompts, params, want, future, LLM(
        str(target), speculative_config=_spec(drafter), **opts)


def test_oracle_drafts_through_the_cuda_drafter_are_accepted(target, drafter):
    """The cuda drafter runs (its drafts checked for shape), but the proposal handed on is the
    plain run's continuation: every draft is accepted and the output is unchanged."""
    vocab, prompts, params, want, future, spec = _plain_then_spec(target, drafter)
    real = spec.engine.scheduler.proposer

    def oracle(req, k):
        drafts = real(req, k)
        assert len(drafts) == k and all(0 <= t < vocab for t in drafts)
        return future[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]

    spec.engine.scheduler.proposer = oracle
    outs = [spec.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert _ids(outs) == want
    m = [o.metrics for o in outs]
    assert all(x["spec_draft_tokens"] > 0 for x in m)
    assert all(x["spec_accepted_tokens"] == x["spec_draft_tokens"] for x in m)


def _batched_runs(target, drafter, monkeypatch, fused_values):
    """Up to 7 requests speculating together (``disable_by_batch_size`` 8), one engine per
    value of ``CUTEINFER_SPEC_FUSED``: {value: (LLM, outputs, per-request spec counts)}."""
    rng = np.random.default_rng()
    vocab = ModelConfig.from_pretrained(target).vocab_size
    prompts, params = _prompts(rng, 6, vocab), _params(rng, 6)
    keys = ("spec_steps", "spec_draft_tokens", "spec_accepted_tokens")
    runs = {}
    for value in fused_values:
        monkeypatch.setenv("CUTEINFER_SPEC_FUSED", value)
        llm = LLM(str(target), backend="cuda", max_model_len=1024, enable_prefix_caching=False,
                  num_gpu_blocks_override=16 * 64 + 8,
                  speculative_config=_spec(drafter, disable_by_batch_size=8))
        assert llm.engine.executor.fused_spec == (value == "1")
        outs = llm.generate(prompts, params)
        runs[value] = (llm, _ids(outs), [[o.metrics.get(k, 0) for k in keys] for o in outs])
        assert llm.engine.block_manager.gauges()["live"] == 0
        if value != fused_values[-1]:
            del llm
            runs[value] = (None, *runs[value][1:])
    runs["prompts"] = (prompts, params)
    return runs


def test_fused_and_split_speculative_steps_agree_in_batches(target, drafter, monkeypatch):
    """The whole speculative step in one graph (draft blocks, placement, verify: the default)
    and the draft blocks' own graph before the verify graph (``CUTEINFER_SPEC_FUSED=0``) run
    the same kernels on the same blocks: the same tokens and the same draft / accept counts
    request by request; so do drafts downloaded when proposed (``CudaDFlashProposer.device``
    False)."""
    runs = _batched_runs(target, drafter, monkeypatch, ("0", "1"))
    assert runs["1"][1:] == runs["0"][1:]
    llm = runs["1"][0]
    prop = llm.engine.scheduler.proposer
    assert prop.counts["device"] > 0 and prop.counts["host"] == 0
    # drafts downloaded when proposed (each block alone: CUTEINFER_DEVICE_DRAFTS=0's path); the
    # random drafter's drafts are all rejected either way, so the steps and outputs match
    prop.device = False
    outs = llm.generate(*runs["prompts"])
    assert prop.counts["host"] > 0
    keys = ("spec_steps", "spec_draft_tokens", "spec_accepted_tokens")
    assert (_ids(outs), [[o.metrics.get(k, 0) for k in keys] for o in outs]) == runs["1"][1:]
    assert sum(m[1] for m in runs["1"][2]) > 0
    report({"test": "dflash_fused_vs_split_batched", "counts": dict(prop.counts),
            "drafted": sum(m[1] for m in runs["1"][2]),
            "accepted": sum(m[2] for m in runs["1"][2])})


def test_a_fused_step_reads_back_the_drafts_it_placed(target, drafter):
    """Every span's drafts that a fused speculative step returns (``StepOutput.drafts``, from
    which acceptance is computed) are the ids its graph placed over the span's rows (the step's
    input ids, read after the step), and a proposal the step drafted is never left unread."""
    rng = np.random.default_rng()
    vocab = ModelConfig.from_pretrained(target).vocab_size
    llm = LLM(str(target), backend="cuda", max_model_len=1024, enable_prefix_caching=False,
              num_gpu_blocks_override=16 * 64 + 8,
              speculative_config=_spec(drafter, disable_by_batch_size=8))
    ex = llm.engine.executor
    assert ex.fused_spec and ex.verify is not None
    execute, seen = ex.execute, {"spans": 0, "steps": 0, "graph": 0}

    def checked(b):
        out = execute(b)
        dd = b.device_drafts
        if dd.shape[0]:
            ids = ex.buf.input_ids.download(np.empty(b.num_tokens, np.int32), ex.stream)
            ex.stream.synchronize()
            assert out.drafts is not None and len(out.drafts) == dd.shape[0]
            for (_block, row, k), drafts in zip(dd.tolist(), out.drafts, strict=True):
                assert ids[row:row + k].tolist() == drafts, (row, k)
                assert all(0 <= t < vocab for t in drafts)
            seen["spans"] += dd.shape[0]
            seen["steps"] += 1
            seen["graph"] += int(out.graph)
        return out

    ex.execute = checked
    llm.generate(_prompts(rng, 7, vocab), _params(rng, 7))
    assert seen["steps"] > 0 and seen["graph"] > 0 and seen["spans"] > seen["steps"], seen
    report({"test": "dflash_fused_placed_equals_read", **seen})


def test_issue_681_scenario_with_the_cuda_drafter(target, drafter):
    """161 pages, prefix caching off, 20 requests of ~1,650 + 512 tokens, DFlash k = 15, greedy
    and T = 0.8: every request completes and the free pages return to the baseline after
    each (tests/test_speculative.py ``_issue_681``)."""
    from tests.test_speculative import _issue_681

    llm = LLM(str(target), backend="cuda", num_gpu_blocks_override=161,
              enable_prefix_caching=False, max_model_len=2304, max_num_seqs=8,
              speculative_config=_spec(drafter))
    assert llm.engine.config.speculative_config.num_speculative_tokens == 15
    free = _issue_681(llm, np.random.default_rng(), llm.engine.model_config.vocab_size)
    g = llm.engine.gauges()["spec"]
    assert g["draft_tokens"] > 0 and g["drafts"] > 0
    report({"test": "issue_681_dflash_cuda", "free_after_each": free[:3], "spec": {
        k: g[k] for k in ("draft_tokens", "accepted_tokens", "drafts")}})


def test_device_drafts_that_are_right_are_accepted(target, drafter, monkeypatch):
    """Device drafts with every draft right: the drafter's blocks run (the split path:
    ``CUTEINFER_SPEC_FUSED=0``, so the host can step in), then their tokens are overwritten on
    the device with the plain run's continuation, so the placement over the placeholders
    (``place``) and the blocks' download (``drafts_of``) carry drafts that verification
    accepts: nearly every draft accepted, outputs unchanged."""
    monkeypatch.setenv("CUTEINFER_SPEC_FUSED", "0")
    vocab, prompts, params, want, future, spec = _plain_then_spec(target, drafter)
    prop, d = spec.engine.scheduler.proposer, spec.engine.executor.dflash
    assert not spec.engine.executor.fused_spec
    flush, nxt = d.flush, {}
    bb = d.shapes.block

    def flush_right(ex, blocks=0):
        flush(ex, blocks)
        arr = np.zeros(d.buf.rows, np.int32)
        arr[1:1 + len(nxt["t"])] = nxt["t"]  # (one request at a time: block 0)
        d.buf.sampled.upload(arr, ex.stream)  # (stream order: after the blocks, before place)

    def oracle(req, k):
        nxt["t"] = future[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:bb - 1]
        return prop(req, k)

    d.flush = flush_right
    spec.engine.scheduler.proposer = oracle
    outs = [spec.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    assert _ids(outs) == want
    drafted = sum(o.metrics["spec_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["spec_accepted_tokens"] for o in outs)
    assert prop.counts["device"] > 0 and prop.counts["host"] == 0
    # every draft is right except the zeros past a request's last token
    assert accepted >= drafted - 15 * len(prompts), (accepted, drafted)
    report({"test": "dflash_device_drafts_right", "drafted": drafted, "accepted": accepted})
