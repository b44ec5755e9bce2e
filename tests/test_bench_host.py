"""tools/bench_host.py runs on CPU (no GPU): the engine over its null executor completes every
request, and the report has the fields docs/perf.md quotes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_engine(batch: int, gpu_ms: float) -> dict:
    """``python -m tools.bench_host`` as a user runs it (tools is a script folder, never imported
    by the package or its tests); its one line of output is the report dict."""
    out = subprocess.run([sys.executable, "-m", "tools.bench_host", "--batch", str(batch),
                          "--gpu-ms", str(gpu_ms)], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True)
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_bench_host_engine_mode_runs():
    rec = bench_engine(batch=3, gpu_ms=0.0)
    assert rec["mode"] == "engine" and rec["batch"] == 3
    assert rec["steps"] == 255  # 256 tokens: one from the prefill step, 255 decode steps
    assert 0 < rec["host_ms_median"] <= rec["host_ms_p90"]


def test_bench_host_prices_a_structured_step():
    """``--constrained``: the same batch plain, then with rows under a JSON schema (a Qwen3
    tokenizer checkpoint; the null executor samples what the masks allow): both run to
    max_tokens, and the report has the mask wait and the added host time."""
    out = subprocess.run([sys.executable, "-m", "tools.bench_host", "--batch", "4",
                          "--constrained", "2", "--max-tokens", "24"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, check=True)
    rec = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert rec["constrained"] == 2 and rec["schema"] == "records_unbounded"
    assert rec["steps"] == 23  # the batch ran to max_tokens (24: one from the prefill)
    assert rec["mask_wait_ms"] >= 0 and rec["plain_host_ms_median"] > 0
    assert rec["added_ms_median"] == round(rec["host_ms_median"]
                                           - rec["plain_host_ms_median"], 3)
