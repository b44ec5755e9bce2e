"""The real scheduler and block manager driven by a step-cost model and simulated clients, on
the CPU: what a scheduling policy does to TTFT, ITL and throughput before the GPU measures it.

A step's time comes from a model fitted to measured steps (``COSTS``: graph replay per bucket at
context 256 plus the KV the rows read, mixed steps of <= 128 tokens in the mixed-step graphs,
bigger or ineligible ones eager at a fixed cost plus a per-token cost). Clients are closed-loop
(``--concurrency`` streams, the next request ``--client-delay-ms`` after a finish) or one burst
over shared prefixes (issue 13's TTFT case). Tokens are stamped at the step's end, so ITL is
the time between the steps that give a request its tokens. A guide, not a measurement: the
numbers that count come from tools/gpu_serve_bench.sh.

    python -m tools.sim_schedule --preset qwen3-8b --workload waves --mixed-step-tokens 128
    python -m tools.sim_schedule --preset qwen3-0.6b --workload burst --mixed-step-tokens 128
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from engine.args import EngineArgs
from engine.config import ModelConfig
from engine.executor.cuda_executor import MIXED_KV_TOKENS
from engine.executor.cuda_model import MIXED_BUCKETS
from engine.kv import BlockManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.step import StepOutput
from tools.report import emit


@dataclass(frozen=True)
class Costs:
    """ms: graph replay of decode bucket b at context 256 (``decode``, interpolated), the KV
    term (bytes per token of context over the rate the decode attention reaches), eager steps
    (``eager0`` + ``eager_tok`` per token), the host's share of a step that is not a plain
    decode continuation (``sync``)."""

    decode: tuple[tuple[int, float], ...]
    kv_bytes_per_token: int
    kv_rate: float  # bytes / ms
    eager0: float
    eager_tok: float
    sync: float

    def graph(self, rows: int, kv_tokens: int) -> float:
        b, t = zip(*self.decode, strict=True)
        base = float(np.interp(rows, b, t)) - rows * 256 * self.kv_bytes_per_token / self.kv_rate
        return base + kv_tokens * self.kv_bytes_per_token / self.kv_rate


# H100 80GB HBM3 (docs/perf.md v27 / v28: bench_decode at context 256 and 1024, the 64-cap run's
# mixed steps (p50 8.76 ms at 113 tokens), v11's eager steps (320 tokens 17.2 ms, 2,048 tokens
# 47 ms); batch 256 and qwen3-0.6b's 16-128 / prefill costs are estimates
COSTS = {
    "qwen3-8b": Costs(decode=((1, 5.30), (16, 5.55), (32, 5.85), (64, 6.70), (96, 8.14),
                              (128, 9.0), (256, 12.4)),
                      kv_bytes_per_token=36 * 2 * 8 * 128 * 2, kv_rate=3.1e9,
                      eager0=11.7, eager_tok=0.01725, sync=0.6),
    # v28: replay b1 / b64 at context 256 0.787 / 1.497 ms; prefill ~4 us a token
    "qwen3-0.6b": Costs(decode=((1, 0.79), (16, 0.85), (32, 1.0), (64, 1.50), (96, 2.1),
                                (128, 2.6), (256, 4.8)),
                        kv_bytes_per_token=28 * 2 * 8 * 128 * 2, kv_rate=3.1e9,
                        eager0=3.0, eager_tok=0.004, sync=0.4),
}


def model_config(preset: str) -> ModelConfig:
    h, i, nl = {"qwen3-8b": (4096, 12288, 36), "qwen3-0.6b": (1024, 3072, 28)}[preset]
    return ModelConfig(architecture="qwen3", hidden_size=h, intermediate_size=i,
                       num_hidden_layers=nl, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=40960, tie_word_embeddings=False)


def step_ms(c: Costs, out: SchedulerOutput, continuation: bool) -> tuple[float, str]:
    d = [s for s in out.seqs if s.num_new == 1]
    p = [s for s in out.seqs if s.num_new != 1]
    rows = sum(s.num_new for s in out.seqs)
    kv_d = sum(s.start + 1 for s in d)
    if not p:
        return c.graph(len(d), kv_d) + (0.0 if continuation else c.sync), "decode"
    kv_p = sum(s.num_new * s.start + s.num_new * (s.num_new + 1) // 2 for s in p)
    if rows <= MIXED_BUCKETS[-1] and (kv_p <= MIXED_KV_TOKENS or kv_p <= kv_d):
        bucket = next(b for b in MIXED_BUCKETS if b >= rows)
        return c.graph(bucket, kv_d + kv_p) + (0.0 if continuation else c.sync), "mixed"
    # eager: the prefill kernel reads a chunk's context once per 64-row tile, and the decode
    # rows through the decode kernel
    kv_e = kv_d + sum(-(-s.num_new // 64) * (s.start + s.num_new) for s in p)
    return c.eager0 + c.eager_tok * rows + kv_e * c.kv_bytes_per_token / c.kv_rate, "eager"


def simulate(a: argparse.Namespace, scheduler_cls: type[Scheduler] = Scheduler) -> dict:
    mcfg = model_config(a.preset)
    args = EngineArgs(model="sim", backend="cuda", max_num_seqs=a.max_num_seqs,
                      max_model_len=a.max_model_len,
                      max_num_batched_tokens=a.max_num_batched_tokens,
                      mixed_step_tokens=a.mixed_step_tokens,
                      mixed_prefill_tokens=a.mixed_prefill_tokens)
    cfg = args.create_engine_config(mcfg, backend="cuda")
    bm = BlockManager(a.num_pages, cfg.block_size, enable_prefix_caching=True)
    sched = scheduler_cls(cfg, bm, mcfg.kv_per_weight)
    now = 0.0
    sched.clock = lambda: now / 1e3  # the scheduler reads simulated seconds
    costs = COSTS[a.preset]
    rng = np.random.default_rng(a.seed)
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    arrivals: list[tuple[float, list[int]]] = []  # (time, prompt), kept sorted by time
    if a.workload == "waves":
        lens = rng.integers(a.input_len, max(a.input_len, a.input_len_max or 0) + 1, a.num_prompts)
        prompts = [rng.integers(0, 150000, int(n)).tolist() for n in lens]
        pending = list(reversed(prompts))
        for i in range(min(a.concurrency, len(pending))):
            arrivals.append((i * a.client_spread_ms / max(1, a.concurrency), pending.pop()))
    else:  # burst: clients over shared prefixes, all at once (spread over client_spread_ms)
        prefixes = [rng.integers(0, 150000, a.prefix_len).tolist() for _ in range(a.prefixes)]
        pending = []
        for i in range(a.num_prompts):
            q = rng.integers(0, 150000, a.input_len).tolist()
            t = float(rng.uniform(0, a.client_spread_ms))
            arrivals.append((t, prefixes[i % a.prefixes] + q))
        arrivals.sort(key=lambda x: x[0])
    arrived: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    kinds: dict[str, list[float]] = {"decode": [], "mixed": [], "eager": []}
    n = 0
    prev_decode = prev_any = False
    while arrivals or sched.has_work():
        while arrivals and arrivals[0][0] <= now:
            t, prompt = arrivals.pop(0)
            rid = str(n)
            n += 1
            req = Request(rid, prompt, params, seed=0, arrival=n, max_model_len=cfg.max_model_len)
            req.metrics["arrival"] = t / 1e3
            sched.add(req)
            arrived[rid] = t
            times[rid] = []
        if not sched.has_work():
            now = arrivals[0][0]
            prev_any = False
            continue
        out = sched.schedule()
        if not out.seqs:
            now += 0.1
            continue
        plain = all(s.num_new == 1 for s in out.seqs)
        # planned while the step before runs (async scheduling): decode steps after decode
        # steps; with plan-ahead, every step after one (the engine's default)
        ms, kind = step_ms(costs, out, continuation=(plain and prev_decode)
                           or (a.plan_ahead and prev_any))
        prev_any = True
        prev_decode = plain
        kinds[kind].append(ms)
        now += ms
        sampled = np.zeros(sum(1 for s in out.seqs if s.sample), np.int32)
        for s in out.seqs:
            if s.sample:
                times[s.request.request_id].append(now)
        changed = sched.update_from_output(out, StepOutput(sampled))
        for r in changed:
            if r.is_finished and a.workload == "waves" and pending:
                arrivals.append((now + a.client_delay_ms, pending.pop()))
                arrivals.sort(key=lambda x: x[0])
    ttft = np.array([times[r][0] - arrived[r] for r in times])
    if a.jitter_ms:  # the front end's delivery time varies per token (tokens stay in order)
        jr = np.random.default_rng(a.seed + 1)
        for v in times.values():
            v[:] = np.maximum.accumulate(np.asarray(v) + jr.normal(0.0, a.jitter_ms, len(v)))
    itl = np.concatenate([np.diff(v) for v in times.values()])
    tpot = np.array([(v[-1] - v[0]) / (len(v) - 1) for v in times.values() if len(v) > 1])
    ntok = sum(len(v) for v in times.values())
    start = min(arrived.values())
    med = float(np.median(itl))
    res = {"preset": a.preset, "workload": a.workload, "mixed_step_tokens": cfg.mixed_step_tokens,
           "mixed_prefill_tokens": a.mixed_prefill_tokens,
           "tok_s": round(ntok / (now - start) * 1e3, 1),
           "tpot_ms": round(float(tpot.mean()), 3),
           "ttft_mean_ms": round(float(ttft.mean()), 1),
           "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1),
           "itl_p50_ms": round(med, 3),
           "itl_p99_x": round(float(np.percentile(itl, 99)) / med, 3),
           "itl_max_x": round(float(itl.max()) / med, 3),
           "itl_over_1_5x": round(float((itl > 1.5 * med).mean()), 5),  # share of ITL samples
           "steps": {k: [len(v), round(float(np.median(v)), 2) if v else 0.0]
                     for k, v in kinds.items()}}
    return res


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(COSTS))
    ap.add_argument("--workload", default="waves", choices=("waves", "burst"))
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--input-len-max", type=int, default=None,
                    help="waves: prompt lengths uniform in [input-len, this]")
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--plan-ahead", type=int, default=1,
                    help="1: steps with prompt tokens are planned while the step before runs "
                         "(CUTEINFER_PLAN_AHEAD, the default), 0: only decode steps after "
                         "decode steps")
    ap.add_argument("--prefix-len", type=int, default=3000)
    ap.add_argument("--prefixes", type=int, default=2)
    ap.add_argument("--client-delay-ms", type=float, default=2.0)
    ap.add_argument("--client-spread-ms", type=float, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--mixed-step-tokens", type=int, default=None,
                    help="the engine's option (default: the cuda backend's, 128; 0 = no cap)")
    ap.add_argument("--mixed-prefill-tokens", type=int, default=0)
    ap.add_argument("--num-pages", type=int, default=100000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jitter-ms", type=float, default=0.0,
                    help="standard deviation of the delivery time per token (normal; H100, "
                         "perf.md v36: step end to client 3.1 ms p50, 4.0 p90, 4.7 p99: ~0.7)")
    ap.add_argument("--out", default=None)
    return ap


def defaults(a: argparse.Namespace) -> argparse.Namespace:
    waves = a.workload == "waves"  # issue 13's two workloads, as tools/gpu_*.sh run them
    for k, w, b in (("num_prompts", 320, 256), ("input_len", 128, 32), ("output_len", 256, 64),
                    ("max_num_seqs", 64, 256), ("max_model_len", 1024, 4096),
                    ("client_spread_ms", 20.0, 200.0)):
        if getattr(a, k) is None:
            setattr(a, k, w if waves else b)
    return a


def main(argv: list[str] | None = None) -> int:
    a = defaults(parser().parse_args(argv))
    emit(simulate(a), a.out, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
