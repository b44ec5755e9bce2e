"""AsyncEngine without HTTP: the engine thread, request streams, delta merging, aborts, refusals
after death, the order in which a death is recorded and told, and what the watchdog calls a stall
(no heartbeat while work is in flight, not a long step that keeps beating)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.engine import RequestError
from engine.sampling_params import SamplingParams
from engine.server.async_engine import AsyncEngine
from engine.server.stream import EngineDeadError, StreamDelta
from engine.server.testing import make_engine, wait_for, write_test_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), "tiny")


@pytest.fixture
def engine(model_dir: Path) -> Iterator[AsyncEngine]:
    ae = AsyncEngine(make_engine(model_dir, max_model_len=64), step_timeout_s=30)
    ae.start()
    yield ae
    ae.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def test_deltas_add_up_and_lagging_consumers_get_merged_deltas(engine: AsyncEngine) -> None:
    async def run(lag: bool) -> tuple[list[int], int, StreamDelta]:
        stream = await engine.add([5, 6, 7, 8], GREEDY, f"r-{lag}")
        toks: list[int] = []
        n = 0
        last = None
        async for d in stream:
            assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
            toks += d.token_ids
            n += 1
            last = d
            # a client that lags until the engine has posted everything (the terminal item
            # releases the stream): whatever piled up meanwhile must come as one delta
            while lag and engine.num_in_flight():
                await asyncio.sleep(0.005)
        assert last is not None
        return toks, n, last

    fast, n_fast, last = asyncio.run(run(False))
    slow, n_slow, _ = asyncio.run(run(True))
    assert fast == slow and len(fast) == 12
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 12
    assert 1 <= n_fast <= 12 and n_slow <= 2  # (the fast one's count depends on the machine)


def test_refused_request_raises_and_leaves_nothing_behind(engine: AsyncEngine) -> None:
    async def run() -> None:
        with pytest.raises(RequestError):
            await engine.add([5] * 64, GREEDY, "too-long")  # max_model_len 64

    asyncio.run(run())
    assert engine.num_in_flight() == 0


def test_abort_frees_pages(engine: AsyncEngine) -> None:
    async def run() -> None:
        stream = await engine.add([5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True), "a")
        await stream.__anext__()
        stream.abort()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(run())
    assert wait_for(lambda: engine.snapshot()["kv"]["in_use"] == 0
                    and engine.snapshot()["running"] == 0)


def test_dead_engine_refuses_and_fails_in_flight(engine: AsyncEngine) -> None:
    fatal: list[str] = []
    engine.on_fatal = fatal.append

    def boom() -> None:
        raise RuntimeError("loop bug")

    # Hold the engine's second step until the loop bug is planted, so the request cannot finish
    # first on a slow or loaded machine (it did once, under a parallel CI run).
    planted = threading.Event()
    steps = {"n": 0}

    def hold(plan: object) -> None:
        steps["n"] += 1
        if steps["n"] >= 2:
            planted.wait(10)

    engine.engine.fault_hook = hold

    async def run() -> StreamDelta:
        stream = await engine.add([5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True), "d")
        await stream.__anext__()
        engine.engine.step = boom  # type: ignore[method-assign]
        planted.set()
        last = None
        async for d in stream:
            last = d
        assert last is not None
        return last

    last = asyncio.run(run())
    assert last.finish_reason == "error" and last.fatal and "loop bug" in (last.error or "")
    assert fatal and "loop bug" in fatal[0]
    assert engine.health()[0] is False

    async def later() -> None:
        with pytest.raises(EngineDeadError):
            await engine.add([5, 6], GREEDY, "after")

    asyncio.run(later())


def test_fatal_is_recorded_before_clients_see_the_failure(engine: AsyncEngine) -> None:
    """on_fatal (the server's exit timer) and ``fatal`` happen-before the terminal delta: a client
    that sees its request fail and asks why finds the death recorded. The hook waits for the
    client to see the failure (up to 1 s) so a wrong order cannot hide behind the timing."""
    client_saw_end = threading.Event()
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        client_saw_end.wait(1.0)
        fatal.append(reason)

    engine.on_fatal = on_fatal

    def boom() -> None:
        raise RuntimeError("loop bug")

    engine.engine.step = boom  # type: ignore[method-assign]

    async def run() -> tuple[StreamDelta | None, list[str], str | None, bool]:
        stream = await engine.add([5, 6, 7], GREEDY, "f")
        last = None
        async for d in stream:
            last = d
        seen = (last, list(fatal), engine.fatal, engine.health()[0])
        client_saw_end.set()
        return seen

    last, fatal_then, reason, healthy = asyncio.run(run())
    assert last is not None and last.fatal and "loop bug" in (last.error or "")
    assert fatal_then and "loop bug" in fatal_then[0]
    assert reason is not None and "loop bug" in reason and healthy is False


def test_a_long_step_that_keeps_beating_is_not_a_stall(model_dir: Path) -> None:
    """One step takes 3x the step timeout (a long prefill) but the executor's heartbeat keeps
    moving: the engine is alive and the request completes. (A step whose heartbeat stands still
    is declared dead: test_watchdog_declares_a_stalled_engine_dead.)"""
    eng = make_engine(model_dir, max_model_len=64)
    first = threading.Event()

    def long_step(plan: object) -> None:
        if first.is_set():
            return
        first.set()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            time.sleep(0.02)
            eng.executor.heartbeat += 1  # what each layer of a numpy forward does

    eng.fault_hook = long_step
    ae = AsyncEngine(eng, step_timeout_s=1.0)
    ae.start()
    try:
        async def run() -> StreamDelta | None:
            stream = await ae.add([5, 6, 7], GREEDY, "long")
            last = None
            async for d in stream:
                last = d
            return last

        last = asyncio.run(run())
        assert first.is_set()
        assert ae.fatal is None and ae.health() == (True, "ok")
        assert last is not None and last.finish_reason == "length"
        assert last.num_output_tokens == GREEDY.max_tokens
    finally:
        ae.shutdown()


def test_time_before_start_is_not_a_stall(model_dir: Path) -> None:
    """An AsyncEngine built, then started later (its owner loaded other things meanwhile), whose
    first step is slow but well inside the step timeout: not a stall. The stall clock starts when
    work arrives, not at construction."""
    eng = make_engine(model_dir, max_model_len=64)
    first = threading.Event()

    def slow_first_step(plan: object) -> None:
        if not first.is_set():
            first.set()
            time.sleep(0.4)  # no heartbeat, but less than half the step timeout

    eng.fault_hook = slow_first_step
    ae = AsyncEngine(eng, step_timeout_s=1.0)
    time.sleep(1.5)  # built long before it serves
    ae.start()
    try:
        async def run() -> StreamDelta | None:
            stream = await ae.add([5, 6, 7], GREEDY, "late")
            last = None
            async for d in stream:
                last = d
            return last

        last = asyncio.run(run())
        assert ae.fatal is None
        assert last is not None and last.finish_reason == "length"
    finally:
        ae.shutdown()


def test_duplicate_request_id_is_refused_and_the_first_stays_tracked(model_dir: Path) -> None:
    """A second add() with the id of a request in flight is refused up front; the first one stays
    in the books (a shutdown or death would still give it its terminal answer) and completes."""
    eng = make_engine(model_dir, max_model_len=128)
    eng.fault_hook = lambda plan: time.sleep(0.01)  # 100 steps: the first stays in flight
    ae = AsyncEngine(eng, step_timeout_s=30)
    ae.start()
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    try:
        async def run() -> tuple[int, StreamDelta | None]:
            stream = await ae.add([5, 6, 7], params, "dup")
            with pytest.raises(RequestError, match="already in use"):
                await ae.add([8, 9], params, "dup")
            n = ae.num_in_flight()
            last = None
            async for d in stream:
                last = d
            return n, last

        n, last = asyncio.run(run())
        assert n == 1
        assert last is not None and last.finish_reason == "length"
        assert wait_for(lambda: ae.num_in_flight() == 0)
    finally:
        ae.shutdown()


def test_drain_lets_in_flight_finish_and_refuses_new(engine: AsyncEngine) -> None:
    """stop_accepting(): new requests get EngineDeadError (503) and health says why, while the
    request in flight runs to its normal end; wait_idle() returns once its end was posted."""
    async def run() -> StreamDelta | None:
        stream = await engine.add([5, 6, 7], GREEDY, "in-flight")
        engine.stop_accepting()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await engine.add([5, 6], GREEDY, "new")
        last = None
        async for d in stream:
            last = d
        return last

    assert engine.health() == (True, "ok")
    last = asyncio.run(run())
    assert last is not None and last.finish_reason == "length" and not last.fatal
    assert engine.wait_idle(10) and engine.num_in_flight() == 0
    assert engine.health() == (False, "the server is shutting down")


def test_a_burst_larger_than_a_drain_is_admitted_in_bounded_batches(model_dir: Path) -> None:
    """Adds queued faster than the engine thread takes them: each drain takes at most
    DRAIN_BATCH before a step (so a two-process core gets the first ones while the rest still
    arrive), and every one is accepted and finishes (the drain that stops early wakes the next)."""
    from engine.server import async_engine as ae_mod

    eng = make_engine(model_dir, max_model_len=64)
    ae = AsyncEngine(eng, step_timeout_s=30)
    batches: list[int] = []
    add = eng.add_request
    step = eng.step
    pending = [0]

    def counting_add(*a, **kw):
        pending[0] += 1
        return add(*a, **kw)

    def counting_step():
        if pending[0]:
            batches.append(pending[0])
            pending[0] = 0
        return step()

    eng.add_request, eng.step = counting_add, counting_step
    n = 3 * ae_mod.DRAIN_BATCH + 5
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def run() -> list[int]:
        async def one(i: int) -> int:
            stream = await ae.add([5 + i % 50, 6, 7], params, f"burst-{i}")
            toks: list[int] = []
            async for d in stream:
                toks += d.token_ids
            return len(toks)

        return await asyncio.gather(*[one(i) for i in range(n)])

    try:
        # queued before the engine thread runs: one drain could take all of them at once
        ae.start()
        got = asyncio.run(run())
    finally:
        ae.shutdown()
    assert got == [2] * n
    assert sum(batches) == n and max(batches) <= ae_mod.DRAIN_BATCH, batches
    assert len(batches) >= 4, batches
