"""The three GEMM paths across M, at a model's linear-layer shapes: where each belongs.

    python -m tools.bench_gemm_m --preset qwen3-8b --m 64,128,192,256,320,512 [--out f.json]
        [--wide-tiles 64,128,192,256] [--wide-slab 128|256] [--wide-split 1..8]

For each linear layer (qkv, o, gate_up, down) and each M, the skinny path (token tile 64,
ceil(M / 64) token tiles: ``GemmLauncher(..., tile_as=64)``), the tiled path (128 x tile_n
tiles) and the wide path (gemm_wide.py: the smallest of ``--wide-tiles`` >= M, else the largest
over ceil(M / tile) token tiles; slab and split from the heuristics unless forced) are timed back
to back over ``--copies`` distinct weight copies (so L2 holds no weight), CUDA events, median of
``--iters``. Prints one JSON line per (layer, M, path) (us, TB/s of weight bytes, TFLOPS; for
wide the kernel and its slab/split), then a table: per layer and M the three paths' us, and per
M the layers' sum for each path, for today's choice (``path(M)``: skinny up to the crossover,
128) and for the best path per layer: what a step's GEMMs cost at that many rows, per decoder
layer.
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
    ap.add_argument("--wide-tiles", default="64,128,192,256")
    ap.add_argument("--wide-slab", type=int, default=None, help="force the W slab (128, 256)")
    ap.add_argument("--wide-split", type=int, default=None, help="force the split-K (1..8)")
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
    wide_tiles = tuple(int(x) for x in a.wide_tiles.split(","))
    paths = ("skinny64", "tiled", "wide")
    rows = []
    for name, (n, k) in shapes.items():
        g = compile_gemm(n, k)
        gw = compile_gemm(n, k, crossover=0, wide_tiles=wide_tiles, wide_range=(1, 1 << 30),
                          wide_slab=a.wide_slab, wide_split_k=a.wide_split)
        wide_cfg = {t: (slab, split) for t, slab, split in gw.cfg.wide}
        ws = []
        for _ in range(a.copies):
            w = device_array((n, k), BF16)
            w.upload((rng.standard_normal((n, k), np.float32) * 0.02).astype(BF16))
            ws.append(w)
        x = device_array((mmax, k), BF16)
        x.upload(rng.standard_normal((mmax, k), np.float32).astype(BF16))
        c = device_array((mmax, n), BF16)
        for m in ms:
            for path, launcher, tile_as in (("skinny64", g, 64), ("tiled", g, 1 << 20),
                                            ("wide", gw, None)):
                def run(m=m, tile_as=tile_as, launcher=launcher, ws=ws, x=x, c=c):
                    for w in ws:
                        launcher(x, w, c, m, st, tile_as)
                us = float(np.median(time_ms(st, run, a.iters, warmup=3))) * 1e3 / len(ws)
                r = {"layer": name, "n": n, "k": k, "m": m, "path": path, "us": round(us, 2),
                     "weight_tb_s": round(2 * n * k / us / 1e6, 3),
                     "tflops": round(2 * m * n * k / us / 1e6, 1), "default": g.path(m)}
                if path == "wide":
                    slab, split = wide_cfg[gw.tile_for(m)]
                    r.update(kernel=gw.path(m), slab=slab, split_k=split)
                rows.append(r)
                print(json.dumps(r), flush=True)
    us = {(r["layer"], r["m"], r["path"]): r["us"] for r in rows}
    summary = {}
    for m in ms:
        per = {p: sum(us[(layer, m, p)] for layer in shapes) for p in paths}
        today = sum(r["us"] for r in rows if r["m"] == m and r["path"] != "wide" and (
            r["path"] == "tiled") == (r["default"] == "tiled"))
        best = sum(min(us[(layer, m, p)] for p in paths) for layer in shapes)
        summary[m] = {**{k: round(v, 1) for k, v in per.items()}, "today": round(today, 1),
                      "best": round(best, 1)}
    print(json.dumps({"per_layer_us": summary}), flush=True)
    print(f"\n{'layer':8} {'M':>4} {'skinny64':>9} {'tiled':>9} {'wide':>9}  wide kernel")
    for name in shapes:
        for m in ms:
            w = next(r for r in rows if r["layer"] == name and r["m"] == m
                     and r["path"] == "wide")
            print(f"{name:8} {m:4} " + " ".join(f"{us[(name, m, p)]:9.1f}" for p in paths)
                  + f"  {w['kernel']} slab {w['slab']} split {w['split_k']}"
                  f" {w['weight_tb_s']:.2f} TB/s {w['tflops']:.0f} TFLOPS")
    print(f"\nper decoder layer (us)\n{'M':>4} {'skinny64':>9} {'tiled':>9} {'wide':>9} "
          f"{'today':>9} {'best':>9}")
    for m in ms:
        print(f"{m:4} " + " ".join(f"{summary[m][p]:9.1f}"
                                   for p in (*paths, "today", "best")))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "per_layer_us": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
