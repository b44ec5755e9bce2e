"""Sweep the paged decode attention's main loop, ring depth and split-KV factor.

For each batch, every (variant, splits) pair runs over the same random paged KV (pages in random
order, as a real pool hands them out), timed as a CUDA graph of ``--reps`` launches; GB/s counts
the K and V bytes read. ``choose_num_splits``'s pick is marked. A variant is ``simt:S`` (the
CUDA-core loop, an S-page ring per CTA) or ``mma:WxS`` (the tensor-core loop, W warps with an
S-page ring each); ``--stages 4,6`` is short for ``simt:4,simt:6``.

    python -m tools.tune_attention --nq 32 --nkv 8 --batch 1,64,128 --ctx 1024 \
        --variants simt:4,mma:4x2,mma:4x1,mma:2x2
"""

from __future__ import annotations

import argparse
import json

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nq", type=int, default=32)
    ap.add_argument("--nkv", type=int, default=8)
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--batch", default="8,64,128")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--stages", default=None)
    ap.add_argument("--variants", default="simt:4,mma:4x2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = ([f"simt:{s}" for s in args.stages.split(",")] if args.stages
                else args.variants.split(","))

    from cutlass_kernels.decode_attention import (
        choose_num_splits,
        compile_decode_attention,
        decode_workspace_bytes,
    )
    from engine.cuda.driver import Context, Stream, device_array, graph_time_ms, to_device

    ctx_obj = Context.get()
    st = Stream()
    nq, nkv, hd, ps = args.nq, args.nkv, args.hd, 16
    rng = np.random.default_rng(0)
    records = []
    for batch in (int(b) for b in args.batch.split(",")):
        ctx = args.ctx
        ppseq = -(-ctx // ps)
        n_pages = batch * ppseq + 1
        k = device_array((n_pages, nkv, ps, hd), BF16)
        v = device_array((n_pages, nkv, ps, hd), BF16)
        k.fill_bytes(0x3C, st)
        v.fill_bytes(0x3C, st)
        table = to_device(rng.permutation(np.arange(1, n_pages)).astype(np.int32)
                          .reshape(batch, ppseq))
        lens = to_device(np.full(batch, ctx, np.int32))
        q = to_device(rng.standard_normal((batch, nq * hd)).astype(BF16))
        out = device_array((batch, nq * hd), BF16)
        picked = choose_num_splits(batch, nkv, ctx, ctx_obj.num_sms)
        splits_set = sorted({max(1, picked // 2), picked, picked * 2, 1})
        kv_bytes = 2 * batch * ctx * nkv * hd * 2
        for variant in variants:
            kind, _, conf = variant.partition(":")
            if kind == "mma":
                warps, stages = (int(x) for x in conf.split("x"))
                dec = compile_decode_attention(nq, nkv, hd, num_stages=stages, mma=True,
                                               warps=warps)
            else:
                stages = int(conf)
                dec = compile_decode_attention(nq, nkv, hd, num_stages=stages)
            for splits in splits_set:
                ws = device_array(max(1, decode_workspace_bytes(batch, nq, hd, splits) // 4),
                                  np.float32)
                ws.fill_bytes(0, st)  # the split counters start at zero (decode_attention.py)

                fixed = (q, k, v, table, lens, out, ws, batch, ppseq, splits, hd ** -0.5,
                         st.handle)

                def launch(dec=dec, fixed=fixed) -> None:
                    dec(*fixed)

                launch()
                us = graph_time_ms(st, lambda launch=launch: [launch() for _ in range(args.reps)],
                                   args.iters) / args.reps * 1e3
                rec = {"nq": nq, "nkv": nkv, "hd": hd, "batch": batch, "ctx": ctx,
                       "variant": variant, "splits": splits, "picked": splits == picked,
                       "us": round(us, 2), "gbs": round(kv_bytes / us / 1e3, 1)}
                records.append(rec)
                print(json.dumps(rec), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
