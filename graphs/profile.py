"""``cuteinfer profile-graphs --model DIR``: what each decode graph costs and what graphs buy.

For every bucket: capture time, kernel nodes by name, graph memory, replay time (median and p99
over many replays, CUDA events) against the same step launched eagerly, and the launch overhead
saved. Writes a table (stdout), JSON, a PNG plot (matplotlib, if installed: replay vs eager time
per bucket, and time per token), and optionally the DOT dump of one graph.

Importable: ``profile_graphs(executor, iters=...) -> list[dict]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np


def _short(name: str) -> str:
    """A readable kernel name: the CuTe class the mangled name carries, when it can be found."""
    for tag in ("GemmSkinny", "GemmSm90", "DecodeAttention", "Combine", "PrefillAttention",
                "RMSNorm", "RopeKV", "SiluMul", "Embedding", "Sampler", "LogProbs"):
        if tag.lower() in name.lower():
            return tag
    return name[:48]


def profile_graphs(ex: Any, iters: int = 200, ctx: int = 512,
                   buckets: list[int] | None = None) -> list[dict]:
    """Profile every bucket of ``ex`` (a CudaExecutor) at context length ``ctx``."""
    from engine.cuda.driver import time_ms
    from graphs.runner import GraphRunner
    from tools.bench_decode import make_batch

    runner = ex.graphs or GraphRunner(ex)
    if buckets:
        runner.buckets = sorted(buckets)
    rows = []
    for bk in sorted(runner.buckets, reverse=True):
        g = runner.graphs.get(bk) or runner.capture(bk)
        batch = make_batch(bk, min(ctx, ex.sizes.max_pos - 1), ex.page_size, ex.num_pages,
                           ex.mc.vocab_size)
        ex.upload(batch)
        ex.upload_sampling(batch)

        rep = time_ms(ex.stream, lambda bk=bk: runner.launch(bk), iters, warmup=5)
        eag = time_ms(ex.stream, lambda bk=bk, s=g.num_splits: ex.decode_body(bk, s), iters,
                      warmup=5)
        by_name = Counter(_short(n) for n in g.kernel_names)
        r = dict(bucket=bk, nodes=len(g.kernel_names), nodes_by_kernel=dict(by_name),
                 capture_ms=round(g.capture_s * 1e3, 2), graph_mem_bytes=g.mem_bytes,
                 num_splits=g.num_splits, replay_ms_median=round(float(np.median(rep)), 4),
                 replay_ms_p99=round(float(np.percentile(rep, 99)), 4),
                 eager_ms_median=round(float(np.median(eag)), 4),
                 eager_ms_p99=round(float(np.percentile(eag, 99)), 4))
        saved = r["eager_ms_median"] - r["replay_ms_median"]
        r["saved_ms"] = round(saved, 4)
        r["saved_us_per_node"] = round(saved * 1e3 / max(len(g.kernel_names), 1), 3)
        r["replay_ms_per_token"] = round(r["replay_ms_median"] / bk, 5)
        rows.append(r)
    return sorted(rows, key=lambda r: r["bucket"])


def table(rows: list[dict]) -> str:
    head = (f"{'bucket':>6} {'nodes':>5} {'capture ms':>10} {'graph MiB':>9} {'replay ms':>9} "
            f"{'p99':>8} {'eager ms':>9} {'saved ms':>8} {'us/node':>7} {'ms/token':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['bucket']:>6} {r['nodes']:>5} {r['capture_ms']:>10.1f} "
                     f"{r['graph_mem_bytes'] / 2**20:>9.2f} {r['replay_ms_median']:>9.3f} "
                     f"{r['replay_ms_p99']:>8.3f} {r['eager_ms_median']:>9.3f} "
                     f"{r['saved_ms']:>8.3f} {r['saved_us_per_node']:>7.2f} "
                     f"{r['replay_ms_per_token']:>9.4f}")
    if rows:
        lines.append("nodes by kernel (largest bucket): " + ", ".join(
            f"{k} x{v}" for k, v in sorted(rows[-1]["nodes_by_kernel"].items())))
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path, title: str = "") -> bool:
    """Replay vs eager time per bucket, and time per token. False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    b = [r["bucket"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(b, [r["eager_ms_median"] for r in rows], "o-", label="eager")
    a1.plot(b, [r["replay_ms_median"] for r in rows], "s-", label="graph replay")
    a1.set_xlabel("batch bucket")
    a1.set_ylabel("decode step (ms, median)")
    a1.legend()
    a1.grid(alpha=0.3)
    a2.plot(b, [r["eager_ms_median"] / r["bucket"] for r in rows], "o-", label="eager")
    a2.plot(b, [r["replay_ms_per_token"] for r in rows], "s-", label="graph replay")
    a2.set_xlabel("batch bucket")
    a2.set_ylabel("ms per token")
    a2.set_yscale("log")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def dump_dot(ex: Any, bucket: int, path: str | Path) -> None:
    from engine.cuda.driver import _cu, check

    g = ex.graphs.graphs[bucket]
    check(_cu().cuGraphDebugDotPrint(g.graph, str(path).encode(), 0), "cuGraphDebugDotPrint")


def _bucket_list(text: str) -> list[int]:
    try:
        buckets = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers, got {text!r}") \
            from None
    if any(b < 1 for b in buckets):
        raise argparse.ArgumentTypeError(f"buckets must be >= 1, got {text!r}")
    return buckets


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tools.make_checkpoint import PRESETS

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", choices=sorted(PRESETS), metavar="PRESET",
                     help="random weights in memory at a tools/make_checkpoint preset's shape "
                     f"(one of {', '.join(sorted(PRESETS))}): no files written")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=512, help="context length of every sequence")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--buckets", type=_bucket_list, default=None,
                   help="comma list (default: all)")
    p.add_argument("--out", default="graph_profile", help="output prefix (.json, .png)")
    p.add_argument("--dot", type=int, default=None, help="dump this bucket's graph as DOT")


def run(a: argparse.Namespace) -> int:
    from engine.config import EngineConfig, ModelConfig
    from engine.executor.cuda_executor import CudaExecutor
    from engine.model.loader import load_checkpoint

    if a.model:
        mc = ModelConfig.from_pretrained(a.model)
        ckpt = load_checkpoint(a.model, mc)
        name = Path(a.model).name
    else:
        from engine.model.loader import Checkpoint
        from tools.make_checkpoint import hf_config, make_weights

        mc = ModelConfig.from_dict(hf_config(a.preset))
        ckpt = Checkpoint(Path(a.preset), mc, make_weights(mc, seed=0, threads=16))
        name = a.preset
    buckets = a.buckets
    ec = EngineConfig(model=name, backend="cuda", max_num_seqs=a.max_num_seqs,
                      max_model_len=a.max_model_len, lazy_graph_capture=True,
                      num_gpu_blocks_override=a.max_num_seqs * -(-a.max_model_len // 16) + 8
                      ).resolve(mc)
    ex = CudaExecutor(ckpt, ec)
    del ckpt
    rows = profile_graphs(ex, a.iters, a.ctx, buckets)
    print(table(rows))
    meta = {"model": name, "gpu": ex.ctx.name, "ctx": a.ctx, "iters": a.iters}
    Path(f"{a.out}.json").write_text(json.dumps({"meta": meta, "buckets": rows}, indent=1))
    if plot(rows, f"{a.out}.png", f"{name} on {ex.ctx.name}, ctx {a.ctx}"):
        print(f"wrote {a.out}.json and {a.out}.png", file=sys.stderr)
    else:
        print(f"wrote {a.out}.json; no plot: matplotlib is not installed "
              "(pip install 'cuteinfer[profile]')", file=sys.stderr)
    if a.dot is not None:
        dump_dot(ex, a.dot, f"{a.out}_b{a.dot}.dot")
    return 0
