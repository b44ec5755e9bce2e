"""Capture and replay decode steps as CUDA graphs, one per batch bucket.

Every graph reads the executor's static buffers (ids, positions, slots, context lengths, the
page-index table sized by reference, sampling parameters and seeds): nothing a step changes is
baked into a graph. Buckets are captured largest first, after a warm-up that has compiled and
loaded every kernel (``cute.compile`` never runs inside a capture).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.cuda.driver import _cu, check
from engine.progress import Progress
from engine.step import StepBatch
from graphs.buckets import bucket_for, bucket_sizes


@dataclass
class CapturedGraph:
    bucket: int
    num_splits: int
    graph: Any
    exec: Any
    capture_s: float
    mem_bytes: int
    kernel_names: list[str] = field(default_factory=list)


def kernel_node_names(graph: Any) -> list[str]:
    """Kernel name of every kernel node of a graph (in node order)."""
    cu = _cu()
    _, n = check(cu.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
    nodes, _ = check(cu.cuGraphGetNodes(graph, n), "cuGraphGetNodes")
    names = []
    for node in nodes:
        if check(cu.cuGraphNodeGetType(node), "cuGraphNodeGetType") != \
                cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
            continue
        params = check(cu.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        try:
            name = check(cu.cuFuncGetName(params.func), "cuFuncGetName")
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        except Exception:  # older drivers: no cuFuncGetName
            names.append("kernel")
    return names


class GraphRunner:
    """Owns the captured graphs of one executor."""

    def __init__(self, executor: Any, buckets: list[int] | None = None) -> None:
        self.ex = executor
        cfg = executor.config
        self.buckets = sorted(buckets) if buckets else bucket_sizes(
            executor.sizes.b_max, cfg.cuda_graph_max_bs)
        self.graphs: dict[int, CapturedGraph] = {}
        self.lazy = bool(cfg.lazy_graph_capture)
        self.replays = 0

    # -- capture ---------------------------------------------------------------------------------
    def _warm_inputs(self, bucket: int) -> None:
        """Valid padding inputs for every row (graphs are captured over real buffers)."""
        ex = self.ex
        z = np.zeros(0, np.int32)
        b = StepBatch(input_ids=z, positions=z, slot_mapping=np.zeros(0, np.int64),
                      cu_seqlens_q=np.zeros(1, np.int32), context_lens=z,
                      page_indices=np.zeros((0, 1), np.int32), sample_token_idx=z,
                      temperature=np.zeros(0, np.float32), top_k=z,
                      top_p=np.zeros(0, np.float32), min_p=np.zeros(0, np.float32),
                      seeds=np.zeros(0, np.uint64), sample_steps=np.zeros(0, np.uint32),
                      num_logprobs=z)
        ex.upload(b, pad_to=bucket)
        ex.upload_sampling(b, pad_to=bucket)

    def capture(self, bucket: int) -> CapturedGraph:
        cu, ex = _cu(), self.ex
        splits = ex.decode_splits(bucket)
        self._warm_inputs(bucket)
        ex.decode_body(bucket, splits)  # warm-up: every kernel compiled and loaded
        ex.stream.synchronize()
        free0, _ = ex.ctx.mem_info()
        t0 = time.perf_counter()
        check(cu.cuStreamBeginCapture(
            ex.stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture")
        try:
            ex.decode_body(bucket, splits)
        finally:
            graph = check(cu.cuStreamEndCapture(ex.stream.handle), "cuStreamEndCapture")
        gexec = check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        check(cu.cuGraphUpload(gexec, ex.stream.handle), "cuGraphUpload")
        ex.stream.synchronize()
        dt = time.perf_counter() - t0
        free1, _ = ex.ctx.mem_info()
        g = CapturedGraph(bucket, splits, graph, gexec, dt, max(0, free0 - free1),
                          kernel_node_names(graph))
        self.graphs[bucket] = g
        return g

    def capture_all(self, show: bool = True) -> dict[str, float]:
        """Capture every bucket, largest first. Returns totals for the start-up report."""
        t0 = time.perf_counter()
        with Progress(len(self.buckets), "capturing decode graphs", " buckets",
                      enabled=show) as bar:
            for b in sorted(self.buckets, reverse=True):
                if b not in self.graphs:
                    self.capture(b)
                bar.update(1)
        total = time.perf_counter() - t0
        mem = sum(g.mem_bytes for g in self.graphs.values())
        if show:
            print(f"[cuteinfer] captured {len(self.graphs)} decode graphs in {total:.1f}s "
                  f"(graph memory {mem / 2**20:.1f} MiB)", file=sys.stderr)
        return {"graphs": len(self.graphs), "capture_s": total, "graph_mem_bytes": mem}

    # -- replay ----------------------------------------------------------------------------------
    def bucket(self, b: StepBatch) -> int | None:
        """The bucket a decode step replays, or None (run eagerly)."""
        bk = bucket_for(b.num_seqs, self.buckets)
        if bk is None:
            return None
        if bk not in self.graphs:
            if not self.lazy:
                return None
            self.capture(bk)
        return bk

    def launch(self, bucket: int) -> None:
        check(_cu().cuGraphLaunch(self.graphs[bucket].exec, self.ex.stream.handle),
              "cuGraphLaunch")
        self.replays += 1

    def replay_bucket(self, bucket: int) -> None:
        """Benchmarks: replay a bucket over whatever the static buffers hold."""
        if bucket not in self.graphs:
            self.capture(bucket)
        self.launch(bucket)

    def destroy(self) -> None:
        cu = _cu()
        for g in self.graphs.values():
            cu.cuGraphExecDestroy(g.exec)
            cu.cuGraphDestroy(g.graph)
        self.graphs.clear()
