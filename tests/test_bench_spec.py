"""tools/bench_spec.py on the numpy backend (no GPU): a run's acceptance recorded with
``--record-acceptance`` and replayed with ``--proposer replay`` gives the recorded steps, drafts
and accepted drafts exactly, and outputs equal to plain decoding's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tools.bench_spec", "--backend", "numpy",
                          *args], cwd=REPO, capture_output=True, text=True, timeout=600,
                         check=True)
    return json.loads(out.stdout[out.stdout.index("{"):])


def test_replayed_acceptance_matches_the_recording(tmp_path: Path) -> None:
    from engine.model.synthetic import write_checkpoint

    model = write_checkpoint(tmp_path / "m", "tiny-qwen3", seed=int(
        np.random.default_rng().integers(1 << 20)), quiet=True)
    acc = tmp_path / "acc.json"
    common = ["--model", str(model), "--requests", "3", "--max-tokens", "48", "--k", "5"]
    rec = _bench(*common, "--record-acceptance", str(acc))
    trace = json.loads(acc.read_text())["trace"]
    assert len(trace) == 3
    assert sum(d for t in trace for d, _m in t) == rec["spec"]["drafted"] > 0
    assert sum(m for t in trace for _d, m in t) == rec["spec"]["accepted"]
    assert all(0 <= m <= d <= 5 for t in trace for d, m in t)
    rep = _bench(*common, "--proposer", "replay", "--acceptance", str(acc))
    for key in ("spec_steps", "drafted", "accepted"):
        assert rep["spec"][key] == rec["spec"][key], key
    assert rep["batch1_identical_requests"] == rec["batch1_identical_requests"] == 3
