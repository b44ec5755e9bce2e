"""Read and write safetensors files with numpy only, memory-mapped, bf16 through ml_dtypes.

Format: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then data.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

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


def read_header(path: str | os.PathLike[str]) -> tuple[dict, int]:
    """Return (tensor entries, data start offset). Validates the header against the file size."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{p}: corrupt header (file shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100_000_000:
            raise SafetensorsError(f"{p}: corrupt header (header length {n} exceeds the file "
                                   f"size {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{p}: corrupt header (not valid JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{p}: corrupt header (not a JSON object)")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, e in header.items():
        try:
            b, end = e["data_offsets"]
            dt = e["dtype"]
            shape = e["shape"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{p}: corrupt header (entry {name!r} malformed)") from None
        if dt not in DTYPES:
            raise SafetensorsError(f"{p}: tensor {name!r} has unsupported dtype {dt!r}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        if not (0 <= b <= end <= data_len) or end - b != nbytes:
            raise SafetensorsError(f"{p}: corrupt header (tensor {name!r} offsets {b}..{end} "
                                   f"do not fit {shape} {dt} in {data_len} data bytes)")
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
