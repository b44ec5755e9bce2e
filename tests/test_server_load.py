"""Bounded load: 64 concurrent streaming clients (tools/bench_serving.py's client) send a fixed
number of requests to a server whose KV cache is too small for all of them at once (so requests
are preempted and recomputed), while a few impatient clients disconnect mid-stream. Every
accepted request gets exactly one terminal chunk and [DONE]; afterwards the KV pages are back at
their baseline. Also a smoke run of the bench CLI (table + JSON)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
aiohttp = pytest.importorskip("aiohttp")

from engine.server import bench_client as bench_serving  # noqa: E402
from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import (  # noqa: E402
    SERVER_CORE,
    make_engine,
    running_server,
    wait_idle,
    write_test_checkpoint,
)

CLIENTS = 64
REQUESTS = 192
INPUT_LEN = 16
OUTPUT_LEN = 12
IMPATIENT = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAIServer]:
    model = write_test_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), "tiny")
    # 64 requests of up to 2 pages each want 128 pages: 80 forces preemption under load
    # max_model_len 1024: the impatient clients' requests (1000 tokens) outlast any delay in
    # noticing their hang-up on a loaded 2-core CI box (at 200 tokens one in ~6 runs finished
    # by length first)
    engine = make_engine(model, core=SERVER_CORE, max_num_seqs=CLIENTS,
                         num_gpu_blocks_override=80, max_model_len=1024)
    with running_server(engine) as s:
        yield s


def sample(server: OpenAIServer, name: str, **labels: str) -> float:
    v = server.metrics.registry.get_sample_value(
        name, {"model_name": server.served_model_name, **labels})
    return 0.0 if v is None else v


async def _impatient(url: str, model: str, n: int) -> int:
    """Clients that read one chunk and hang up; returns how many got a first chunk."""
    got = 0
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            await asyncio.sleep(0.05)
            payload = {"model": model, "prompt": [7 + i] * INPUT_LEN, "max_tokens": 1000,
                       "stream": True, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=payload) as resp:
                assert resp.status == 200
                line = await resp.content.readline()
                got += line.startswith(b"data: ")
                resp.close()  # hang up mid-stream
    return got


async def _load(url: str, model: str) -> tuple[dict, list[bench_serving.RequestResult], int]:
    prompts = bench_serving.make_prompts(REQUESTS, INPUT_LEN, "ids", seed=1,
                                         vocab_range=(3, 1000), range_ratio=0.25)
    bench = bench_serving.run_benchmark(url, prompts, OUTPUT_LEN, model=model,
                                        max_concurrency=CLIENTS, ignore_eos=True,
                                        temperature=0.8, timeout=120)
    (summary, results), impatient = await asyncio.gather(bench, _impatient(url, model,
                                                                           IMPATIENT))
    return summary, results, impatient


def test_64_streaming_clients(server: OpenAIServer) -> None:
    assert wait_idle(server)
    base = server.async_engine.snapshot()["kv"]
    base_length = sample(server, "cuteinfer:requests_total", outcome="length")
    base_abort = sample(server, "cuteinfer:requests_total", outcome="abort")

    summary, results, impatient = asyncio.run(_load(server.url, server.served_model_name))

    assert len(results) == REQUESTS
    bad = [r.error for r in results if not r.success]
    assert not bad, bad[:3]
    for r in results:
        assert r.done and r.terminal_events == 1 and r.finish_reasons == ["length"]
        assert r.output_tokens == OUTPUT_LEN and r.prompt_tokens > 0
    assert summary["completed"] == REQUESTS and summary["output_throughput"] > 0
    assert impatient == IMPATIENT
    # the server's own accounting agrees: every request ended exactly once
    assert wait_idle(server, timeout=30)
    assert sample(server, "cuteinfer:requests_total", outcome="length") - base_length == REQUESTS
    assert sample(server, "cuteinfer:requests_total", outcome="abort") - base_abort == IMPATIENT
    assert sample(server, "cuteinfer:requests_total", outcome="error") == 0
    kv = server.async_engine.snapshot()["kv"]
    assert kv["in_use"] == base["in_use"] == 0 and kv["requests"] == 0
    assert kv["free"] + kv["reclaimable"] == base["free"] + base["reclaimable"] == kv["pages"]
    assert server.async_engine.snapshot()["num_preemptions"] > 0  # the cache was contended
    print(f"\nload: {REQUESTS} requests, {CLIENTS} clients, {summary['duration_s']:.1f}s, "
          f"{summary['output_throughput']:.0f} out tok/s, TTFT p50 "
          f"{summary['ttft_ms']['p50']:.0f} ms, TPOT p50 {summary['tpot_ms']['p50']:.0f} ms, "
          f"{server.async_engine.snapshot()['num_preemptions']} preemptions")


def test_bench_cli_table_and_json(server: OpenAIServer, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = bench_serving.main([
        "--base-url", server.url, "--num-prompts", "6", "--random-input-len", "8",
        "--random-output-len", "4", "--vocab-range", "3", "1000", "--request-rate", "50",
        "--max-concurrency", "4", "--ignore-eos", "--out", str(out), "--save-detailed"])
    assert code == 0
    table = capsys.readouterr().out
    for row in ("Successful requests:", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                "Median TPOT (ms):", "P99 ITL (ms):"):
        assert row in table
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["completed"] == 6 and s["failed"] == 0 and s["total_output_tokens"] == 24
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(s[key]) == {"mean", "p50", "p99", "max"}
        assert s[key]["max"] >= s[key]["p99"] >= s[key]["p50"] > 0
    assert len(doc["requests"]) == 6 and doc["config"]["request_rate"] == 50
