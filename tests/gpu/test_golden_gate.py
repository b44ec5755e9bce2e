"""Golden gate: the cuda backend against Hugging Face bf16 at the real qwen3-0.6b shape.

Random weights from tools/make_checkpoint.py; transformers loads the same directory. Teacher-
forced logprobs of 16 sequences of mixed lengths up to 1,024 tokens, with the prefix cache off
and on (on: the later sequences share a long prefix with an earlier one, so their logprobs are
computed over cached pages). mean |d| <= 0.03 nat, p99 <= 0.15 nat.
"""

import json
import os

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.model.synthetic import write_checkpoint
from tests.tolerances import TOL

LENS = [2, 17, 64, 100, 128, 255, 256, 300, 511, 512, 600, 777, 900, 1000, 1023, 1024]


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d = write_checkpoint(tmp_path_factory.mktemp("gate") / "qwen3-0.6b", "qwen3-0.6b", seed=7,
                         quiet=True)
    rng = np.random.default_rng(123)
    base = rng.integers(0, 151000, 1024).tolist()
    seqs = []
    for i, n in enumerate(LENS):
        if i >= 8:  # share the first 512 tokens of `base` (prefix-cache hits when on)
            seqs.append(base[:min(512, n - 1)] + rng.integers(0, 151000, n).tolist()[
                :n - min(512, n - 1)])
        else:
            seqs.append(rng.integers(0, 151000, n).tolist())
    seqs.insert(8, base[:600])  # the sequence that warms the shared prefix
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda()
    ref = []
    with torch.no_grad():
        for s in seqs:
            lg = model(torch.tensor([s], device="cuda")).logits[0].float()
            lp = torch.log_softmax(lg, -1)
            ref.append(lp[torch.arange(len(s) - 1), torch.tensor(s[1:])].cpu().numpy())
    del model
    torch.cuda.empty_cache()
    return d, seqs, ref


def _cuda_logprobs(d, seqs, prefix_cache: bool):
    llm = LLM(str(d), backend="cuda", enable_prefix_caching=prefix_cache,
              prompt_logprobs_prefix_cache=prefix_cache, max_model_len=2048,
              max_num_seqs=16, max_num_batched_tokens=2048, num_gpu_blocks_override=2048)
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    # two waves, so the second reads the first's cached prefix pages
    outs = llm.generate(seqs[:9], sp) + llm.generate(seqs[9:], sp)
    res, cached = [], 0
    for s, o in zip(seqs, outs, strict=True):
        cached += o.num_cached_tokens
        res.append(np.array([np.nan if o.prompt_logprobs[i] is None
                             else o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))]))
    return res, cached


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_golden_gate_qwen3_0_6b(gate, prefix_cache):
    d, seqs, ref = gate
    got, cached = _cuda_logprobs(d, seqs, prefix_cache)
    diff = np.concatenate([np.abs(a - b) for a, b in zip(ref, got, strict=True)])
    diff = diff[~np.isnan(diff)]
    mean, p99 = float(diff.mean()), float(np.percentile(diff, 99))
    rec = {"test": "golden_gate_qwen3_0.6b", "prefix_cache": prefix_cache, "mean": mean,
           "p99": p99, "max": float(diff.max()), "positions": int(diff.size),
           "sequences": len(seqs), "cached_tokens": cached}
    print(json.dumps(rec))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_results.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
    if prefix_cache:
        assert cached >= 6 * 512, "the shared prefix should have been served from the cache"
    assert mean <= TOL["cuda_vs_hf_bf16_mean"]["mean_abs"], rec
    assert p99 <= TOL["cuda_vs_hf_bf16_p99"]["p99_abs"], rec
