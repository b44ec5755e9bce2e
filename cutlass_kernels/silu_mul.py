"""SwiGLU: ``out = bf16(bf16(g * sigmoid(g)) * u)`` with ``g = x[:, :I]``, ``u = x[:, I:]``.

fp32 inside (``sigmoid(g) = 1 / (1 + exp(-g))``), bf16 in and out.

Constraints: I (intermediate size) is compile-time, I % 8 == 0; T is runtime.
Layout: ``x`` bf16 ``[T, 2I]`` (gate columns first, then up), ``out`` bf16 ``[T, I]``, both
row-major contiguous, rows 16-byte aligned. ``block`` (compile-time, default I): gate and up
alternate in blocks of that many columns (``x[:, 2jB:2jB+B]`` gate columns jB.., the next B up),
the order the engine's gate_up weight has for the skinny GEMM's fused SiLU epilogue (block 32);
B % 8 == 0 and I % B == 0.
Grid ``(T, ceil(I/8 / (block * NV)), 1)``, block ``min(256, ceil32(I/8))`` threads; each thread
handles ``NV`` 128-bit vectors of g and of u (NV = 2 once a row needs more than one CTA of 256).
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import BFloat16, Float32, Int32

from cutlass_kernels._common import Ptr, Scalar, Signature

VEC = 8


class SiluMul:
    def __init__(self, intermediate: int, block: int | None = None) -> None:
        if intermediate % VEC:
            raise ValueError(f"intermediate={intermediate} must be a multiple of {VEC}")
        block = intermediate if block is None else block
        if block <= 0 or block % VEC or intermediate % block:
            raise ValueError(f"block={block} must be a positive multiple of {VEC} dividing "
                             f"intermediate={intermediate}")
        self.inter = intermediate
        self.block = block
        self.nvec = intermediate // VEC
        self.threads = min(256, (self.nvec + 31) // 32 * 32)
        self.nv = 2 if self.nvec > 2 * self.threads else 1
        per_cta = self.threads * self.nv
        self.ctas_per_row = (self.nvec + per_cta - 1) // per_cta

    @cute.jit
    def __call__(self, x: cute.Pointer, out: cute.Pointer, num_tokens: Int32,
                 stream: cuda.CUstream):
        # x viewed as (T, 2 [gate/up], (B/8, I/B), 8): vector c of gate at block c // (B/8)
        bv, b = self.block // VEC, self.block
        mX = cute.make_tensor(x, cute.make_layout(
            (num_tokens, 2, (bv, self.inter // b), VEC),
            stride=(2 * self.inter, b, (VEC, 2 * b), 1)))
        mO = cute.make_tensor(out, cute.make_layout((num_tokens, self.nvec, VEC),
                                                    stride=(self.inter, VEC, 1)))
        self.kernel(mX, mO).launch(grid=[num_tokens, self.ctas_per_row, 1],
                                   block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor):
        cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        tidx, _, _ = cute.arch.thread_idx()
        row, cta, _ = cute.arch.block_idx()
        base = cta * (self.threads * self.nv) + tidx
        for i in cutlass.range_constexpr(self.nv):
            c = base + i * self.threads
            if c < self.nvec:
                g = mX[row, 0, c, None].load().to(Float32)
                u = mX[row, 1, c, None].load().to(Float32)
                act = (g / (Float32(1.0) + cute.math.exp(-g))).to(BFloat16).to(Float32)
                mO[row, c, None].store((act * u).to(BFloat16))


# ---------------------------------------------------------------------------------------------
# Host side

SIGNATURE = Signature(Ptr("x", "bf16", shape=("num_tokens", 2, "inter")),
                      Ptr("out", "bf16", shape=("num_tokens", "inter")),
                      Scalar("num_tokens", Int32))


class SiluMulLauncher:
    """``launcher(x, out, num_tokens, stream)``: x bf16[T, 2I] -> out bf16[T, I]."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel, self.inter = kernel, kernel.op.inter

    def __call__(self, x: Any, out: Any, num_tokens: int, stream: Any) -> None:
        t = int(num_tokens)
        if t <= 0:
            return
        self.kernel(x, out, t, stream)


def compile_silu_mul(intermediate: int, block: int | None = None) -> SiluMulLauncher:
    """Compile (once per ``(intermediate, block)``) the SiLU-and-mul kernel; ``block``: the
    gate / up interleave of x (module docstring; default: all gate columns, then all up)."""
    b = intermediate if block is None else int(block)

    def build() -> SiluMulLauncher:
        return SiluMulLauncher(SIGNATURE.compile(SiluMul(intermediate, b)))

    return common.cached_compile(("silu_mul", intermediate, b), build)
