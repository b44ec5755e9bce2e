"""Prometheus metrics for ``/metrics`` (prometheus-client, one registry per server): vLLM's names
under the ``cuteinfer:`` prefix, every series labelled ``model_name`` (the served model name).

    vLLM's                                   here as cuteinfer:<name>, from
    num_requests_running / _waiting          gauges   the engine snapshot (scrape time)
    kv_cache_usage_perc                      gauge    "   (KV pages in use / all pages, 0..1)
    num_preemptions_total                    counter  "   (the scheduler's count)
    prompt_tokens_total                      counter  per request, when its prompt is computed
    generation_tokens_total                  counter  per step, as tokens arrive
    prefix_cache_queries_total / _hits_total counter  prompt tokens looked up / found, at prefill
    time_to_first_token_seconds              histo    arrival -> first token
    inter_token_latency_seconds              histo    between a request's successive steps
    e2e_request_latency_seconds              histo    arrival -> finish
    request_queue_time_seconds               histo    arrival -> first admitted (scheduled)
    request_prefill_time_seconds             histo    scheduled -> first token
    request_decode_time_seconds              histo    first token -> last token
    request_inference_time_seconds           histo    scheduled -> last token
    request_time_per_output_token_seconds    histo    per request: decode time / (tokens - 1)
    request_success_total{finished_reason}   counter  stop, length, abort

and cuteinfer's own: ``requests_total{outcome}`` (finish reasons plus the HTTP layer's refusals:
rejected = 4xx, unauthorized = 401, unavailable = 503), ``engine_healthy``, ``kv_pages{state}``,
``prefix_cache_hit_rate``, ``engine_steps_total{kind}``.

Per-request numbers are observed on the engine thread: ``on_output`` for each request a step
changed (a few dict reads and at most one histogram observation), ``on_finish`` once per request.
The timestamps are ``Request.metrics``' (``time.perf_counter()``): arrival (front end),
scheduled (the core's admission: ``engine.core.process.AdmissionClock``), first and last token.
Engine gauges are read at scrape time from the snapshot the engine thread publishes (with the
engine core in its own process, the snapshot the core sends every 0.1 s), so a scrape never
touches the engine.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from engine.request import Request

PREFIX = "cuteinfer:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 60.0, 120.0, 240.0, 480.0)

# outcome label values: the engine's finish reasons, plus what the HTTP layer refuses
OUTCOMES = ("stop", "length", "abort", "error", "rejected", "unauthorized", "unavailable")
SUCCESS_REASONS = ("stop", "length", "abort")  # vLLM's request_success finished_reason values
_SEEN_AT, _SEEN_N = "seen_token", "seen_tokens"  # Request.metrics keys of on_output's cursor


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], healthy: Callable[[], bool],
                 model_name: str = "") -> None:
        disable_created_metrics()  # no *_created series (as vLLM): process-wide, idempotent
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*label, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, label, buckets=buckets,
                             registry=r).labels(model_name)

        self.requests = counter("requests", "Requests by outcome: finish reason (stop, length, "
                                "abort, error) or refusal (rejected = 4xx, unauthorized = 401, "
                                "unavailable = 503)", ("outcome",))
        for o in OUTCOMES:
            self.requests.labels(model_name, o)
        self.success = counter("request_success", "Finished requests by finish reason",
                               ("finished_reason",))
        for reason in SUCCESS_REASONS:
            self.success.labels(model_name, reason)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed or found in the "
                                     "prefix cache (per request, at its first token)"
                                     ).labels(model_name)
        # the two series every token moves: plain numbers on the engine thread, rendered at
        # scrape time (_EngineCollector). A prometheus-client Counter.inc and Histogram.observe
        # per changed request and step were ~20% of the front end's engine-thread time
        # (yappi, tools/bench_host.py --server, docs/perf.md v20)
        self.generation_tokens = 0
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache").labels(model_name)
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix "
                                   "cache").labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to the first output "
                              "token", TTFT_BUCKETS)
        self.itl = LightHistogram(ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Per request: decode "
                              "time / (output tokens - 1)", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the end of the request",
                             PHASE_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled "
                               "(time spent waiting)", PHASE_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to the first "
                                 "output token", PHASE_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First output token to the last",
                                PHASE_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "First scheduled to the "
                                   "last output token", PHASE_BUCKETS)
        self.prefix_query_total = 0  # the same two counts, for the hit-rate gauge
        self.prefix_hit_total = 0
        r.register(_EngineCollector(snapshot, healthy, self))

    # -- the engine thread -----------------------------------------------------------------------
    def on_output(self, req: Request) -> None:
        """A step changed ``req`` (new tokens, or finished): token counts and the ITL."""
        m = req.metrics
        last = m.get("last_token")
        if last is None:
            return
        n = len(req.output_token_ids)
        seen = m.get(_SEEN_AT)
        if seen is None:  # the first token: the prompt is computed
            self.prompt_tokens.inc(req.num_prompt_tokens)
            hit = min(req.num_cached_tokens, req.num_prompt_tokens)
            self.prefix_queries.inc(req.num_prompt_tokens)
            self.prefix_hits.inc(hit)
            self.prefix_query_total += req.num_prompt_tokens
            self.prefix_hit_total += hit
        elif last > seen:
            self.itl.observe(last - seen)
        m[_SEEN_AT] = last
        new = n - m.get(_SEEN_N, 0)
        if new > 0:
            self.generation_tokens += new
            m[_SEEN_N] = n

    def on_finish(self, req: Request) -> None:
        """A request finished (any reason); ``on_output`` has seen its tokens."""
        m = req.metrics
        now = time.perf_counter()
        reason = req.finish_reason.value if req.finish_reason else "error"
        self.requests.labels(self.model_name, reason).inc()
        if reason in SUCCESS_REASONS:
            self.success.labels(self.model_name, reason).inc()
        arrival, scheduled = m.get("arrival"), m.get("scheduled")
        first, last = m.get("first_token"), m.get("last_token")
        if arrival is not None:
            self.e2e.observe(now - arrival)
        if first is None:  # never produced a token: no phase to time
            return
        last = first if last is None else last
        if arrival is not None:
            self.ttft.observe(first - arrival)
            if scheduled is not None:
                self.queue.observe(max(0.0, scheduled - arrival))
        if scheduled is not None:
            self.prefill.observe(max(0.0, first - scheduled))
            self.inference.observe(max(0.0, last - scheduled))
        self.decode.observe(last - first)
        n = len(req.output_token_ids)
        if n > 1:
            self.tpot.observe((last - first) / (n - 1))

    def refused(self, status: int) -> None:
        outcome = {503: "unavailable", 401: "unauthorized"}.get(status, "rejected")
        self.requests.labels(self.model_name, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LightHistogram:
    """A histogram observed by one thread (the engine's) and rendered at scrape time: a bisect
    and two additions per value instead of prometheus-client's locked per-bucket counters. A
    scrape during an observation may see ``_sum`` without that value; the buckets and
    ``_count`` always agree."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(self.bounds, v)] += 1
        self.sum += v

    def family(self, name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cum, buckets = 0, []
        for b, c in zip(self.bounds, counts, strict=False):
            cum += c
            buckets.append((floatToGoString(b), float(cum)))
        buckets.append(("+Inf", float(cum + counts[-1])))
        h = HistogramMetricFamily(name, doc, labels=["model_name"])
        h.add_metric(labels, buckets, total)
        return h


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
        m = self.metrics
        model = [m.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(model, value)
            return g

        yield gauge("engine_healthy", "1 while the engine loop is alive and making progress, "
                    "else 0", 1.0 if self.healthy() else 0.0)
        yield gauge("num_requests_running", "Requests in the running batch",
                    float(s.get("running", 0)))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. "
                    "preempted)", float(s.get("waiting", 0)))
        pages = kv.get("pages", 0)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache pages in use (0 to 1)",
                    kv.get("in_use", 0) / pages if pages else 0.0)
        g = GaugeMetricFamily(PREFIX + "kv_pages", "KV pages by state: live (in a request's "
                              "table), cached (registered in the prefix cache), reclaimable "
                              "(inactive, evictable), free, in_use, total",
                              labels=["model_name", "state"])
        for state, key in (("live", "live"), ("cached", "cached"),
                           ("reclaimable", "reclaimable"), ("free", "free"),
                           ("in_use", "in_use"), ("total", "pages")):
            g.add_metric([*model, state], float(kv.get(key, 0)))
        yield g
        queried, hits = m.prefix_query_total, m.prefix_hit_total
        yield gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt "
                    "tokens looked up, since start", hits / queried if queried else 0.0)
        c = CounterMetricFamily(PREFIX + "generation_tokens", "Output tokens generated",
                                labels=["model_name"])
        c.add_metric(model, float(m.generation_tokens))
        yield c
        yield m.itl.family(PREFIX + "inter_token_latency_seconds", "Time between a request's "
                           "successive output steps", model)
        c = CounterMetricFamily(PREFIX + "num_preemptions", "Requests preempted (pages "
                                "released, recomputed later)", labels=["model_name"])
        c.add_metric(model, float(s.get("num_preemptions", 0)))
        yield c
        sp = s.get("spec") or {}
        for name, key, doc in (
                ("spec_decode_num_drafts", "drafts", "Speculative spans verified"),
                ("spec_decode_num_draft_tokens", "draft_tokens", "Draft tokens proposed"),
                ("spec_decode_num_accepted_tokens", "accepted_tokens",
                 "Draft tokens accepted (equal to the target's own token)")):
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(model, float(sp.get(key, 0)))
            yield c
        hist = sp.get("accepted_per_draft") or []
        if hist:  # spans by accepted drafts (0..k), as a cumulative histogram
            cum, buckets = 0, []
            for k, n in enumerate(hist):
                cum += n
                buckets.append((str(k), float(cum)))
            buckets.append(("+Inf", float(cum)))
            h = HistogramMetricFamily(PREFIX + "spec_decode_acceptance_length", "Draft tokens "
                                      "accepted per speculative span", labels=["model_name"])
            h.add_metric(model, buckets, float(sum(k * n for k, n in enumerate(hist))))
            yield h
        c = CounterMetricFamily(PREFIX + "engine_steps", "Engine steps by kind: graph (CUDA "
                                "graph replay), eager, failed", labels=["model_name", "kind"])
        for kind in ("graph", "eager", "failed"):
            c.add_metric([*model, kind], float(s.get(f"{kind}_steps", 0)))
        yield c
