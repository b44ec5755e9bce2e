"""Sweep the paged decode attention's main loop, ring depth and split-KV factor.

For each batch, every (variant, splits) pair runs over the same random paged KV (pages in random
order, as a real pool hands them out), timed as a CUDA graph of ``--reps`` launches; GB/s counts
the K and V bytes read. ``choose_num_splits``'s pick is marked. A variant is ``simt:S`` (the
CUDA-core loop, an S-page ring per CTA) or ``mma:WxS`` (the tensor-core loop, W warps with an
S-page ring each); ``--stages 4,6`` is short for ``simt:4,simt:6``. ``rope:WxS`` times the
decode attention with the rope / KV-write prologue (``compile_decode_rope_attention``, what plain
decode steps run) and ``sep:WxS`` the two kernels it replaces (rope_kv, then ``mma:WxS``), both
from the same qkv rows, with PDL as the engine launches them (``--no-pdl`` to drop it).

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
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--splits", default=None, help="more split counts to time, e.g. 4,12")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = ([f"simt:{s}" for s in args.stages.split(",")] if args.stages
                else args.variants.split(","))

    from cutlass_kernels.decode_attention import (
        choose_num_splits,
        compile_decode_attention,
        compile_decode_rope_attention,
        decode_workspace_bytes,
    )
    from cutlass_kernels.rope_kv import compile_rope_kv
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
        table_h = rng.permutation(np.arange(1, n_pages)).astype(np.int32).reshape(batch, ppseq)
        table = to_device(table_h)
        lens = to_device(np.full(batch, ctx, np.int32))
        q = to_device(rng.standard_normal((batch, nq * hd)).astype(BF16))
        out = device_array((batch, nq * hd), BF16)
        # rope / sep: the step's qkv rows, the new token at position ctx - 1 (its slot in the
        # last page), qwen3's q / k norms
        qkv = to_device(rng.standard_normal((batch, (nq + 2 * nkv) * hd)).astype(BF16))
        pos_h = np.full(batch, ctx - 1, np.int32)
        last = table_h[:, (ctx - 1) // ps].astype(np.int64)
        positions, slots = to_device(pos_h), to_device(last * ps + (ctx - 1) % ps)
        norm_w = to_device(np.ones(hd, BF16))
        max_pos = max(ctx, 2)
        inv = 1.0 / (1e6 ** (np.arange(0, hd, 2) / hd))
        fr = np.arange(max_pos)[:, None] * inv[None, :]
        cos_sin = to_device(np.concatenate([np.cos(fr), np.sin(fr)], 1).astype(np.float32))
        picked_mma = choose_num_splits(batch, nkv, ctx, ctx_obj.num_sms, mma=True)
        picked_simt = choose_num_splits(batch, nkv, ctx, ctx_obj.num_sms)
        extra = [int(x) for x in args.splits.split(",")] if args.splits else []
        kv_bytes = 2 * batch * ctx * nkv * hd * 2
        for variant in variants:
            kind, _, conf = variant.partition(":")
            pdl = not args.no_pdl
            if kind in ("mma", "rope", "sep"):
                warps, stages = (int(x) for x in conf.split("x"))
                dec = (compile_decode_attention(nq, nkv, hd, num_stages=stages, mma=True,
                                                warps=warps, pdl=pdl and kind == "sep")
                       if kind != "rope" else None)  # rope: the fused kernel alone runs
                fused = (compile_decode_rope_attention(nq, nkv, hd, ps, True, num_stages=stages,
                                                       warps=warps, pdl=pdl)
                         if kind == "rope" else None)
                rope = compile_rope_kv(nq, nkv, hd, ps, True, pdl=pdl) if kind == "sep" else None
            else:
                stages = int(conf)
                dec = compile_decode_attention(nq, nkv, hd, num_stages=stages)
            picked = picked_simt if kind == "simt" else picked_mma
            for splits in sorted({max(1, picked // 2), picked, picked * 2, 1, *extra}):
                ws = device_array(max(1, decode_workspace_bytes(batch, nq, hd, splits) // 4),
                                  np.float32)
                ws.fill_bytes(0, st)  # the split counters start at zero (decode_attention.py)

                fixed = (q, k, v, table, lens, out, ws, batch, ppseq, splits, hd ** -0.5,
                         st.handle)

                calls = [(dec, fixed)]
                if kind == "rope":
                    calls = [(fused, (qkv, positions, slots, norm_w, norm_w, cos_sin, k, v, table,
                                      lens, out, ws, batch, ppseq, splits, hd ** -0.5, max_pos,
                                      1e-6, st.handle))]
                elif kind == "sep":
                    calls.insert(0, (rope, (qkv, positions, slots, norm_w, norm_w, cos_sin, q, k,
                                            v, batch, max_pos, 1e-6, st.handle)))

                def launch(calls=calls) -> None:
                    for fn, fn_args in calls:
                        fn(*fn_args)

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
