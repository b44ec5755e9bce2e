"""Host arrays to device addresses at the speed of the bus: pinned staging, several threads.

``DeviceWeights`` queues one ``copy(dst, array)`` per weight (or per part of a fused weight: the
q, k and v rows go straight to their offsets in the QKV buffer, no concatenation on the host),
then ``run()`` moves them all. Each worker thread has its own CUDA stream and two pinned staging
buffers: it fills one while the DMA engine drains the other. A chunk of a memory-mapped
checkpoint tensor is read from its file with ``os.preadv`` (the kernel copies from the page
cache; touching the mapping instead costs a page fault per 4 KiB, ~2 s for 16 GB); any other
array (converted or padded on the host) is copied in with numpy. Reads, copies and the driver
calls release the GIL, so the threads overlap.

Before, every weight was uploaded from the mapping with a synchronize after it: 16.4 GB of
qwen3-8b took ~7 s (2.3 GB/s) on the H200 host (docs/perf.md v11).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.cuda.driver import (
    Context,
    DeviceBuffer,
    Event,
    PinnedBuffer,
    Stream,
    _cu,
    check,
)

CHUNK_BYTES = 16 << 20
WORKERS = 6
HOST_PENDING_LIMIT = 1 << 30  # host temporaries held for the queue: run it past this


@dataclass
class _Piece:
    dst: int  # device address
    src: np.ndarray  # 1-D uint8 view of the bytes to copy (kept alive until copied)
    path: str | None  # the file it maps, when it is a view of a np.memmap
    offset: int  # file offset of src[0]


def file_range(a: np.ndarray) -> tuple[str, int] | None:
    """(file, offset) of a C-contiguous view of a ``np.memmap``, else None."""
    if not a.flags.c_contiguous:
        return None
    top = a
    while isinstance(top.base, np.ndarray):
        top = top.base
    if not isinstance(top, np.memmap) or top.filename is None:
        return None
    return str(top.filename), a.ctypes.data - top.ctypes.data + int(top.offset)


class WeightUploader:
    def __init__(self, ctx: Context, workers: int = WORKERS, chunk: int = CHUNK_BYTES,
                 on_bytes: Callable[[int], None] = lambda n: None) -> None:
        self.ctx, self.workers, self.chunk, self.on_bytes = ctx, workers, chunk, on_bytes
        self._pieces: list[_Piece] = []
        self._host_pending = 0
        self.bytes = 0

    def copy(self, buf: DeviceBuffer, offset: int, a: np.ndarray) -> None:
        """Queue ``a``'s bytes (C order) for ``buf`` at byte ``offset``."""
        dst = buf.ptr + offset
        where = file_range(a)
        if where is None:
            a = np.ascontiguousarray(a)
            self._host_pending += a.nbytes
        flat = a.reshape(-1).view(np.uint8)
        for lo in range(0, flat.size, self.chunk):
            part = flat[lo:lo + self.chunk]
            self._pieces.append(_Piece(dst + lo, part, None if where is None else where[0],
                                       0 if where is None else where[1] + lo))
        if self._host_pending > HOST_PENDING_LIMIT:
            self.run()

    def run(self) -> None:
        """Copy everything queued; returns when it is on the device."""
        pieces, self._pieces, self._host_pending = self._pieces, [], 0
        if not pieces:
            return
        work: queue.SimpleQueue[_Piece | None] = queue.SimpleQueue()
        for p in pieces:
            work.put(p)
        n = max(1, min(self.workers, len(pieces)))
        for _ in range(n):
            work.put(None)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._worker, args=(work, errors),
                                    name=f"cuteinfer-upload-{i}", daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.bytes += sum(p.src.nbytes for p in pieces)

    def _worker(self, work: queue.SimpleQueue[_Piece | None], errors: list[BaseException]
                ) -> None:
        cu = _cu()
        stream = None
        bufs: list[PinnedBuffer] = []
        done: list[Event] = []
        fds: dict[str, int] = {}
        try:
            check(cu.cuCtxSetCurrent(self.ctx.ctx), "cuCtxSetCurrent")
            stream = Stream()
            bufs = [PinnedBuffer(self.chunk, np.uint8) for _ in range(2)]
            done = [Event(timing=False) for _ in bufs]
            used = [False, False]
            i = 0
            while (p := work.get()) is not None:
                if errors:
                    continue  # drain: another worker failed
                k = i % 2
                if used[k]:
                    done[k].synchronize()  # its previous DMA has finished
                n = p.src.nbytes
                host = bufs[k].array[:n]
                if p.path is None:
                    np.copyto(host, p.src)
                else:
                    fd = fds.get(p.path)
                    if fd is None:
                        fd = fds[p.path] = os.open(p.path, os.O_RDONLY)
                    _read_exactly(fd, memoryview(host), p.offset, p.path)
                check(cu.cuMemcpyHtoDAsync(p.dst, bufs[k].ptr, n, stream.handle),
                      "cuMemcpyHtoDAsync")
                done[k].record(stream)
                used[k] = True
                i += 1
                self.on_bytes(n)
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 -- raised by run()
            errors.append(e)
        finally:
            if stream is not None:
                try:
                    stream.synchronize()
                    stream.destroy()
                except Exception:  # noqa: BLE001 -- the first error is the one reported
                    pass
            for b in bufs:
                b.close()
            for e in done:
                e.destroy()
            for fd in fds.values():
                os.close(fd)


class SerialUploader:
    """The plain way, one buffer at a time: the parts of each buffer stacked on the host and
    uploaded with ``DeviceBuffer.upload`` (one synchronize each). For buffers that are not
    device memory (the memory-plan tests' fakes) and as the reference for ``WeightUploader``."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._parts: dict[int, tuple[DeviceBuffer, list[np.ndarray]]] = {}

    def copy(self, buf: DeviceBuffer, offset: int, a: np.ndarray) -> None:
        entry = self._parts.setdefault(id(buf), (buf, []))
        assert offset == sum(x.nbytes for x in entry[1]), "parts arrive in order"
        entry[1].append(a)

    def run(self) -> None:
        parts, self._parts = self._parts, {}
        for buf, arrays in parts.values():
            a = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            buf.upload(a.reshape(buf.shape) if getattr(buf, "shape", None) else a, self.stream)
            self.stream.synchronize()  # the host array may be a temporary


def _read_exactly(fd: int, out: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n <= 0:
            raise OSError(f"{path}: file ended at byte {offset + got} while reading weights")
        got += n
