"""Prometheus metrics for ``/metrics`` (prometheus-client, one registry per server).

Per-request numbers (outcomes, TTFT / TPOT / end-to-end latency, token counts, prefix-cache hits)
are observed on the engine thread as each request finishes. Engine gauges (running and waiting
requests, KV pages, preemptions, graph replays vs eager steps) are read at scrape time from the
snapshot the engine thread publishes, so a scrape never touches the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.request import Request

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0)

# outcome label values: the engine's finish reasons, plus what the HTTP layer refuses
OUTCOMES = ("stop", "length", "abort", "error", "rejected", "unavailable")


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]],
                 healthy: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("cuteinfer_requests", "Requests by outcome: finish reason "
                                "(stop, length, abort, error) or refusal (rejected = 4xx, "
                                "unavailable = 503)", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.ttft = Histogram("cuteinfer_time_to_first_token_seconds",
                              "Arrival at the engine to the first output token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("cuteinfer_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("cuteinfer_e2e_request_latency_seconds",
                             "Arrival at the engine to the end of the request",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cuteinfer_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("cuteinfer_generation_tokens", "Output tokens of "
                                         "finished requests", registry=r)
        self.prefix_queried = Counter("cuteinfer_prefix_cache_queries", "Prompt tokens looked "
                                      "up in the prefix cache (finished requests)", registry=r)
        self.prefix_hits = Counter("cuteinfer_prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache (finished requests)", registry=r)
        self.prefix_query_total = 0  # the same two counts, for the hit-rate gauge
        self.prefix_hit_total = 0
        r.register(_EngineCollector(snapshot, healthy, self))

    def on_finish(self, req: Request) -> None:
        """Engine thread: a request finished (any reason)."""
        m = req.metrics
        now = time.perf_counter()
        reason = req.finish_reason.value if req.finish_reason else "error"
        self.requests.labels(reason).inc()
        arrival = m.get("arrival")
        first = m.get("first_token")
        n = len(req.output_token_ids)
        if arrival is not None:
            self.e2e.observe(now - arrival)
            if first is not None:
                self.ttft.observe(first - arrival)
        if first is not None and n > 1:
            self.tpot.observe((m.get("last_token", first) - first) / (n - 1))
        self.generation_tokens.inc(n)
        self.prompt_tokens.inc(req.num_prompt_tokens)
        if first is not None:  # it was admitted, so the prefix cache was consulted
            hit = min(req.num_cached_tokens, req.num_prompt_tokens)
            self.prefix_queried.inc(req.num_prompt_tokens)
            self.prefix_hits.inc(hit)
            self.prefix_query_total += req.num_prompt_tokens
            self.prefix_hit_total += hit

    def refused(self, status: int) -> None:
        self.requests.labels("unavailable" if status == 503 else "rejected").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], healthy: Callable[[], bool],
                 metrics: ServerMetrics) -> None:
        self.snapshot = snapshot
        self.healthy = healthy
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        kv = s.get("kv", {})
        g = GaugeMetricFamily("cuteinfer_engine_healthy", "1 while the engine loop is alive "
                              "and making progress, else 0")
        g.add_metric([], 1.0 if self.healthy() else 0.0)
        yield g
        for name, key, doc in (("running", "running", "Requests in the running batch"),
                               ("waiting", "waiting", "Requests waiting (incl. preempted)")):
            g = GaugeMetricFamily(f"cuteinfer_num_requests_{name}", doc)
            g.add_metric([], float(s.get(key, 0)))
            yield g
        g = GaugeMetricFamily("cuteinfer_kv_pages", "KV pages by state: live (in a request's "
                              "table), cached (registered in the prefix cache), reclaimable "
                              "(inactive, evictable), free, in_use, total", labels=["state"])
        for state, key in (("live", "live"), ("cached", "cached"),
                           ("reclaimable", "reclaimable"), ("free", "free"),
                           ("in_use", "in_use"), ("total", "pages")):
            g.add_metric([state], float(kv.get(key, 0)))
        yield g
        m = self.metrics
        queried, hits = m.prefix_query_total, m.prefix_hit_total
        g = GaugeMetricFamily("cuteinfer_prefix_cache_hit_rate", "Prompt tokens served from "
                              "the prefix cache / prompt tokens looked up, since start")
        g.add_metric([], hits / queried if queried else 0.0)
        yield g
        c = CounterMetricFamily("cuteinfer_num_preemptions", "Requests preempted (pages "
                                "released, recomputed later)")
        c.add_metric([], float(s.get("num_preemptions", 0)))
        yield c
        c = CounterMetricFamily("cuteinfer_engine_steps", "Engine steps by kind: graph "
                                "(CUDA graph replay), eager, failed", labels=["kind"])
        for kind in ("graph", "eager", "failed"):
            c.add_metric([kind], float(s.get(f"{kind}_steps", 0)))
        yield c
