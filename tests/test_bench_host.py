"""tools/bench_host.py runs on CPU (no GPU): the engine over its null executor completes every
request, and the report has the fields docs/perf.md quotes."""

from __future__ import annotations

from tools.bench_host import bench_engine


def test_bench_host_engine_mode_runs(tmp_path):
    rec = bench_engine(batch=3, gpu_ms=0.0, model_dir=tmp_path / "tiny")
    assert rec["mode"] == "engine" and rec["batch"] == 3
    assert rec["steps"] == 255  # 256 tokens: one from the prefill step, 255 decode steps
    assert 0 < rec["host_ms_median"] <= rec["host_ms_p90"]
