"""Speculative decoding against plain decoding on one backend: token agreement, acceptance, speed.

    python -m tools.bench_spec --model DIR [--backend cuda] [--k 4] [--requests 8] [--out f.json]
        [--proposer ngram|oracle] [--workload repeat|copy] [--prompt-len N] [--drafter DIR]

The same requests run plainly and with speculation (``--k`` drafts), one at a time (batch 1,
where speculation pays) and then all together: outputs compared token for token (greedy and
seeded), drafted / accepted counts, and output tokens per second of each.

Proposers: ``ngram`` (prompt lookup, vLLM's); ``oracle`` proposes the plain run's own
continuation (every draft right: the ceiling of a perfect drafter, the verify step's cost alone).
``--drafter DIR``: a DFlash drafter proposes (method dflash); with ``--proposer oracle`` it still
runs every step but the oracle's drafts are used: a perfect drafter at the real drafter's cost.
``replay`` replays the acceptance of another run (``--record-acceptance FILE`` there,
``--acceptance FILE`` here): request i's proposals draft as many tokens as the recorded run's
i-th request did, step by step, the recorded number of them right (the plain run's tokens) and
the rest wrong, so a model without the workload's behaviour (random weights) runs at a real
workload's acceptance (e.g. n-gram on a copy-heavy prompt with a real small checkpoint).
Workloads: ``repeat`` (default): token prompts that repeat a random phrase to ``--prompt-len``
tokens, the case prompt lookup is for; ``copy``: text prompts that ask a model to write a code
snippet out again (an edit-like, copy-heavy answer: with a real checkpoint the answer repeats the
prompt; random weights do not copy); ``fewshot``: a base-model prompt, one snippet shown with
its copy, then another snippet to copy (a 135M model copies it nearly verbatim, where it writes
its own code when asked in a chat).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from tools.report import emit

SNIPPET = """def {name}(items, limit):
    \"\"\"Return the running totals of items, stopping once a total passes limit.\"\"\"
    totals = []
    running = 0
    for index, value in enumerate(items):
        running += value * {scale}
        if running > limit:
            break
        totals.append((index, running))
    return totals


class {cls}:
    def __init__(self, size):
        self.size = size
        self.buffer = [0] * size

    def push(self, value):
        self.buffer = self.buffer[1:] + [value]
        return sum(self.buffer) / self.size
"""


def _prompts(a: argparse.Namespace, vocab: int, tokenizer=None) -> list:
    rng = np.random.default_rng(0)
    if a.workload == "fewshot":  # one worked copy, then a snippet to copy: a base-model prompt
        out = []
        for i in range(a.requests):
            first = SNIPPET.format(name=f"running_totals_{i}", scale=i + 2, cls=f"Window{i}")
            second = SNIPPET.format(name=f"moving_sum_{i}", scale=i + 9, cls=f"Ring{i}")
            out.append(f"### Original\n{first}\n### Copy\n{first}\n### Original\n{second}\n"
                       "### Copy\n")
        return out
    if a.workload == "copy":  # a code edit: the answer is mostly the prompt's code again
        out = []
        for i in range(a.requests):
            code = SNIPPET.format(name=f"running_totals_{i}", scale=i + 2, cls=f"Window{i}")
            ask = (f"Rewrite this Python code with the function renamed to totals_{i}. Output "
                   f"only the code.\n\n```python\n{code}```")
            if tokenizer is not None and getattr(tokenizer, "chat_template", None):
                out.append(tokenizer.apply_chat_template(
                    [{"role": "user", "content": ask}], tokenize=False,
                    add_generation_prompt=True))
            else:
                out.append(ask + "\n\n```python\n")
        return out
    prompts = []
    for _ in range(a.requests):
        phrase = rng.integers(5, min(vocab, 20000), int(rng.integers(8, 24))).tolist()
        prompts.append((phrase * (a.prompt_len // len(phrase) + 1))[:a.prompt_len])
    return prompts


def run_one(a: argparse.Namespace, mode: str) -> dict:
    """One engine (plain or speculative) in this process: the requests one at a time, then all
    together; token ids and counts."""
    from engine import LLM, SamplingParams
    from engine.config import ModelConfig
    from engine.engine import resolve_model_dir

    vocab = ModelConfig.from_pretrained(resolve_model_dir(a.model)).vocab_size
    params = [SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
              if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=40, seed=1000 + i, max_tokens=a.max_tokens,
                             ignore_eos=True) for i in range(a.requests)]
    method = ({"method": "dflash", "model": a.drafter} if a.drafter else {"method": "ngram"})
    below = {"disable_by_batch_size": a.spec_below} if a.spec_below else {}
    extra = {} if mode == "plain" else {"speculative_config": {
        **method, "num_speculative_tokens": a.k, **below}}
    llm = LLM(a.model, backend=a.backend, max_num_seqs=max(a.requests, 1),
              max_model_len=max(1024, a.prompt_len + a.max_tokens + 64), **extra)
    sched = llm.engine.scheduler
    if mode == "spec" and a.proposer in ("oracle", "replay"):
        with open(a.future) as f:  # the plain run's (prompt ids, output ids), one at a time
            pairs, batched_pairs = json.load(f)
        future = {tuple(p): o for p, o in pairs}
        # all together, the plain run's own batched outputs (a bucket's kernels may pick the
        # other of two near-tied tokens than batch 1's: the oracle follows the batched run)
        future_batched = {tuple(p): o for p, o in batched_pairs}
        order = {tuple(p): i for i, (p, _o) in enumerate(pairs)}
        trace = None
        if a.proposer == "replay":
            with open(a.acceptance) as f:
                trace = json.load(f)["trace"]
        calls: dict[str, int] = {}

        drafter = sched.proposer if a.drafter else None

        def oracle(req, k):
            if drafter is not None:  # the drafter runs (its cost counts), the oracle proposes
                drafter(req, k)
            true = future[tuple(req.prompt_token_ids)][len(req.output_token_ids):][:k]
            if trace is None:
                return true
            # replay: the recorded step's (drafted, accepted) -- right drafts, then wrong ones
            j = calls[req.request_id] = calls.get(req.request_id, -1) + 1
            i = order[tuple(req.prompt_token_ids)]
            steps = trace[i] if i < len(trace) else []
            if j >= len(steps):
                return []
            d = min(steps[j][0], len(true))
            m = min(steps[j][1], d)
            return true[:m] + [(t + 1) % vocab for t in true[m:d]]

        sched.proposer = oracle
    log: dict[str, list[list[int]]] = {}
    if mode == "spec" and a.record_acceptance:  # each proposal: (drafted, accepted), in order
        from engine.speculative import accept

        propose, update = sched.proposer, sched._update_spec

        def recording(req, k):
            d = propose(req, k)
            if not d:
                log.setdefault(req.request_id, []).append([0, 0])
            return d

        def recorded(s, ys, now, changed, d):
            log.setdefault(s.request.request_id, []).append([len(d), accept(d, ys)])
            return update(s, ys, now, changed, d)

        sched.proposer, sched._update_spec = recording, recorded
    prompts = _prompts(a, vocab, llm.get_tokenizer() if a.workload != "repeat" else None)
    llm.generate(prompts[:1], params[:1])  # warm
    t0 = time.perf_counter()
    one = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params, strict=True)]
    t1 = time.perf_counter()
    before = llm.engine.gauges()["spec"]
    if mode == "spec" and a.proposer in ("oracle", "replay"):
        future.clear()
        future.update(future_batched)
    batch = llm.generate(prompts, params)
    t2 = time.perf_counter()
    after = llm.engine.gauges()["spec"]
    n = sum(len(o.outputs[0].token_ids) for o in one)
    if mode == "spec" and a.record_acceptance:
        with open(a.record_acceptance, "w") as f:
            json.dump({"model": a.model, "workload": a.workload, "k": a.k,
                       "trace": [log.get(o.request_id, []) for o in one]}, f)
    return {"batch1_tok_s": n / (t1 - t0), "batched_tok_s": n / (t2 - t1),
            "batch1_s": t1 - t0, "batch1_tokens": n,
            "spec_steps": sum(o.metrics.get("spec_steps", 0) for o in one),
            "drafted": sum(o.metrics.get("spec_draft_tokens", 0) for o in one),
            "accepted": sum(o.metrics.get("spec_accepted_tokens", 0) for o in one),
            "batched_drafted": after["draft_tokens"] - before["draft_tokens"],
            "batched_accepted": after["accepted_tokens"] - before["accepted_tokens"],
            "batch1": [o.outputs[0].token_ids for o in one],
            "prompt_ids": [list(o.prompt_token_ids) for o in one],
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
    ap.add_argument("--proposer", choices=("ngram", "oracle", "replay"), default="ngram",
                    help="replay: each request's recorded (drafted, accepted) steps "
                         "(--acceptance) with the plain run's tokens as the right drafts")
    ap.add_argument("--record-acceptance", default=None,
                    help="write each batch-1 request's (drafted, accepted) per proposal here")
    ap.add_argument("--acceptance", default=None, help="--proposer replay: a recorded file")
    ap.add_argument("--workload", choices=("repeat", "copy", "fewshot"), default="repeat")
    ap.add_argument("--prompt-len", type=int, default=96,
                    help="repeat workload: prompt tokens (context = this + max_tokens)")
    ap.add_argument("--drafter", default=None,
                    help="a DFlash drafter directory: speculate with it (method dflash); with "
                         "--proposer oracle the drafter still runs, the oracle's drafts are used")
    ap.add_argument("--future", default=None, help=argparse.SUPPRESS)  # oracle: plain outputs
    ap.add_argument("--spec-below", type=int, default=0, metavar="N",
                    help="speculate while fewer than N requests run (disable_by_batch_size; "
                         "default: the engine's, 2: batch 1 only)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.mode != "both":
        print(json.dumps(run_one(a, a.mode)))
        return
    import subprocess
    import sys

    runs = {}
    future = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    for mode in ("plain", "spec"):
        argv = [sys.executable, "-m", "tools.bench_spec", "--model", a.model, "--backend",
                a.backend, "--k", str(a.k), "--requests", str(a.requests), "--max-tokens",
                str(a.max_tokens), "--mode", mode, "--proposer", a.proposer, "--workload",
                a.workload, "--prompt-len", str(a.prompt_len), "--future", future.name]
        if a.drafter:
            argv += ["--drafter", a.drafter]
        if a.spec_below:
            argv += ["--spec-below", str(a.spec_below)]
        if a.record_acceptance:
            argv += ["--record-acceptance", a.record_acceptance]
        if a.acceptance:
            argv += ["--acceptance", a.acceptance]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        runs[mode] = json.loads(out.strip().splitlines()[-1])
        if mode == "plain":
            json.dump([list(zip(runs[mode]["prompt_ids"], runs[mode][kind], strict=True))
                       for kind in ("batch1", "batched")], future)
            future.close()
    res: dict = {"k": a.k, "requests": a.requests, "max_tokens": a.max_tokens,
                 "proposer": a.proposer, "workload": a.workload, "prompt_len": a.prompt_len,
                 "drafter": a.drafter, "spec_below": a.spec_below}
    for mode, r in runs.items():
        res[mode] = {k: v for k, v in r.items() if k not in ("batch1", "batched", "prompt_ids")}
    for kind in ("batch1", "batched"):
        p, s = runs["plain"][kind], runs["spec"][kind]
        res[f"{kind}_identical_requests"] = int(sum(x == y for x, y in zip(p, s, strict=True)))
        res[f"{kind}_token_agreement"] = float(np.mean(
            [np.mean([u == v for u, v in zip(x, y, strict=False)]) for x, y in
             zip(p, s, strict=True)]))
    res["batch1_speedup"] = res["spec"]["batch1_tok_s"] / res["plain"]["batch1_tok_s"]
    emit(res, a.out)


if __name__ == "__main__":
    main()
