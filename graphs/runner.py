"""Capture and replay decode steps as CUDA graphs, one per batch bucket.

The runner is given a ``DecodePlan`` (the buckets, the split-KV factor of each, lazy or eager
capture) and two callables over its caller's static buffers: ``stage(bucket)`` writes valid
padding inputs into every row of a bucket, ``body(bucket, num_splits)`` enqueues one decode step
of that many rows. It never sees the executor. Every graph reads the static buffers (ids,
positions, slots, context lengths, the page-index table sized by reference, sampling parameters
and seeds): nothing a step changes is baked into a graph. Buckets are captured largest first,
each after a warm-up run of its body that has compiled and loaded every kernel
(``cute.compile`` never runs inside a capture).

A decode step of B sequences: ``can_replay(B)``; if so ``bucket = pad(B)`` (captures it now when
capture is lazy), the caller uploads its inputs padded to ``bucket``, then ``replay(bucket)``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.cuda.driver import Graph, Stream
from engine.progress import progress
from graphs.buckets import bucket_for

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


# makes the Graph of the work a callable enqueues on a stream (driver.Graph.capture)
GraphFactory = Callable[[Stream, Callable[[], None]], Graph]


class GraphError(RuntimeError):
    """A graph asked for that the plan does not hold, or that was never captured."""


@dataclass(frozen=True)
class DecodePlan:
    """What the runner captures: batch buckets (ascending), the split-KV factor each bucket's
    graph is captured with (an eager step of that bucket must use the same), and whether a
    bucket is captured on first use (``lazy``) or only by ``capture_all``."""

    buckets: tuple[int, ...]
    splits: Mapping[int, int]  # bucket -> num_splits
    lazy: bool = False

    def __post_init__(self) -> None:
        b = self.buckets
        if not b or any(not isinstance(x, int) or x < 1 for x in b):
            raise ValueError(f"DecodePlan.buckets must be positive ints, got {b!r}")
        if any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"DecodePlan.buckets must be strictly ascending, got {b!r}")
        if set(self.splits) != set(b):
            raise ValueError(f"DecodePlan.splits must have one entry per bucket: buckets {b!r}, "
                             f"splits for {sorted(self.splits)!r}")
        bad = {k: v for k, v in self.splits.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"DecodePlan.splits must be ints >= 1, got {bad!r}")

    def bucket(self, num_seqs: int) -> int | None:
        """Smallest bucket >= num_seqs, or None when the batch is larger than every bucket."""
        return bucket_for(num_seqs, self.buckets)


@dataclass
class CapturedGraph:
    bucket: int
    num_splits: int
    graph: Graph
    kernel_names: list[str]  # every kernel node, in node order

    @property
    def capture_s(self) -> float:
        return self.graph.capture_s

    @property
    def mem_bytes(self) -> int:
        return self.graph.mem_bytes


class GraphRunner:
    """Owns the captured decode graphs of one plan. ``capture_graph`` makes a ``Graph`` of the
    work a callable enqueues on a stream (tests inject a fake one: the runner's logic without a
    GPU)."""

    def __init__(self, plan: DecodePlan, stage: Callable[[int], None],
                 body: Callable[[int, int], None], stream: Stream,
                 capture_graph: GraphFactory = Graph.capture) -> None:
        self.plan = plan
        self._stage, self._body, self._stream = stage, body, stream
        self._capture_graph = capture_graph
        self.graphs: dict[int, CapturedGraph] = {}
        self.replays = 0

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.plan.buckets

    @property
    def lazy(self) -> bool:
        return self.plan.lazy

    # -- capture ---------------------------------------------------------------------------------
    def capture(self, bucket: int) -> CapturedGraph:
        """Stage padding inputs, warm the body up (every kernel compiled and loaded), capture it.
        Overwrites the static buffers: stage a step's real inputs after this."""
        if bucket not in self.plan.splits:
            raise GraphError(f"bucket {bucket} is not in the decode plan {self.plan.buckets}")
        splits = self.plan.splits[bucket]
        self._stage(bucket)
        self._body(bucket, splits)  # warm-up
        graph = self._capture_graph(self._stream, lambda: self._body(bucket, splits))
        g = CapturedGraph(bucket, splits, graph, graph.kernel_names())
        old = self.graphs.get(bucket)
        self.graphs[bucket] = g
        if old is not None:
            old.graph.destroy()
        return g

    def capture_all(self, show: bool = True) -> dict[str, float]:
        """Capture every bucket, largest first. Returns totals for the start-up report."""
        t0 = time.perf_counter()
        with progress(sorted(self.buckets, reverse=True), "capturing decode graphs",
                      enable=show, unit="bucket") as bar:
            for b in bar:
                if b not in self.graphs:
                    self.capture(b)
        total = time.perf_counter() - t0
        mem = sum(g.mem_bytes for g in self.graphs.values())
        if show:
            log.info("captured %d decode graphs in %.1fs (graph memory %.1f MiB)",
                     len(self.graphs), total, mem / 2**20)
        return {"graphs": len(self.graphs), "capture_s": total, "graph_mem_bytes": mem}

    # -- replay ----------------------------------------------------------------------------------
    def can_replay(self, num_seqs: int) -> bool:
        """A decode step of ``num_seqs`` rows can replay a graph: its bucket exists and is
        captured, or capture is lazy."""
        bk = self.plan.bucket(num_seqs)
        return bk is not None and (self.plan.lazy or bk in self.graphs)

    def pad(self, num_seqs: int) -> int:
        """The bucket a step of ``num_seqs`` rows pads to, captured by the time this returns (a
        lazy capture runs here, before the caller stages the step's inputs)."""
        bk = self.plan.bucket(num_seqs)
        if bk is None:
            raise GraphError(f"a step of {num_seqs} sequences exceeds the largest decode "
                             f"graph bucket ({self.plan.buckets[-1]}); run it eagerly")
        if bk not in self.graphs:
            if not self.plan.lazy:
                raise GraphError(f"bucket {bk} is not captured (capture_all first, or a lazy "
                                 "plan)")
            self.capture(bk)
        return bk

    def replay(self, bucket: int) -> None:
        """Launch ``bucket``'s graph over whatever the static buffers hold."""
        try:
            g = self.graphs[bucket]
        except KeyError:
            raise GraphError(f"bucket {bucket} is not captured (pad() or capture() first)") \
                from None
        g.graph.launch(self._stream)
        self.replays += 1

    def destroy(self) -> None:
        graphs, self.graphs = list(self.graphs.values()), {}
        for g in graphs:
            g.graph.destroy()
