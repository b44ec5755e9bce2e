"""Read-only streaming: the 32-bit wrapping sum of a large buffer, for the true read ceiling.

The decode floor divides the bytes a step reads by 4.28 TB/s, the device-to-device copy rate,
which counts a read and a write per byte; a step only reads. This kernel only reads (one
4-byte word per CTA is written), so its rate is the ceiling a decode step's weight stream can
reach (tools/bench_read.py measures it; issue 15).

``out[c] = sum of the words CTA c read (mod 2^32)``; the host adds the ``num_ctas`` partial sums
(mod 2^32) and checks them against numpy's ``src.sum(dtype=uint32)``: the result is exact, so a
word skipped or read twice shows.

Layout: ``src`` uint32 ``[num_vec, 4]`` (16-byte vectors, 16-byte aligned), ``out`` uint32
``[num_ctas]``. ``num_vec`` < 2^29 (offsets are 32-bit words: 8 GiB). Grid ``(num_ctas, 1, 1)``,
block ``threads``: vector ``i`` is read by thread ``i mod (num_ctas x threads)`` of the grid
(grid-stride, coalesced 128-bit loads, ``unroll`` loads in flight per thread).
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Int32, Uint32

from cutlass_kernels._common import Ptr, Scalar, Signature
from cutlass_kernels._reduce import add, block_reduce

VEC = 4  # uint32 words per 16-byte vector
MAX_VEC = 1 << 29


class ReadStream:
    def __init__(self, threads: int = 512, unroll: int = 4) -> None:
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"threads={threads} must be a multiple of 32 in [32, 1024]")
        if unroll < 1:
            raise ValueError(f"unroll={unroll} must be >= 1")
        self.threads, self.unroll, self.nwarps = threads, unroll, threads // 32

    @cute.jit
    def __call__(self, src: cute.Pointer, out: cute.Pointer, num_vec: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):
        mS = cute.make_tensor(src, cute.make_layout((num_vec, VEC), stride=(VEC, 1)))
        mO = cute.make_tensor(out, cute.make_layout(num_ctas))
        self.kernel(mS, mO, num_vec, num_ctas).launch(
            grid=[num_ctas, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mS: cute.Tensor, mO: cute.Tensor, num_vec: Int32, num_ctas: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sSum = smem.allocate_tensor(Uint32, cute.make_layout(self.nwarps), byte_alignment=16)
        acc = cute.make_rmem_tensor(cute.make_layout(VEC), Uint32)
        acc.fill(0)
        stride = num_ctas * self.threads
        for i in cutlass.range(cta * self.threads + tidx, num_vec, stride, unroll=self.unroll):
            acc.store(acc.load() + mS[i, None].load())
        mine = acc.load().reduce(cute.ReductionOp.ADD, Uint32(0), 0)
        (total,) = block_reduce((mine,), add, (sSum,), self.nwarps, reuse_smem=False)
        if tidx == 0:
            mO[cta] = total


# ---------------------------------------------------------------------------------------------
# Host side

SIGNATURE = Signature(Ptr("src", "u32", 16, ("num_vec", VEC)), Ptr("out", "u32", 4, ("num_ctas",)),
                      Scalar("num_vec", Int32), Scalar("num_ctas", Int32))


class ReadStreamLauncher:
    """``launcher(src, out, num_vec, num_ctas, stream)``: src uint32[num_vec, 4] ->
    out uint32[num_ctas] partial sums (module docstring)."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel = kernel

    def __call__(self, src: Any, out: Any, num_vec: int, num_ctas: int, stream: Any) -> None:
        n, c = int(num_vec), int(num_ctas)
        if not 0 <= n < MAX_VEC:
            raise common.KernelArgError(f"num_vec={n} must be in [0, {MAX_VEC})")
        if c < 1:
            raise common.KernelArgError(f"num_ctas={c} must be >= 1")
        self.kernel(src, out, n, c, stream)


def compile_read_stream(threads: int = 512, unroll: int = 4) -> ReadStreamLauncher:
    """Compile (once per ``(threads, unroll)``) the read-only streaming kernel."""

    def build() -> ReadStreamLauncher:
        return ReadStreamLauncher(SIGNATURE.compile(ReadStream(threads, unroll)))

    return common.cached_compile(("read_stream", threads, unroll), build)
