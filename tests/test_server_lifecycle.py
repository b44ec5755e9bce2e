"""Graceful shutdown of a real server process (the pattern of `cuteinfer serve`): on SIGTERM /
SIGINT new requests get a JSON 503 and /health 503 "shutting down" at once; requests in flight
may finish within the grace; what is still in flight after it gets its terminal answer (a JSON
503 in OpenAI's error shape, or an SSE error event then ``[DONE]``); then the process exits 0.

The server's steps take 50 ms each (a fault hook), so a 200-token request surely outlives a 3 s
grace and a 40-token one surely does not outlive a 30 s one. The hook prints which requests
(named by their first prompt token) each step runs: the test sends the signal only once both
requests are in the same step, i.e. surely in flight.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from engine.server.testing import free_port, http, wait_for, wait_healthy, write_test_checkpoint  # noqa: E402  # noqa: E402
from tests.test_server_faults import REPO  # noqa: E402

STREAMED, PLAIN, LATE = 7, 8, 9  # first prompt token of each request: how the hook names them
SHUTTING_DOWN = "the server is shutting down"

SERVE_SCRIPT = textwrap.dedent("""
    import sys
    import time

    from engine.server.launch import OpenAIServer
    from engine.server.testing import make_engine

    engine = make_engine(sys.argv[1])
    seen = set()

    def slow_step(plan):
        marks = tuple(sorted({s.request.prompt_token_ids[0] for s in plan.seqs}))
        if marks not in seen:
            seen.add(marks)
            print("step", *marks, flush=True)
        time.sleep(0.05)

    engine.fault_hook = slow_step
    server = OpenAIServer(engine, port=int(sys.argv[2]), shutdown_grace_s=float(sys.argv[3]),
                          log_level="warning")
    sys.exit(server.run())
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), "tiny")


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    port: int
    stderr: Path
    steps: list[tuple[int, ...]] = field(default_factory=list)

    def ran_together(self, *marks: int) -> bool:
        return any(set(marks) <= set(s) for s in self.steps)

    def log(self) -> str:
        return self.stderr.read_text()


@contextmanager
def serve(model_dir: Path, tmp_path: Path, grace: float) -> Iterator[Served]:
    script = tmp_path / "serve.py"
    script.write_text(SERVE_SCRIPT)
    port = free_port()
    err = tmp_path / "stderr.txt"
    with err.open("w") as err_f:
        proc = subprocess.Popen(
            [sys.executable, str(script), str(model_dir), str(port), str(grace)], cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=err_f,
            text=True)
    s = Served(proc, f"http://127.0.0.1:{port}", port, err)

    def read_steps() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step"):
                s.steps.append(tuple(int(x) for x in line.split()[1:]))

    reader = threading.Thread(target=read_steps, daemon=True)
    reader.start()
    try:
        wait_healthy(proc, s.url)
        yield s
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(10)


class StreamClient(threading.Thread):
    """One streamed completion, read event by event (``data: ...`` payloads, in order)."""

    def __init__(self, port: int, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.prompt, self.max_tokens = port, prompt, max_tokens
        self.status = 0
        self.events: list[str] = []
        self.first_chunk = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = HTTPConnection("127.0.0.1", self.port, timeout=60)
            body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    self.events.append(line[len("data: "):])
                    self.first_chunk.set()
            conn.close()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.first_chunk.set()

    def payloads(self) -> list[dict[str, Any]]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]


class PlainClient(threading.Thread):
    """One non-streamed completion: its status and parsed body."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.result: tuple[int, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = http("POST", f"{self.url}/v1/completions",
                               {"prompt": self.prompt, "max_tokens": self.max_tokens,
                                "temperature": 0, "ignore_eos": True})
        except BaseException as e:
            self.error = e


def start_both(s: Served, max_tokens: int) -> tuple[StreamClient, PlainClient]:
    """A streamed and a plain request, returned once both run in one step (surely in flight)."""
    streamed = StreamClient(s.port, [STREAMED, 5, 6], max_tokens)
    plain = PlainClient(s.url, [PLAIN, 5, 6], max_tokens)
    streamed.start()
    plain.start()
    assert streamed.first_chunk.wait(60) and streamed.error is None, streamed.error
    assert wait_for(lambda: s.ran_together(STREAMED, PLAIN), timeout=60), s.log()
    return streamed, plain


def assert_draining(s: Served) -> None:
    """Once the signal took effect: /health 503 "shutting down", a new request a JSON 503."""
    assert wait_for(lambda: http("GET", f"{s.url}/health", timeout=5)[0] != 200, timeout=5)
    status, body = http("GET", f"{s.url}/health", timeout=5)
    assert status == 503 and body == {"status": "unhealthy", "reason": SHUTTING_DOWN}
    status, body = http("POST", f"{s.url}/v1/completions",
                        {"prompt": [LATE, 5, 6], "max_tokens": 2}, timeout=5)
    assert status == 503 and body["error"]["type"] == "service_unavailable_error"
    assert SHUTTING_DOWN in body["error"]["message"]


def assert_unavailable_error(err: dict[str, Any]) -> None:
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "service_unavailable_error" and err["code"] == "engine_unavailable"
    assert SHUTTING_DOWN in err["message"]


def test_sigterm_fails_what_outlives_the_grace_then_exits_0(model_dir: Path,
                                                            tmp_path: Path) -> None:
    grace = 3.0
    with serve(model_dir, tmp_path, grace) as s:
        streamed, plain = start_both(s, max_tokens=200)  # >= 10 s of 50 ms steps
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert_draining(s)
        code = s.proc.wait(timeout=grace + 30)
        took = time.monotonic() - t0
        streamed.join(10)
        plain.join(10)
        log = s.log()
    assert code == 0, log
    assert grace <= took < grace + 3, f"exit {took:.1f}s after SIGTERM (grace {grace}s)\n{log}"
    # the plain request: a JSON 503 in OpenAI's error shape
    assert plain.error is None and plain.result is not None, plain.error
    status, body = plain.result
    assert status == 503 and set(body) == {"error"}, body
    assert_unavailable_error(body["error"])
    # the stream: its tokens so far, then an error event, then [DONE]
    assert streamed.error is None and streamed.status == 200, streamed.error
    assert streamed.events[-1] == "[DONE]", streamed.events[-3:]
    *chunks, last = streamed.payloads()
    assert chunks and all("choices" in c for c in chunks)
    assert set(last) == {"error"}, last
    assert_unavailable_error(last["error"])


def test_sigint_lets_requests_that_finish_within_the_grace_complete(model_dir: Path,
                                                                    tmp_path: Path) -> None:
    grace = 30.0
    with serve(model_dir, tmp_path, grace) as s:
        streamed, plain = start_both(s, max_tokens=40)  # >= 2 s of 50 ms steps
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        assert_draining(s)
        plain.join(60)
        streamed.join(60)
        code = s.proc.wait(timeout=grace + 30)
        took = time.monotonic() - t0
        log = s.log()
    assert code == 0, log
    assert took < grace / 2, f"the drain waited out the grace ({took:.1f}s)\n{log}"
    assert plain.error is None and plain.result is not None, plain.error
    status, body = plain.result
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 40
    assert streamed.error is None and streamed.events[-1] == "[DONE]", streamed.error
    payloads = streamed.payloads()
    assert not any("error" in p for p in payloads), payloads[-1]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_a_second_signal_ends_the_grace_at_once(model_dir: Path, tmp_path: Path) -> None:
    grace = 60.0
    with serve(model_dir, tmp_path, grace) as s:
        streamed, plain = start_both(s, max_tokens=200)
        s.proc.send_signal(signal.SIGTERM)
        assert_draining(s)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(timeout=30)
        took = time.monotonic() - t0
        streamed.join(10)
        plain.join(10)
        log = s.log()
    assert code == 0, log
    assert took < 5, f"exit {took:.1f}s after the second signal\n{log}"
    assert plain.result is not None and plain.result[0] == 503, plain.result
    assert_unavailable_error(plain.result[1]["error"])
    assert streamed.events[-1] == "[DONE]" and "error" in streamed.payloads()[-1]
