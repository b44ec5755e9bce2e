"""Probe (GPU host; not yet run on a GPU): can a host thread gate a stream?

The design of docs/perf.md v31 item 3 gates a constrained step's grammar-mask upload on the GPU
with ``cuStreamWaitValue32`` on a pinned flag that the mask thread writes. With
engine/cuda/driver.py's buffers and events this prints one JSON line: the device's stream-mem-op
attributes, the latency from the flag write to the gated copy's completion, whether the copy
waited and copied the right bytes, the stream cost of an already-satisfied wait and whether the
wait captures into a CUDA graph. A second line follows once a Python thread has set the flag
while the main thread waits in ``cuEventSynchronize`` (a hang there: that call holds the GIL).
Run it with a timeout:

    timeout 60 python3 tools/probe_stream_wait.py
"""
from __future__ import annotations

import json
import threading
import time

import numpy as np

MASK_WORDS = 16 * 4748  # 16 grammar rows of Qwen3's vocabulary, one bit per token


def main() -> None:
    from cuda.bindings import driver as cu

    from engine.cuda.driver import Context, Event, Graph, PinnedBuffer, Stream, check
    from engine.cuda.driver import device_array as device_buffer

    ctx = Context.get()
    res: dict = {"name": ctx.name}
    for a in ("CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1",
              "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR"):
        res[a] = check(cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, a), ctx.device),
                       a)
    stream, ev, e0 = Stream(), Event(timing=False), Event()
    flag_buf = PinnedBuffer(16, np.uint32)  # pinned: mapped into the device under UVA
    flag = flag_buf.array
    fdev = check(cu.cuMemHostGetDevicePointer(flag_buf.ptr, 0), "cuMemHostGetDevicePointer")
    src = PinnedBuffer(MASK_WORDS, np.uint32)
    dst = device_buffer(MASK_WORDS, np.uint32)
    geq = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

    def wait(value: int) -> None:
        check(cu.cuStreamWaitValue32(stream.handle, fdev, value, geq), "cuStreamWaitValue32")

    def done() -> bool:
        return cu.cuEventQuery(ev.handle)[0] == cu.CUresult.CUDA_SUCCESS

    # 1. gated copies: the stream waits until the host writes the step's sequence number
    lat, ok = [], True
    rng = np.random.default_rng(0)
    flag[0] = 0
    for seq in range(1, 41):
        wait(seq)
        dst.upload(src.array, stream)
        ev.record(stream)
        pat = rng.integers(0, 2**32, MASK_WORDS, dtype=np.uint32)
        time.sleep(0.002)
        early = done()  # must not be: the stream waits for the flag
        src.array[:] = pat
        t0 = time.perf_counter()
        flag[0] = seq
        ev.synchronize()
        lat.append((time.perf_counter() - t0) * 1e6)
        ok &= bool((dst.download() == pat).all()) and not early
    res.update(wake_copy_us_p50=float(np.median(lat)), wake_copy_us_p90=float(np.percentile(
        lat, 90)), copies_equal_and_waited=ok)

    # 2. an already-satisfied wait: its cost on the stream
    e1 = Event()
    ts = []
    for _ in range(20):
        e0.record(stream)
        wait(1)
        e1.record(stream)
        e1.synchronize()
        ts.append(e0.elapsed_ms(e1) * 1e3)
    res["satisfied_wait_us_p50"] = float(np.median(ts))

    # 3. the wait and the copy captured into a graph
    try:
        flag[0] = 0
        graph = Graph.capture(stream, lambda: (wait(2000), dst.upload(src.array, stream)))
        graph.launch(stream)
        ev.record(stream)
        time.sleep(0.002)
        waited = not done()
        src.array[:] = 7
        flag[0] = 2000
        ev.synchronize()
        res["graph_capture"] = {"waited": waited, "copied": bool((dst.download() == 7).all())}
    except Exception as e:  # noqa: BLE001 -- (reported)
        res["graph_capture"] = repr(e)
    print(json.dumps(res), flush=True)

    # 4. a Python thread sets the flag while this thread waits on the engine's kind of event
    # (last: it hangs if cuEventSynchronize holds the GIL)
    flag[0] = 0
    wait(1000)
    ev.record(stream)
    th = threading.Thread(target=lambda: (time.sleep(0.003), flag.__setitem__(0, 1000)))
    t0 = time.perf_counter()
    th.start()
    ev.synchronize()
    print(json.dumps({"thread_set_ms": (time.perf_counter() - t0) * 1e3}), flush=True)
    th.join()


if __name__ == "__main__":
    main()
