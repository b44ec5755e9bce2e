"""The kernel cache on disk: compiled kernels saved, checked and loaded back.

Every ``Signature.compile`` (_common.py) goes through ``load_or_compile``: a kernel compiled once
is exported with the DSL's ahead-of-time path (``export_to_c``: a host object with the cubin
inside) and, in later processes, loaded back (``cute.runtime.load_module``, ~3 ms) instead of
traced and compiled (0.1-4 s each). The loaded function takes the same
arguments as the JIT-compiled one; its handle is kept (looking it up costs ~0.4 ms per call).

Key: what changes the generated code. The kernel class; its compile-time attributes (the kernel
object's ``vars``: numbers, strings, dtypes, tuples; an object holding anything else is compiled,
not cached); the launch signature; a fingerprint of the source of the kernel's module and of
every cutlass_kernels module it imports, transitively (_common.py, _reduce.py, ...); the DSL
version and its compile settings (``CUTE_DSL_ARCH`` among them); the host's machine type.

Entry, under ``envs.kernel_cache_dir()``, for kernel class K and key hash H:

    K-H.json     manifest: the full key, the object's file name, size and sha256, its symbol prefix
    K-H-S.o      the object, S = the start of its sha256: a name is never rewritten with other bytes

Writes go to a temp folder inside the cache folder and are renamed into place (``os.replace``),
the object first and the manifest last: a reader sees no entry or a whole one, and processes
storing the same key at once all leave a valid entry (the last manifest wins). A load checks the
manifest's key against the wanted key and the object's size and hash before loading it; an
unreadable, truncated or stale entry is a logged warning and a recompile, never loaded.

Compiling many kernels in worker processes that fill this cache: _parallel.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine import envs

log = logging.getLogger(__name__)

FORMAT = 1  # of the key and the manifest; raise it when either changes meaning
PACKAGE = Path(__file__).resolve().parent
# this process's kernels: loaded / compiled / stored / rejected (bad entries) / uncacheable;
# worker_compiled: compiled by its workers (and then loaded here)
STATS: Counter[str] = Counter()


class CacheMiss(Exception):
    """Raised instead of compiling while ``probing()``."""


class _Uncacheable(TypeError):
    pass


_probing: contextvars.ContextVar[bool] = contextvars.ContextVar("probing", default=False)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Inside: a kernel that is not in the cache raises CacheMiss instead of compiling."""
    token = _probing.set(True)
    try:
        yield
    finally:
        _probing.reset(token)


_fingerprints: dict[str, str] = {}
_store_warned = False


# ---------------------------------------------------------------------------------------------
# The key


def _plain(v: Any) -> Any:
    """``v`` as JSON values that say exactly what it is, or _Uncacheable."""
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    if isinstance(v, enum.Enum):
        return f"{type(v).__module__}.{type(v).__qualname__}.{v.name}"
    if dataclasses.is_dataclass(v):
        return {"": _plain(type(v)),
                **{f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}}
    raise _Uncacheable(type(v).__qualname__)


def _module_file(name: str) -> Path | None:
    if name == PACKAGE.name or name.startswith(PACKAGE.name + "."):
        path = PACKAGE.joinpath(*name.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        return path if path.is_file() else None
    file = getattr(sys.modules.get(name), "__file__", None)  # a kernel defined elsewhere
    return Path(file) if file else None


_SELF = f"{PACKAGE.name}._cache"  # this module changes no kernel (FORMAT versions its files)


# Import statements, read as text: ``import a.b [as c], d`` and ``from [..]x import (a, b)``
# anywhere in a file (inside functions too). What the AST holds and possibly more (an import
# quoted in a string only adds a file to the fingerprint), at ~1/50 of ast.parse + ast.walk:
# fingerprinting a model's kernel modules took 0.12-0.16 s of a warm start that way.
# (a parenthesized name list may hold comments, and a comment may hold ")")
_IMPORTS = re.compile(rb"(?<![\w.])(?:from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]*"
                      rb"(\((?:[^)#]|#[^\n]*)*\)|(?:[^\n\\;]|\\\n)*)"
                      rb"|import[ \t]+((?:[^\n\\;]|\\\n)*))")


def _names(text: bytes) -> list[str]:
    """``a.b as c, d`` (maybe in parentheses, over lines, with comments) -> ["a.b", "d"]."""
    text = re.sub(rb"#[^\n]*|\\\n|[()]", b" ", text)
    return [part.split()[0].decode(errors="replace") for part in text.split(b",") if part.split()]


def _imported(name: str, source: bytes, is_package: bool) -> list[str]:
    """Every cutlass_kernels module (or name in one) ``source`` imports, anywhere in it."""
    out: list[str] = []
    for m in _IMPORTS.finditer(source):
        if m.group(3) is not None:
            out += _names(m.group(3))
            continue
        base = m.group(1).decode()
        level = len(base) - len(base.lstrip("."))
        base = base[level:]
        if level:
            anchor = name.split(".")[: len(name.split(".")) - level + is_package]
            base = ".".join(anchor + ([base] if base else []))
        out += [base] + [f"{base}.{a}" for a in _names(m.group(2))]
    return [m for m in out if (m == PACKAGE.name or m.startswith(PACKAGE.name + "."))
            and m != _SELF]


def source_fingerprint(module: str) -> str:
    """sha256 over the source of ``module`` and every cutlass_kernels module it imports
    (but this one)."""
    hit = _fingerprints.get(module)
    if hit is None:
        files: dict[str, bytes] = {}
        todo = [module]
        while todo:
            name = todo.pop()
            path = _module_file(name)
            if name in files or path is None:
                continue
            files[name] = path.read_bytes()
            todo += _imported(name, files[name], path.name == "__init__.py")
        if module not in files:
            raise _Uncacheable(f"no source file for module {module}")
        h = hashlib.sha256()
        for name in sorted(files):
            h.update(b"%s\0%d\0%s" % (name.encode(), len(files[name]), files[name]))
        hit = _fingerprints[module] = h.hexdigest()
    return hit


def _dsl_settings() -> dict[str, str]:
    import cutlass

    try:
        from cutlass.cutlass_dsl.cutlass import CuTeDSL

        dsl = CuTeDSL._get_dsl()
        settings = dsl.envar.cache_key_str()  # the settings the DSL's own JIT cache keys on
        options = " ".join(dsl.compile_options.to_str().split())
        arch = str(dsl.envar.arch)
    except (ImportError, AttributeError):  # another DSL version: every CUTE_DSL_ variable
        settings = ";".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                            if k.startswith("CUTE_DSL_"))
        options, arch = "", os.environ.get("CUTE_DSL_ARCH", "")
    return {"dsl": cutlass.__version__, "arch": arch, "settings": settings, "options": options}


def kernel_key(op: Any, params: Any) -> dict[str, Any]:
    """The full key of kernel object ``op`` compiled with launch parameters ``params``."""
    cls = type(op)
    return {"format": FORMAT, "kernel": f"{cls.__module__}.{cls.__qualname__}",
            "attributes": _plain(vars(op)), "signature": _plain(params),
            "source": source_fingerprint(cls.__module__), **_dsl_settings(),
            "host": platform.machine()}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# Entries


def load_or_compile(op: Any, params: Any, build: Callable[[], Any]) -> Any:
    """The compiled function of kernel object ``op``: loaded from the disk cache when a valid
    entry is there, else ``build()`` (``cute.compile``) and stored."""
    probing = _probing.get()
    key = None
    if envs.kernel_cache_enabled():
        try:
            key = kernel_key(op, params)
        except (TypeError, OSError, SyntaxError) as e:  # _Uncacheable: not plain values
            STATS["uncacheable"] += 1
            log.debug("kernel cache: %s not cached (%s)", type(op).__name__, e)
    if key is None:
        if probing:
            raise CacheMiss(type(op).__name__)
        STATS["compiled"] += 1
        return build()
    root = envs.kernel_cache_dir()
    stem = f"{type(op).__name__}-{_digest(json.dumps(key, sort_keys=True).encode())[:32]}"
    fn = _load(root, stem, key)
    if fn is not None:
        STATS["loaded"] += 1
        return fn
    if probing:
        raise CacheMiss(stem)
    STATS["compiled"] += 1
    compiled = build()
    _store(root, stem, key, compiled)
    return compiled


def _load(root: Path, stem: str, key: dict[str, Any]) -> Any:
    path = root / f"{stem}.json"
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None  # not cached yet
    except OSError as e:
        log.warning("kernel cache: cannot read %s (%s); compiling the kernel", path, e)
        return None
    try:
        entry = json.loads(text)
        if entry.get("key") != key:
            raise ValueError("its key differs from this kernel's (another source or DSL)")
        obj = root / entry["object"]
        if obj.parent != root:
            raise ValueError(f"object name {entry['object']!r} leaves the cache folder")
        data = obj.read_bytes()
        if len(data) != entry["size"] or _digest(data) != entry["sha256"]:
            raise ValueError(f"{obj.name}: {len(data)} B whose sha256 is not the manifest's "
                             f"({entry['size']} B)")
        from cutlass.cute.runtime import load_module

        return load_module(str(obj))[entry["prefix"]]
    except Exception as e:
        STATS["rejected"] += 1
        log.warning("kernel cache: ignoring %s (%s: %s); compiling the kernel again", path,
                    type(e).__name__, e)
        return None


def _store(root: Path, stem: str, key: dict[str, Any], compiled: Any) -> None:
    global _store_warned
    tmp = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{stem}-", dir=root))
        prefix = "ck_" + stem.rsplit("-", 1)[1][:24]
        compiled.export_to_c(str(tmp), "kernel", prefix)
        data = (tmp / "kernel.o").read_bytes()
        digest = _digest(data)
        obj = f"{stem}-{digest[:16]}.o"
        os.replace(tmp / "kernel.o", root / obj)
        manifest = {"format": FORMAT, "key": key, "object": obj, "size": len(data),
                    "sha256": digest, "prefix": prefix, "created": time.time()}
        (tmp / "manifest").write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp / "manifest", root / f"{stem}.json")
        STATS["stored"] += 1
    except Exception as e:  # a read-only cache, a full disk, a backend without export
        if not _store_warned:
            _store_warned = True
            log.warning("kernel cache: cannot store kernels in %s (%s: %s); they are compiled "
                        "at every start", root, type(e).__name__, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
