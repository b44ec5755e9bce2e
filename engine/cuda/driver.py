"""Thin, checked layer over ``cuda.bindings.driver``: context, stream, events, memory, graphs.

Every driver call goes through :func:`check`, so a failure names the call. Nothing here knows
about models or kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine import envs


class CudaError(RuntimeError):
    """A CUDA driver call failed. The message names the call and the driver's error."""


class NoGpuError(CudaError):
    """No usable NVIDIA GPU / driver on this machine."""


@functools.cache
def _cu() -> Any:
    from cuda.bindings import driver

    return driver


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple ``(CUresult, *values)``; raise CudaError on failure."""
    cu = _cu()
    if isinstance(result, tuple):
        err, *vals = result
    else:
        err, vals = result, []
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        _, desc = cu.cuGetErrorString(err)
        n = name.decode() if isinstance(name, bytes) else str(name)
        d = desc.decode() if isinstance(desc, bytes) else str(desc)
        raise CudaError(f"{call} failed: {n} ({d})")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else tuple(vals)


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """Why no GPU is usable here (for test skips and errors), or None when a Hopper GPU is."""
    try:
        cu = _cu()
        check(cu.cuInit(0), "cuInit")
        n = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if n < 1:
            return "no CUDA device found"
        major = check(cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0),
            "cuDeviceGetAttribute")
        if major != 9:
            return f"GPU compute capability {major}.x; cuteinfer's kernels target sm_90a (Hopper)"
        return None
    except Exception as e:  # driver library missing, no device, ...
        return f"no usable NVIDIA GPU ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def gpu_usable() -> bool:
    """True when a Hopper GPU is usable (what backend "auto" picks cuda by)."""
    return gpu_unavailable_reason() is None


_SCHED_FLAG = {"blocking": "BLOCKING_SYNC"}  # CUTEINFER_CUDA_SCHED -> CU_CTX_SCHED_* (else upper)


class Context:
    """The device's primary context, made current on this thread."""

    _instance: Context | None = None

    def __init__(self, device: int = 0) -> None:
        reason = gpu_unavailable_reason()
        if reason is not None:
            raise NoGpuError(reason)
        cu = _cu()
        self.device = check(cu.cuDeviceGet(device), "cuDeviceGet")
        sched = envs.cuda_sched()
        if sched != "auto":  # (before the context is made; CUTEINFER_CUDA_SCHED)
            flag = getattr(cu.CUctx_flags, f"CU_CTX_SCHED_{_SCHED_FLAG.get(sched, sched.upper())}")
            check(cu.cuDevicePrimaryCtxSetFlags(self.device, flag),
                  f"cuDevicePrimaryCtxSetFlags (CUTEINFER_CUDA_SCHED={sched})")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        name = check(cu.cuDeviceGetName(128, self.device), "cuDeviceGetName")
        self.name = name.split(b"\0")[0].decode() if isinstance(name, bytes) else str(name)
        a = cu.CUdevice_attribute
        self.num_sms = check(cu.cuDeviceGetAttribute(
            a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.device), "cuDeviceGetAttribute")

    @classmethod
    def get(cls) -> Context:
        if cls._instance is None:
            cls._instance = Context()
        else:
            check(_cu().cuCtxSetCurrent(cls._instance.ctx), "cuCtxSetCurrent")
        return cls._instance

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        return check(_cu().cuMemGetInfo(), "cuMemGetInfo")

    def synchronize(self) -> None:
        check(_cu().cuCtxSynchronize(), "cuCtxSynchronize")


class Stream:
    def __init__(self) -> None:
        cu = _cu()
        self.handle = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING),
                            "cuStreamCreate")

    def synchronize(self) -> None:
        check(_cu().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def destroy(self) -> None:
        if self.handle is not None:
            check(_cu().cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


class Event:
    def __init__(self, timing: bool = True) -> None:
        cu = _cu()
        flags = (cu.CUevent_flags.CU_EVENT_DEFAULT if timing
                 else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.handle = check(cu.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        check(_cu().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        check(_cu().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        return float(check(_cu().cuEventElapsedTime(self.handle, end.handle),
                           "cuEventElapsedTime"))

    def destroy(self) -> None:
        """Release the handle (idempotent); the event must not be in use by pending work that
        anyone still waits on."""
        if self.handle is not None:
            check(_cu().cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


def time_ms(stream: Stream, fn: Any, iters: int, warmup: int = 3) -> np.ndarray:
    """Device time of ``fn()`` (work it enqueues on ``stream``), ms per call, one sample per
    call, measured with CUDA events after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    e0, e1 = Event(), Event()
    ts = np.empty(iters)
    try:
        for i in range(iters):
            e0.record(stream)
            fn()
            e1.record(stream)
            e1.synchronize()
            ts[i] = e0.elapsed_ms(e1)
    finally:
        stream.synchronize()
        e0.destroy()
        e1.destroy()
    return ts


def graph_time_ms(stream: Stream, body: Callable[[], None], iters: int) -> float:
    """Median device time (ms) of one replay of the CUDA graph captured from ``body()`` (work it
    enqueues on ``stream``); the graph is destroyed afterwards. For tools timing kernels the way
    a decode step runs them, back to back without host launch gaps."""
    graph = Graph.capture(stream, body)
    try:
        ts = time_ms(stream, lambda: graph.launch(stream), iters)
    finally:
        graph.destroy()
    return float(np.median(ts))


class Graph:
    """One captured CUDA graph, instantiated and uploaded: ``Graph.capture(stream, body)``,
    ``launch(stream)``, ``destroy()``.

    Capture is thread-local (``CU_STREAM_CAPTURE_MODE_THREAD_LOCAL``): only this thread's calls
    are checked against the capture, so another thread's driver calls cannot invalidate it.
    ``capture_s`` is the wall time from the start of capture to the uploaded graph;
    ``mem_bytes`` the device memory that capture, instantiation and upload took (free memory
    before and after; other allocations made meanwhile count too).
    """

    def __init__(self, graph: Any, exec_: Any, capture_s: float = 0.0, mem_bytes: int = 0) -> None:
        self.graph = graph  # CUgraph (node topology: kernel names, DOT dumps)
        self.exec = exec_  # CUgraphExec (what is launched)
        self.capture_s = capture_s
        self.mem_bytes = mem_bytes

    @classmethod
    def capture(cls, stream: Stream, body: Callable[[], None]) -> Graph:
        """Record the work ``body()`` enqueues on ``stream``; instantiate and upload it. The
        capture ends even when ``body`` raises (the stream leaves capture mode, the partial graph
        is destroyed, and ``body``'s error is the one raised). ``body`` must not compile or
        allocate: warm it up first."""
        cu = _cu()
        stream.synchronize()  # free memory is read with every earlier step done
        free0, _ = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        t0 = time.perf_counter()
        # no garbage collection while capturing: a collection run here would free whatever
        # device or pinned memory unreachable objects hold (an engine dropped earlier), and a
        # cuMemFree in the capturing thread invalidates the capture
        gc_on = gc.isenabled()
        gc.disable()
        try:
            check(cu.cuStreamBeginCapture(
                stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "cuStreamBeginCapture")
            try:
                body()
            except BaseException:
                with contextlib.suppress(CudaError):  # an invalidated capture ends graphless
                    partial = check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
                    cls(partial, None).destroy()
                raise
            graph = cls(check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture"),
                        None)
        finally:
            if gc_on:
                gc.enable()
        try:
            graph.exec = check(cu.cuGraphInstantiate(graph.graph, 0), "cuGraphInstantiate")
            check(cu.cuGraphUpload(graph.exec, stream.handle), "cuGraphUpload")
            stream.synchronize()
        except BaseException:
            with contextlib.suppress(CudaError):
                graph.destroy()
            raise
        graph.capture_s = time.perf_counter() - t0
        free1, _ = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        graph.mem_bytes = max(0, free0 - free1)
        return graph

    def launch(self, stream: Stream) -> None:
        if self.exec is None:
            raise CudaError("cuGraphLaunch of a destroyed (or never instantiated) graph")
        check(_cu().cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")

    def destroy(self) -> None:
        """Free the executable graph and the graph; a second call does nothing."""
        cu = _cu()
        exec_, self.exec = self.exec, None
        graph, self.graph = self.graph, None
        if exec_ is not None:
            check(cu.cuGraphExecDestroy(exec_), "cuGraphExecDestroy")
        if graph is not None:
            check(cu.cuGraphDestroy(graph), "cuGraphDestroy")

    def kernel_names(self) -> list[str]:
        """Kernel name of every kernel node (in node order)."""
        cu = _cu()
        _, n = check(cu.cuGraphGetNodes(self.graph, 0), "cuGraphGetNodes")
        nodes, _ = check(cu.cuGraphGetNodes(self.graph, n), "cuGraphGetNodes")
        names = []
        for node in nodes:
            if check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType") != \
                    cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                continue
            params = check(cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            try:
                name = check(cu.cuFuncGetName(params.func), "cuFuncGetName")
                names.append(name.decode() if isinstance(name, bytes) else str(name))
            except Exception:  # older drivers: no cuFuncGetName
                names.append("kernel")
        return names

    def write_dot(self, path: str) -> None:
        """The graph's structure as a Graphviz DOT file (kernel names, node types)."""
        check(_cu().cuGraphDebugDotPrint(self.graph, str(path).encode(), 0),
              "cuGraphDebugDotPrint")


_NP_OF = {"bf16": None, "f32": np.float32, "i32": np.int32, "i64": np.int64, "u32": np.uint32,
          "u64": np.uint64, "f16": np.float16, "u8": np.uint8}


class DeviceBuffer:
    """A view of device memory: an address, a byte size, and (optionally) a numpy dtype+shape."""

    def __init__(self, ptr: int, nbytes: int, dtype: Any = None,
                 shape: tuple[int, ...] | None = None, owner: Any = None) -> None:
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self.dtype = np.dtype(dtype) if dtype is not None else None
        self.shape = shape
        self._owner = owner  # keeps the backing allocation alive

    def __repr__(self) -> str:
        return f"DeviceBuffer(0x{self.ptr:x}, {self.nbytes} B, {self.dtype}, {self.shape})"

    def upload(self, host: np.ndarray, stream: Stream | None = None) -> None:
        host = np.ascontiguousarray(host)
        if host.nbytes > self.nbytes:
            raise CudaError(f"upload of {host.nbytes} B into a {self.nbytes} B buffer")
        cu = _cu()
        if stream is None:
            check(cu.cuMemcpyHtoD(self.ptr, host.ctypes.data, host.nbytes), "cuMemcpyHtoD")
        else:
            check(cu.cuMemcpyHtoDAsync(self.ptr, host.ctypes.data, host.nbytes, stream.handle),
                  "cuMemcpyHtoDAsync")

    def download(self, out: np.ndarray | None = None, stream: Stream | None = None) -> np.ndarray:
        if out is None:
            assert self.dtype is not None and self.shape is not None
            out = np.empty(self.shape, self.dtype)
        if out.nbytes > self.nbytes:
            raise CudaError(f"download of {out.nbytes} B from a {self.nbytes} B buffer")
        cu = _cu()
        if stream is None:
            check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes), "cuMemcpyDtoH")
        else:
            check(cu.cuMemcpyDtoHAsync(out.ctypes.data, self.ptr, out.nbytes, stream.handle),
                  "cuMemcpyDtoHAsync")
        return out

    def upload_rows(self, host: np.ndarray, row_pitch_bytes: int, stream: Stream) -> None:
        """Copy a 2-D host array into the first columns of a wider row-major device array
        (one pitched copy: only the bytes that matter cross PCIe)."""
        host = np.ascontiguousarray(host)
        rows, width = host.shape[0], host.shape[1] * host.itemsize
        if rows == 0 or width == 0:
            return
        if width > row_pitch_bytes or rows * row_pitch_bytes > self.nbytes:
            raise CudaError(f"upload_rows of {rows}x{width} B into pitch {row_pitch_bytes} B, "
                            f"{self.nbytes} B buffer")
        cu = _cu()
        p = cu.CUDA_MEMCPY2D()
        p.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_HOST
        p.srcHost = host.ctypes.data
        p.srcPitch = width
        p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.dstDevice = self.ptr
        p.dstPitch = row_pitch_bytes
        p.WidthInBytes = width
        p.Height = rows
        check(cu.cuMemcpy2DAsync(p, stream.handle), "cuMemcpy2DAsync")

    def fill_bytes(self, value: int, stream: Stream | None = None) -> None:
        cu = _cu()
        if stream is None:
            check(cu.cuMemsetD8(self.ptr, value & 0xFF, self.nbytes), "cuMemsetD8")
        else:
            check(cu.cuMemsetD8Async(self.ptr, value & 0xFF, self.nbytes, stream.handle),
                  "cuMemsetD8Async")

    def copy_from(self, src: DeviceBuffer, nbytes: int | None = None,
                  stream: Stream | None = None) -> None:
        n = src.nbytes if nbytes is None else nbytes
        cu = _cu()
        if stream is None:
            check(cu.cuMemcpyDtoD(self.ptr, src.ptr, n), "cuMemcpyDtoD")
        else:
            check(cu.cuMemcpyDtoDAsync(self.ptr, src.ptr, n, stream.handle), "cuMemcpyDtoDAsync")


    def copy_rows_from(self, src: DeviceBuffer, rows: int, width: int, src_pitch: int,
                       dst_pitch: int, stream: Stream, dst_offset: int = 0,
                       src_offset: int = 0) -> None:
        """Device-to-device pitched copy: ``rows`` rows of ``width`` bytes from ``src`` (row
        pitch ``src_pitch``) into this buffer at ``dst_offset`` (row pitch ``dst_pitch``). One
        memcpy node under graph capture."""
        if rows <= 0 or width <= 0:
            return
        if (width > min(src_pitch, dst_pitch)
                or dst_offset + (rows - 1) * dst_pitch + width > self.nbytes
                or src_offset + (rows - 1) * src_pitch + width > src.nbytes):
            raise CudaError(f"copy_rows_from of {rows}x{width} B (pitches {src_pitch} -> "
                            f"{dst_pitch}, offsets {src_offset} -> {dst_offset}) outside a "
                            f"{src.nbytes} B -> {self.nbytes} B buffer")
        cu = _cu()
        p = cu.CUDA_MEMCPY2D()
        p.srcMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.srcDevice = src.ptr + src_offset
        p.srcPitch = src_pitch
        p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
        p.dstDevice = self.ptr + dst_offset
        p.dstPitch = dst_pitch
        p.WidthInBytes = width
        p.Height = rows
        check(cu.cuMemcpy2DAsync(p, stream.handle), "cuMemcpy2DAsync")

    def view(self, offset: int, nbytes: int | None = None) -> DeviceBuffer:
        """The bytes ``[offset, offset + nbytes)`` of this buffer (default: to its end)."""
        n = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise CudaError(f"view [{offset}, {offset + n}) outside a {self.nbytes} B buffer")
        return DeviceBuffer(self.ptr + offset, n, owner=self)


class Allocation:
    """One cuMemAlloc, freed when closed (or at exit)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self.ptr = int(check(_cu().cuMemAlloc(max(self.nbytes, 1)), f"cuMemAlloc({nbytes} B)"))

    def close(self) -> None:
        if self.ptr:
            check(_cu().cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0

    def __del__(self) -> None:  # buffers of tests and tools come and go
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a context already gone
            pass


def device_array(shape: tuple[int, ...] | int, dtype: Any) -> DeviceBuffer:
    """A standalone device allocation shaped like a numpy array (tests and tools)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    a = Allocation(nbytes)
    return DeviceBuffer(a.ptr, nbytes, dt, shape, owner=a)


def to_device(host: np.ndarray) -> DeviceBuffer:
    buf = device_array(host.shape, host.dtype)
    buf.upload(host)
    return buf


class Arena:
    """A bump allocator over one device allocation made at start-up.

    Weights, KV pages, activations and graph buffers all come from here, so the memory the
    engine uses is decided once and never grows at run time.
    """

    ALIGN = 256

    def __init__(self, nbytes: int) -> None:
        self._alloc = Allocation(nbytes)
        self.base = self._alloc.ptr
        self.capacity = self._alloc.nbytes
        self.used = 0

    def alloc(self, shape: tuple[int, ...] | int, dtype: Any, name: str = "") -> DeviceBuffer:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        off = (self.used + self.ALIGN - 1) // self.ALIGN * self.ALIGN
        if off + nbytes > self.capacity:
            raise CudaError(f"arena out of memory allocating {name or 'buffer'} "
                            f"({nbytes} B; {self.capacity - off} B left of {self.capacity})")
        self.used = off + nbytes
        return DeviceBuffer(self.base + off, nbytes, dt, shape, owner=self)

    def close(self) -> None:
        self._alloc.close()


class PinnedBuffer:
    """Page-locked host memory exposed as a numpy array (fast, async uploads)."""

    def __init__(self, shape: tuple[int, ...] | int, dtype: Any) -> None:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = np.dtype(dtype)
        nbytes = max(int(np.prod(shape, dtype=np.int64)) * dt.itemsize, 1)
        self.ptr = int(check(_cu().cuMemAllocHost(nbytes), "cuMemAllocHost"))
        raw = (ctypes.c_byte * nbytes).from_address(self.ptr)
        self.array = np.frombuffer(raw, dtype=dt, count=int(np.prod(shape))).reshape(shape)

    def close(self) -> None:
        if self.ptr:
            check(_cu().cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0


_HOST_REGISTERED: dict[int, int] = {}  # this process's cuMemHostRegister ranges: base -> bytes


def register_host(base: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` of host memory at ``base`` that CUDA did not allocate (a shared
    memory mapping) and map it for the device (``cuMemHostRegister``); returns the device
    address of ``base``. A range this process registered before that overlaps it is
    unregistered first: two live mappings cannot overlap, so its memory was unmapped without
    being unregistered (an engine dropped without ``shutdown``) and the new mapping reuses its
    addresses, where registering again would fail (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``).
    """
    cu = _cu()
    for b, n in list(_HOST_REGISTERED.items()):
        if b < base + nbytes and base < b + n:
            unregister_host(b)
    check(cu.cuMemHostRegister(base, nbytes, cu.CU_MEMHOSTREGISTER_DEVICEMAP
                               | cu.CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister")
    _HOST_REGISTERED[base] = nbytes
    return int(check(cu.cuMemHostGetDevicePointer(base, 0), "cuMemHostGetDevicePointer"))


def unregister_host(base: int) -> None:
    """Undo ``register_host`` (nothing if ``base`` is not registered). The memory may be
    unmapped already: the driver's answer is not checked."""
    if _HOST_REGISTERED.pop(base, None) is not None:
        _cu().cuMemHostUnregister(base)
