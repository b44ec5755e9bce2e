"""Decode step time of the cuda backend next to the memory-bandwidth floor.

    python -m tools.bench_decode --preset qwen3-0.6b --batch 1,8,64 --ctx 1024 [--out f.json]

Random weights at the preset's real shape (made in memory, no files). For each batch size B, B
sequences of context ``ctx`` decode one token: the eager step (every kernel launched from the
host) and, when graphs are available, the replayed graph, timed with CUDA events (median over
``--iters``). Floor = the bytes a step reads (``cuda_model.decode_bytes_read``: every weight
once, but only the gathered rows of an untied embedding table, plus the KV) / 4.28 TB/s, the
device-to-device copy rate measured on the H200; ``floor_all_weights_ms`` is the older floor that
counted the whole embedding table (the ratios printed use the bytes-read floor).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from engine import envs
from graphs.profile import hook_kernels, make_batch, make_span_batch

BW = 4.28e12


def host_launch_us(ex, step, reps: int = 5) -> dict:
    """Host time per launch of each kernel of ``step`` (us, median over ``reps`` steps): what
    bounds an eager step. Wraps the executor's launchers for the measurement, then restores
    them; the stream is synchronized before each step so the queue never fills."""
    kernels = ex.kernels
    spent: dict[str, list[float]] = {}
    calls: dict[str, int] = {}

    def timed(name, fn, *args, **kwargs):
        t = time.perf_counter()
        fn(*args, **kwargs)
        spent[name][-1] += time.perf_counter() - t
        calls[name] = calls.get(name, 0) + 1

    names = [f.name for f in dataclasses.fields(kernels)]
    ex.kernels = hook_kernels(kernels, timed)
    try:
        for _ in range(reps):
            ex.stream.synchronize()
            for name in names:
                spent.setdefault(name, []).append(0.0)
            calls.clear()
            step()
    finally:
        ex.kernels = kernels
        ex.stream.synchronize()
    return {name: round(float(np.median(v)) * 1e6 / calls[name], 1)
            for name, v in spent.items() if calls.get(name)}


def bench(preset: str, batches: list[int], ctx: int, iters: int, graphs: bool,
          verify: int = 0, spread: int = 0, sweep: tuple[int, ...] = ()) -> list[dict]:
    """``verify`` = k > 0: also the speculative verify step of each batch (B sequences x
    (k + 1) rows at context ``ctx``, ``CudaExecutor.verify_body``) replayed from its graph,
    beside the plain decode graph (``verify_over_decode``). ``spread``: contexts uniform in
    ``ctx +- spread`` (a served batch); ``sweep``: also replay graphs captured with each of these
    split-KV factors (``split_sweep_ms``)."""
    from engine.args import EngineArgs
    from engine.config import ModelConfig
    from engine.cuda.driver import time_ms
    from engine.executor.cuda_executor import CudaExecutor
    from engine.executor.cuda_model import decode_bytes_read
    from engine.model.loader import Checkpoint
    from engine.model.synthetic import hf_config, make_weights

    mc = ModelConfig.from_dict(hf_config(preset))
    t0 = time.perf_counter()
    ckpt = Checkpoint(Path(preset), mc, make_weights(mc, seed=0, threads=16))
    print(f"{preset}: random weights in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    bmax = max(batches)
    pages = bmax * -(-(ctx + spread) // 16) + 8
    spec = {} if not verify else {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": verify, "disable_by_batch_size": bmax + 1}}
    seqs = bmax * (verify + 1)
    ec = EngineArgs.from_kwargs(model=preset, backend="cuda",
                    max_model_len=max(ctx + spread + 16, 2048),
                    max_num_seqs=seqs, max_num_batched_tokens=max(seqs, 256),
                    num_gpu_blocks_override=pages, enforce_eager=True,
                    **spec).create_engine_config(mc)
    if sweep:  # room for the largest split factor swept
        from cutlass_kernels.decode_plan import decode_workspace_bytes

        own = CudaExecutor._workspace_bytes
        CudaExecutor._workspace_bytes = lambda self: max(own(self), decode_workspace_bytes(
            seqs, mc.num_attention_heads, mc.head_dim, max(sweep)))
    ex = CudaExecutor(ckpt, ec)
    del ckpt
    wbytes = 2 * mc.num_parameters
    runner = vrunner = None
    if graphs:
        runner = ex.graph_runner(sorted(set(batches)))
        runner.capture_all()
        if verify:
            vrunner = ex.verify_runner()
            if vrunner is not None:
                vrunner.capture_all(show=False)
    rows = []
    for b in batches:
        batch = make_batch(b, ctx, 16, ex.num_pages, mc.vocab_size, spread=spread)
        ex.upload(batch)
        ex.upload_sampling(batch)
        splits = ex.decode_splits(b)

        def eager(b=b, splits=splits):
            ex.decode_body(b, splits)  # forward + logits + sampling, as a graph captures it

        def timed(fn) -> tuple[float, float]:
            ts = time_ms(ex.stream, fn, iters)
            return float(np.median(ts)), float(np.percentile(ts, 99))

        eager_ms, eager_p99 = timed(eager)
        launch_us = host_launch_us(ex, eager)
        t_up = []
        for _ in range(20):  # the per-step host uploads (pageable numpy arrays today)
            ex.stream.synchronize()
            t1 = time.perf_counter()
            ex.upload(batch)
            ex.upload_sampling(batch)
            t_up.append((time.perf_counter() - t1) * 1e6)
        launch_us["upload+upload_sampling"] = round(float(np.median(t_up)), 1)
        # the whole step as the engine runs it (eager): upload, forward, logits, sampling,
        # download
        t_full = []
        for _ in range(max(5, iters // 4)):
            t1 = time.perf_counter()
            ex.execute(batch)
            t_full.append((time.perf_counter() - t1) * 1e3)
        kv = b * ctx * mc.num_hidden_layers * 2 * mc.kv_size * 2
        floor = decode_bytes_read(mc, b, ctx) / BW * 1e3
        r = dict(model=preset, engine="cuteinfer", pdl=envs.pdl_enabled(), bs=b, ctx=ctx,
                 ctx_spread=spread,
                 eager_ms=round(eager_ms, 4),
                 eager_p99_ms=round(eager_p99, 4), step_full_ms=round(float(np.median(t_full)), 4),
                 floor_ms=round(floor, 4),
                 floor_all_weights_ms=round((wbytes + kv) / BW * 1e3, 4),
                 eager_floor_ratio=round(floor / eager_ms, 3),
                 num_splits=splits, host_launch_us=launch_us)
        if runner is not None:
            g_ms, g_p99 = timed(lambda b=b: runner.replay(b))  # capture_all captured b
            r.update(graph_ms=round(g_ms, 4), graph_p99_ms=round(g_p99, 4),
                     graph_floor_ratio=round(floor / g_ms, 3))
            if sweep:
                ms = {}
                for ns in sweep:
                    sr = ex.graph_runner([b], splits=ns)
                    sr.capture(b)
                    ex.upload(batch)
                    ex.upload_sampling(batch)
                    ms[ns] = round(timed(lambda b=b, sr=sr: sr.replay(b))[0], 4)
                    sr.destroy()
                r.update(split_sweep_ms=ms)
            if vrunner is not None and vrunner.can_replay(b):
                vb = vrunner.pad(b)
                span = ex.verify_rows(make_span_batch(b, ctx, verify + 1, 16, ex.num_pages,
                                                      mc.vocab_size))
                ex.upload(span, pad_to=vb * (verify + 1))
                ex.upload_sampling(span, pad_to=vb * (verify + 1))
                v_ms, v_p99 = timed(lambda vb=vb: vrunner.replay(vb))
                r.update(verify_k=verify, verify_rows=span.num_seqs, verify_graph_ms=round(
                    v_ms, 4), verify_p99_ms=round(v_p99, 4),
                    verify_over_decode=round(v_ms / g_ms, 3))
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--ctx-spread", type=int, default=0, metavar="S",
                    help="contexts uniform in ctx +- S (default: all at ctx)")
    ap.add_argument("--split-sweep", default="", metavar="LIST",
                    help="also time graphs captured with these split-KV factors, e.g. 1,2,4")
    ap.add_argument("--verify", type=int, default=0, metavar="K",
                    help="also time the speculative verify graph of K drafts per sequence")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = bench(a.preset, [int(x) for x in a.batch.split(",")], a.ctx, a.iters,
                 not a.no_graphs, a.verify, a.ctx_spread,
                 tuple(int(x) for x in a.split_sweep.split(",") if x))
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
