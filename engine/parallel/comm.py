"""Collectives between tensor-parallel ranks: the ``Communicator`` interface, its single-rank
identity, and an in-process group whose ranks are threads (the numpy simulation, sim.py).

    comm.all_reduce(x)          the sum over ranks, added in rank order (deterministic)
    comm.all_gather(x, axis)    the ranks' arrays joined along ``axis``, rank 0 first

Every rank calls the same collectives in the same order (SPMD); the n-th call of each rank
meets the n-th call of the others. A TP=1 run goes through ``SingleRankCommunicator``, whose
collectives are the identity, so one code path serves every size.

No hang. Each collective waits at most ``timeout_s`` for the other ranks. When one has not come
in time, the waiting ranks raise ``CollectiveTimeoutError`` (the op, its sequence number, the
missing ranks) and the group is aborted, as torch.distributed's NCCL watchdog aborts a
communicator: the ranks' sequences of collectives no longer line up, so nothing after can be
trusted. In an aborted group every collective, and every rank still waiting, raises
``CollectiveAbortedError`` at once. A rank that fails outside a collective calls ``abort`` so its
peers fail at once instead of after the timeout. All are ``ExecutorError``s: the engine fails the
step's requests.

The default timeout (60 s) is below the server's step watchdog (120 s of no heartbeat): a hung
rank fails its step through the collective, with a message naming it, before the watchdog calls
the whole engine dead. The GPU worker's NCCL communicator (not built: it needs two GPUs) would
take device buffers and a stream where this takes arrays, with the same timeout and abort
(ncclCommAbort).
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from engine.executor.base import ExecutorError
from engine.jsonfile import is_int, is_number

DEFAULT_TIMEOUT_S = 60.0


class CollectiveError(ExecutorError):
    """A collective that could not complete (ranks that diverged or disagree on shapes)."""


class CollectiveTimeoutError(CollectiveError):
    """A rank waited ``timeout_s`` at a collective that other ranks never joined."""

    def __init__(self, op: str, seq: int, rank: int, missing: list[int], timeout_s: float) -> None:
        self.op, self.seq, self.rank = op, seq, rank
        self.missing, self.timeout_s = missing, timeout_s
        super().__init__(
            f"{op} #{seq} timed out after {timeout_s:g} s on tensor-parallel rank {rank}: "
            f"rank(s) {missing} never joined it (hung or failed); the group is aborted and "
            "this step's requests fail")


class CollectiveAbortedError(CollectiveError):
    """A collective of a group that was aborted (a timeout, or a rank that failed)."""


class Communicator(ABC):
    """One rank's end of a tensor-parallel group."""

    rank: int
    world_size: int

    @abstractmethod
    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The sum of every rank's ``x`` (same shape and dtype on every rank). The result may be
        ``x`` itself: do not write to ``x`` after the call."""

    @abstractmethod
    def all_gather(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        """Every rank's ``x`` (same shape on every rank) joined along ``axis``, rank order."""


class SingleRankCommunicator(Communicator):
    """A group of one: both collectives are the identity (a TP=1 run's communicator)."""

    rank, world_size = 0, 1

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        return x

    def all_gather(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        return x


def _same_shapes(op: str, xs: list[np.ndarray]) -> None:
    if len({(a.shape, a.dtype) for a in xs}) > 1:
        got = ", ".join(f"rank {r}: {a.shape} {a.dtype}" for r, a in enumerate(xs))
        raise ValueError(f"{op}: the ranks disagree on the shape or dtype ({got})")


def _sum(xs: list[np.ndarray]) -> np.ndarray:
    _same_shapes("all_reduce", xs)
    out = xs[0].copy()
    for a in xs[1:]:
        out += a
    return out


@dataclass
class _Op:
    kind: str
    inputs: list[np.ndarray | None]
    result: np.ndarray | None = None
    taken: int = 0


class InProcessGroup:
    """``world_size`` ranks in one process (one thread each), meeting under one condition
    variable. ``communicator(rank)`` is rank ``rank``'s end."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
        if not is_number(timeout_s) or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        self.world_size, self.timeout_s = world_size, float(timeout_s)
        self._cv = threading.Condition()
        self._ops: dict[int, _Op] = {}  # sequence number -> the collective in progress
        self._next = [0] * world_size  # each rank's next sequence number
        self.aborted: str | None = None  # why, once aborted

    def communicator(self, rank: int) -> InProcessCommunicator:
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} outside 0..{self.world_size - 1}")
        return InProcessCommunicator(self, rank)

    def abort(self, reason: str) -> None:
        """Fail every collective in progress and every later one (the first reason is kept)."""
        with self._cv:
            self._abort(reason)

    def _abort(self, reason: str) -> None:
        if self.aborted is None:
            self.aborted = reason
        self._cv.notify_all()

    def run(self, rank: int, kind: str, x: np.ndarray,
            combine: Callable[[list[np.ndarray]], np.ndarray]) -> np.ndarray:
        """Rank ``rank``'s part of its next collective: contribute ``x``, wait for the others
        (at most ``timeout_s``), return a copy of ``combine(every rank's x)``."""
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            if self.aborted is not None:
                raise CollectiveAbortedError(f"{kind} on rank {rank}: the tensor-parallel group "
                                             f"was aborted ({self.aborted})")
            seq = self._next[rank]
            self._next[rank] += 1
            op = self._ops.setdefault(seq, _Op(kind, [None] * self.world_size))
            if op.kind != kind:
                msg = (f"rank {rank} called {kind} as collective #{seq} where another rank "
                       f"called {op.kind}: the ranks' programs diverged")
                self._abort(msg)
                raise CollectiveError(msg)
            op.inputs[rank] = np.asarray(x)
            if all(a is not None for a in op.inputs):
                try:
                    op.result = combine([a for a in op.inputs if a is not None])
                except ValueError as e:
                    self._abort(f"collective #{seq}: {e}")
                    raise CollectiveError(f"collective #{seq}: {e}") from None
                self._cv.notify_all()
            while op.result is None:
                if self.aborted is not None:
                    raise CollectiveAbortedError(
                        f"{kind} #{seq} on rank {rank}: the tensor-parallel group was aborted "
                        f"({self.aborted})")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r, a in enumerate(op.inputs) if a is None]
                    err = CollectiveTimeoutError(kind, seq, rank, missing, self.timeout_s)
                    self._abort(str(err))
                    raise err
                self._cv.wait(left)
            op.taken += 1
            if op.taken == self.world_size:
                del self._ops[seq]
            return op.result.copy()


class InProcessCommunicator(Communicator):
    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        return self.group.run(self.rank, "all_reduce", x, _sum)

    def all_gather(self, x: np.ndarray, axis: int = -1) -> np.ndarray:
        def join(xs: list[np.ndarray]) -> np.ndarray:
            _same_shapes("all_gather", xs)
            return np.concatenate(xs, axis=axis)

        return self.group.run(self.rank, f"all_gather(axis={axis})", x, join)
