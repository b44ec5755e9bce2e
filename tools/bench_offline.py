"""Offline throughput of ``LLM.generate`` over the serving benchmark's workload: random token-id
prompts, fixed output length (EOS ignored), at most ``--max-num-seqs`` in flight. The number a
served run is held against (same requests, same concurrency, same call).

    python -m tools.bench_offline --model DIR --backend cuda --num-prompts 320 \\
        --input-len 128 --output-len 256 --max-num-seqs 64 [--out result.json]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from tools.report import emit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=320)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--vocab-range", type=int, nargs=2, default=[0, 150000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mixed-step-tokens", type=int, default=None,
                    help="the engine option of that name (the served run's, to compare alike; "
                    "default: the engine's, 128 on cuda)")
    ap.add_argument("--mixed-prefill-tokens", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from engine import LLM, SamplingParams

    llm = LLM(a.model, backend=a.backend, max_num_seqs=a.max_num_seqs,
              max_model_len=a.max_model_len, mixed_step_tokens=a.mixed_step_tokens,
              mixed_prefill_tokens=a.mixed_prefill_tokens)
    rng = np.random.default_rng(a.seed)
    prompts = [rng.integers(a.vocab_range[0], a.vocab_range[1], a.input_len).tolist()
               for _ in range(a.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(prompts[:a.max_num_seqs], sp, use_tqdm=False)  # warm-up: every bucket seen
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    # batch 1: TPOT from the metrics, the median of three runs after one to warm bucket 1 (a
    # single cold run read ~4% above a warmed loop: docs/perf.md v28)
    tpots = []
    for _ in range(4):
        one = llm.generate([prompts[0]], sp, use_tqdm=False)[0]
        m = one.metrics
        tpots.append((m["last_token"] - m["first_token"])
                     / (len(one.outputs[0].token_ids) - 1) * 1e3)
    tpot1 = float(np.median(tpots[1:]))
    res = {"mode": "offline LLM.generate", "num_prompts": a.num_prompts,
           "input_len": a.input_len, "output_len": a.output_len,
           "max_num_seqs": a.max_num_seqs, "mixed_step_tokens": a.mixed_step_tokens,
           "mixed_prefill_tokens": a.mixed_prefill_tokens, "duration_s": round(dt, 3),
           "output_tokens": n, "output_tok_s": round(n / dt, 1),
           "batch1_tpot_ms": round(tpot1, 4)}
    emit(res, a.out, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
