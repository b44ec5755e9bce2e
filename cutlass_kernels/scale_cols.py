"""Column scaling of a weight, in place: ``w[n, k] = bf16(w[n, k] * g[k])`` (fp32 product).

The engine folds an RMSNorm's weight ``g`` into the linear layer that follows it, once at load
(``W' = W diag(g)``), so that the skinny GEMM can fuse the norm as a per-row scale of its
product (gemm_skinny.py): ``bf16(x * rstd) * g @ W^T ~= rstd * (x @ W'^T)``.

Constraints: K (columns) is compile-time, K % 8 == 0; N (rows) is runtime.
Layout: ``w`` bf16 ``[N, K]`` row-major contiguous, ``g`` bf16 ``[K]``, 16-byte aligned.
Grid ``(N, ceil(K/8 / 256), 1)``, block ``min(256, ceil32(K/8))``: one 128-bit vector per thread.
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32

from cutlass_kernels._common import Ptr, Scalar, Signature

VEC = 8


class ScaleCols:
    def __init__(self, cols: int) -> None:
        if cols <= 0 or cols % VEC:
            raise ValueError(f"cols={cols} must be a positive multiple of {VEC}")
        self.cols = cols
        self.nvec = cols // VEC
        self.threads = min(256, (self.nvec + 31) // 32 * 32)
        self.ctas_per_row = (self.nvec + self.threads - 1) // self.threads

    @cute.jit
    def __call__(self, w: cute.Pointer, g: cute.Pointer, rows: Int32, stream: cuda.CUstream):
        mW = cute.make_tensor(w, cute.make_layout((rows, self.nvec, VEC),
                                                  stride=(self.cols, VEC, 1)))
        mG = cute.make_tensor(g, cute.make_layout((self.nvec, VEC), stride=(VEC, 1)))
        self.kernel(mW, mG).launch(grid=[rows, self.ctas_per_row, 1],
                                   block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mG: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, cta, _ = cute.arch.block_idx()
        c = cta * self.threads + tidx
        if c < self.nvec:
            x = mW[row, c, None].load().to(Float32)
            mW[row, c, None].store((x * mG[c, None].load().to(Float32)).to(BFloat16))


# ---------------------------------------------------------------------------------------------
# Host side

SIGNATURE = Signature(Ptr("w", "bf16", shape=("rows", "cols")), Ptr("g", "bf16", shape=("cols",)),
                      Scalar("rows", Int32))


class ScaleColsLauncher:
    """``launcher(w, g, rows, stream)``: w bf16[rows, cols] *= g bf16[cols], in place."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.cols = kernel, kernel.op.cols

    def __call__(self, w: Any, g: Any, rows: int, stream: Any) -> None:
        r = int(rows)
        if r < 0 or r >= 2**31 // self.cols:
            raise common.KernelArgError(f"rows={rows}: must be in [0, 2^31 / cols)")
        if r:
            self.kernel(w, g, r, stream)


def compile_scale_cols(cols: int) -> ScaleColsLauncher:
    """Compile (once per ``cols``) the column-scaling kernel."""

    def build() -> ScaleColsLauncher:
        return ScaleColsLauncher(SIGNATURE.compile(ScaleCols(cols)))

    return common.cached_compile(("scale_cols", cols), build)

