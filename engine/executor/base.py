"""The executor interface: a step's flat arrays in, sampled tokens (and logprobs) out.

Every backend (numpy reference, cuda) implements ``Executor``. Kernels and executors know nothing
of requests; ``engine.step`` defines the batch and builds it.

KV cache layout (identical on every backend), per layer, for K and for V separately::

    cache[num_pages, num_kv_heads, page_size, head_dim]     (bf16; "HND" pages)

so the slot ``s`` of a token is ``page * page_size + offset``, and one (page, kv head) is a
contiguous ``page_size x head_dim`` tile. Page 0 is the padding page: it is never handed to a
request; graph padding rows read it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from engine.step import ProcessorRows, StepBatch, StepOutput


class _Deferred:
    """A step launched before its logits processors were known (``launch_deferred``)."""

    __slots__ = ("batch", "src_rows")

    def __init__(self, batch: StepBatch, src_rows: np.ndarray | None) -> None:
        self.batch, self.src_rows = batch, src_rows


class ExecutorError(RuntimeError):
    """A step that the executor could not run. The scheduler fails the step's requests only."""


class Executor(ABC):
    """Runs the model on a StepBatch. Owns the KV cache (``num_pages`` pages)."""

    num_pages: int
    page_size: int
    # Progress counter, bumped at least once per layer of a forward (numpy) and once per step:
    # the server's watchdog judges liveness by it, so a long but moving step is never "dead".
    heartbeat: int = 0
    # a row's logits do not depend on what else its step computes (numpy: exact reference);
    # False (cuda): a multi-token step rounds differently from decode rows, so the scheduler
    # keeps speculative spans out of steps with prompt tokens (Scheduler.spec_alone)
    batch_invariant: bool = False
    _last_sampled: np.ndarray = np.zeros(0, np.int32)  # the last launched step's tokens

    @abstractmethod
    def execute(self, batch: StepBatch) -> StepOutput: ...

    # -- async scheduling (engine/engine.py): a step launched before the previous one's tokens
    # are on the host; ``finish`` returns its output
    def launch(self, batch: StepBatch, src_rows: np.ndarray | None = None) -> Any:
        """Start a step; ``finish(handle)`` waits for its output. ``src_rows``: row i's input
        token is the token the previously launched step sampled at its row ``src_rows[i]``
        (-1: ``batch.input_ids[i]`` as given). This default runs the step now."""
        if src_rows is not None:
            take = src_rows >= 0
            batch.input_ids[take] = self._last_sampled[src_rows[take]]
        out = self.execute(batch)
        self._last_sampled = out.sampled
        return out

    def launch_deferred(self, batch: StepBatch, src_rows: np.ndarray | None = None) -> Any:
        """Start a step whose logits processors (``batch.procs``) are not known yet: they
        depend on the tokens of the step in flight (grammar masks, bad words, min_tokens).
        ``launch_procs(handle, procs)`` gives them once that step is complete, and only then
        does this step sample. A GPU backend runs the forward meanwhile; this default runs
        the whole step in ``launch_procs``."""
        return _Deferred(batch, src_rows)

    def launch_procs(self, handle: Any, procs: ProcessorRows | None) -> Any:
        """The processors of a ``launch_deferred`` step; returns the handle ``finish`` takes."""
        handle.batch.procs = procs
        return self.launch(handle.batch, handle.src_rows)

    def finish(self, handle: Any) -> StepOutput:
        if isinstance(handle, _Deferred):  # discarded before its processors came
            return StepOutput(sampled=np.zeros(0, np.int32))
        return handle

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass
