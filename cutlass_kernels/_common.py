"""Shared plumbing for the CuTe DSL kernels: target arch, typed pointers, launch signatures,
the compile cache (in memory here; on disk in _cache.py).

Import this module before ``cutlass``: on a machine without a GPU the DSL silently targets
sm_100 unless ``CUTE_DSL_ARCH`` is set, and every kernel here is for Hopper (sm_90a).

A kernel declares its launch contract once, as a ``Signature``: the parameters of its
``@cute.jit`` host function in order (checked against it at compile time), each pointer with its
dtype, the alignment it is compiled and called with (part of the compiled type), and the shape it
touches. ``Signature.compile(op)`` builds the placeholder arguments ``cute.compile`` needs; the
``Kernel`` it returns takes device buffers (``.ptr``, optionally ``.nbytes``) or addresses, Python
numbers and a stream (a ``CUstream`` or an object with ``.handle``), checks each pointer (a
buffer, aligned, big enough for its shape when its size is known) and calls the compiled code.
Compiled functions do not type-check their arguments: this is the one typed path into them.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_stream, make_ptr  # noqa: E402

from cutlass_kernels._cache import load_or_compile  # noqa: E402

ALIGN = 16  # bytes; every pointer is compiled and passed with this alignment

DTYPES = {
    "bf16": cutlass.BFloat16,
    "f16": cutlass.Float16,
    "f32": cutlass.Float32,
    "i32": cutlass.Int32,
    "i64": cutlass.Int64,
    "u32": cutlass.Uint32,
    "u64": cutlass.Uint64,
    "u8": cutlass.Uint8,
}
SIZES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "u32": 4, "u64": 8, "u8": 1}


class KernelArgError(TypeError):
    """A kernel launcher got a bad argument (wrong type, misaligned pointer)."""


def gmem_ptr(dtype: str, address: int, align: int = ALIGN, name: str = "") -> cute.Pointer:
    """A typed global-memory pointer. Alignment is part of the compiled type: check it here."""
    where = f"{name}: " if name else ""
    if not isinstance(address, int):
        raise KernelArgError(
            f"{where}expected a device address (int), got {type(address).__name__}")
    if address % align:
        raise KernelArgError(f"{where}device address 0x{address:x} is not {align}-byte aligned")
    return make_ptr(DTYPES[dtype], address, cute.AddressSpace.gmem, assumed_align=align)


def fake_ptr(dtype: str, align: int = ALIGN) -> cute.Pointer:
    """Placeholder pointer for compiling without data (works on a CPU-only machine)."""
    return make_ptr(DTYPES[dtype], 0, cute.AddressSpace.gmem, assumed_align=align)


def fake_stream() -> Any:
    return make_fake_stream()


def addr(buf: Any) -> int:
    """Device address of a DeviceBuffer-like object (has .ptr) or an int."""
    return int(buf.ptr) if hasattr(buf, "ptr") else int(buf)


def stream_handle(stream: Any) -> Any:
    """The ``CUstream`` of a stream object (engine.cuda.driver.Stream has ``.handle``)."""
    return getattr(stream, "handle", stream)


# ---------------------------------------------------------------------------------------------
# Launch signatures

Dim = str | int  # a scalar parameter's name, an attribute of the kernel object, or a number


@dataclass(frozen=True)
class Ptr:
    """A pointer parameter. ``shape``: what the kernel touches, as dims whose product (times the
    element size) a buffer of known ``.nbytes`` must hold; None: not checked here."""

    name: str
    dtype: str
    align: int = ALIGN
    shape: tuple[Dim, ...] | None = None


@dataclass(frozen=True)
class Scalar:
    """A dynamic scalar parameter (``cutlass.Int32`` / ``Float32``); ``fake``: compiled with."""

    name: str
    type: type
    fake: int | float = 1


class Unused:
    """Fills a pointer slot this launch never touches (dead under a compile-time flag or a
    runtime count): any buffer of the declared alignment will do; its size is not checked."""

    __slots__ = ("buf",)

    def __init__(self, buf: Any) -> None:
        self.buf = buf


class Signature:
    """The parameters of a kernel's ``@cute.jit`` host function, in order; the stream follows
    them, always last, and is not declared."""

    def __init__(self, *params: Ptr | Scalar) -> None:
        self.params = params

    def fake_args(self) -> list[Any]:
        """Placeholders to compile with: null pointers, typed scalars, a fake stream."""
        return [fake_ptr(p.dtype, p.align) if isinstance(p, Ptr) else p.type(p.fake)
                for p in self.params] + [fake_stream()]

    def compile(self, op: Any) -> Kernel:
        """``cute.compile`` the kernel object ``op`` (its ``__call__`` is the ``@cute.jit`` host
        function this signature declares), or load it from the disk cache (_cache.py), and
        wrap it."""
        names = list(inspect.signature(type(op).__call__).parameters)[1:]
        want = [p.name for p in self.params] + ["stream"]
        if names != want:
            raise TypeError(f"{type(op).__name__}.__call__ takes {names}; its Signature "
                            f"declares {want}")
        compiled = load_or_compile(op, self.params,
                                   lambda: cute.compile(op, *self.fake_args()))
        return Kernel(self, op, compiled)


class Kernel:
    """A compiled kernel behind its signature: ``kernel(*args, stream)``, the declared
    parameters in order: buffers / addresses / ``Unused`` for pointers, Python numbers for
    scalars. Pointer objects are kept by address (building one costs ~3-10 us, and the engine
    passes the same static buffers every step); sizes are checked on every call."""

    def __init__(self, sig: Signature, op: Any, compiled: Any) -> None:
        self.signature, self.op, self.compiled = sig, op, compiled
        self._nargs = len(sig.params) + 1
        index = {p.name: i for i, p in enumerate(sig.params) if isinstance(p, Scalar)}
        # per pointer: (position, Ptr, bytes per unit of the runtime dims or None (unchecked),
        # the runtime dims' positions, its pointer objects by address)
        self._ptrs: list[tuple[int, Ptr, int | None, tuple[int, ...], dict]] = []
        for i, p in enumerate(sig.params):
            if not isinstance(p, Ptr):
                continue
            const, dims = None, []
            if p.shape is not None:
                const = SIZES[p.dtype]
                for d in p.shape:
                    if isinstance(d, str) and d in index:
                        dims.append(index[d])
                    else:  # a compile-time dim: an attribute of the kernel object, or a number
                        const *= int(getattr(op, d) if isinstance(d, str) else d)
            self._ptrs.append((i, p, const, tuple(dims), {}))
        self._scalars = [(i, p.type) for i, p in enumerate(sig.params) if isinstance(p, Scalar)]

    def __call__(self, *args: Any) -> None:
        if len(args) != self._nargs:
            raise KernelArgError(f"expected {self._nargs - 1} arguments and a stream, "
                                 f"got {len(args)}")
        out = list(args)
        for i, p, const, dims, cache in self._ptrs:
            buf = args[i]
            if buf.__class__ is Unused:
                buf = buf.buf
            elif const is not None:
                nbytes = getattr(buf, "nbytes", None)
                if nbytes is not None:
                    need = const
                    for j in dims:
                        need *= args[j]
                    if nbytes < need:
                        raise KernelArgError(
                            f"{p.name}: buffer of {nbytes} B, kernel touches {need} B")
            address = buf.ptr if hasattr(buf, "ptr") else buf
            ptr = cache.get(address)
            if ptr is None:  # checked once per address: a bad one never enters the cache
                if buf is None:
                    raise KernelArgError(f"{p.name}: no buffer given (None)")
                if len(cache) >= 1024:
                    cache.clear()
                ptr = cache[address] = gmem_ptr(p.dtype, int(address), p.align, p.name)
            out[i] = ptr
        for i, kind in self._scalars:
            out[i] = kind(args[i])
        out[-1] = stream_handle(out[-1])
        self.compiled(*out)


_cache: dict[Hashable, Any] = {}
_lock = threading.Lock()


def cached_compile(key: Hashable, build: Callable[[], Any]) -> Any:
    """Compile once per key. The key holds exactly what changes the generated code."""
    with _lock:
        hit = _cache.get(key)
        if hit is None:
            hit = build()
            _cache[key] = hit
        return hit


def compile_cache_size() -> int:
    return len(_cache)
