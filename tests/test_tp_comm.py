"""The collectives between tensor-parallel ranks, with a thread per rank: sums and gathers in rank
order, the single-rank identity, and no hang: a slow, absent or failing rank makes the others
raise a typed error after the timeout (or at once, when it aborts the group)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from engine.executor.base import ExecutorError
from engine.parallel.comm import (
    CollectiveAbortedError,
    CollectiveError,
    CollectiveTimeoutError,
    Communicator,
    InProcessGroup,
    SingleRankCommunicator,
)


def run_ranks(group: InProcessGroup, fn: Callable[[Communicator], object],
              join_s: float = 10.0) -> tuple[list[object], list[BaseException | None]]:
    n = group.world_size
    results: list[object] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def one(r: int) -> None:
        try:
            results[r] = fn(group.communicator(r))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            errors[r] = e

    threads = [threading.Thread(target=one, args=(r,), name=f"test-rank-{r}") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), f"{t.name} hung"
    return results, errors


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_reduce_and_all_gather(n: int) -> None:
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal((5, 7)).astype(np.float32) for _ in range(n)]
    group = InProcessGroup(n, timeout_s=5)

    def prog(c: Communicator):
        x = xs[c.rank]
        out = []
        for _ in range(3):  # several collectives in a row line up by sequence number
            out.append(c.all_reduce(x))
            out.append(c.all_gather(x, axis=-1))
            out.append(c.all_gather(x, axis=0))
        return out

    results, errors = run_ranks(group, prog)
    assert errors == [None] * n
    want_sum = xs[0].copy()
    for a in xs[1:]:
        want_sum += a  # rank order: every rank gets the same bits
    for r, out in enumerate(results):
        assert isinstance(out, list)
        for k in range(3):
            red, g1, g0 = out[3 * k:3 * k + 3]
            np.testing.assert_array_equal(red, want_sum)
            np.testing.assert_array_equal(g1, np.concatenate(xs, axis=1))
            np.testing.assert_array_equal(g0, np.concatenate(xs, axis=0))
            assert red is not xs[r]
        if r:  # each rank its own buffer
            assert not np.shares_memory(out[0], results[0][0])
    assert not group._ops and group.aborted is None


def test_single_rank_is_the_identity() -> None:
    c = SingleRankCommunicator()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert (c.rank, c.world_size) == (0, 1)
    assert c.all_reduce(x) is x and c.all_gather(x, axis=0) is x


def test_an_absent_rank_times_out_and_aborts_the_group() -> None:
    group = InProcessGroup(2, timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as e:
        group.communicator(0).all_reduce(np.ones(3, np.float32))
    took = time.monotonic() - t0
    assert 0.2 <= took < 2.0
    err = e.value
    assert (err.op, err.seq, err.rank, err.missing, err.timeout_s) == ("all_reduce", 0, 0, [1],
                                                                       0.2)
    assert "rank(s) [1] never joined" in str(err) and isinstance(err, ExecutorError)
    assert group.aborted is not None
    # the late rank fails at once instead of waiting for a partner that has given up
    t0 = time.monotonic()
    with pytest.raises(CollectiveAbortedError, match="aborted"):
        group.communicator(1).all_reduce(np.ones(3, np.float32))
    assert time.monotonic() - t0 < 0.1


def test_a_slow_rank_fails_its_peers_after_the_timeout() -> None:
    group = InProcessGroup(3, timeout_s=0.2)

    def prog(c: Communicator):
        x = np.full(4, c.rank, np.float32)
        c.all_reduce(x)  # all three meet once
        if c.rank == 2:
            time.sleep(1.0)  # then rank 2 is slow
        return c.all_reduce(x)

    t0 = time.monotonic()
    _, errors = run_ranks(group, prog)
    assert time.monotonic() - t0 < 3.0
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    timeouts = [e for e in errors if isinstance(e, CollectiveTimeoutError)]
    assert timeouts and all(e.missing == [2] and e.seq == 1 for e in timeouts)
    assert isinstance(errors[2], CollectiveAbortedError)  # it came back to an aborted group


def test_a_slow_rank_within_the_timeout_is_fine() -> None:
    group = InProcessGroup(2, timeout_s=5)

    def prog(c: Communicator):
        if c.rank == 1:
            time.sleep(0.2)
        return c.all_reduce(np.full(2, c.rank + 1, np.float32))

    results, errors = run_ranks(group, prog)
    assert errors == [None, None]
    np.testing.assert_array_equal(results[0], [3, 3])


def test_a_failing_rank_aborts_at_once() -> None:
    group = InProcessGroup(2, timeout_s=30)

    def prog(c: Communicator):
        if c.rank == 1:
            time.sleep(0.1)
            group.abort("rank 1 failed: boom")
            raise RuntimeError("boom")
        return c.all_reduce(np.ones(2, np.float32))

    t0 = time.monotonic()
    _, errors = run_ranks(group, prog)
    assert time.monotonic() - t0 < 2.0  # not the 30 s timeout
    assert isinstance(errors[0], CollectiveAbortedError) and "boom" in str(errors[0])


def test_diverged_programs_and_disagreeing_shapes_are_errors() -> None:
    group = InProcessGroup(2, timeout_s=5)

    def diverged(c: Communicator):
        x = np.ones(2, np.float32)
        return c.all_reduce(x) if c.rank == 0 else c.all_gather(x)

    _, errors = run_ranks(group, diverged)
    assert all(isinstance(e, CollectiveError) for e in errors)
    assert any("diverged" in str(e) for e in errors)

    group = InProcessGroup(2, timeout_s=5)
    _, errors = run_ranks(group, lambda c: c.all_reduce(np.ones(2 + c.rank, np.float32)))
    assert all(isinstance(e, CollectiveError) for e in errors)
    assert any("disagree on the shape" in str(e) for e in errors)


@pytest.mark.parametrize("kw,needle", [
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size=2, timeout_s=0), "timeout_s must be a finite number > 0"),
    (dict(world_size=2, timeout_s=float("inf")), "timeout_s must be a finite number > 0"),
])
def test_group_arguments_are_checked(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        InProcessGroup(**kw)
    with pytest.raises(ValueError, match="rank 2 outside 0..1"):
        InProcessGroup(2).communicator(2)
