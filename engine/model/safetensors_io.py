"""Read and write safetensors files with numpy only, memory-mapped, bf16 through ml_dtypes.

Format: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then data.
The header is checked as the reference (Rust) reader checks it: UTF-8 JSON object, no duplicate
keys, string-to-string metadata, integer shapes and offsets that fit the data, before any view.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from engine.jsonfile import json_type

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read; the message names the file and the problem."""


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:  # two entries for one tensor: which would a reader use?
            raise _Duplicate(k)
        out[k] = v
    return out


def _is_uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry_problem(e: Any, data_len: int) -> str | None:
    """Why one tensor entry is unusable, or None."""
    if not isinstance(e, dict):
        return f"entry is {json_type(e)}, not an object"
    dt, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dt, str) or dt not in DTYPES:
        return f"dtype {dt!r} is not one of {', '.join(DTYPES)}"
    if not isinstance(shape, list) or not all(_is_uint(x) for x in shape):
        return f"shape must be an array of integers >= 0, got {shape!r:.60}"
    if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_uint(x) for x in offs)
            or offs[0] > offs[1]):
        return f"data_offsets must be two integers 0 <= begin <= end, got {offs!r:.60}"
    b, end = offs
    nbytes = math.prod(shape) * DTYPES[dt].itemsize  # Python ints: no int64 wrap-around
    if end > data_len or end - b != nbytes:
        return (f"offsets {b}..{end} do not fit {shape} {dt} ({nbytes} bytes) in {data_len} "
                "data bytes")
    return None


def read_header(path: str | os.PathLike[str]) -> tuple[dict, int]:
    """Return (tensor entries, data start offset). Validates the header against the file size."""
    p = Path(path)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
            raise SafetensorsError(f"{p}: not a regular file")
        size = st.st_size
        with open(p, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise SafetensorsError(f"{p}: corrupt header (file shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise SafetensorsError(f"{p}: corrupt header (header length {n} exceeds the "
                                       f"file size {size})")
            hb = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{p}: cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(hb.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise SafetensorsError(f"{p}: corrupt header (key {e.args[0]!r} appears twice)") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise SafetensorsError(f"{p}: corrupt header (not valid UTF-8 JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{p}: corrupt header (a JSON object is needed, got "
                               f"{json_type(header)})")
    meta = header.pop("__metadata__", None)
    if meta is not None and (not isinstance(meta, dict)
                             or not all(isinstance(v, str) for v in meta.values())):
        raise SafetensorsError(f"{p}: corrupt header (__metadata__ must be an object of strings, "
                               f"got {meta!r:.60})")
    data_len = size - 8 - n
    for name, e in header.items():
        why = _entry_problem(e, data_len)
        if why:
            raise SafetensorsError(f"{p}: corrupt header (tensor {name!r}: {why})")
    return header, 8 + n


def open_tensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Memory-map every tensor of a file (read-only views; nothing is read until used)."""
    header, start = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        out[name] = mm[start + b:start + end].view(DTYPES[e["dtype"]]).reshape(e["shape"])
    return out


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike[str],
              metadata: dict[str, str] | None = None) -> None:
    """Write tensors (contiguous, in insertion order, 8-byte aligned header)."""
    header: dict[str, object] = {}
    off = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in NAMES:
            raise SafetensorsError(f"cannot save {name!r}: dtype {a.dtype} unsupported")
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)
