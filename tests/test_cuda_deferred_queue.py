"""The order in which ``CudaExecutor`` enqueues deferred steps (``launch_deferred`` /
``launch_procs``), checked without a GPU: the executor's own methods run over recording stand-ins
for its stream work (uploads, device copies, graph replays), so the test reads the stream order.

What must hold (docs/perf.md v20): a step's forward is enqueued only after the tail of the
deferred step before it (its input tokens are that tail's samples, which its forward gathers on
the device: the rows to take go up with its token rows); its
token rows may go up before that tail only when the step ahead is a heads step (whose tail reads
no token rows), never before a step that runs whole in ``launch_procs`` (its own upload would
overwrite them); a failed ``launch_procs`` leaves nothing queued, and the queued forward never
runs. The GPU tests (tests/gpu/test_async.py) check the outputs of the same paths."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import engine.executor.cuda_executor as cx


class _Runner:
    """A graph runner of one bucket per size, every bucket captured; replays are logged."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name
        self.graphs = {b: object() for b in (1, 2, 4, 8)}
        self.plan = SimpleNamespace(bucket=lambda n: min(b for b in self.graphs if b >= n))

    def pad(self, n: int) -> int:
        return self.plan.bucket(n)

    def replay(self, bucket: int) -> None:
        self.log.append((self.name, bucket))


class _Batch:
    def __init__(self, tag: str, n: int = 3, whole: bool = False) -> None:
        self.tag, self.num_seqs, self.whole, self.procs = tag, n, whole, None


@pytest.fixture
def ex(monkeypatch):
    log: list = []
    e = object.__new__(cx.CudaExecutor)
    e.log = log
    e._awaiting, e._queued, e.queued_heads, e._inflight = None, None, 0, None
    e.heads, e.tails = _Runner(log, "heads"), _Runner(log, "tail")
    # a staged token upload: the step's tokens and the sample rows its forward gathers
    e.staged = SimpleNamespace(put_tokens=lambda b, pad, st, src: log.append(
        ("tokens", b.tag, len(src))))
    fail = {"stage": False}
    e.fail = fail

    def stage(procs, bucket, st):
        if fail["stage"]:
            raise cx.ExecutorError("injected")
        log.append(("rows", bucket))

    e.buf = SimpleNamespace(procs=SimpleNamespace(stage=stage))
    e._check = lambda b: None
    e._async_ok = lambda b: not b.whole
    e.upload = lambda b, pad_to=None, src_rows=None: log.append(("tokens", b.tag, len(src_rows)))
    e.upload_sampling = lambda b, pad_to=None, procs=True: log.append(("sampling", b.tag))
    # tokens and sampling rows in one copy (staged)
    e.upload_step = lambda b, pad_to=None, src_rows=None, procs=True: log.append(
        ("step", b.tag, len(src_rows)))
    e._download_async = lambda n: log.append(("download", n)) or SimpleNamespace(n=n)
    # a step that runs whole (the base class's launch_procs launches it): stands for its upload,
    # forward and samples
    e.launch = lambda b, src: log.append(("whole", b.tag)) or SimpleNamespace(n=b.num_seqs)
    e.stream = SimpleNamespace(synchronize=lambda: log.append(("sync",)))
    return e


def _src(n: int = 3) -> np.ndarray:
    return np.arange(n, dtype=np.int64)


def test_a_forward_queued_behind_a_heads_step_starts_right_after_its_tail(ex) -> None:
    a = ex.launch_deferred(_Batch("A"), _src())
    assert ex.log == [("step", "A", 3), ("heads", 4)]
    ex.log.clear()
    b = ex.launch_deferred(_Batch("B"), _src())
    assert b.queued and ex._queued is b
    assert ex.log == [("tokens", "B", 3)]  # early: A's tail reads no token rows
    ex.log.clear()
    ex.launch_procs(a, None)
    # B's forward (which gathers A's samples) only after A's tail
    assert ex.log == [("rows", 4), ("tail", 4), ("download", 3),
                      ("sampling", "B"), ("heads", 4)]
    assert ex._awaiting is b and ex._queued is None and not b.queued and ex.queued_heads == 1
    ex.log.clear()
    ex.launch_procs(b, None)
    assert ex.log == [("rows", 4), ("tail", 4), ("download", 3)]
    assert ex._awaiting is None


def test_token_rows_wait_behind_a_step_that_runs_whole(ex) -> None:
    """A step ahead without a heads graph runs whole in launch_procs: its upload comes then, so
    the queued step's token rows must come after it (sent early, they were overwritten)."""
    a = ex.launch_deferred(_Batch("A", whole=True), _src())
    assert ex.log == [] and ex._awaiting is a  # nothing runs until its processors come
    b = ex.launch_deferred(_Batch("B"), _src())
    assert b.queued and ex.log == []
    ex.launch_procs(a, None)
    assert ex.log == [("whole", "A"), ("step", "B", 3), ("heads", 4)]
    assert ex._awaiting is b


def test_a_failed_launch_procs_leaves_nothing_queued(ex) -> None:
    a = ex.launch_deferred(_Batch("A"), _src())
    b = ex.launch_deferred(_Batch("B"), _src())
    ex.log.clear()
    ex.fail["stage"] = True
    with pytest.raises(cx.ExecutorError):
        ex.launch_procs(a, None)
    # the engine then finishes both (engine._launch_procs, _step_pipelined)
    ex.finish(a)
    ex.finish(b)
    assert ex._awaiting is None and ex._queued is None
    assert ("heads", 4) not in ex.log and ("tail", 4) not in ex.log
    assert ex.log == [("sync",)]  # a's forward ran: wait for it; b never launched
    ex.fail["stage"] = False
    ex.log.clear()
    c = ex.launch_deferred(_Batch("C"), _src())  # a fresh pipeline: runs at once
    assert not c.queued and ex.log[-1] == ("heads", 4)
