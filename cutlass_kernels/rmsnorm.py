"""RMSNorm over rows of ``H`` (compile-time), optionally fused with the residual add.

Plain:  ``out = bf16(bf16(x * rstd) * w)`` with ``rstd = 1 / sqrt(mean(x^2) + eps)`` in fp32.
Fused:  ``r = bf16(x + residual)``; ``residual <- r``; ``out = rmsnorm(r)``  (HF's order and
rounding: add in bf16, normalize in fp32, cast to bf16, multiply by the bf16 weight).

Constraints: H % 8 == 0 (one 128-bit vector = 8 bf16); T and eps are runtime. ``out`` may alias
``x`` (a CTA reads its whole row into registers before the reduction barrier, then writes);
``residual`` must not alias ``out``.

Layout: ``x, residual, out`` bf16 ``[T, H]`` row-major contiguous; ``w`` bf16 ``[H]``.
Grid ``(T, 1, 1)``: one CTA per row. Block: ``NV = ceil(H/8 / 256)`` vectors per thread,
``ceil32(ceil(H/8 / NV))`` threads (H=4096: 256 x 2, H=576: 96 x 1); the row lives in registers,
the sum of squares goes warp shuffle -> shared memory -> every thread adds the warp sums in order.
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32

VEC = 8  # bf16 per 128-bit vector


class RMSNorm:
    def __init__(self, hidden: int, fused_residual: bool) -> None:
        if hidden % VEC:
            raise ValueError(f"hidden={hidden} must be a multiple of {VEC}")
        self.hidden = hidden
        self.fused = fused_residual
        self.nvec = hidden // VEC
        self.nv = (self.nvec + 255) // 256  # vectors per thread
        self.threads = ((self.nvec + self.nv - 1) // self.nv + 31) // 32 * 32
        self.nwarps = self.threads // 32

    @cute.jit
    def __call__(self, x: cute.Pointer, residual: cute.Pointer, w: cute.Pointer,
                 out: cute.Pointer, num_tokens: Int32, eps: Float32, stream: cuda.CUstream):
        rows = cute.make_layout((num_tokens, self.nvec, VEC), stride=(self.hidden, VEC, 1))
        mX = cute.make_tensor(x, rows)
        mR = cute.make_tensor(residual, rows)
        mO = cute.make_tensor(out, rows)
        mW = cute.make_tensor(w, cute.make_layout((self.nvec, VEC), stride=(VEC, 1)))
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
        ss = cute.arch.warp_reduction(ss, lambda a, b: a + b)
        # warp_idx() is a warp-wide shuffle: evaluate it with every lane active
        wid = cute.arch.warp_idx()
        if cute.arch.lane_idx() == 0:
            sSum[wid] = ss
        cute.arch.sync_threads()
        total = sSum[0]
        for k in cutlass.range_constexpr(1, self.nwarps):
            total = total + sSum[k]
        rstd = cute.math.rsqrt(total / Float32(self.hidden) + eps)

        for i in cutlass.range_constexpr(self.nv):
            c = tidx + i * self.threads
            if c < self.nvec:
                y = (rX[None, i].load() * rstd).to(BFloat16).to(Float32)
                wv = mW[c, None].load().to(Float32)
                mO[row, c, None].store((y * wv).to(BFloat16))


# ---------------------------------------------------------------------------------------------
# Host side


def _ptr(buf: Any, numel: int, name: str) -> cute.Pointer:
    nbytes = getattr(buf, "nbytes", None)
    if nbytes is not None and nbytes < 2 * numel:
        raise common.KernelArgError(f"{name}: buffer of {nbytes} B, kernel touches {2 * numel} B")
    return common.gmem_ptr("bf16", common.addr(buf))


class RMSNormLauncher:
    """``launcher(x, residual, weight, out, num_tokens, eps, stream)``.

    x, out bf16[T, hidden]; weight bf16[hidden]; residual bf16[T, hidden] (updated in place) when
    compiled with ``fused_residual=True``, else it must be None. eps: Python float.
    """

    def __init__(self, compiled: Any, hidden: int, fused: bool) -> None:
        self.compiled, self.hidden, self.fused = compiled, hidden, fused

    def __call__(self, x: Any, residual: Any, weight: Any, out: Any, num_tokens: int,
                 eps: float, stream: Any) -> None:
        t = int(num_tokens)
        if (residual is None) == self.fused:
            raise common.KernelArgError(
                "residual must be given exactly when compiled with fused_residual=True")
        if t <= 0:
            return
        n = t * self.hidden
        px = _ptr(x, n, "x")
        pr = _ptr(residual, n, "residual") if self.fused else px
        self.compiled(px, pr, _ptr(weight, self.hidden, "weight"), _ptr(out, n, "out"),
                      Int32(t), Float32(float(eps)), getattr(stream, "handle", stream))


def compile_rmsnorm(hidden: int, fused_residual: bool = False) -> RMSNormLauncher:
    """Compile (once per ``(hidden, fused_residual)``) the RMSNorm kernel."""

    def build() -> RMSNormLauncher:
        p = common.fake_ptr("bf16")
        compiled = cute.compile(RMSNorm(hidden, fused_residual), p, p, p, p, Int32(1),
                                Float32(1e-6), common.fake_stream())
        return RMSNormLauncher(compiled, hidden, fused_residual)

    return common.cached_compile(("rmsnorm", hidden, bool(fused_residual)), build)
