"""``cuteinfer serve`` with its engine core in a child process (the default): when the core
process dies mid-stream every client in flight gets a terminal error within 5 s, /health turns
503, and the server exits non-zero for its supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("zmq")

from engine.server.testing import free_port, http, wait_healthy  # noqa: E402

CLIENTS = 6


def _core_pid(server_pid: int) -> int:
    """The engine core: the server's child started by multiprocessing's spawn."""
    for tid in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{tid}/children") as f:
            for pid in f.read().split():
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    if b"spawn_main" in c.read():
                        return int(pid)
    raise AssertionError("no engine core process found")


def _stream(url: str, i: int, out: dict[int, tuple[list[dict], float]]) -> None:
    body = {"model": "m", "prompt": [5 + i] * 8, "max_tokens": 4000, "ignore_eos": True,
            "stream": True, "temperature": 0}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    events: list[dict] = []
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            for line in resp:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
    except OSError as e:  # a cut connection is an error the client sees, also acceptable
        events.append({"error": {"message": f"connection: {e}"}})
    out[i] = (events, time.monotonic())


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_core_killed_mid_stream(tmp_path: Path) -> None:
    from engine.server.testing import write_test_checkpoint

    model = write_test_checkpoint(tmp_path / "tiny", "tiny")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--backend",
         "numpy", "--port", str(port), "--served-model-name", "m", "--max-model-len", "4096",
         "--shutdown-grace", "1", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, url)
        core = _core_pid(proc.pid)
        out: dict[int, tuple[list[dict], float]] = {}
        threads = [threading.Thread(target=_stream, args=(url, i, out)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # all streaming by now (4000 tokens take longer)
        killed_at = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(10)
        assert len(out) == CLIENTS, "a client is still waiting"
        for events, ended in out.values():
            assert ended - killed_at < 5.0, "a client waited more than 5 s for its end"
            assert events and any("choices" in e for e in events), "no token before the kill"
            assert "error" in events[-1], f"the stream ended without an error: {events[-1]}"
        status, _ = http("GET", f"{url}/health", timeout=5)
        assert status == 503
        assert proc.wait(timeout=20) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
