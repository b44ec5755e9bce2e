"""Speculative decoding against plain decoding on one backend: token agreement, acceptance, speed.

    python -m tools.bench_spec --model DIR [--backend cuda] [--k 4] [--requests 8] [--out f.json]

The same requests run plainly and with n-gram speculation (``--k`` drafts), one at a time
(batch 1, where speculation pays) and then all together: outputs compared token for token (greedy
and seeded), drafted / accepted counts, and output tokens per second of each. Prompts repeat a
random phrase, the case prompt lookup is for.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def run_one(a: argparse.Namespace, mode: str) -> dict:
    """One engine (plain or speculative) in this process: the requests one at a time, then all
    together; token ids and counts."""
    from engine import LLM, SamplingParams
    from engine.config import ModelConfig
    from engine.engine import resolve_model_dir

    vocab = ModelConfig.from_pretrained(resolve_model_dir(a.model)).vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, min(vocab, 20000), int(rng.integers(8, 24))).tolist() * 6
               for _ in range(a.requests)]
    params = [SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
              if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=40, seed=1000 + i, max_tokens=a.max_tokens,
                             ignore_eos=True) for i in range(a.requests)]
    extra = {} if mode == "plain" else {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": a.k}}
    llm = LLM(a.model, backend=a.backend, max_num_seqs=max(a.requests, 1), max_model_len=1024,
              **extra)
    llm.generate(prompts[:1], params[:1])  # warm
    t0 = time.perf_counter()
    one = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    t1 = time.perf_counter()
    batch = llm.generate(prompts, params)
    t2 = time.perf_counter()
    n = sum(len(o.outputs[0].token_ids) for o in one)
    return {"batch1_tok_s": n / (t1 - t0), "batched_tok_s": n / (t2 - t1),
            "drafted": sum(o.metrics.get("spec_draft_tokens", 0) for o in one),
            "accepted": sum(o.metrics.get("spec_accepted_tokens", 0) for o in one),
            "batch1": [o.outputs[0].token_ids for o in one],
            "batched": [o.outputs[0].token_ids for o in batch]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mode", choices=("both", "plain", "spec"), default="both",
                    help="both: each mode in a process of its own (each engine takes the GPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.mode != "both":
        print(json.dumps(run_one(a, a.mode)))
        return
    import subprocess
    import sys

    runs = {}
    for mode in ("plain", "spec"):
        argv = [sys.executable, "-m", "tools.bench_spec", "--model", a.model, "--backend",
                a.backend, "--k", str(a.k), "--requests", str(a.requests), "--max-tokens",
                str(a.max_tokens), "--mode", mode]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    res: dict = {"k": a.k, "requests": a.requests, "max_tokens": a.max_tokens}
    for mode, r in runs.items():
        res[mode] = {k: v for k, v in r.items() if k not in ("batch1", "batched")}
    for kind in ("batch1", "batched"):
        p, s = runs["plain"][kind], runs["spec"][kind]
        res[f"{kind}_identical_requests"] = int(sum(x == y for x, y in zip(p, s, strict=True)))
        res[f"{kind}_token_agreement"] = float(np.mean(
            [np.mean([u == v for u, v in zip(x, y, strict=False)]) for x, y in
             zip(p, s, strict=True)]))
    res["batch1_speedup"] = res["spec"]["batch1_tok_s"] / res["plain"]["batch1_tok_s"]
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
