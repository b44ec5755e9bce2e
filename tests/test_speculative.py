"""Speculative decoding (engine/speculative.py, the scheduler's spans): the n-gram proposer
against a brute-force reference, the configuration's typed errors, and losslessness end to end on
the numpy backend -- greedy and seeded outputs equal plain decoding's token for token, with the
n-gram proposer, an oracle that proposes the true continuation and an adversary that is always
wrong -- plus finishing inside an accepted run, a tight KV pool, metrics and no page left
behind."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.config import ConfigError
from engine.speculative import PROBATION_STEPS, SpeculativeConfig, accept, ngram_propose

# speculation in batches too (the default, disable_by_batch_size 2, speculates at batch 1 only)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "disable_by_batch_size": 64}


def _reference_propose(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_proposer_matches_a_brute_force_reference() -> None:
    rng = np.random.default_rng()
    for _ in range(400):
        size = int(rng.integers(0, 40))
        toks = rng.integers(0, int(rng.integers(2, 6)), size).tolist()  # small alphabets repeat
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        assert ngram_propose(toks, k, lo, hi) == _reference_propose(toks, k, lo, hi), (toks, k)
    assert ngram_propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 4) == [4, 5, 1]
    assert ngram_propose([1, 2, 3], 3, 2, 4) == []


def test_accept_is_the_longest_matching_prefix() -> None:
    assert accept((4, 5, 6), [4, 5, 7, 8]) == 2
    assert accept((4, 5, 6), [4, 5, 6, 9]) == 3
    assert accept((1,), [2, 3]) == 0


@pytest.mark.parametrize("value,field", [
    ("{", "JSON object"), ({"method": "dflash"}, "speculative_config.model is required"),
    ({"method": "medusa"}, "method must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 99}, "num_speculative_tokens must be <="),
    ({"prompt_lookup_min": 5}, "prompt_lookup_min must be <="),
    ({"prompt_lookup_max": "4"}, "prompt_lookup_max"), ({"lookahead": 2}, "unsupported"),
    ([1, 2], "JSON object"),
])
def test_bad_configs_are_typed_errors_naming_the_field(value, field) -> None:
    with pytest.raises(ConfigError, match=field):
        SpeculativeConfig.parse(value)


def test_cli_flag_and_dict_keyword_give_the_same_config() -> None:
    import json

    from engine.config import ModelConfig
    from engine.model.synthetic import hf_config
    from tests.test_args import cli_args

    mc = ModelConfig.from_dict(hf_config("tiny-qwen3"))
    a = cli_args("--speculative-config", json.dumps(NGRAM)).create_engine_config(mc, "numpy")
    b = EngineArgs.from_kwargs(speculative_config=NGRAM).create_engine_config(mc, "numpy")
    assert a.speculative_config == b.speculative_config == SpeculativeConfig(**NGRAM)
    assert EngineArgs().create_engine_config(mc, "numpy").speculative_config is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.model.synthetic import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("spec") / "m", "tiny-qwen3", seed=3,
                            quiet=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return ([rng.integers(5, 200, int(rng.integers(3, 8))).tolist() * 4 for _ in range(5)]
            + [rng.integers(5, 200, int(rng.integers(5, 30))).tolist() for _ in range(3)])


def _params(seed: int) -> list[SamplingParams]:
    rng = np.random.default_rng(seed)
    out = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 30)), ignore_eos=True)
           for _ in range(4)]
    out += [SamplingParams(temperature=0.8, top_k=20, top_p=0.95, seed=int(rng.integers(1 << 30)),
                           max_tokens=int(rng.integers(8, 30)), ignore_eos=True)
            for _ in range(4)]
    return out


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _no_pages_left(llm: LLM) -> None:
    eng = llm.engine
    if eng._pending is not None and not eng.scheduler.has_work():
        # async scheduling: generate() returns once its requests finish; a step may still be
        # in flight whose rows all belong to requests whose stop it found a step late
        assert all(s.request.is_finished for s in eng._pending[0].seqs)
        eng.step()
    assert not eng.has_unfinished()
    assert eng.block_manager.gauges()["live"] == 0


def test_ngram_speculation_is_lossless_greedy_and_seeded(tiny: Path) -> None:
    seed = int(np.random.default_rng().integers(1 << 20))
    prompts, params = _prompts(seed), _params(seed)
    plain = LLM(str(tiny), backend="numpy")
    spec = LLM(str(tiny), backend="numpy", speculative_config=NGRAM)
    want, got = plain.generate(prompts, params), spec.generate(prompts, params)
    assert _ids(got) == _ids(want), f"seed {seed}"
    drafted = sum(o.metrics.get("spec_draft_tokens", 0) for o in got)
    accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in got)
    assert drafted > 0 and 0 < accepted <= drafted
    g = spec.engine.gauges()["spec"]
    assert (g["draft_tokens"], g["accepted_tokens"]) == (drafted, accepted)
    assert sum(g["accepted_per_draft"]) == g["drafts"]
    # never more steps for the same tokens (fewer unless the longest request drafted nothing)
    assert spec.engine.stats.steps <= plain.engine.stats.steps
    _no_pages_left(spec)


def _oracle(future: dict[tuple[int, ...], list[int]], wrong: bool = False):
    """Proposes the true continuation of each request (from a plain run), or always a wrong one."""

    def propose(req, k):
        true = future[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]
        return [t + 1 for t in true] if wrong else true

    return propose


@pytest.mark.parametrize("wrong", [False, True])
def test_oracle_and_adversarial_proposers_keep_the_output(tiny: Path, wrong: bool) -> None:
    prompts = _prompts(7)
    params = _params(7)
    want = _ids(LLM(str(tiny), backend="numpy").generate(prompts, params))
    spec = LLM(str(tiny), backend="numpy", speculative_config=NGRAM)
    spec.engine.scheduler.proposer = _oracle(
        {tuple(p): w for p, w in zip(prompts, want, strict=True)}, wrong)
    got = spec.generate(prompts, params)
    assert _ids(got) == want
    drafted = sum(o.metrics.get("spec_draft_tokens", 0) for o in got)
    accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in got)
    assert drafted > 0
    if wrong:  # nothing accepted; each request stops drafting after its probation
        assert accepted == 0
        assert all(o.metrics.get("spec_steps", 0) <= PROBATION_STEPS for o in got)
    else:
        assert accepted == drafted  # every draft is the token plain decoding chose
    _no_pages_left(spec)


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_device_drafts_are_placed_and_accepted_like_host_drafts(tiny: Path,
                                                                wrong_every: int) -> None:
    """The DeviceDrafts path (the cuda drafter's, played here on numpy): the proposer leaves its
    drafts in slots, the span's input rows hold placeholders, the executor writes the slots'
    drafts over them and returns them with the samples; acceptance uses those. Outputs equal
    plain decoding's; with every third draft wrong, the counts match a host-drafts run."""
    from engine.speculative import DeviceDrafts

    prompts, params = _prompts(13), _params(13)
    want = _ids(LLM(str(tiny), backend="numpy").generate(prompts, params))
    future = {tuple(p): w for p, w in zip(prompts, want, strict=True)}

    def drafts_of(req, k):
        true = future[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]
        if wrong_every:  # reject from a draft on, depending on where the request is
            return [t + 1 if (len(req.output_token_ids) + i) % wrong_every == 2 else t
                    for i, t in enumerate(true)]
        return true

    host = LLM(str(tiny), backend="numpy", speculative_config=NGRAM)
    host.engine.scheduler.proposer = drafts_of
    host_out = host.generate(prompts, params)

    spec = LLM(str(tiny), backend="numpy", speculative_config=NGRAM)
    slots: list[list[int]] = []
    placed: list[int] = []

    def propose(req, k):
        d = drafts_of(req, k)
        if not d:
            return []
        slots.append(d)
        return DeviceDrafts(len(d), len(slots) - 1, lambda: d)

    ex = spec.engine.executor
    run = ex.execute

    def execute(b):
        ids = b.input_ids.copy()
        dd = b.device_drafts.tolist()
        for slot, row, k in dd:
            assert (ids[row:row + k] == 0).all(), "placeholders expected"
            assert k == len(slots[slot])
            ids[row:row + k] = slots[slot]
            placed.append(k)
        out = run(dataclasses.replace(b, input_ids=ids))
        out.drafts = [slots[slot][:k] for slot, _row, k in dd] if dd else None
        slots.clear()
        return out

    ex.execute = execute
    spec.engine.scheduler.proposer = propose
    got = spec.generate(prompts, params)
    assert _ids(got) == want == _ids(host_out)
    assert placed and sum(placed) == sum(o.metrics.get("spec_draft_tokens", 0) for o in got)
    for a, b in zip(got, host_out, strict=True):
        for key in ("spec_steps", "spec_draft_tokens", "spec_accepted_tokens"):
            assert a.metrics.get(key, 0) == b.metrics.get(key, 0), key
    accepted = sum(o.metrics.get("spec_accepted_tokens", 0) for o in got)
    drafted = sum(o.metrics.get("spec_draft_tokens", 0) for o in got)
    assert (accepted < drafted) if wrong_every else (accepted == drafted)
    _no_pages_left(spec)


def test_a_step_with_device_drafts_but_no_drafts_back_is_an_error(tiny: Path) -> None:
    """An executor that drops the device drafts (StepOutput.drafts None) cannot be accepted
    silently: the step fails loudly."""
    from engine.speculative import DeviceDrafts

    spec = LLM(str(tiny), backend="numpy", speculative_config=NGRAM)
    spec.engine.scheduler.proposer = lambda req, k: DeviceDrafts(min(k, 2), 0, lambda: [5, 6])
    ex = spec.engine.executor
    run = ex.execute
    ex.execute = lambda b: run(b)  # returns no drafts
    with pytest.raises(RuntimeError, match="device drafts"):
        spec.generate([[5, 6, 7, 8]], [SamplingParams(temperature=0.0, max_tokens=6,
                                                      ignore_eos=True)])


def test_spans_never_share_a_step_with_prompt_tokens(tiny: Path) -> None:
    """A speculative span only goes into a step of decode rows and spans (on cuda: verify rows,
    plain decoding's bits), never beside an admission, a prefill chunk or a recompute (the
    multi-token forward): a preempting pool, waiting requests, chunked prefill. Outputs equal
    plain decoding's."""
    rng = np.random.default_rng()
    # 8 prompts of 150-300 tokens + 40-60 out through 40 pages of 16 tokens: it preempts
    prompts = [rng.integers(5, 200, int(rng.integers(150, 300))).tolist() for _ in range(8)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                             max_tokens=int(rng.integers(40, 60)), ignore_eos=True)
              for i in range(8)]
    opts = {"backend": "numpy", "max_model_len": 512, "max_num_seqs": 4,
            "num_gpu_blocks_override": 40, "max_num_batched_tokens": 64}
    want = _ids(LLM(str(tiny), **opts).generate(prompts, params))
    spec = LLM(str(tiny), speculative_config=NGRAM, **opts)
    sched = spec.engine.scheduler
    assert not sched.spec_alone  # numpy is batch-invariant: spans may share steps there
    sched.spec_alone = True  # as on cuda
    schedule = sched.schedule
    seen = {"span_steps": 0, "mixed": 0}

    def spy(*a, **kw):
        out = schedule(*a, **kw)
        if out is not None and any(s.drafts for s in out.seqs):
            seen["span_steps"] += 1
            seen["mixed"] += any(not s.drafts and s.num_new > 1 for s in out.seqs)
        return out

    sched.schedule = spy
    assert _ids(spec.generate(prompts, params)) == want
    assert seen["span_steps"] > 0 and seen["mixed"] == 0, seen
    assert sched.num_preemptions > 0
    _no_pages_left(spec)


def test_a_stop_token_inside_an_accepted_run_ends_it_there(tiny: Path) -> None:
    prompts = _prompts(11)[:4]
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = _ids(LLM(str(tiny), backend="numpy").generate(prompts, base))
    # stop at each output's 6th token: a run of accepted drafts crosses it
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                             stop_token_ids=[w[5]]) for w in free]
    want = LLM(str(tiny), backend="numpy").generate(prompts, params)
    spec = LLM(str(tiny), backend="numpy", speculative_config=NGRAM)
    spec.engine.scheduler.proposer = _oracle({tuple(p): w for p, w in zip(prompts, free,
                                                                            strict=True)})
    got = spec.generate(prompts, params)
    assert _ids(got) == _ids(want)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason
                                                         for o in want]
    _no_pages_left(spec)


def test_tight_kv_pool_falls_back_to_plain_tokens(tiny: Path) -> None:
    """Spans that do not fit the pool decode plainly (or preempt, as plain decoding would):
    the outputs stay the plain ones."""
    prompts, params = _prompts(5), _params(5)
    want = _ids(LLM(str(tiny), backend="numpy").generate(prompts, params))
    spec = LLM(str(tiny), backend="numpy", speculative_config=NGRAM, num_gpu_blocks_override=12,
               max_model_len=64)
    assert _ids(spec.generate(prompts, params)) == want
    _no_pages_left(spec)


def test_requests_with_logprobs_or_processors_decode_plainly(tiny: Path) -> None:
    prompts = _prompts(3)[:3]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    want = LLM(str(tiny), backend="numpy").generate(prompts, params)
    got = LLM(str(tiny), backend="numpy", speculative_config=NGRAM).generate(prompts, params)
    assert _ids(got) == _ids(want)
    assert "spec_steps" not in got[0].metrics and "spec_steps" not in got[1].metrics
    assert len(got[0].outputs[0].logprobs) == 12


def test_by_default_only_a_lone_request_speculates(tiny: Path) -> None:
    prompts, params = _prompts(9)[:3], _params(9)[:3]
    want = _ids(LLM(str(tiny), backend="numpy").generate(prompts, params))
    llm = LLM(str(tiny), backend="numpy", speculative_config={"method": "ngram"})
    assert llm.engine.config.speculative_config.disable_by_batch_size == 2
    seen = []
    spec = llm.engine.scheduler._speculate

    def spy(req, *a):
        seen.append(len(llm.engine.scheduler.running))
        return spec(req, *a)

    llm.engine.scheduler._speculate = spy
    assert _ids(llm.generate(prompts, params)) == want
    assert seen and max(seen) == 1  # proposals only while one request ran


def test_the_two_process_engine_speculates_and_reports_it(tiny: Path) -> None:
    prompts, params = _prompts(13)[:4], _params(13)[:4]
    want = _ids(LLM(str(tiny), backend="numpy").generate(prompts, params))
    llm = LLM(str(tiny), backend="numpy", speculative_config=NGRAM, engine_core="process")
    try:
        got = llm.generate(prompts, params)
        assert _ids(got) == want
        assert sum(o.metrics.get("spec_draft_tokens", 0) for o in got) > 0
        assert all(o.metrics.get("spec_accepted_tokens", 0) <= o.metrics.get(
            "spec_draft_tokens", 0) for o in got)
    finally:
        llm.shutdown()


def test_random_workloads_stay_lossless(tiny: Path) -> None:
    """Random prompts (some repetitive), lengths, stop tokens, stop strings, greedy and seeded
    sampling, a small KV pool and a small token budget: the speculative engine's tokens, text and
    finish reasons equal the plain engine's."""
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    rng = np.random.default_rng(seed)
    for _ in range(3):
        n = int(rng.integers(2, 9))
        prompts = []
        for _ in range(n):
            if rng.random() < 0.6:
                prompts.append(rng.integers(5, 300, int(rng.integers(2, 7))).tolist()
                               * int(rng.integers(2, 6)))
            else:
                prompts.append(rng.integers(5, 300, int(rng.integers(1, 40))).tolist())
        params = []
        for _ in range(n):
            kw: dict = {"max_tokens": int(rng.integers(1, 40)),
                        "ignore_eos": bool(rng.random() < 0.7)}
            if rng.random() < 0.5:
                kw.update(temperature=float(rng.uniform(0.3, 1.2)), top_k=int(rng.integers(0, 30)),
                          seed=int(rng.integers(1 << 30)))
            else:
                kw["temperature"] = 0.0
            if rng.random() < 0.3:
                kw["stop_token_ids"] = rng.integers(5, 300, 3).tolist()
            params.append(SamplingParams(**kw))
        opts = dict(backend="numpy", max_num_batched_tokens=int(rng.integers(16, 128)),
                    num_gpu_blocks_override=int(rng.integers(20, 60)), max_model_len=256)
        want = LLM(str(tiny), **opts).generate(prompts, params)
        spec_cfg = {**NGRAM, "num_speculative_tokens": int(rng.integers(1, 6))}
        llm = LLM(str(tiny), speculative_config=spec_cfg, **opts)
        got = llm.generate(prompts, params)
        assert _ids(got) == _ids(want), f"seed {seed}"
        assert [o.outputs[0].finish_reason for o in got] == [
            o.outputs[0].finish_reason for o in want], f"seed {seed}"
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        _no_pages_left(llm)


def test_verify_rows_are_the_span_as_one_decode_row_per_token(tiny: Path) -> None:
    """CudaExecutor.verify_rows (the cuda verify step's layout): a step whose every token is
    sampled becomes one decode row per token, row j of a span attending over its own prefix;
    on the numpy reference the rows give the span's logits. Other steps are not verify steps."""
    from engine.executor.cuda_executor import CudaExecutor
    from graphs.profile import make_batch, make_span_batch

    llm = LLM(str(tiny), backend="numpy")
    ex = llm.engine.executor
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng()
    for cache in ex.k_cache + ex.v_cache:
        cache[:] = rng.standard_normal(cache.shape)
    ctx, q = int(rng.integers(20, 60)), int(rng.integers(2, 9))
    span = make_span_batch(3, ctx, q, 16, ex.num_pages, vocab, seed=int(rng.integers(1 << 20)))
    rows = CudaExecutor.verify_rows(span)
    assert rows is not None and rows.is_decode and rows.num_seqs == 3 * q
    assert rows.context_lens.tolist() == list(range(ctx - q + 1, ctx + 1)) * 3
    assert np.array_equal(rows.page_indices, np.repeat(span.page_indices, q, axis=0))
    assert np.array_equal(rows.input_ids, span.input_ids)
    want = ex.logits(span, np.arange(span.num_tokens))
    got = ex.logits(rows, np.arange(rows.num_tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # a plain decode step, a step with an unsampled token, a prompt-logprob step: not verify
    assert CudaExecutor.verify_rows(make_batch(4, ctx, 16, ex.num_pages, vocab)) is None
    part = dataclasses.replace(span, sample_token_idx=span.sample_token_idx[1:])
    assert CudaExecutor.verify_rows(part) is None
    plp = dataclasses.replace(span, prompt_logprob_idx=np.zeros(1, np.int32))
    assert CudaExecutor.verify_rows(plp) is None


def _issue_681(llm: LLM, rng: np.random.Generator, vocab: int) -> list[int]:
    """The seed's capacity bug (its issue #681): a 161-page pool, prefix caching off, 20
    requests one after another of ~1,650 prompt + 512 generated tokens, speculating k = 15 (the
    DFlash block; here n-gram drafts, repetitive prompts so that they come), greedy and T = 0.8.
    Returns the free pages after each request."""
    free = []
    base = llm.engine.block_manager.gauges()["free"]
    for i in range(20):
        phrase = rng.integers(5, vocab, int(rng.integers(6, 40))).tolist()
        prompt = (phrase * (1650 // len(phrase) + 1))[:int(rng.integers(1600, 1700))]
        sp = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=512,
                            ignore_eos=True)
        out = llm.generate([prompt], [sp])[0]
        assert out.finished and len(out.outputs[0].token_ids) == 512, i
        assert out.outputs[0].finish_reason == "length"
        free.append(llm.engine.block_manager.gauges()["free"])
    assert free == [base] * 20
    return free


def test_issue_681_scenario_completes_and_frees_every_page(tiny: Path) -> None:
    llm = LLM(str(tiny), backend="numpy", num_gpu_blocks_override=161,
              enable_prefix_caching=False, max_model_len=2304,
              speculative_config={"method": "ngram", "num_speculative_tokens": 15})
    _issue_681(llm, np.random.default_rng(), llm.engine.model_config.vocab_size)
    g = llm.engine.gauges()["spec"]
    assert g["draft_tokens"] > 0 and g["accepted_tokens"] > 0


def _first_tokens(llm: LLM, n: int, prompt: list[int]) -> np.ndarray:
    """``n`` unseeded samples of the first 3 generated tokens of ``prompt`` (batched)."""
    sp = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * n, [sp] * n)
    return np.array([o.outputs[0].token_ids for o in outs])


def _chi2_two_sample(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Pearson's chi-square statistic of two samples of categories (rows as tuples), and its
    degrees of freedom; categories seen fewer than 5 times in all are pooled."""
    keys = [tuple(r) for r in a] + [tuple(r) for r in b]
    cats, idx = np.unique(np.array([hash(k) for k in keys]), return_inverse=True)
    ca = np.bincount(idx[:len(a)], minlength=len(cats)).astype(float)
    cb = np.bincount(idx[len(a):], minlength=len(cats)).astype(float)
    small = (ca + cb) < 5
    if small.any():
        ca = np.append(ca[~small], ca[small].sum())
        cb = np.append(cb[~small], cb[small].sum())
    tot = ca + cb
    ea, eb = tot * len(a) / len(keys), tot * len(b) / len(keys)
    stat = float((((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum())
    return stat, len(tot) - 1


def _chi2_critical(dof: int, z: float = 3.0902) -> float:
    """The chi-square quantile at 1 - alpha for alpha = 0.001 (z: the normal quantile), by the
    Wilson-Hilferty approximation (within 1% for dof >= 3; no scipy here)."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * c ** 0.5) ** 3


def test_unseeded_sampling_keeps_the_distribution(tiny: Path, monkeypatch) -> None:
    """Unseeded sampled requests: the joint distribution of the first three tokens with
    speculation equals plain decoding's, by a two-sample chi-square test at alpha = 0.001. The
    proposer drafts the plain run's most frequent second token (accepted about as often as it is
    sampled). The engines draw their requests' seeds from different engine seeds, so the two
    samples are independent. The test's power is shown on the alternative a broken acceptor
    makes (one that accepts every draft, whatever the target sampled): with the same sample
    sizes it rejects (statistic 1,400-2,300 against critical values 70-120 on three prompts;
    the unbroken one 40-63)."""
    import engine.scheduler as sched

    rng = np.random.default_rng()
    prompt = rng.integers(5, 200, 12).tolist()
    n = 1500
    spec_cfg = dict(NGRAM, num_speculative_tokens=2, disable_by_batch_size=1000)
    plain = _first_tokens(LLM(str(tiny), backend="numpy", max_num_seqs=256, seed=1), n, prompt)
    vals, counts = np.unique(plain[:, 1], return_counts=True)
    mode = int(vals[np.argmax(counts)])

    def spec_llm() -> LLM:
        llm = LLM(str(tiny), backend="numpy", max_num_seqs=256, speculative_config=spec_cfg,
                  seed=int(rng.integers(2, 1 << 30)))
        llm.engine.scheduler.proposer = lambda req, k: [mode][:k]
        return llm

    llm = spec_llm()
    spec = _first_tokens(llm, n, prompt)
    g = llm.engine.gauges()["spec"]
    assert g["draft_tokens"] == n and 0 < g["accepted_tokens"] < n
    stat, dof = _chi2_two_sample(plain, spec)
    assert stat < _chi2_critical(dof), (stat, dof)
    # the broken acceptor: every draft accepted
    monkeypatch.setattr(sched, "accept", lambda drafts, sampled: len(drafts))
    biased = _first_tokens(spec_llm(), n, prompt)
    stat_b, dof_b = _chi2_two_sample(plain, biased)
    assert stat_b > _chi2_critical(dof_b), (stat_b, dof_b)
