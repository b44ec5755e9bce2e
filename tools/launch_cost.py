"""Host time per launch of the GEMM launcher's paths (skinny with and without PDL, tiled), and
of a compiled skinny kernel called directly with prebuilt arguments: where an eager step's host
time goes. Prints one JSON line per case.

    python -m tools.launch_cost --n 4096 --k 4096 --iters 300
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args(argv)

    import cutlass

    from cutlass_kernels import _common as common
    from cutlass_kernels.gemm import compile_gemm
    from engine.cuda.driver import Context, Stream, device_array

    Context.get()
    st = Stream()
    n, k = args.n, args.k
    bf16 = np.dtype("uint16")  # 2-byte storage; values are not read back
    a = device_array((256, k), bf16)
    w = device_array((n, k), bf16)
    c = device_array((256, n), bf16)
    for buf in (a, w, c):
        buf.fill_bytes(0, st)

    def per_call(fn) -> float:
        for _ in range(5):
            fn()
        st.synchronize()
        t = time.perf_counter()
        for _ in range(args.iters):
            fn()
        dt = time.perf_counter() - t
        st.synchronize()
        return dt / args.iters * 1e6

    for pdl in (False, True):
        g = compile_gemm(n, k, "bf16", pdl=pdl)
        for m in (1, 16, 200):
            us = per_call(lambda g=g, m=m: g(a, w, c, m, st))
            print(json.dumps({"case": "launcher", "path": g.path(m), "pdl": pdl, "m": m,
                              "host_us": round(us, 2)}), flush=True)
        fn = g._skinny[0][1].compiled
        prebuilt = (*(common.gmem_ptr("bf16", x.ptr) for x in (a, w, c)), cutlass.Int32(1),
                    cutlass.Int32(16), st.handle)
        us = per_call(lambda fn=fn, args=prebuilt: fn(*args))
        print(json.dumps({"case": "compiled skinny16, prebuilt args", "pdl": pdl,
                          "host_us": round(us, 2)}), flush=True)


if __name__ == "__main__":
    main()
