"""RMSNorm over rows of ``H`` (compile-time), optionally fused with the residual add.

Plain:  ``out = bf16(bf16(x * rstd) * w)`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` in fp32.
Fused:  ``r = bf16(x + residual)``; ``residual <- r``; ``out = rmsnorm(r)``  (HF's order and
rounding: add in bf16, normalize in fp32, cast to bf16, multiply by the bf16 weight).

Constraints: H % 8 == 0 (one 128-bit vector = 8 bf16); T and eps are runtime. ``out`` may alias
``x`` (a CTA reads its whole row into registers before the reduction barrier, then writes);
``residual`` must not alias ``out``.

Padded rows (``norm_size`` < H, compile-time): the mean of squares divides by ``norm_size``, the
model's real width, instead of H. The engine pads a hidden size that is not a multiple of the GEMM
tiles with zero columns (x, residual and weight zero there), so the sum of squares is that of the
real columns and the padding columns come out zero. ``norm_size == H`` is the plain kernel.

Layout: ``x, residual, out`` bf16 ``[T, H]`` row-major contiguous; ``weight`` bf16 ``[H]``.
Grid ``(T, 1, 1)``: one CTA per row. Block: ``NV = ceil(H/8 / 256)`` vectors per thread,
``ceil32(ceil(H/8 / NV))`` threads (H=4096: 256 x 2, H=576: 96 x 1); the row lives in registers,
the sum of squares goes warp shuffle -> shared memory -> every thread adds the warp sums in order
(``_reduce.block_reduce``).
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32

from cutlass_kernels._common import Ptr, Scalar, Signature, Unused
from cutlass_kernels._reduce import add, block_reduce

VEC = 8  # bf16 per 128-bit vector


class RMSNorm:
    def __init__(self, hidden: int, fused_residual: bool, norm_size: int | None = None) -> None:
        if hidden % VEC:
            raise ValueError(f"hidden={hidden} must be a multiple of {VEC}")
        norm_size = hidden if norm_size is None else norm_size
        if not 0 < norm_size <= hidden:
            raise ValueError(f"norm_size={norm_size} must be in [1, hidden={hidden}]")
        self.hidden = hidden
        self.norm_size = norm_size  # the mean's divisor: the real row width (module docstring)
        self.fused = fused_residual
        self.nvec = hidden // VEC
        self.nv = (self.nvec + 255) // 256  # vectors per thread
        self.threads = ((self.nvec + self.nv - 1) // self.nv + 31) // 32 * 32
        self.nwarps = self.threads // 32

    @cute.jit
    def __call__(self, x: cute.Pointer, residual: cute.Pointer, weight: cute.Pointer,
                 out: cute.Pointer, num_tokens: Int32, eps: Float32, stream: cuda.CUstream):
        rows = cute.make_layout((num_tokens, self.nvec, VEC), stride=(self.hidden, VEC, 1))
        mX = cute.make_tensor(x, rows)
        mR = cute.make_tensor(residual, rows)
        mO = cute.make_tensor(out, rows)
        mW = cute.make_tensor(weight, cute.make_layout((self.nvec, VEC), stride=(VEC, 1)))
        self.kernel(mX, mR, mW, mO, eps).launch(
            grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR: cute.Tensor, mW: cute.Tensor, mO: cute.Tensor,
               eps: Float32):
        cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sSum = smem.allocate_tensor(Float32, cute.make_layout(self.nwarps), byte_alignment=16)

        rX = cute.make_rmem_tensor(cute.make_layout((VEC, self.nv), stride=(1, VEC)), Float32)
        rX.fill(0.0)
        for i in cutlass.range_constexpr(self.nv):
            c = tidx + i * self.threads
            if c < self.nvec:
                x = mX[row, c, None].load().to(Float32)
                if cutlass.const_expr(self.fused):
                    r = (x + mR[row, c, None].load().to(Float32)).to(BFloat16)
                    mR[row, c, None].store(r)
                    x = r.to(Float32)
                rX[None, i].store(x)
        xv = rX.load()
        ss = (xv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        (total,) = block_reduce((ss,), add, (sSum,), self.nwarps, reuse_smem=False)
        rstd = cute.math.rsqrt(total / Float32(self.norm_size) + eps)

        for i in cutlass.range_constexpr(self.nv):
            c = tidx + i * self.threads
            if c < self.nvec:
                y = (rX[None, i].load() * rstd).to(BFloat16).to(Float32)
                wv = mW[c, None].load().to(Float32)
                mO[row, c, None].store((y * wv).to(BFloat16))


# ---------------------------------------------------------------------------------------------
# Host side

ROWS = ("num_tokens", "hidden")
SIGNATURE = Signature(Ptr("x", "bf16", shape=ROWS), Ptr("residual", "bf16", shape=ROWS),
                      Ptr("weight", "bf16", shape=("hidden",)), Ptr("out", "bf16", shape=ROWS),
                      Scalar("num_tokens", Int32), Scalar("eps", Float32, fake=1e-6))


class RMSNormLauncher:
    """``launcher(x, residual, weight, out, num_tokens, eps, stream)``.

    x, out bf16[T, hidden]; weight bf16[hidden]; residual bf16[T, hidden] (updated in place) when
    compiled with ``fused_residual=True``, else it must be None. eps: Python float.
    """

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.hidden, self.fused = kernel, kernel.op.hidden, kernel.op.fused

    def __call__(self, x: Any, residual: Any, weight: Any, out: Any, num_tokens: int,
                 eps: float, stream: Any) -> None:
        t = int(num_tokens)
        if (residual is None) == self.fused:
            raise common.KernelArgError(
                "residual must be given exactly when compiled with fused_residual=True")
        if t <= 0:
            return
        self.kernel(x, residual if self.fused else Unused(x), weight, out, t, float(eps), stream)


def compile_rmsnorm(hidden: int, fused_residual: bool = False,
                    norm_size: int | None = None) -> RMSNormLauncher:
    """Compile (once per ``(hidden, fused_residual, norm_size)``) the RMSNorm kernel; rows of
    ``hidden`` normalized over their first ``norm_size`` columns (default: all; the rest must be
    zero, module docstring)."""
    n = hidden if norm_size is None else int(norm_size)

    def build() -> RMSNormLauncher:
        return RMSNormLauncher(SIGNATURE.compile(RMSNorm(hidden, fused_residual, n)))

    return common.cached_compile(("rmsnorm", hidden, bool(fused_residual), n), build)
