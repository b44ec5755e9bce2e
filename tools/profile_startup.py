"""Where start-up time goes: imports, then ``LLMEngine(...)`` under cProfile (the main thread:
context, plan, weight upload, the wait for kernels, graph capture), top functions by cumulative
time.

    python -m tools.profile_startup --model DIR [--backend cuda] [--top 40] [--json OUT]
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernels-only", action="store_true",
                    help="instead: the DSL import, then every kernel loaded from the cache (or "
                    "compiled) one after another in the main thread, under cProfile")
    a = ap.parse_args()
    if a.kernels_only:
        return kernels_only(a)
    t = {}
    from engine.args import EngineArgs
    from engine.engine import LLMEngine

    t["import_engine_s"] = time.perf_counter() - T0
    t1 = time.perf_counter()
    try:  # what the server adds: fastapi, pydantic, uvicorn
        import engine.server.app  # noqa: F401
        import engine.server.launch  # noqa: F401

        t["import_server_s"] = time.perf_counter() - t1
    except ImportError as e:
        t["import_server_s"] = f"not installed: {e}"
    args = EngineArgs(model=a.model, backend=a.backend, max_num_seqs=a.max_num_seqs,
                      max_model_len=a.max_model_len)
    prof = cProfile.Profile()
    t2 = time.perf_counter()
    prof.enable()
    eng = LLMEngine(args)
    prof.disable()
    t["engine_init_s"] = time.perf_counter() - t2
    ex = eng.executor
    for k in ("compile_s", "kernel_wait_s"):
        if hasattr(ex, k):
            t[k] = getattr(ex, k)
    t.update({f"graph_{k}": v for k, v in getattr(ex, "graph_stats", {}).items()})
    t.update(getattr(ex, "startup_phases", {}))
    _report(t, prof, a)
    eng.shutdown() if hasattr(eng, "shutdown") else None


def _report(t: dict, prof: cProfile.Profile, a: argparse.Namespace) -> None:
    """The phases as JSON, then the top functions by cumulative time (and both to --json)."""
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.top)
    print(json.dumps(t, indent=1))
    print(s.getvalue())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"phases": t, "profile": s.getvalue()}, f, indent=1)


def kernels_only(a: argparse.Namespace) -> None:
    from engine.config import ModelConfig
    from engine.engine import resolve_model_dir
    from engine.executor.cuda_model import _jobs

    mc = ModelConfig.from_pretrained(resolve_model_dir(a.model))
    t = {"import_engine_s": time.perf_counter() - T0}
    t1 = time.perf_counter()
    jobs = _jobs(mc)  # imports the kernel modules and the DSL
    t["import_kernels_s"] = time.perf_counter() - t1
    prof = cProfile.Profile()
    t2 = time.perf_counter()
    prof.enable()
    for fn, args, kwargs in jobs.values():
        fn(*args, **kwargs)
    prof.disable()
    t["kernels_s"] = time.perf_counter() - t2
    from cutlass_kernels._cache import STATS

    t["cache"] = dict(STATS)
    _report(t, prof, a)


if __name__ == "__main__":
    main()
