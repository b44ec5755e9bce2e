"""``cuteinfer profile-graphs --model DIR | --preset NAME``: build a cuda executor, profile every
decode graph (``graphs.profile``), write the table, JSON, plot and optionally a DOT dump.

The command lives here, not in ``graphs/``, because building the executor is the engine's job:
``graphs`` knows no executor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


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
    from engine.model.synthetic import PRESETS

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", choices=sorted(PRESETS), metavar="PRESET",
                     help="random weights in memory at an engine.model.synthetic preset's shape "
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
    from engine.args import EngineArgs
    from engine.config import ModelConfig
    from engine.executor.cuda_executor import CudaExecutor
    from engine.model.loader import load_checkpoint
    from graphs.profile import dump_dot, plot, profile_graphs, table

    if a.model:
        mc = ModelConfig.from_pretrained(a.model)
        ckpt = load_checkpoint(a.model, mc)
        name = Path(a.model).name
    else:
        from engine.model.loader import Checkpoint
        from engine.model.synthetic import hf_config, make_weights

        mc = ModelConfig.from_dict(hf_config(a.preset))
        ckpt = Checkpoint(Path(a.preset), mc, make_weights(mc, seed=0, threads=16))
        name = a.preset
    buckets = a.buckets
    ec = EngineArgs(model=name, backend="cuda", max_num_seqs=a.max_num_seqs,
                    max_model_len=a.max_model_len, lazy_graph_capture=True,
                    num_gpu_blocks_override=a.max_num_seqs * -(-a.max_model_len // 16) + 8
                    ).create_engine_config(mc)
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
