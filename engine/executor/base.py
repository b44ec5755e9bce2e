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

from engine.step import StepBatch, StepOutput


class ExecutorError(RuntimeError):
    """A step that the executor could not run. The scheduler fails the step's requests only."""


class Executor(ABC):
    """Runs the model on a StepBatch. Owns the KV cache (``num_pages`` pages)."""

    num_pages: int
    page_size: int
    # Progress counter, bumped at least once per layer of a forward (numpy) and once per step:
    # the server's watchdog judges liveness by it, so a long but moving step is never "dead".
    heartbeat: int = 0

    @abstractmethod
    def execute(self, batch: StepBatch) -> StepOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass
