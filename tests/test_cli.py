"""The ``cuteinfer`` command's error reporting: one line, a typed exit status, tracebacks only
with --debug. Each case runs the real command in a subprocess, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.model.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parents[1]
HINT = "(run with --debug for the traceback)"


def cuteinfer(*args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m engine.cli ARGS``, or ``python -c CODE`` (which then calls the CLI itself)."""
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "engine.cli", *args]
    return subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    """The error line, checking it is the only thing on stderr besides progress notes."""
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("[cuteinfer]")]
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("cuteinfer: error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", "tiny-qwen3", quiet=True)


def _broken_copy(tiny: Path, tmp_path: Path, **change: object) -> Path:
    d = tmp_path / "broken"
    d.mkdir()
    for f in tiny.iterdir():
        (d / f.name).symlink_to(f)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_nonexistent_model_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    r = cuteinfer("generate", "hi", "--model", str(missing), "--backend", "numpy")
    assert r.returncode == 2
    line = one_error_line(r)
    assert str(missing) in line and "does not exist" in line


def test_broken_config_json(tiny: Path, tmp_path: Path) -> None:
    d = _broken_copy(tiny, tmp_path, rms_norm_eps="abc")
    r = cuteinfer("generate", "hi", "--model", str(d), "--backend", "numpy")
    assert r.returncode == 2
    line = one_error_line(r)
    assert str(d / "config.json") in line and "rms_norm_eps" in line and "'abc'" in line


@pytest.mark.parametrize("args,needle", [
    (["--max-num-seqs", "lots"], "argument --max-num-seqs: invalid int value: 'lots'"),
    (["--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
    (["--block-size", "12"], "block_size must be a power of two, got 12"),
])
def test_invalid_option_value(tiny: Path, args: list[str], needle: str) -> None:
    r = cuteinfer("generate", "hi", "--model", str(tiny), *args)
    assert r.returncode == 2
    assert needle in one_error_line(r)


def test_request_and_sampling_errors_are_input_errors(tiny: Path) -> None:
    # tiny has no tokenizer.json: a text prompt is refused (RequestError)
    r = cuteinfer("generate", "hi", "--model", str(tiny), "--backend", "numpy")
    assert r.returncode == 2 and "no tokenizer.json" in one_error_line(r)
    r = cuteinfer("generate", "hi", "--model", str(tiny), "--backend", "numpy",
                  "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in one_error_line(r)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path: Path, where: str) -> None:
    args = ["generate", "hi", "--model", str(tmp_path / "nope"), "--backend", "numpy"]
    r = cuteinfer(*(["--debug", *args] if where == "before" else [*args, "--debug"]))
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr and "ConfigError" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("cuteinfer: error: ")


_PATCHED_RUN = """
import sys
import engine.commands.generate as g
def run(args):
    raise {exc}
g.run = run
from engine.cli import main
sys.exit(main({argv}))
"""


def test_unexpected_error_is_one_line_with_the_debug_hint() -> None:
    r = cuteinfer(code=_PATCHED_RUN.format(exc="KeyError('boom')", argv="['generate', 'x']"))
    assert r.returncode == 1
    assert one_error_line(r) == f"cuteinfer: error: KeyError: 'boom' {HINT}"
    r = cuteinfer(code=_PATCHED_RUN.format(exc="KeyError('boom')",
                                           argv="['--debug', 'generate', 'x']"))
    assert r.returncode == 1 and "Traceback" in r.stderr and HINT not in r.stderr


def test_keyboard_interrupt_exits_130_without_traceback() -> None:
    r = cuteinfer(code=_PATCHED_RUN.format(exc="KeyboardInterrupt", argv="['generate', 'x']"))
    assert r.returncode == 130
    assert "Traceback" not in r.stderr and "interrupted" in r.stderr


# sys.modules[name] = None makes `import name` raise ModuleNotFoundError(name=name), as when the
# package is not installed.
_WITHOUT = """
import sys
for m in {modules}:
    sys.modules[m] = None
from engine.cli import main
sys.exit(main({argv}))
"""


@pytest.mark.parametrize("modules,argv,package,extra", [
    (["fastapi"], ["serve"], "fastapi", "server"),
    (["uvicorn"], ["serve", "--port", "1"], "uvicorn", "server"),
    (["hypothesis", "hypothesis.stateful"], ["check-kv"], "hypothesis", "test"),
])
def test_missing_extra_names_the_package_and_the_install(
        modules: list[str], argv: list[str], package: str, extra: str) -> None:
    r = cuteinfer(code=_WITHOUT.format(modules=modules, argv=argv))
    assert r.returncode == 2
    line = one_error_line(r)
    assert f"needs the Python package '{package}'" in line
    assert line.endswith(f"pip install 'cuteinfer[{extra}]'")


def test_usage_errors_are_one_line() -> None:
    r = cuteinfer()
    assert r.returncode == 2 and "required" in one_error_line(r)
    r = cuteinfer("generat", "hi")
    assert r.returncode == 2 and "invalid choice: 'generat'" in one_error_line(r)
    r = cuteinfer("check-kv", "--examples", "0")
    assert r.returncode == 2 and "--examples: must be >= 1" in one_error_line(r)


def test_help_still_exits_0() -> None:
    r = cuteinfer("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "--debug" in r.stdout


def test_configure_logging_twice_keeps_one_handler() -> None:
    """``python -m engine.cli`` runs cli.py as ``__main__`` and a subcommand imports it again as
    ``engine.cli``: two module objects, both configuring. One handler either way."""
    import importlib.util
    import logging

    import engine.cli

    spec = importlib.util.spec_from_file_location("__main__as_run", engine.cli.__file__)
    assert spec is not None and spec.loader is not None
    as_main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(as_main)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        as_main.configure_logging()
        engine.cli.configure_logging(level="warning")
        engine.cli.configure_logging(debug=True)
        ours = [h for h in root.handlers if h.get_name() == engine.cli.HANDLER]
        assert len(ours) == 1 and isinstance(ours[0], engine.cli._Stderr)
        assert logging.getLogger("engine").level == logging.DEBUG
    finally:
        root.handlers[:], root.level = saved


def test_serve_prints_its_ready_line_once(tiny: Path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    p = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny),
                          "--backend", "numpy", "--port", "0"], cwd=REPO, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL)
    lines: list[str] = []
    try:
        assert p.stderr is not None
        for line in p.stderr:  # up to uvicorn's own start-up lines, which follow ours
            lines.append(line)
            if "Uvicorn running" in line or "Application startup complete" in line:
                break
    finally:
        p.send_signal(2)  # SIGINT: drain and exit
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    ready = [ln for ln in lines if "ready in" in ln]
    assert len(ready) == 1, "".join(lines)
    assert len(set(lines)) == len(lines), "".join(lines)
