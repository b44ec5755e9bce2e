"""Reading JSON files a checkpoint ships (config.json, generation_config.json, the safetensors
index, tokenizer_config.json) with every field's JSON type checked: whatever is malformed becomes
the caller's typed error, naming the file and the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def json_type(v: Any) -> str:
    """What a parsed JSON value is, in JSON's words (for messages)."""
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"),
                    (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(v, t):
            return name
    return "null" if v is None else type(v).__name__


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _object_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out and out[k] != v:  # which one would a reader take? refuse, as for tensors
            raise _DuplicateKey(k)
        out[k] = v
    return out


def read_json(path: Path, error: Callable[[str], Exception]) -> Any:
    """The parsed contents of a UTF-8 JSON file. Whatever makes it unusable (I/O, bytes that are
    not UTF-8, invalid JSON, a key given twice with different values) raises ``error(message)``
    with a message that names the file."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start}); "
                    "save it as UTF-8 JSON") from None
    try:
        return json.loads(text, object_pairs_hook=_object_pairs)
    except _DuplicateKey as e:
        raise error(f"{path}: key {e.key!r} is given twice with different values; keep one") \
            from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a 5000-digit int, deep nesting
        raise error(f"{path}: not valid JSON ({e})") from None


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_id(v: Any) -> bool:
    return is_int(v) and v >= 0


# kind -> (what the field must be, check). JSON null counts as absent (the field's default).
def is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "bool": ("a JSON boolean (true or false)", lambda v: isinstance(v, bool)),
    "int": ("an integer", is_int),
    "number": ("a number", is_number),
    "str": ("a string", lambda v: isinstance(v, str)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "strings": ("an array of strings",
                lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "ids": ("a token id (an integer >= 0) or an array of them",
            lambda v: is_id(v) or isinstance(v, list) and all(is_id(x) for x in v)),
}


class Fields:
    """Typed reads of one JSON object. Each wrong value becomes a problem naming the field and
    what it holds, so one error can list them all."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj
        self.problems: list[str] = []

    def get(self, key: str, kind: str, default: Any = None, *, required: bool = False,
            obj: dict[str, Any] | None = None, name: str | None = None) -> Any:
        v = (self.obj if obj is None else obj).get(key)
        name = name or key
        desc, ok = _KINDS[kind]
        if v is None:
            if required:
                self.problems.append(f"{name} is missing (it must be {desc})")
            return default
        if not ok(v):
            self.problems.append(f"{name} must be {desc}, got {v!r:.60} ({json_type(v)})")
            return default
        if kind == "number":
            try:
                return float(v)
            except OverflowError:
                self.problems.append(f"{name} must be a finite number, got {v!r:.60}")
                return default
        return v
