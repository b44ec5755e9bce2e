"""Tensor parallelism simulated in one process on the CPU: N ranks, each holding its weight shards
and its KV shard, each running its part of every layer in a thread of its own
(``<arch>-tp-rank-<r>``), meeting in the in-process collectives of comm.py.

One rank's program per step (what a GPU worker runs; collectives marked *):

    x = *all_reduce(embedding rows of the ids in its vocab range, zeros for the others)
    every layer:
        q, k, v of its heads          ReferenceModel.qkv over its shard (norm replicated)
        its KV written, attention     NumpyExecutor.attend over its cache (its KV heads)
        x = x + *all_reduce(o_proj of its heads)              (row-parallel: a partial sum)
        x = x + *all_reduce(down(SiLU(gate) * up) of its MLP slice)
    logits = *all_gather(its vocab shard's logits)[:, :vocab_size]

A rank is a ``NumpyExecutor`` over its own checkpoint (``shard_checkpoint``): the reference
math and the paged attention are the TP=1 code, run at the rank's shape. Sums over ranks
reassociate float32 additions, so results equal TP=1 within float32 rounding, not bit for bit
(N=1 goes through ``SingleRankCommunicator`` and the same program). The block manager is one:
every rank has ``num_pages`` pages, page ``p`` holding its KV heads of the same tokens.

Failures. A rank that raises aborts the group: the step raises ``RankFailedError`` naming it. A
rank that hangs makes its peers' next collective time out (``CollectiveTimeoutError``). Either
way the other ranks end at once (their collectives raise) and the step's requests fail; the
next step runs on a new group. A rank thread still running ``timeout_s`` after the failure is
hung: the executor is then broken and refuses every later step (it cannot be trusted to leave
the KV cache alone); restart the engine.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from engine.executor.base import Executor, ExecutorError
from engine.executor.numpy_executor import NumpyExecutor, check_batch, logit_rows, sample_output
from engine.model.loader import Checkpoint
from engine.parallel.comm import (
    DEFAULT_TIMEOUT_S,
    CollectiveError,
    CollectiveTimeoutError,
    Communicator,
    InProcessGroup,
    SingleRankCommunicator,
)
from engine.parallel.plan import TensorParallelPlan, shard_checkpoint
from engine.step import StepBatch, StepOutput

F32 = np.float32


class RankFailedError(ExecutorError):
    """A tensor-parallel rank raised during a step (the cause is chained)."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        self.rank = rank
        super().__init__(f"tensor-parallel rank {rank} failed: {type(cause).__name__}: {cause}")


class RankWorker:
    """One rank: its weight shards and KV shard (a NumpyExecutor at the rank's shape)."""

    def __init__(self, ckpt: Checkpoint, plan: TensorParallelPlan, rank: int, num_pages: int,
                 page_size: int) -> None:
        self.rank, self.plan = rank, plan
        self.local = NumpyExecutor(shard_checkpoint(ckpt, plan, rank), num_pages, page_size)
        self.vocab_start, self.vocab_stop = plan.vocab_range(rank)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """Embedding rows of the ids in this rank's vocab range; zero rows for the others."""
        local = ids.astype(np.int64) - self.vocab_start
        mine = (local >= 0) & (ids < self.vocab_stop)
        x = self.local.model.embed[np.where(mine, local, 0)]
        x[~mine] = 0
        return x

    def forward(self, b: StepBatch, rows: np.ndarray, comm: Communicator,
                on_layer: Callable[[], None] | None = None) -> np.ndarray:
        """This rank's part of the step (its KV written); the full logits [len(rows), vocab]
        of token rows ``rows``, the same on every rank."""
        m, cfg = self.local.model, self.local.config
        x = comm.all_reduce(self.embed(b.input_ids))
        for li in range(cfg.num_hidden_layers):
            q, k, v = m.qkv(li, x, b.positions)
            x = x + comm.all_reduce(m.o_proj(li, self.local.attend(li, q, k, v, b)))
            x = (x + comm.all_reduce(m.mlp(li, x))).astype(F32)
            if on_layer is not None:
                on_layer()
        logits = m.logits(x[rows])
        return comm.all_gather(logits, axis=-1)[:, :self.plan.model.vocab_size]


class TensorParallelNumpyExecutor(Executor):
    """The numpy backend at tensor_parallel_size N: N ``RankWorker`` threads per step."""

    def __init__(self, ckpt: Checkpoint, num_pages: int, page_size: int,
                 tensor_parallel_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.plan = TensorParallelPlan(ckpt.config, tensor_parallel_size)
        self.config = ckpt.config
        self.num_pages, self.page_size = num_pages, page_size
        self.timeout_s = timeout_s
        self.workers = [RankWorker(ckpt, self.plan, r, num_pages, page_size)
                        for r in range(tensor_parallel_size)]
        self.group = InProcessGroup(tensor_parallel_size, timeout_s)
        self.broken: str | None = None  # why every step is refused, once a rank hung

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def _beat(self) -> None:
        self.heartbeat += 1

    def logits(self, b: StepBatch, rows: np.ndarray) -> np.ndarray:
        """Run the step on every rank; the logits [len(rows), vocab] of token rows ``rows``."""
        if self.broken is not None:
            raise ExecutorError(self.broken)
        check_batch(b, self.num_pages, self.page_size, self.config.vocab_size)
        if self.world_size == 1:
            return self.workers[0].forward(b, rows, SingleRankCommunicator(), self._beat)
        return self._run_ranks(b, rows)

    def execute(self, b: StepBatch) -> StepOutput:
        return sample_output(b, self.logits(b, logit_rows(b)))

    def _run_ranks(self, b: StepBatch, rows: np.ndarray) -> np.ndarray:
        n, group = self.world_size, self.group
        results: list[np.ndarray | None] = [None] * n
        errors: list[BaseException | None] = [None] * n
        finished: queue.SimpleQueue[int] = queue.SimpleQueue()

        def run(w: RankWorker) -> None:
            try:
                results[w.rank] = w.forward(b, rows, group.communicator(w.rank),
                                            self._beat if w.rank == 0 else None)
            except BaseException as e:  # noqa: BLE001 - reported by the driver below
                errors[w.rank] = e
                if not isinstance(e, CollectiveError):
                    group.abort(f"rank {w.rank} failed: {type(e).__name__}: {e}")
            finally:
                finished.put(w.rank)

        threads = [threading.Thread(target=run, args=(w,), daemon=True,
                                    name=f"{self.config.architecture}-tp-rank-{w.rank}")
                   for w in self.workers]
        for t in threads:
            t.start()
        # Wait for every rank. A rank that never returns makes its peers' next collective time
        # out, so some rank always reports; once one has failed, the rest get timeout_s to end.
        deadline: float | None = None
        for _ in range(n):
            try:
                finished.get(timeout=None if deadline is None
                             else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if deadline is None and any(e is not None for e in errors):
                deadline = time.monotonic() + self.timeout_s
        if not any(e is not None for e in errors):
            out = results[0]
            assert out is not None
            return out
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        err = self._primary(errors)
        if hung:
            self.broken = (f"tensor-parallel rank(s) {hung} still running {self.timeout_s:g} s "
                           f"after a failed step ({err}); the ranks cannot be trusted: restart "
                           "the engine")
        else:
            self.group = InProcessGroup(n, self.timeout_s)  # the aborted one cannot be reused
        raise err

    @staticmethod
    def _primary(errors: list[BaseException | None]) -> ExecutorError:
        """The error that explains a failed step: a rank's own failure first, then a timeout
        (the other ranks' aborted collectives are its consequences)."""
        for r, e in enumerate(errors):
            if e is not None and not isinstance(e, CollectiveError):
                failed = RankFailedError(r, e)
                failed.__cause__ = e
                return failed
        timeouts = [e for e in errors if isinstance(e, CollectiveTimeoutError)]
        first = timeouts[0] if timeouts else next(e for e in errors if e is not None)
        assert isinstance(first, ExecutorError)
        return first
