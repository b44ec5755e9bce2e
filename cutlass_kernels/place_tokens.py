"""Token placement: ``ids[t] = tokens[src[t]]`` for every t in [0, T) with ``src[t] >= 0``.

A speculative step's drafts come from the DFlash drafter's sampler on the device
(engine/executor/cuda_dflash.py): this kernel copies them over their span's placeholder rows of
the step's input ids, inside the step's graph, so nothing waits on the host between draft and
verify. ``src[t] < 0`` keeps ``ids[t]`` (the step's own token: a pending token, a plain decode
row, padding); ``src[t] >= num_tokens`` (out of ``tokens``) also keeps it, never reads out of
bounds.

int32 everywhere; ``T`` and ``num_tokens`` are runtime. Grid ``(ceil(T / 128), 1, 1)``, 128
threads, a thread per row. No programmatic dependent launch: it reads what the kernel before it
wrote.
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Int32

from cutlass_kernels._common import Ptr, Scalar, Signature

THREADS = 128


class PlaceTokens:
    """``ids[t] = tokens[src[t]]`` where ``0 <= src[t] < num_tokens``, for t < T."""

    @cute.jit
    def __call__(self, src: cute.Pointer, tokens: cute.Pointer, ids: cute.Pointer,
                 num_tokens: Int32, num_rows: Int32, stream: cuda.CUstream):
        mSrc = cute.make_tensor(src, cute.make_layout(num_rows))
        mTok = cute.make_tensor(tokens, cute.make_layout(num_tokens))
        mIds = cute.make_tensor(ids, cute.make_layout(num_rows))
        self.kernel(mSrc, mTok, mIds, num_tokens, num_rows).launch(
            grid=[(num_rows + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1],
            stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mTok: cute.Tensor, mIds: cute.Tensor, num_tokens: Int32,
               num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * THREADS + tidx
        if t < num_rows:
            s = mSrc[t]
            if s >= 0 and s < num_tokens:
                mIds[t] = mTok[s]


# ---------------------------------------------------------------------------------------------
# Host side


def signature() -> Signature:
    return Signature(Ptr("src", "i32", 4, ("num_rows",)), Ptr("tokens", "i32", 4, ("num_tokens",)),
                     Ptr("ids", "i32", 4, ("num_rows",)), Scalar("num_tokens", Int32),
                     Scalar("num_rows", Int32))


class PlaceTokensLauncher:
    """``launcher(src, tokens, ids, num_tokens, num_rows, stream)``: src / ids i32[num_rows],
    tokens i32[num_tokens], 4-byte aligned. ``num_rows == 0`` launches nothing."""

    def __init__(self, kernel: common.Kernel) -> None:
        self.kernel = kernel

    def __call__(self, src: Any, tokens: Any, ids: Any, num_tokens: int, num_rows: int,
                 stream: Any) -> None:
        num_tokens, num_rows = int(num_tokens), int(num_rows)
        if num_rows <= 0:
            return
        if num_tokens <= 0:
            raise common.KernelArgError(f"num_tokens={num_tokens}: no tokens to place from")
        self.kernel(src, tokens, ids, num_tokens, num_rows, stream)


def compile_place_tokens() -> PlaceTokensLauncher:
    """Compile (once) the token placement."""

    def build() -> PlaceTokensLauncher:
        return PlaceTokensLauncher(signature().compile(PlaceTokens()))

    return common.cached_compile(("place_tokens",), build)
