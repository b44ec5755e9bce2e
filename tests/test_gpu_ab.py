"""tools/gpu_ab.sh runs one command over the working tree and a baseline archive, alternating,
each run importing its own tree's code (checked without a GPU: the command prints where
``engine`` comes from)."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_run_imports_its_own_tree(tmp_path: Path) -> None:
    pkg = tmp_path / "src" / "engine"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("WHO = 'base'\n")
    archive = tmp_path / "base.tar.xz"
    with tarfile.open(archive, "w:xz") as t:
        t.add(pkg, arcname="engine")
    cmd = ["bash", "tools/gpu_ab.sh", sys.executable, "-c",
           "import engine, os; print('{tag}', getattr(engine, 'WHO', 'new'), "
           "os.getcwd() == os.path.dirname(os.path.dirname(engine.__file__)))"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                            "BASE": str(archive), "ROUNDS": "2", "HOME": str(tmp_path)})
    assert p.returncode == 0, p.stdout + p.stderr
    runs = [ln for ln in p.stdout.splitlines() if not ln.startswith("===")]
    assert runs == ["new1 new True", "base1 base True", "new2 new True", "base2 base True"]


def test_a_missing_baseline_is_refused() -> None:
    p = subprocess.run(["bash", "tools/gpu_ab.sh", "true"], cwd=ROOT, capture_output=True,
                       text=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                       "BASE": "/nonexistent.tar.xz"})
    assert p.returncode == 2 and "BASE=" in p.stdout
