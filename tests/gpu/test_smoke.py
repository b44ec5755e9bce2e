"""Plumbing: the driver layer, a compiled CuTe DSL kernel launched on our stream, the results."""

import cutlass
import cutlass.cute as cute
import numpy as np
from cuda.bindings import driver as cu

from cutlass_kernels._common import fake_ptr, fake_stream, gmem_ptr
from engine.cuda.driver import device_array, to_device


def test_scale_kernel_roundtrip(cuda_ctx, stream):
    @cute.kernel
    def kern(mA: cute.Tensor, mB: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < n:
            mB[i] = (mA[i] * 2.0).to(cutlass.Float32)

    @cute.jit
    def host(a: cute.Pointer, b: cute.Pointer, n: cutlass.Int32, s: cu.CUstream):
        mA = cute.make_tensor(a, cute.make_layout(n))
        mB = cute.make_tensor(b, cute.make_layout(n))
        kern(mA, mB, n).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=s)

    compiled = cute.compile(host, fake_ptr("f32"), fake_ptr("f32"), cutlass.Int32(1),
                            fake_stream())
    n = 1000
    x = np.random.default_rng().standard_normal(n).astype(np.float32)
    a = to_device(x)
    b = device_array(n, np.float32)
    b.fill_bytes(0xFF, stream)  # poison (NaN)
    compiled(gmem_ptr("f32", a.ptr), gmem_ptr("f32", b.ptr), cutlass.Int32(n), stream.handle)
    stream.synchronize()
    np.testing.assert_array_equal(b.download(), 2 * x)


def test_cuda_sched_sets_the_primary_context_flag(cuda_ctx):
    """CUTEINFER_CUDA_SCHED=blocking: a fresh process's Context makes the primary context with
    CU_CTX_SCHED_BLOCKING_SYNC (the default leaves CUDA's heuristic, CU_CTX_SCHED_AUTO)."""
    import os
    import subprocess
    import sys

    code = ("from cuda.bindings import driver as cu\n"
            "from engine.cuda.driver import Context, check\n"
            "Context.get()\n"
            "f = check(cu.cuCtxGetFlags(), 'cuCtxGetFlags')\n"
            "print(int(f) & int(cu.CUctx_flags.CU_CTX_SCHED_MASK))\n")
    got = {}
    for sched in ("auto", "blocking", "yield"):
        env = {**os.environ, "CUTEINFER_CUDA_SCHED": sched}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got[sched] = int(out.stdout.strip().splitlines()[-1])
    assert got == {"auto": int(cu.CUctx_flags.CU_CTX_SCHED_AUTO),
                   "blocking": int(cu.CUctx_flags.CU_CTX_SCHED_BLOCKING_SYNC),
                   "yield": int(cu.CUctx_flags.CU_CTX_SCHED_YIELD)}, got
