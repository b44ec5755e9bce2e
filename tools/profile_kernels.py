"""Per-kernel device time of one decode step, from graphs that hold one kernel kind each.

    python -m tools.profile_kernels --preset qwen3-8b --batch 1,64 --ctx 1024 [--out f.json]

Random weights at the preset's real shape (in memory). For each batch B: the step's graph
(``decode_body``, what the engine replays) is captured and timed; then, for every kernel kind the
step launches (the ``Kernels`` fields: qkv, o, gate_up, down, decode, rope, add_norm, ...), a graph
of the same step in which only that kind launches (every other launch is skipped) is captured and
timed. A kind's time is its graph's replay time (its launches back to back, in step order, with
the step's shapes and launch parameters); ``per_launch_us`` divides it by the launches. The parts
need not add up to the step: back to back, a kernel overlaps its own neighbours (PDL) instead of
the step's, and an empty graph costs the launch of the graph itself (``empty_graph_ms``).
Also prints the step graph's node count by kind (``cuteinfer profile-graphs`` has the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from graphs.profile import hook_kernels, make_batch


def _noop(*args, **kwargs) -> None:
    pass


def profile(preset: str, batches: list[int], ctx: int, iters: int) -> list[dict]:
    from engine.args import EngineArgs
    from engine.config import ModelConfig
    from engine.executor.cuda_executor import CudaExecutor
    from engine.executor.cuda_model import decode_bytes_read
    from engine.model.loader import Checkpoint
    from engine.model.synthetic import hf_config, make_weights

    mc = ModelConfig.from_dict(hf_config(preset))
    t0 = time.perf_counter()
    ckpt = Checkpoint(Path(preset), mc, make_weights(mc, seed=0, threads=16))
    print(f"{preset}: random weights in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    bmax = max(batches)
    ec = EngineArgs.from_kwargs(
        model=preset, backend="cuda", max_model_len=max(ctx + 16, 2048), max_num_seqs=bmax,
        max_num_batched_tokens=max(bmax, 256), num_gpu_blocks_override=bmax * -(-ctx // 16) + 8,
        enforce_eager=True).create_engine_config(mc)
    ex = CudaExecutor(ckpt, ec)
    del ckpt
    rows = []
    for b in batches:
        r = _profile_batch(ex, b, ctx, iters)
        r.update(model=preset, floor_ms=round(decode_bytes_read(mc, b, ctx) / 4.28e12 * 1e3, 4))
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def _profile_batch(ex, b: int, ctx: int, iters: int) -> dict:
    from engine.cuda.driver import time_ms

    kernels = ex.kernels
    names = [f.name for f in dataclasses.fields(kernels)]
    batch = make_batch(b, ctx, 16, ex.num_pages, ex.mc.vocab_size)
    splits = ex.decode_splits(b)
    calls: Counter[str] = Counter()

    def counting(name, fn, *a, **k):
        calls[name] += 1
        return fn(*a, **k)

    ex.upload(batch)
    ex.upload_sampling(batch)
    ex.kernels = hook_kernels(kernels, counting)
    ex.decode_body(b, splits)  # one eager step: which kinds launch, how often
    ex.kernels = kernels

    def graph_ms(only: str | None) -> tuple[float, int]:
        """(replay ms, nodes) of the step with every kind (None), none (""), or one."""
        if only is not None:
            ex.kernels = hook_kernels(kernels, _noop, [n for n in names if n != only])
        try:
            runner = ex.graph_runner([b])
            g = runner.capture(b)
        finally:
            ex.kernels = kernels
        ex.upload(batch)
        ex.upload_sampling(batch)
        ms = float(np.median(time_ms(ex.stream, lambda: runner.replay(b), iters, warmup=5)))
        nodes = len(g.kernel_names)
        runner.destroy()
        return ms, nodes

    step_ms, nodes = graph_ms(None)
    try:
        empty = graph_ms("")[0]
    except Exception:  # an empty graph the driver does not take: count nothing for it
        empty = 0.0
    parts = {}
    for n, count in calls.items():
        ms = graph_ms(n)[0]
        parts[n] = {"launches": count, "graph_ms": round(ms, 4),
                    "per_launch_us": round((ms - empty) * 1e3 / count, 2),
                    "share_of_step": round((ms - empty) / step_ms, 3)}
    return {"bs": b, "ctx": ctx, "num_splits": splits, "step_graph_ms": round(step_ms, 4),
            "nodes": nodes, "empty_graph_ms": round(empty, 4),
            "sum_of_parts_ms": round(sum(p["graph_ms"] - empty for p in parts.values()), 4),
            "kernels": dict(sorted(parts.items(), key=lambda kv: -kv[1]["graph_ms"]))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = profile(a.preset, [int(x) for x in a.batch.split(",")], a.ctx, a.iters)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
