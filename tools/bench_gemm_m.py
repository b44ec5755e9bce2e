"""Both GEMM paths across M, at a model's linear-layer shapes: where the crossover belongs.

    python -m tools.bench_gemm_m --preset qwen3-8b --m 64,128,192,256,320,512 [--out f.json]

For each linear layer (qkv, o, gate_up, down) and each M, the skinny path (token tile 64,
ceil(M / 64) token tiles: ``GemmLauncher(..., tile_as=64)``) and the tiled path (128 x tile_n
tiles) are timed back to back over ``--copies`` distinct weight copies (so L2 holds no weight),
CUDA events, median of ``--iters``. Prints us, TB/s of weight bytes and TFLOPS per (layer, M,
path), and per M the layers' sum for each path and for today's choice (``path(M)``: skinny up to
the crossover, 128): what a step's GEMMs cost at that many rows, per decoder layer.
"""

from __future__ import annotations

import argparse
import json
import sys

import cutlass_kernels._common  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)

# isort: split
import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def main(argv: list[str] | None = None) -> int:
    from cutlass_kernels.gemm import compile_gemm
    from engine.config import ModelConfig
    from engine.cuda.driver import Context, Stream, device_array, time_ms
    from engine.model.synthetic import hf_config

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--m", default="64,128,192,256,320,512")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    Context.get()
    st = Stream()
    mc = ModelConfig.from_dict(hf_config(a.preset))
    h, inter = mc.hidden_size, mc.intermediate_size
    shapes = {"qkv": (mc.qkv_size, h), "o": (h, mc.q_size), "gate_up": (2 * inter, h),
              "down": (h, inter)}
    ms = [int(x) for x in a.m.split(",")]
    mmax = max(ms)
    rng = np.random.default_rng(0)
    rows = []
    for name, (n, k) in shapes.items():
        g = compile_gemm(n, k)
        ws = []
        for _ in range(a.copies):
            w = device_array((n, k), BF16)
            w.upload((rng.standard_normal((n, k), np.float32) * 0.02).astype(BF16))
            ws.append(w)
        x = device_array((mmax, k), BF16)
        x.upload(rng.standard_normal((mmax, k), np.float32).astype(BF16))
        c = device_array((mmax, n), BF16)
        for m in ms:
            for path, tile_as in (("skinny64", 64), ("tiled", 1 << 20)):
                def run(m=m, tile_as=tile_as, g=g, ws=ws, x=x, c=c):
                    for w in ws:
                        g(x, w, c, m, st, tile_as)
                us = float(np.median(time_ms(st, run, a.iters, warmup=3))) * 1e3 / len(ws)
                r = {"layer": name, "n": n, "k": k, "m": m, "path": path, "us": round(us, 2),
                     "weight_tb_s": round(2 * n * k / us / 1e6, 3),
                     "tflops": round(2 * m * n * k / us / 1e6, 1), "default": g.path(m)}
                rows.append(r)
                print(json.dumps(r), flush=True)
    summary = {}
    for m in ms:
        per = {p: sum(r["us"] for r in rows if r["m"] == m and r["path"] == p)
               for p in ("skinny64", "tiled")}
        today = sum(r["us"] for r in rows if r["m"] == m and (
            r["path"] == "tiled") == (r["default"] == "tiled"))
        summary[m] = {**{k: round(v, 1) for k, v in per.items()}, "today": round(today, 1)}
    print(json.dumps({"per_layer_us": summary}), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "per_layer_us": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
