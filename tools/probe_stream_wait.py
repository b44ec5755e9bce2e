"""Probe (GPU host, cuda.bindings only; not yet run on a GPU): can a host thread gate a stream?

The design of docs/perf.md v31 item 3 gates a constrained step's grammar-mask upload on the GPU
with ``cuStreamWaitValue32`` on a pinned, device-mapped flag that the mask thread writes. This
prints one JSON line with the device's stream-mem-op attributes, the latency from the flag
write to the gated copy's completion, whether the copy waited and copied the right bytes, the
stream cost of an already-satisfied wait and whether the wait captures into a CUDA graph; then
a second line once a Python thread has set the flag while the main thread waits in
``cuEventSynchronize`` (a hang there: that call holds the GIL). Run it with a timeout:

    timeout 60 python3 tools/probe_stream_wait.py
"""
from __future__ import annotations

import ctypes
import json
import threading
import time

import numpy as np

MASK_BYTES = 16 * 4748 * 4  # 16 grammar rows of Qwen3's vocabulary, one bit per token


def main() -> None:
    from cuda.bindings import driver as d

    def ck(r):
        err, *rest = r if isinstance(r, tuple) else (r,)
        if err != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(err))
        return rest[0] if len(rest) == 1 else (rest or None)

    def host_array(ptr: int, n: int, ctype) -> np.ndarray:
        return np.ctypeslib.as_array((ctype * n).from_address(int(ptr)))

    ck(d.cuInit(0))
    dev = ck(d.cuDeviceGet(0))
    ck(d.cuCtxSetCurrent(ck(d.cuDevicePrimaryCtxRetain(dev))))
    res: dict = {"name": ck(d.cuDeviceGetName(64, dev)).decode(errors="ignore").strip("\x00")}
    for a in ("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1",
              "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR"):
        try:
            res[a] = ck(d.cuDeviceGetAttribute(getattr(d.CUdevice_attribute, a), dev))
        except Exception as e:  # noqa: BLE001 -- (reported)
            res[a] = repr(e)
    stream = ck(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
    fptr = ck(d.cuMemHostAlloc(64, d.CU_MEMHOSTALLOC_DEVICEMAP | d.CU_MEMHOSTALLOC_PORTABLE))
    fdev = ck(d.cuMemHostGetDevicePointer(fptr, 0))
    flag = host_array(fptr, 1, ctypes.c_uint32)
    flag[0] = 0
    n = MASK_BYTES
    src_p = ck(d.cuMemHostAlloc(n, 0))
    src = host_array(src_p, n, ctypes.c_uint8)
    dst = ck(d.cuMemAlloc(n))
    back = np.zeros(n, np.uint8)
    ev = ck(d.cuEventCreate(d.CUevent_flags.CU_EVENT_BLOCKING_SYNC))
    geq = d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    ready = d.CUresult.CUDA_SUCCESS

    # 1. gated copies: the stream waits until the host writes the step's sequence number
    lat, ok = [], True
    rng = np.random.default_rng(0)
    for seq in range(1, 41):
        ck(d.cuStreamWaitValue32(stream, fdev, seq, geq))
        ck(d.cuMemcpyHtoDAsync(dst, src_p, n, stream))
        ck(d.cuEventRecord(ev, stream))
        pat = rng.integers(0, 256, n, dtype=np.uint8)
        time.sleep(0.002)
        early = d.cuEventQuery(ev)[0] == ready  # must not be: the stream waits for the flag
        src[:] = pat
        t0 = time.perf_counter()
        flag[0] = seq
        ck(d.cuEventSynchronize(ev))
        lat.append((time.perf_counter() - t0) * 1e6)
        ck(d.cuMemcpyDtoH(back.ctypes.data, dst, n))
        ok &= bool((back == pat).all()) and not early
    res["wake_copy_us_p50"] = float(np.median(lat))
    res["wake_copy_us_p90"] = float(np.percentile(lat, 90))
    res["copies_equal_and_waited"] = ok

    # 2. an already-satisfied wait: its cost on the stream
    e0, e1 = (ck(d.cuEventCreate(d.CUevent_flags.CU_EVENT_DEFAULT)) for _ in range(2))
    ts = []
    for _ in range(20):
        ck(d.cuEventRecord(e0, stream))
        ck(d.cuStreamWaitValue32(stream, fdev, 1, geq))
        ck(d.cuEventRecord(e1, stream))
        ck(d.cuEventSynchronize(e1))
        ts.append(ck(d.cuEventElapsedTime(e0, e1)) * 1e3)
    res["satisfied_wait_us_p50"] = float(np.median(ts))

    # 3. the wait and the copy captured into a graph
    try:
        flag[0] = 0
        ck(d.cuStreamBeginCapture(stream,
                                  d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        ck(d.cuStreamWaitValue32(stream, fdev, 2000, geq))
        ck(d.cuMemcpyHtoDAsync(dst, src_p, n, stream))
        graph = ck(d.cuStreamEndCapture(stream))
        exe = ck(d.cuGraphInstantiate(graph, 0))
        ck(d.cuGraphLaunch(exe, stream))
        ck(d.cuEventRecord(ev, stream))
        time.sleep(0.002)
        waited = d.cuEventQuery(ev)[0] != ready
        src[:] = 7
        flag[0] = 2000
        ck(d.cuEventSynchronize(ev))
        ck(d.cuMemcpyDtoH(back.ctypes.data, dst, n))
        res["graph_capture"] = {"waited": bool(waited), "copied": bool((back == 7).all())}
    except Exception as e:  # noqa: BLE001 -- (reported)
        res["graph_capture"] = repr(e)
    print(json.dumps(res), flush=True)

    # 4. a Python thread sets the flag while this thread waits on the event (last: it hangs
    # if cuEventSynchronize holds the GIL)
    flag[0] = 0
    ck(d.cuStreamWaitValue32(stream, fdev, 1000, geq))
    ck(d.cuEventRecord(ev, stream))
    th = threading.Thread(target=lambda: (time.sleep(0.003), flag.__setitem__(0, 1000)))
    t0 = time.perf_counter()
    th.start()
    ck(d.cuEventSynchronize(ev))
    print(json.dumps({"thread_set_ms": (time.perf_counter() - t0) * 1e3}), flush=True)
    th.join()


if __name__ == "__main__":
    main()
