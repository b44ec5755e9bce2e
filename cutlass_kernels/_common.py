"""Shared plumbing for the CuTe DSL kernels: target arch, typed pointers, the compile cache.

Import this module before ``cutlass``: on a machine without a GPU the DSL silently targets
sm_100 unless ``CUTE_DSL_ARCH`` is set, and every kernel here is for Hopper (sm_90a).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Any

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_stream, make_ptr  # noqa: E402

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


class KernelArgError(TypeError):
    """A kernel launcher got a bad argument (wrong type, misaligned pointer)."""


def gmem_ptr(dtype: str, address: int, align: int = ALIGN) -> cute.Pointer:
    """A typed global-memory pointer. Alignment is part of the compiled type: check it here."""
    if not isinstance(address, int):
        raise KernelArgError(f"expected a device address (int), got {type(address).__name__}")
    if address % align:
        raise KernelArgError(f"device address 0x{address:x} is not {align}-byte aligned")
    return make_ptr(DTYPES[dtype], address, cute.AddressSpace.gmem, assumed_align=align)


def fake_ptr(dtype: str, align: int = ALIGN) -> cute.Pointer:
    """Placeholder pointer for compiling without data (works on a CPU-only machine)."""
    return make_ptr(DTYPES[dtype], 0, cute.AddressSpace.gmem, assumed_align=align)


def fake_stream() -> Any:
    return make_fake_stream()


def addr(buf: Any) -> int:
    """Device address of a DeviceBuffer-like object (has .ptr) or an int."""
    return int(buf.ptr) if hasattr(buf, "ptr") else int(buf)


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
