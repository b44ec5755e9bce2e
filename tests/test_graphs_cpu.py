"""Graph bookkeeping that needs no GPU: buckets, padding choice, the profiler's report, the
runner's verbs over fake callables, and driver.Graph's call sequence over a fake driver."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from engine.cuda import driver
from graphs.buckets import bucket_for, bucket_sizes
from graphs.profile import plot, table
from graphs.runner import DecodePlan, GraphError, GraphRunner


def test_bucket_sizes_default_and_capped():
    s = bucket_sizes(256)
    assert s[:6] == [1, 2, 4, 8, 16, 24] and s[-1] == 256 and len(s) == 35
    assert all(b - a == 8 for a, b in zip(s[4:], s[5:], strict=False))
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(1000)[-1] == 256
    assert bucket_sizes(1000, max_bucket=512)[-1] == 512


@pytest.mark.parametrize("b,expect", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 24), (33, 40),
                                      (100, 104), (256, 256), (257, None)])
def test_bucket_for(b, expect):
    assert bucket_for(b, bucket_sizes(256)) == expect


ROWS = [dict(bucket=b, nodes=100, nodes_by_kernel={"GemmSkinny": 60, "RMSNorm": 40},
             capture_ms=12.0, graph_mem_bytes=1 << 20, num_splits=4, replay_ms_median=1.0 + b / 100,
             replay_ms_p99=1.2 + b / 100, eager_ms_median=2.0 + b / 100,
             eager_ms_p99=2.5 + b / 100, saved_ms=1.0, saved_us_per_node=10.0,
             replay_ms_per_token=(1.0 + b / 100) / b) for b in (1, 2, 4, 8)]


def test_profile_table_and_plot(tmp_path):
    t = table(ROWS)
    assert "bucket" in t.splitlines()[0] and len(t.splitlines()) == 2 + len(ROWS) + 1
    assert "GemmSkinny x60" in t
    ok = plot(ROWS, tmp_path / "p.png", "test")
    if importlib.util.find_spec("matplotlib") is None:
        assert ok is False
    else:
        assert ok and (tmp_path / "p.png").stat().st_size > 1000


# -- DecodePlan and GraphRunner over fake callables and a fake Graph factory -------------------
class FakeGraph:
    def __init__(self, log, bucket):
        self.log, self.bucket = log, bucket
        self.capture_s, self.mem_bytes = 0.5, 1000 * bucket
        self.destroyed = 0

    def launch(self, stream):
        self.log.append(("launch", self.bucket, stream))

    def destroy(self):
        self.destroyed += 1

    def kernel_names(self):
        return ["k"] * self.bucket


def _runner(buckets=(1, 2, 4, 8), lazy=False):
    log = []
    made = []

    def capture(stream, body):
        log.append(("begin", stream))
        body()
        log.append(("end",))
        g = FakeGraph(log, log[-2][1])  # the bucket of the body call just captured
        made.append(g)
        return g

    plan = DecodePlan(tuple(buckets), {b: b + 100 for b in buckets}, lazy)
    r = GraphRunner(plan, lambda b: log.append(("stage", b)),
                    lambda b, s: log.append(("body", b, s)), "stream", capture_graph=capture)
    return r, log, made


@pytest.mark.parametrize("buckets,splits,msg", [
    ((), {}, "positive"), ((0, 1), {0: 1, 1: 1}, "positive"), ((2, 1), {1: 1, 2: 1}, "ascending"),
    ((1, 1), {1: 1}, "ascending"), ((1, 2), {1: 1}, "one entry per bucket"),
    ((1,), {1: 1, 2: 1}, "one entry per bucket"), ((1, 2), {1: 1, 2: 0}, ">= 1")])
def test_decode_plan_rejects(buckets, splits, msg):
    with pytest.raises(ValueError, match=msg):
        DecodePlan(buckets, splits)


def test_runner_capture_order_and_records():
    r, log, made = _runner()
    g = r.capture(4)
    # padding inputs staged, a warm-up run, then the captured run (same splits)
    assert log == [("stage", 4), ("body", 4, 104), ("begin", "stream"), ("body", 4, 104), ("end",)]
    assert (g.bucket, g.num_splits, g.kernel_names, g.capture_s, g.mem_bytes) == \
        (4, 104, ["k"] * 4, 0.5, 4000)
    with pytest.raises(GraphError, match="not in the decode plan"):
        r.capture(3)
    r.capture(4)  # a recapture frees the graph it replaces
    assert made[0].destroyed == 1 and r.graphs[4].graph is made[1]


def test_runner_capture_all_largest_first():
    r, log, _ = _runner()
    r.capture(2)
    log.clear()
    stats = r.capture_all(show=False)
    assert [e[1] for e in log if e[0] == "stage"] == [8, 4, 1]  # 2 was captured already
    assert stats["graphs"] == 4 and stats["graph_mem_bytes"] == 15000


def test_runner_eager_plan_verbs():
    r, log, _ = _runner(lazy=False)
    assert not r.can_replay(3)  # bucket 4 exists but is not captured
    with pytest.raises(GraphError, match="not captured"):
        r.pad(3)
    r.capture_all(show=False)
    assert all(r.can_replay(n) for n in range(1, 9)) and not r.can_replay(9)
    assert [r.pad(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(GraphError, match="exceeds the largest"):
        r.pad(9)
    log.clear()
    r.replay(4)
    r.replay(4)
    assert log == [("launch", 4, "stream")] * 2 and r.replays == 2


def test_runner_lazy_plan_captures_in_pad():
    r, log, _ = _runner(lazy=True)
    assert r.can_replay(5) and not r.graphs and not log  # can_replay never captures
    with pytest.raises(GraphError, match="not captured"):
        r.replay(8)
    assert r.pad(5) == 8 and list(r.graphs) == [8]
    assert log[0] == ("stage", 8)
    log.clear()
    assert r.pad(6) == 8 and not log  # captured once
    assert r.can_replay(7) and r.pad(7) == 8 and not r.can_replay(9)
    r.replay(8)
    assert log == [("launch", 8, "stream")] and r.replays == 1


def test_runner_destroy():
    r, _, made = _runner()
    r.capture_all(show=False)
    r.destroy()
    assert not r.graphs and all(g.destroyed == 1 for g in made)
    r.destroy()  # nothing left to free
    assert all(g.destroyed == 1 for g in made)


# -- driver.Graph over a fake cuda driver --------------------------------------------------------
class FakeDriver:
    """The driver calls Graph makes, as cuda-python returns them: (CUresult, *values)."""

    CUresult = SimpleNamespace(CUDA_SUCCESS=0)
    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL="thread-local")
    CUgraphNodeType = SimpleNamespace(CU_GRAPH_NODE_TYPE_KERNEL="kernel")

    def __init__(self, fail=()):
        self.calls, self.fail, self.free = [], set(fail), 10_000

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append(name)
            if name in self.fail:
                return (999,) if name != "cuStreamEndCapture" else (999, None)
            return (0, *self._values(name, args))
        return call

    def _values(self, name, args):
        if name == "cuGetErrorName":
            return (b"CUDA_ERROR_FAKE",)
        if name == "cuGetErrorString":
            return (b"fake failure",)
        if name == "cuMemGetInfo":
            self.free -= 300  # each reading sees less free memory
            return (self.free, 20_000)
        if name == "cuStreamEndCapture":
            return ("graph",)
        if name == "cuGraphInstantiate":
            return ("exec",)
        if name == "cuGraphGetNodes":
            return (["n1", "n2", "n3"], 3) if args[1] else (None, 3)
        if name == "cuGraphNodeGetType":
            return ("memset" if args[0] == "n2" else "kernel",)
        if name == "cuGraphKernelNodeGetParams":
            return (SimpleNamespace(func=f"f_{args[0]}"),)
        if name == "cuFuncGetName":
            return (f"kernel_{args[0]}".encode(),)
        return ()


class FakeStream:
    handle = "stream"

    def __init__(self):
        self.syncs = 0

    def synchronize(self):
        self.syncs += 1


@pytest.fixture
def fake_cu(monkeypatch):
    def install(fail=()):
        cu = FakeDriver(fail)
        monkeypatch.setattr(driver, "_cu", lambda: cu)
        return cu
    return install


def test_graph_capture_launch_destroy(fake_cu):
    cu, st = fake_cu(), FakeStream()
    ran = []
    g = driver.Graph.capture(st, lambda: ran.append(cu.calls[-1]))
    assert ran == ["cuStreamBeginCapture"]  # the body runs inside the capture
    assert cu.calls == ["cuMemGetInfo", "cuStreamBeginCapture", "cuStreamEndCapture",
                        "cuGraphInstantiate", "cuGraphUpload", "cuMemGetInfo"]
    assert st.syncs == 2 and g.mem_bytes == 300 and g.capture_s >= 0
    assert g.kernel_names() == ["kernel_f_n1", "kernel_f_n3"]
    cu.calls.clear()
    g.launch(st)
    g.destroy()
    g.destroy()  # idempotent
    assert cu.calls == ["cuGraphLaunch", "cuGraphExecDestroy", "cuGraphDestroy"]
    with pytest.raises(driver.CudaError, match="destroyed"):
        g.launch(st)


def test_graph_capture_ends_when_body_raises(fake_cu):
    cu = fake_cu()

    def body():
        raise ValueError("kernel launcher failed")

    with pytest.raises(ValueError, match="launcher failed"):
        driver.Graph.capture(FakeStream(), body)
    assert cu.calls[-2:] == ["cuStreamEndCapture", "cuGraphDestroy"]  # partial graph freed
    cu = fake_cu(fail={"cuStreamEndCapture"})  # an invalidated capture: the body's error wins
    with pytest.raises(ValueError, match="launcher failed"):
        driver.Graph.capture(FakeStream(), body)
    assert cu.calls[-1] == "cuGetErrorString" and "cuStreamEndCapture" in cu.calls


def test_graph_capture_errors_name_the_call(fake_cu):
    cu = fake_cu(fail={"cuGraphInstantiate"})
    with pytest.raises(driver.CudaError, match=r"cuGraphInstantiate failed: CUDA_ERROR_FAKE"):
        driver.Graph.capture(FakeStream(), lambda: None)
    assert cu.calls[-1] == "cuGraphDestroy" and "cuGraphExecDestroy" not in cu.calls
    cu = fake_cu(fail={"cuGraphUpload"})
    with pytest.raises(driver.CudaError, match="cuGraphUpload failed"):
        driver.Graph.capture(FakeStream(), lambda: None)
    assert cu.calls[-2:] == ["cuGraphExecDestroy", "cuGraphDestroy"]
    cu = fake_cu(fail={"cuGraphLaunch"})
    with pytest.raises(driver.CudaError, match="cuGraphLaunch failed"):
        driver.Graph("graph", "exec").launch(FakeStream())


# -- driver.register_host over a fake driver that refuses overlapping registrations ------------
class FakeHostDriver(FakeDriver):
    """cuMemHostRegister as the driver does it: a range overlapping a registered one fails
    (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, 712); unregistering frees the range."""

    CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_PORTABLE = 2, 1

    def __init__(self):
        super().__init__()
        self.ranges: dict[int, int] = {}

    def cuMemHostRegister(self, base, nbytes, flags):
        self.calls.append(("register", base))
        assert flags == 3
        if any(b < base + nbytes and base < b + n for b, n in self.ranges.items()):
            return (712,)
        self.ranges[base] = nbytes
        return (0,)

    def cuMemHostUnregister(self, base):
        self.calls.append(("unregister", base))
        return (0,) if self.ranges.pop(base, None) is not None else (1,)

    def cuMemHostGetDevicePointer(self, base, flags):
        assert any(b <= base < b + n for b, n in self.ranges.items())
        return (0, base + (1 << 40))


def test_register_host_replaces_stale_overlapping_registrations(monkeypatch):
    """A shared memory mapping registered by an engine that was dropped without shutdown is
    unmapped but stays registered; a new mapping at an overlapping address registers anyway
    (the stale range is unregistered first) and gets its device address; ranges that do not
    overlap are left alone; unregister_host is idempotent."""
    cu = FakeHostDriver()
    monkeypatch.setattr(driver, "_cu", lambda: cu)
    monkeypatch.setattr(driver, "_HOST_REGISTERED", {})
    assert driver.register_host(0x1000, 0x3000) == 0x1000 + (1 << 40)
    assert driver.register_host(0x8000, 0x1000) == 0x8000 + (1 << 40)  # (apart: both live)
    # the first engine is dropped: its range stays registered; a new mapping reuses part of it
    assert driver.register_host(0x2000, 0x4000) == 0x2000 + (1 << 40)
    assert cu.ranges == {0x2000: 0x4000, 0x8000: 0x1000}
    assert ("unregister", 0x1000) in cu.calls and ("unregister", 0x8000) not in cu.calls
    driver.unregister_host(0x2000)
    driver.unregister_host(0x2000)  # (nothing left to undo: no driver call)
    driver.unregister_host(0)
    assert cu.ranges == {0x8000: 0x1000} and cu.calls.count(("unregister", 0x2000)) == 1
    cu.ranges[0x10000] = 0x1000  # registered behind our back: the driver's error is raised
    with pytest.raises(driver.CudaError, match="cuMemHostRegister failed"):
        driver.register_host(0x10000, 0x1000)
