"""The H200's read ceiling: a read-only stream (cutlass_kernels/read_stream.py) beside the
device-to-device copy that the decode floor divides by (issue 15).

    python -m tools.bench_read [--gib 2] [--iters 20] [--out f.json]

For each launch shape (threads x unroll x CTAs per SM) the kernel reads the whole buffer
(``--gib``, far larger than the 50 MB L2) and its device time is the median of ``--iters``
CUDA-event timings; rate = bytes read / time. The copy is ``cuMemcpyDtoDAsync`` of half the
buffer into the other half: its rate is quoted both ways, bytes copied / time (the 4.28 TB/s
convention of the decode floor) and bytes moved (read + written) / time. The sum of the
buffer is checked against numpy once (the kernel is exact). Prints one JSON object.
"""

from __future__ import annotations

import argparse

import numpy as np

from tools.report import emit

SHAPES = "512x4x2,512x8x2,1024x4x1,256x4x4,512x2x4,512x4x4,256x2x8,256x1x8,512x1x4,128x4x16"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default=SHAPES,
                    help="comma list of THREADSxUNROLLxCTAS_PER_SM")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from cutlass_kernels.read_stream import VEC, compile_read_stream
    from engine.cuda.driver import Context, Stream, _cu, check, device_array, time_ms

    ctx = Context.get()
    st = Stream()
    nbytes = int(a.gib * 2**30) // 32 * 32
    num_vec = nbytes // (4 * VEC)
    src = device_array((num_vec, VEC), np.uint32)
    host = np.frombuffer(np.random.default_rng(0).bytes(nbytes), np.uint32).reshape(num_vec, VEC)
    src.upload(host, st)
    want = int(host.sum(dtype=np.uint64) % 2**32)
    del host
    sms = ctx.num_sms
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    out = device_array(max(p for _, _, p in shapes) * sms, np.uint32)
    res: dict = {"device": ctx.name, "sms": sms, "bytes": nbytes, "read": []}
    for threads, unroll, per_sm in shapes:
        k, ctas = compile_read_stream(threads, unroll), per_sm * sms
        k(src, out, num_vec, ctas, st)
        st.synchronize()
        ok = int(out.download()[:ctas].sum(dtype=np.uint64) % 2**32) == want
        ms = float(np.median(time_ms(st, lambda k=k, c=ctas: k(src, out, num_vec, c, st),
                                     a.iters)))
        res["read"].append({"threads": threads, "unroll": unroll, "ctas": ctas,
                            "ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3),
                            "sum_ok": ok})
    half = nbytes // 2

    def copy() -> None:
        check(_cu().cuMemcpyDtoDAsync(src.ptr + half, src.ptr, half, st.handle),
              "cuMemcpyDtoDAsync")

    ms = float(np.median(time_ms(st, copy, a.iters)))
    res["copy"] = {"bytes_copied": half, "ms": round(ms, 4),
                   "copied_tb_s": round(half / ms / 1e9, 3),
                   "moved_tb_s": round(2 * half / ms / 1e9, 3)}
    best = max(res["read"], key=lambda r: r["tb_s"])
    res["best_read_tb_s"] = best["tb_s"]
    res["read_over_copy_convention"] = round(best["tb_s"] / res["copy"]["copied_tb_s"], 3)
    emit(res, a.out)


if __name__ == "__main__":
    main()
