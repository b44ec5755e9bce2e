"""Row gather: ``out[t, :] = table[ids[t], :]`` for t in [0, T).

Used for the token embedding (``table`` = embedding matrix ``[V, H]``) and, with the same kernel,
to gather the hidden rows that are sampled (``table`` = hidden states ``[T_all, H]``, ``ids`` =
``sample_token_idx``).

Constraints: the row width ``H`` is compile-time and a whole number of 16-byte vectors
(H % 8 == 0 for bf16, H % 4 == 0 for f32); ``num_rows`` (rows of ``table``) and ``T`` are runtime.
An id outside ``[0, num_rows)`` writes a row of zeros instead of reading out of bounds.
Offsets are 32-bit: ``num_rows * H`` must stay below 2^31 elements (151936 x 8192 fits).

``EmbeddingFromSamples`` (the forward's token embedding): a row's id may instead come from the
previous step's samples on the device, ``ids[t] = samples[src[t]]`` for every t with
``0 <= src[t] < num_src`` (written back to ``ids[t]`` too); ``src[t] < 0`` keeps ``ids[t]``. An
asynchronous decode step's input tokens are its previous step's samples: gathered here, inside the
step's graph, they need no device copy between the steps (one ~10 us copy a step, docs/perf.md
v28), and the host never waits for them.

Layout: row-major, contiguous (row stride = H), every row 16-byte aligned.
Grid ``(T, 1, 1)``: one CTA per output row; block ``min(256, ceil32(H / VEC))`` threads, thread
``i`` copies the 16-byte vectors ``i, i + block, ...`` of the row (128-bit loads and stores).
"""

import cutlass_kernels._common as common  # noqa: I001  (sets CUTE_DSL_ARCH before cutlass)
from typing import Any

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Int32

from cutlass_kernels._common import Ptr, Scalar, Signature

_DTYPES = {"bf16": (cutlass.BFloat16, 2), "f32": (cutlass.Float32, 4)}


class Embedding:
    """Gather ``T`` rows of width ``hidden`` (compile-time) from a ``[num_rows, hidden]`` table."""

    def __init__(self, hidden: int, dtype: str = "bf16") -> None:
        elem, size = _DTYPES[dtype]
        self.dtype = elem
        self.vec = 16 // size  # elements per 128-bit vector
        if hidden % self.vec:
            raise ValueError(f"hidden={hidden} must be a multiple of {self.vec} for {dtype}")
        self.hidden = hidden
        self.nvec = hidden // self.vec
        self.threads = min(256, (self.nvec + 31) // 32 * 32)
        self.iters = (self.nvec + self.threads - 1) // self.threads

    @cute.jit
    def __call__(self, ids: cute.Pointer, table: cute.Pointer, out: cute.Pointer,
                 num_rows: Int32, num_tokens: Int32, stream: cuda.CUstream):
        row = cute.make_layout((num_rows, self.nvec, self.vec), stride=(self.hidden, self.vec, 1))
        mIds = cute.make_tensor(ids, cute.make_layout(num_tokens))
        mTable = cute.make_tensor(table, row)
        mOut = cute.make_tensor(out, cute.make_layout((num_tokens, self.nvec, self.vec),
                                                      stride=(self.hidden, self.vec, 1)))
        self.kernel(mIds, mTable, mOut, num_rows).launch(
            grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mIds: cute.Tensor, mTable: cute.Tensor, mOut: cute.Tensor, num_rows: Int32):
        cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        src = mIds[t]
        valid = (src >= 0) & (src < num_rows)
        src = src if valid else 0
        for i in cutlass.range_constexpr(self.iters):
            c = tidx + i * self.threads
            if c < self.nvec:
                v = mTable[src, c, None].load()
                if valid:
                    mOut[t, c, None].store(v)
                else:
                    mOut[t, c, None].store(cute.zeros_like(v))


class EmbeddingFromSamples(Embedding):
    """``Embedding`` whose row ids may come from ``samples`` (indices ``src``, -1: ``ids``)."""

    @cute.jit
    def __call__(self, ids: cute.Pointer, src: cute.Pointer, samples: cute.Pointer,
                 table: cute.Pointer, out: cute.Pointer, num_rows: Int32, num_src: Int32,
                 num_tokens: Int32, stream: cuda.CUstream):
        row = cute.make_layout((num_rows, self.nvec, self.vec), stride=(self.hidden, self.vec, 1))
        mIds = cute.make_tensor(ids, cute.make_layout(num_tokens))
        mSrc = cute.make_tensor(src, cute.make_layout(num_tokens))
        mSmp = cute.make_tensor(samples, cute.make_layout(num_src))
        mTable = cute.make_tensor(table, row)
        mOut = cute.make_tensor(out, cute.make_layout((num_tokens, self.nvec, self.vec),
                                                      stride=(self.hidden, self.vec, 1)))
        self.kernel_from(mIds, mSrc, mSmp, mTable, mOut, num_rows, num_src).launch(
            grid=[num_tokens, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel_from(self, mIds: cute.Tensor, mSrc: cute.Tensor, mSmp: cute.Tensor,
                    mTable: cute.Tensor, mOut: cute.Tensor, num_rows: Int32, num_src: Int32):
        cute.arch.griddepcontrol_launch_dependents()  # PDL (gemm_skinny.py)
        tidx, _, _ = cute.arch.thread_idx()
        t, _, _ = cute.arch.block_idx()
        s = mSrc[t]
        take = (s >= 0) & (s < num_src)
        s = s if take else 0
        picked = mSmp[s]
        given = mIds[t]
        src = picked if take else given
        if take:
            if tidx == 0:  # (the other threads never read ids[t] once a sample replaces it)
                mIds[t] = src
        valid = (src >= 0) & (src < num_rows)
        src = src if valid else 0
        for i in cutlass.range_constexpr(self.iters):
            c = tidx + i * self.threads
            if c < self.nvec:
                v = mTable[src, c, None].load()
                if valid:
                    mOut[t, c, None].store(v)
                else:
                    mOut[t, c, None].store(cute.zeros_like(v))


# ---------------------------------------------------------------------------------------------
# Host side


def signature(dtype: str) -> Signature:
    return Signature(Ptr("ids", "i32", 4, ("num_tokens",)),
                     Ptr("table", dtype, shape=("num_rows", "hidden")),
                     Ptr("out", dtype, shape=("num_tokens", "hidden")),
                     Scalar("num_rows", Int32), Scalar("num_tokens", Int32))


def signature_from_samples(dtype: str) -> Signature:
    return Signature(Ptr("ids", "i32", 4, ("num_tokens",)), Ptr("src", "i32", 4, ("num_tokens",)),
                     Ptr("samples", "i32", 4, ("num_src",)),
                     Ptr("table", dtype, shape=("num_rows", "hidden")),
                     Ptr("out", dtype, shape=("num_tokens", "hidden")),
                     Scalar("num_rows", Int32), Scalar("num_src", Int32),
                     Scalar("num_tokens", Int32))


class EmbeddingLauncher:
    """``launcher(ids, table, out, num_rows, num_tokens, stream)``.

    ids i32[T] (4-byte aligned); table dtype[num_rows, hidden]; out dtype[T, hidden] (16-byte
    aligned); stream: a CUstream or an object with ``.handle``. T == 0 launches nothing.
    """

    def __init__(self, kernel: common.Kernel, dtype: str) -> None:
        self.kernel, self.hidden, self.dtype = kernel, kernel.op.hidden, dtype

    def __call__(self, ids: Any, table: Any, out: Any, num_rows: int, num_tokens: int,
                 stream: Any) -> None:
        num_rows, num_tokens = int(num_rows), int(num_tokens)
        if num_tokens <= 0:
            return
        if num_rows <= 0:
            raise common.KernelArgError(f"num_rows={num_rows}: the table must have rows")
        self.kernel(ids, table, out, num_rows, num_tokens, stream)


def compile_embedding(hidden: int, dtype: str = "bf16") -> EmbeddingLauncher:
    """Compile (once per ``(hidden, dtype)``) the row gather."""

    def build() -> EmbeddingLauncher:
        return EmbeddingLauncher(signature(dtype).compile(Embedding(hidden, dtype)), dtype)

    return common.cached_compile(("embedding", hidden, dtype), build)


class EmbeddingFromSamplesLauncher:
    """``launcher(ids, src, samples, table, out, num_rows, num_src, num_tokens, stream)``.

    ids / src i32[T]; samples i32[num_src] (4-byte aligned); table, out as ``EmbeddingLauncher``.
    T == 0 launches nothing."""

    def __init__(self, kernel: common.Kernel, dtype: str) -> None:
        self.kernel, self.hidden, self.dtype = kernel, kernel.op.hidden, dtype

    def __call__(self, ids: Any, src: Any, samples: Any, table: Any, out: Any, num_rows: int,
                 num_src: int, num_tokens: int, stream: Any) -> None:
        num_rows, num_src, num_tokens = int(num_rows), int(num_src), int(num_tokens)
        if num_tokens <= 0:
            return
        if num_rows <= 0:
            raise common.KernelArgError(f"num_rows={num_rows}: the table must have rows")
        if num_src <= 0:
            raise common.KernelArgError(f"num_src={num_src}: the samples must have rows")
        self.kernel(ids, src, samples, table, out, num_rows, num_src, num_tokens, stream)


def compile_embedding_from_samples(hidden: int, dtype: str = "bf16"
                                   ) -> EmbeddingFromSamplesLauncher:
    """Compile (once per ``(hidden, dtype)``) the row gather with ids from the samples."""

    def build() -> EmbeddingFromSamplesLauncher:
        return EmbeddingFromSamplesLauncher(
            signature_from_samples(dtype).compile(EmbeddingFromSamples(hidden, dtype)), dtype)

    return common.cached_compile(("embedding_from_samples", hidden, dtype), build)
