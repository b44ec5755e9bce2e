"""``cuteinfer serve`` as vLLM's (issue 18): the model as a positional argument (``--model`` still
works), ``cuteinfer --version``, ``--chat-template`` (a file or the template itself), API keys from
``--api-key`` (repeatable, comma lists) or ``CUTEINFER_API_KEY``, and help text on every flag;
one real ``cuteinfer serve MODEL --api-key K`` subprocess."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

import engine  # noqa: E402
from engine.cli import CLIError, main  # noqa: E402
from engine.server import cli as serve_cli  # noqa: E402
from engine.server.testing import free_port, http, wait_healthy, write_test_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cuteinfer serve")
    serve_cli.add_arguments(p)
    return p


def test_every_flag_has_help() -> None:
    for action in parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help != argparse.SUPPRESS, action.option_strings or \
            action.dest


def test_positional_model_and_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CUTEINFER_API_KEY", raising=False)
    a = parser().parse_args(["some/model", "--api-key", "k1,k2", "--api-key", "k3"])
    keys, template = serve_cli.resolve_options(a)
    assert a.model == "some/model" and keys == ["k1", "k2", "k3"] and template is None
    a = parser().parse_args(["--model", "m"])
    assert serve_cli.resolve_options(a) == ([], None) and a.model == "m"
    with pytest.raises(CLIError, match="two models"):
        serve_cli.resolve_options(parser().parse_args(["a", "--model", "b"]))
    monkeypatch.setenv("CUTEINFER_API_KEY", "env-1, env-2")
    assert serve_cli.resolve_options(parser().parse_args(["m"]))[0] == ["env-1", "env-2"]
    assert serve_cli.resolve_options(parser().parse_args(["m", "--api-key", "x"]))[0] == ["x"]
    monkeypatch.delenv("CUTEINFER_API_KEY")
    with pytest.raises(CLIError, match="--metrics-require-key needs"):
        serve_cli.resolve_options(parser().parse_args(["m", "--metrics-require-key"]))
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    a = parser().parse_args(["m", "--chat-template", str(f)])
    assert serve_cli.resolve_options(a)[1] == "{{ messages[0].content }}"
    a = parser().parse_args(["m", "--chat-template", "{% for m in messages %}x{% endfor %}"])
    assert serve_cli.resolve_options(a)[1] == "{% for m in messages %}x{% endfor %}"
    with pytest.raises(CLIError, match="no such file"):
        serve_cli.resolve_options(parser().parse_args(["m", "--chat-template", "nope.jinja"]))
    assert parser().parse_args(["m"]).cache_isolation_per_key is True
    assert parser().parse_args(["m", "--no-cache-isolation-per-key"]) \
        .cache_isolation_per_key is False


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == engine.__version__


def test_bad_chat_template_is_an_input_error(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    chat = write_test_checkpoint(tmp_path / "chat", "chat")
    code = main(["serve", str(chat), "--backend", "numpy", "--engine-core", "thread",
                 "--chat-template", "{% for x in %}"])
    err = capsys.readouterr().err
    assert code == 2 and "--chat-template does not compile" in err, err


def test_serve_positional_model_with_api_key(tmp_path: Path) -> None:
    tiny = write_test_checkpoint(tmp_path / "tiny", "tiny")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUTEINFER_API_KEY": "from-env"}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", str(tiny), "--backend",
                             "numpy", "--port", str(port), "--api-key", "sekrit",
                             "--log-level", "warning"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(proc, url)
        assert http("GET", f"{url}/v1/models")[0] == 401
        assert http("GET", f"{url}/v1/models", headers={"Authorization": "Bearer from-env"})[0] \
            == 401  # --api-key wins over the environment
        status, out = http("GET", f"{url}/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert status == 200 and out["data"][0]["id"] == "tiny"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.communicate()
