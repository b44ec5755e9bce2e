"""The cuda backend against the numpy backend on the committed goldens, and the default model."""

import json
import os

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.model.loader import load_checkpoint
from engine.model.reference import ReferenceModel
from tests.conftest import golden_names, greedy_cases, split_sequences
from tests.tolerances import TOL

# 255 usable pages hold one request of max_model_len 1024 (start-up refuses a smaller pool)
CUDA_OPTS = dict(num_gpu_blocks_override=256, max_num_seqs=16, max_num_batched_tokens=512,
                 max_model_len=1024)


def _teacher_forced(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                temperature=0.0))
    res = []
    for p, o in zip(prompts, outs, strict=True):
        res.append(np.array([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]))
    return res


def _report(name, data):
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_results.jsonl"), "a") as f:
            f.write(json.dumps({"test": name, **data}) + "\n")


@pytest.mark.parametrize("name", golden_names())
def test_cuda_matches_numpy_on_goldens(golden_case, name):
    d, data = golden_case(name)
    prompts = [s[0].tolist() for s in split_sequences(data)]
    ref = _teacher_forced(LLM(str(d), backend="numpy"), prompts)
    llm = LLM(str(d), backend="cuda", **CUDA_OPTS)
    got = _teacher_forced(llm, prompts)
    diff = np.concatenate([np.abs(a - b) for a, b in zip(ref, got, strict=True)])
    _report("cuda_vs_numpy_goldens", {"case": name, "mean": float(diff.mean()),
                                      "max": float(diff.max()), "n": int(diff.size)})
    assert diff.mean() <= TOL["cuda_vs_numpy_mean"]["mean_abs"], diff.mean()
    assert diff.max() <= TOL["cuda_vs_numpy_max"]["max_abs"], diff.max()
    # greedy: identical wherever the reference's top-2 margin is clear
    model = ReferenceModel(load_checkpoint(d))
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt, expected in greedy_cases(data):
        mine = llm.generate(prompt, sp)[0].outputs[0].token_ids
        if mine == expected:
            continue
        i = next(j for j in range(len(mine)) if mine[j] != expected[j])
        logits = model.forward(prompt + expected[:i])[-1]
        top2 = np.sort(logits)[-2:]
        margin = float(top2[1] - top2[0])
        assert margin <= 0.1, f"greedy diverged at step {i} with a clear margin {margin:.3f}"


def test_default_model_answers_paris_on_cuda():
    try:
        from engine.model.gguf_convert import default_model_dir

        d = default_model_dir()
    except Exception as e:
        pytest.skip(f"default model unavailable on this host: {e}")
    llm = LLM(str(d), backend="cuda", **CUDA_OPTS)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    _report("smollm2_paris_cuda", {"text": out.text})
    assert "Paris" in out.text, out.text
