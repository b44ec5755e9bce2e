"""tools/bench_offline.py on the numpy backend: every request's tokens counted, the engine
option it passes on (the served run's setting) reported, a batch-1 TPOT from warmed runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.model.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parents[1]


def test_bench_offline_reports_the_run(tmp_path: Path) -> None:
    ckpt = write_checkpoint(tmp_path / "m", "tiny-qwen3", seed=5, quiet=True)
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "tools.bench_offline", "--model", str(ckpt),
                    "--backend", "numpy", "--num-prompts", "6", "--input-len", "12",
                    "--output-len", "5", "--max-num-seqs", "4", "--vocab-range", "0", "100",
                    "--mixed-step-tokens", "8", "--out", str(out)],
                   cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    rec = json.loads(out.read_text())
    assert rec["output_tokens"] == 6 * 5 and rec["mixed_step_tokens"] == 8
    assert rec["output_tok_s"] > 0 and rec["batch1_tpot_ms"] > 0
