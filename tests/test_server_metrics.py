"""A Prometheus scrape of /metrics (issue 18): vLLM's metric names under the ``cuteinfer:`` prefix,
each series labelled ``model_name``, parsed with prometheus-client's own text parser; the engine
gauges (running, waiting, KV usage, preemptions) come from the engine core's stats when it runs in
its own process; the per-request histograms and counters move with the requests served."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import (  # noqa: E402
    SERVER_CORE,
    http,
    make_engine,
    running_server,
    wait_for,
    write_test_checkpoint,
)

MODEL = "tiny-metrics"
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens",
            "num_preemptions")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    """A tiny model with a pool of 11 usable pages: four 76-token requests cannot all fit, so
    the scheduler preempts."""
    tiny = write_test_checkpoint(tmp_path_factory.mktemp("tiny"), "tiny")
    engine = make_engine(tiny, core=SERVER_CORE, num_gpu_blocks_override=12, max_model_len=160)
    with running_server(engine, served_model_name=MODEL) as s:
        yield s


def scrape(server: OpenAIServer) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """/metrics parsed: family name -> {sorted labels -> value} of its samples (by sample name
    for histograms: name_bucket, name_sum, name_count)."""
    status, text = http("GET", f"{server.url}/metrics")
    assert status == 200
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m[name][tuple(sorted({"model_name": MODEL, **labels}.items()))]


def completion(i: int, max_tokens: int = 60) -> dict:
    return {"prompt": [1 + i] * 16, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}


def test_scrape_has_vllm_names_and_labels(server: OpenAIServer) -> None:
    before = scrape(server)
    results: list[int] = []
    threads = [threading.Thread(target=lambda i=i: results.append(
        http("POST", f"{server.url}/v1/completions", completion(i))[0])) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [200] * 4
    # a repeated prompt: a prefix-cache hit
    assert http("POST", f"{server.url}/v1/completions", completion(0, 2))[0] == 200
    m = scrape(server)
    for name in GAUGES:
        assert f"cuteinfer:{name}" in m, name
        assert set(m[f"cuteinfer:{name}"]) == {(("model_name", MODEL),)}
    for name in COUNTERS:
        assert (("model_name", MODEL),) in m[f"cuteinfer:{name}_total"], name
    for name in HISTOGRAMS:
        buckets = m[f"cuteinfer:{name}_bucket"]
        assert all(dict(k)["model_name"] == MODEL and "le" in dict(k) for k in buckets), name
        assert value(m, f"cuteinfer:{name}_count") >= 5, name
    assert value(m, "cuteinfer:prompt_tokens_total") - value(
        before, "cuteinfer:prompt_tokens_total") == 5 * 16
    assert value(m, "cuteinfer:generation_tokens_total") - value(
        before, "cuteinfer:generation_tokens_total") == 4 * 60 + 2
    assert value(m, "cuteinfer:prefix_cache_queries_total") >= 5 * 16
    assert value(m, "cuteinfer:prefix_cache_hits_total") >= 0
    # from the core's scheduler, through the engine snapshot (published at most every
    # snapshot_interval_s and when idle: a scrape right after the requests may predate it)
    assert wait_for(lambda: value(scrape(server), "cuteinfer:num_preemptions_total") > 0)
    # one observation per output step as the front end sees it (steps the core ran while the
    # front end was busy arrive together)
    assert 4 <= value(m, "cuteinfer:inter_token_latency_seconds_count") - value(
        before, "cuteinfer:inter_token_latency_seconds_count") <= 4 * 59 + 1
    assert value(m, "cuteinfer:request_success_total", finished_reason="length") >= 5
    assert 0.0 <= value(m, "cuteinfer:kv_cache_usage_perc") <= 1.0


def test_gauges_follow_the_engine(server: OpenAIServer) -> None:
    """Gauges come from snapshots published every 0.1 s (the core's, then the front end's): the
    work has to outlast a few of them to be seen. Eight requests of 1 + 158 tokens (the longest
    max_model_len 160 allows) over an 11-page pool run one or two at a time."""
    n = 8
    done = threading.Barrier(n + 1)

    def long_request(i: int) -> None:
        http("POST", f"{server.url}/v1/completions", {**completion(7 + i, 158), "prompt": [8 + i]})
        done.wait(120)

    for i in range(n):
        threading.Thread(target=long_request, args=(i,), daemon=True).start()

    def busy() -> bool:
        m = scrape(server)
        return (value(m, "cuteinfer:num_requests_running") >= 1
                and value(m, "cuteinfer:kv_cache_usage_perc") > 0)

    assert wait_for(busy, timeout=30)
    done.wait(120)
    time.sleep(0.3)  # the next snapshot (every 0.1 s)
    assert wait_for(lambda: value(scrape(server), "cuteinfer:num_requests_running") == 0)
    assert value(scrape(server), "cuteinfer:kv_cache_usage_perc") == 0.0


def test_model_name_label_is_the_served_name(chat_dir: Path) -> None:
    with running_server(make_engine(chat_dir), served_model_name="my-model") as s:
        status, text = http("GET", f"{s.url}/metrics")
    assert status == 200 and 'model_name="my-model"' in text and "_created" not in text


def test_light_histogram_renders_as_prometheus_client_does() -> None:
    """The ITL histogram kept as plain numbers renders the samples a prometheus-client
    Histogram given the same values renders: every bucket (values on a bound included), the
    count and the sum."""
    import numpy as np
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from engine.server.metrics import ITL_BUCKETS, LightHistogram

    rng = np.random.default_rng()
    values = [*rng.exponential(0.02, 500).tolist(), *ITL_BUCKETS, 0.0, 99.0]
    reg = CollectorRegistry()
    ref = Histogram("cuteinfer:x", "doc", ["model_name"], buckets=ITL_BUCKETS,
                    registry=reg).labels("m")
    light = LightHistogram(ITL_BUCKETS)
    for v in values:
        ref.observe(v)
        light.observe(v)

    class One:
        def collect(self):
            yield light.family("cuteinfer:x", "doc", ["m"])

    reg2 = CollectorRegistry()
    reg2.register(One())

    def samples(r):
        out = {}
        for fam in text_string_to_metric_families(generate_latest(r).decode()):
            for s in fam.samples:
                if not s.name.endswith("_created"):
                    out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    want, got = samples(reg), samples(reg2)
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
