"""``cuteinfer warmup [--model M | --preset NAME]``: fill the kernel cache ahead of time.

Compiles every kernel the cuda backend compiles for the model (``Kernels.compile``) into the
kernel cache on disk (cutlass_kernels/_cache.py), so that later starts load them instead of
compiling them. Needs no GPU: without one the DSL builds for ``CUTE_DSL_ARCH`` (sm_90a, set by
cutlass_kernels/_common.py). Kernels depend on ``CUTEINFER_PDL`` and ``CUTEINFER_FUSED`` too:
warm up with the values the engine will run with.
"""

from __future__ import annotations

import argparse
import logging
import time

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.commands.generate import positive_int
    from engine.model.synthetic import PRESETS

    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="",
                     help="a checkpoint directory, a .gguf file or a hub id, as for generate "
                     "(default: the embedded default model)")
    src.add_argument("--preset", choices=sorted(PRESETS), metavar="PRESET",
                     help="the shapes of an engine.model.synthetic preset "
                     f"({', '.join(sorted(PRESETS))}); no checkpoint needed")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="processes compiling at once (default: CUTEINFER_COMPILE_WORKERS, else "
                   "one per CPU core)")


def run(a: argparse.Namespace) -> int:
    from cutlass_kernels import _cache
    from engine import envs
    from engine.config import ModelConfig
    from engine.executor.cuda_model import Kernels

    if a.preset:
        from engine.model.synthetic import hf_config

        mc, name = ModelConfig.from_dict(hf_config(a.preset)), a.preset
    else:
        from engine.engine import resolve_model_dir

        model_dir = resolve_model_dir(a.model)
        mc, name = ModelConfig.from_pretrained(model_dir), model_dir.name
    root = envs.kernel_cache_dir()
    if not envs.kernel_cache_enabled():
        log.warning("the kernel cache is off (CUTEINFER_KERNEL_CACHE=0): compiling, keeping "
                    "nothing")
    before = _cache.STATS.copy()
    t0 = time.perf_counter()
    Kernels.compile(mc, workers=a.workers)
    dt = time.perf_counter() - t0
    n = _cache.STATS - before
    workers = n["worker_compiled"]
    cached = n["loaded"] - workers  # what workers compile, this process then loads
    print(f"{name}: {cached + n['compiled'] + workers} kernels in {dt:.1f}s: {cached} were in "
          f"the cache, {n['compiled'] + workers} compiled"
          + (f" ({workers} in worker processes)" if workers else "")
          + (f", {n['rejected']} bad entries replaced" if n["rejected"] else ""))
    if envs.kernel_cache_enabled() and root.is_dir():
        entries = list(root.glob("*.json"))
        size = sum(f.stat().st_size for f in root.iterdir() if f.is_file())
        print(f"kernel cache {root}: {len(entries)} entries, {size / 2**20:.1f} MiB")
    return 0
