"""Sweep the skinny (decode) GEMM's split-K factor per token tile at a model's shapes.

For each linear layer of the preset and each M (served by the smallest token tile >= M), every
split-K factor (1, 2, 4, 8) is timed two ways, optionally with and without PDL (``--pdl``):

* ``alone``: one launch behind a 256 MiB memset (queued, L2 holds no weight): the kernel by itself;
* ``graph``: a CUDA graph of ``--layers`` (row gather -> GEMM) pairs over distinct weight copies,
  as a decode step runs them (the gather writes A). The gather-only graph is subtracted.

``--ctas both`` also times each split under the one-CTA smem plan (``gemm_skinny.skinny_plan``:
the most stages) beside the two-CTA one (the "plan" column: CTAs per SM x stages).

GB/s counts the weight bytes plus A and C. Prints a row per run and, per (layer, tile), the split
with the least graph time summed over that tile's M values beside ``gemm.choose_split_k``'s pick;
the JSON (``--out``) holds the records and that table (``best_split``: "N,K,tile,pdl,pad" ->
split).

    python -m tools.tune_skinny --preset qwen3-8b --m 1,16,32,64 --tiles 16,32,64 --out t.json
"""

from __future__ import annotations

import argparse
import json

import cutlass_kernels._common as common  # noqa: F401  (CUTE_DSL_ARCH before cutlass loads)

# isort: split
import cutlass
import cutlass.cute as cute
import ml_dtypes
import numpy as np

from cutlass_kernels.embedding import compile_embedding
from cutlass_kernels.gemm import SLAB, choose_split_k
from cutlass_kernels.gemm_skinny import GemmSkinnySm90
from cutlass_kernels.gemm_sm90 import BK
from engine.cuda.driver import Context, Event, Stream, device_array, graph_time_ms
from engine.model.synthetic import PRESETS

BF16 = np.dtype(ml_dtypes.bfloat16)


def layer_shapes(preset: str) -> list[tuple[str, int, int]]:
    cfg = PRESETS[preset]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    return [("qkv", q + 2 * kv, h), ("o_proj", h, q), ("gate_up", 2 * inter, h),
            ("down", h, inter)]


def sweep_shape(preset: str, name: str, n: int, k: int, ms: list[int], tiles: list[int],
                pdls: list[bool], pads: list[bool], layers: int, iters: int, stream: Stream,
                flush, ctas_list: tuple[int, ...] = (2,)) -> list[dict]:
    """Every (M, split, pdl, pad) of one layer shape; prints a row each."""
    fake = (common.fake_ptr("bf16"), common.fake_ptr("bf16"), common.fake_ptr("bf16"),
            cutlass.Int32(1), cutlass.Int32(1), common.fake_stream())
    ws = [device_array((n, k), BF16) for _ in range(layers)]
    for w in ws:
        w.fill_bytes(0x3C, stream)  # bf16 ~0.0115: finite, no upload needed
    mmax = max(ms)
    table = device_array((64, k), BF16)
    table.fill_bytes(0x3C, stream)
    ids = device_array(mmax, np.int32)
    ids.fill_bytes(0, stream)
    a = device_array((-(-mmax // tiles[-1]) * tiles[-1], k), BF16)
    a.fill_bytes(0xFF, stream)  # rows past M: NaN, as in a poisoned buffer
    cs = [device_array((mmax, n), BF16) for _ in range(layers)]
    gather = compile_embedding(k)
    pa = common.gmem_ptr("bf16", a.ptr)
    pws = [common.gmem_ptr("bf16", w.ptr) for w in ws]
    pcs = [common.gmem_ptr("bf16", c.ptr) for c in cs]
    e0, e1 = Event(), Event()
    records = []
    try:
        for m in ms:
            tile = next((t for t in tiles if t >= m), tiles[-1])
            nbytes = n * k * 2 + 2 * m * (k + n)

            def gathers(m=m) -> None:
                for _ in range(layers):
                    gather(ids, table, a, 64, m, stream)

            gather_ms = graph_time_ms(stream, gathers, iters)
            for split in (1, 2, 4, 8):
                if split > k // BK or (SLAB // 4) * tile % split:
                    continue
                for pdl, pad, ctas in [(p, q, c) for p in pdls for q in pads
                                       for c in ctas_list]:
                    gemm = GemmSkinnySm90(n, k, cutlass.BFloat16, tile, split, pdl,
                                          max_ctas=ctas)
                    if ctas != ctas_list[0] and gemm.ctas_per_sm != ctas:
                        continue  # (the plan is the same as another's)
                    fn = cute.compile(gemm, *fake)
                    mm = cutlass.Int32(m)
                    ml = cutlass.Int32(-(-m // tile) * tile if pad else m)
                    fn(pa, pws[0], pcs[0], mm, ml, stream.handle)
                    ts = []
                    for _ in range(iters):  # alone: a memset, then one launch between the events
                        flush.fill_bytes(0, stream)
                        e0.record(stream)
                        fn(pa, pws[0], pcs[0], mm, ml, stream.handle)
                        e1.record(stream)
                        e1.synchronize()
                        ts.append(e0.elapsed_ms(e1))
                    alone_ms = float(np.median(ts))

                    def body(fn=fn, mm=mm, ml=ml, m=m) -> None:
                        for i in range(layers):
                            gather(ids, table, a, 64, m, stream)
                            fn(pa, pws[i], pcs[i], mm, ml, stream.handle)

                    pair_ms = (graph_time_ms(stream, body, iters) - gather_ms) / layers
                    rec = {"preset": preset, "layer": name, "n": n, "k": k, "m": m, "tile": tile,
                           "split": split, "pdl": pdl, "pad": pad, "ctas": gemm.ctas_per_sm,
                           "stages": gemm.stages, "alone_us": alone_ms * 1e3,
                           "alone_gbs": nbytes / alone_ms / 1e6, "graph_us": pair_ms * 1e3,
                           "graph_gbs": nbytes / pair_ms / 1e6,
                           "heuristic": choose_split_k(n, k)}
                    records.append(rec)
                    print(f"{name:8} {n:6} {k:6} {m:3} {split:5} {int(pdl):3} {int(pad):3} "
                          f"{gemm.ctas_per_sm}x{gemm.stages:<2} "
                          f"{rec['alone_us']:9.2f} {rec['alone_gbs']:6.0f} "
                          f"{rec['graph_us']:9.2f} {rec['graph_gbs']:6.0f}", flush=True)
    finally:  # (an error in a sweep: the events are released all the same)
        e0.destroy()
        e1.destroy()
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(PRESETS))
    ap.add_argument("--m", default="1,16,32,64")
    ap.add_argument("--tiles", default="16,32,64", help="token tiles; M uses the smallest >= M")
    ap.add_argument("--pdl", default="0", choices=["0", "1", "both"])
    ap.add_argument("--pad", default="1", choices=["0", "1", "both"],
                    help="A's TMA view rounded up to the token tile (as the launcher does)")
    ap.add_argument("--ctas", default="2", choices=["1", "2", "both"],
                    help="the smem plan: up to 2 resident CTAs per SM (the default), or one CTA "
                         "with the most stages")
    ap.add_argument("--layers", type=int, default=8, help="gather+GEMM pairs per graph")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    ms = [int(x) for x in args.m.split(",")]
    tiles = sorted(int(x) for x in args.tiles.split(","))
    pdls = {"0": [False], "1": [True], "both": [True, False]}[args.pdl]
    pads = {"0": [False], "1": [True], "both": [True, False]}[args.pad]
    ctas_list = {"1": (1,), "2": (2,), "both": (2, 1)}[args.ctas]
    Context.get()
    stream = Stream()
    flush = device_array(256 << 20, np.uint8)
    print(f"{'layer':8} {'N':>6} {'K':>6} {'M':>3} {'split':>5} {'pdl':>3} {'pad':>3} "
          f"{'plan':5} {'alone us':>9} "
          f"{'GB/s':>6} {'graph us':>9} {'GB/s':>6}")
    records = []
    for name, n, k in layer_shapes(args.preset):
        records += sweep_shape(args.preset, name, n, k, ms, tiles, pdls, pads,
                               max(args.layers, 1), args.iters, stream, flush, ctas_list)
    print("\nbest split per (layer, token tile), graph time summed over its M values:")
    best = {}
    for layer, tile, pdl, pad, ctas in sorted({(r["layer"], r["tile"], r["pdl"], r["pad"],
                                                r["ctas"]) for r in records}):
        rs = [r for r in records if (r["layer"], r["tile"], r["pdl"], r["pad"], r["ctas"])
              == (layer, tile, pdl, pad, ctas)]
        tot: dict[int, float] = {}
        for r in rs:
            tot[r["split"]] = tot.get(r["split"], 0.0) + r["graph_us"]
        split = min(tot, key=tot.get)
        heur = rs[0]["heuristic"]
        best[f"{rs[0]['n']},{rs[0]['k']},{tile},pdl{int(pdl)},pad{int(pad)},ctas{ctas}"] = split
        print(f"  {layer:8} tile {tile:3} pdl {int(pdl)} pad {int(pad)} ctas {ctas}: "
              f"best split {split} "
              f"({tot[split]:.2f} us over M {sorted({r['m'] for r in rs})}); "
              f"heuristic {heur} ({tot[heur]:.2f} us); "
              + " ".join(f"s{s}:{t:.2f}" for s, t in sorted(tot.items())))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": records, "best_split": best}, f, indent=1)


if __name__ == "__main__":
    main()
