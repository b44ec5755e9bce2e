"""Fault containment: a failing step fails only its requests (error response or error event),
concurrent requests complete with the right tokens, later requests succeed, /health stays
truthful; a stalled engine (watchdog) and a dead engine loop turn /health to 503, and the dead
one makes the process exit non-zero (a real `cuteinfer serve`-style subprocess)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from engine.api import LLM  # noqa: E402
from engine.executor.base import ExecutorError  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import SchedulerOutput  # noqa: E402
from engine.server.launch import OpenAIServer  # noqa: E402
from engine.server.testing import (  # noqa: E402
    free_port,
    http,
    make_engine,
    running_server,
    wait_healthy,
    wait_idle,
    write_test_checkpoint,
)

REPO = Path(__file__).resolve().parents[1]
POISON = 999  # a prompt starting with this token id triggers the injected fault
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), "tiny")


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[OpenAIServer]:
    with running_server(make_engine(model_dir, max_num_seqs=4)) as s:
        yield s


def prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + j) % 900 for j in range(5 + 3 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    llm = LLM(model=str(model_dir), backend="numpy", max_model_len=256)
    outs = llm.generate(prompts(6), SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def token_ids(tokens: list[str]) -> list[int]:
    # no tokenizer: logprobs name each token "token_id:<id>"
    return [int(t.split(":")[1]) for t in tokens]


async def _run_mix(url: str, model: str) -> tuple[dict[int, list[int] | Exception], list[str]]:
    """Six normal requests (half streamed) in flight, then a poisoned one. Returns per-prompt
    token ids or the exception, and the poisoned request's outcome."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    started = asyncio.Event()
    out: dict[int, list[int] | Exception] = {}
    args = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True})

    async def normal(i: int, p: list[int]) -> None:
        try:
            if i % 2:
                r = await client.completions.create(prompt=p, **args)
                out[i] = token_ids(r.choices[0].logprobs.tokens)
                return
            toks: list[str] = []
            async for c in await client.completions.create(prompt=p, stream=True, **args):
                started.set()
                if c.choices and c.choices[0].logprobs:
                    toks += c.choices[0].logprobs.tokens
            out[i] = token_ids(toks)
        except Exception as e:
            out[i] = e
            started.set()

    tasks = [asyncio.create_task(normal(i, p)) for i, p in enumerate(prompts(6))]
    await asyncio.wait_for(started.wait(), 30)
    poisoned: list[str] = []
    try:
        await client.completions.create(prompt=[POISON, 5, 6, 7], **args)
        poisoned.append("ok")
    except openai.APIStatusError as e:
        poisoned.append(f"{e.status_code}: {e.message}")
    await asyncio.gather(*tasks)
    await client.close()
    return out, poisoned


@pytest.mark.parametrize("scope", ["step", "row"])
def test_step_fault_fails_only_its_requests(server: OpenAIServer, reference: list[list[int]],
                                            scope: str) -> None:
    """scope "step": the hook raises, so every request in that step fails. scope "row": the
    executor reports the poisoned row only (ExecutorError.rows), the rest of the step is
    rescheduled and unaffected."""
    failed_plan: list[set[str]] = []

    def hook(plan: SchedulerOutput) -> None:
        if failed_plan:
            return
        rows = [i for i, s in enumerate(plan.seqs) if s.request.prompt_token_ids[0] == POISON]
        if not rows:
            return
        failed_plan.append({s.request.request_id for s in plan.seqs})
        if scope == "step":
            raise RuntimeError("injected step fault")
        e = ExecutorError("injected row fault")
        e.rows = set(rows)  # type: ignore[attr-defined]
        raise e

    health: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            health.append(http("GET", f"{server.url}/health")[0])
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    server.engine.fault_hook = hook
    try:
        out, poisoned = asyncio.run(_run_mix(server.url, server.served_model_name))
    finally:
        server.engine.fault_hook = None
        stop.set()
        prober.join()
    assert failed_plan, "the poisoned request never ran"
    assert len(poisoned) == 1 and poisoned[0].startswith("500") and "injected" in poisoned[0]
    errors = {i: o for i, o in out.items() if isinstance(o, Exception)}
    done = {i: o for i, o in out.items() if not isinstance(o, Exception)}
    n_failed_normal = len(failed_plan[0]) - 1
    assert len(errors) == (n_failed_normal if scope == "step" else 0)
    for e in errors.values():
        assert isinstance(e, openai.APIError) and "injected" in str(e)
    assert done, "no concurrent request survived"
    for i, toks in done.items():
        assert toks == reference[i], f"request {i} completed with wrong tokens"
    assert set(health) == {200}
    # later requests succeed; every page came back
    status, body = http("POST", f"{server.url}/v1/completions",
                        {"prompt": prompts(1)[0], "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    assert wait_idle(server)
    assert server.metrics.registry.get_sample_value(
        "cuteinfer:engine_steps_total",
        {"kind": "failed", "model_name": server.served_model_name}) >= 1


def test_watchdog_declares_a_stalled_engine_dead(model_dir: Path) -> None:
    fired = threading.Event()

    def hang(plan: SchedulerOutput) -> None:
        if not fired.is_set():
            fired.set()
            time.sleep(2.0)  # a step that stops making progress

    with running_server(make_engine(model_dir), step_timeout_s=0.5,
                        shutdown_grace_s=60) as srv:
        assert http("GET", f"{srv.url}/health")[0] == 200
        srv.engine.fault_hook = hang
        status, body = http("POST", f"{srv.url}/v1/completions",
                            {"prompt": [5, 6, 7], "max_tokens": 4})
        assert status == 503 and "no progress" in body["error"]["message"]
        status, body = http("GET", f"{srv.url}/health")
        assert status == 503 and "no progress" in body["reason"]
        status, body = http("POST", f"{srv.url}/v1/completions",
                            {"prompt": [5, 6, 7], "max_tokens": 4})
        assert status == 503 and body["error"]["type"] == "service_unavailable_error"
        assert srv.metrics.registry.get_sample_value(
            "cuteinfer:engine_healthy", {"model_name": srv.served_model_name}) == 0.0
        assert srv.exit_code() == 1


SERVE_SCRIPT = textwrap.dedent("""
    import sys
    from engine.server.launch import OpenAIServer
    from engine.server.testing import make_engine

    engine = make_engine(sys.argv[1])
    schedule = engine.scheduler.schedule

    def broken_schedule():  # a bug outside the step's fault containment kills the loop
        if any(r.prompt_token_ids[0] == {poison} for r in engine.scheduler.waiting):
            raise RuntimeError("injected scheduler bug")
        return schedule()

    engine.scheduler.schedule = broken_schedule
    server = OpenAIServer(engine, port=int(sys.argv[2]), shutdown_grace_s=2.0,
                          log_level="warning")
    sys.exit(server.run())
""")


def test_dead_engine_loop_gives_503_and_nonzero_exit(model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(SERVE_SCRIPT.format(poison=POISON))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(model_dir), str(port)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, url)
        status, body = http("POST", f"{url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert status == 200
        status, body = http("POST", f"{url}/v1/completions",
                            {"prompt": [POISON, 6], "max_tokens": 2})
        assert status == 503 and "injected scheduler bug" in body["error"]["message"]
        status, body = http("GET", f"{url}/health")
        assert status == 503 and "died" in body["reason"]
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    assert code == 1, err
    assert "engine loop died" in err and "injected scheduler bug" in err


def test_cli_serve_starts_and_stops_cleanly(model_dir: Path) -> None:
    """`cuteinfer serve` itself: serves, and exits 0 on SIGTERM (a supervisor's normal stop)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(model_dir), "--backend",
         "numpy", "--port", str(port), "--max-model-len", "128", "--log-level", "warning",
         "--max-request-bytes", "4096"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(proc, url)
        status, body = http("GET", f"{url}/v1/models")
        assert status == 200 and body["data"][0]["id"] == model_dir.name
        assert body["data"][0]["max_model_len"] == 128
        status, body = http("POST", f"{url}/v1/completions",
                            {"model": model_dir.name, "prompt": [5, 6], "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        status, body = http("POST", f"{url}/v1/completions",  # over --max-request-bytes
                            {"model": model_dir.name, "prompt": [5] * 2000, "max_tokens": 2})
        assert status == 413 and "4096" in body["error"]["message"], body
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    assert code == 0, err
