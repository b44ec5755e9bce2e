"""AsyncEngine without HTTP: the engine thread, request streams, delta merging, aborts, and
refusals after death."""

from __future__ import annotations

import asyncio
import threading
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
    async def run(lag: float) -> tuple[list[int], int, StreamDelta]:
        stream = await engine.add([5, 6, 7, 8], GREEDY, f"r-{lag}")
        toks: list[int] = []
        n = 0
        last = None
        async for d in stream:
            assert d.logprobs is not None and len(d.logprobs) == len(d.token_ids)
            toks += d.token_ids
            n += 1
            last = d
            await asyncio.sleep(lag)  # a slow client: deltas pile up meanwhile
        assert last is not None
        return toks, n, last

    fast, n_fast, last = asyncio.run(run(0.0))
    slow, n_slow, _ = asyncio.run(run(0.05))
    assert fast == slow and len(fast) == 12
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 12
    assert n_slow < n_fast


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
