"""Load a Hugging Face checkpoint without torch: config, single or sharded safetensors, checked.

Every tensor is checked against the config before anything is used: missing, unexpected, wrong
shape or dtype all go into one ``CheckpointError`` that lists every problem.

Shard files stay inside the checkpoint: an index entry that is absolute, climbs with ``..`` or
resolves (through symlinks) outside the directory is refused before anything is opened. The one
wider root is a Hugging Face hub cache snapshot, whose files are symlinks into the repository's
``blobs/``: ``models--org--name/snapshots/<rev>/x -> ../../blobs/<hash>``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import ml_dtypes
import numpy as np

from engine.config import ModelConfig
from engine.jsonfile import json_type, read_json
from engine.model.safetensors_io import SafetensorsError, open_tensors
from engine.model.spec import expected_tensors, ignorable, layer_prefix, optional_tensors
from engine.progress import progress as progress_bar

log = logging.getLogger(__name__)

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (BF16, np.dtype(np.float16), np.dtype(np.float32))


class CheckpointError(ValueError):
    """A checkpoint that does not match its config. Lists every problem found."""

    def __init__(self, path: str, problems: list[str],
                 headline: str = "checkpoint does not match its config.json") -> None:
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20
                                 else [])
        super().__init__(f"{path}: {headline}:\n  - " + "\n  - ".join(shown))


@dataclass
class Checkpoint:
    """Config plus memory-mapped bf16 tensors under their HF names."""

    path: Path
    config: ModelConfig
    tensors: dict[str, np.ndarray]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]

    @property
    def lm_head(self) -> np.ndarray:
        if self.config.tie_word_embeddings:
            return self.tensors["model.embed_tokens.weight"]
        return self.tensors["lm_head.weight"]

    def layer(self, i: int, name: str) -> np.ndarray:
        return self.tensors[layer_prefix(i) + name]

    def qkv_weight(self, i: int) -> np.ndarray:
        """[q_size + 2 kv_size, hidden]: q rows, then k, then v (the fused projection)."""
        return np.concatenate([self.layer(i, "self_attn.q_proj.weight"),
                               self.layer(i, "self_attn.k_proj.weight"),
                               self.layer(i, "self_attn.v_proj.weight")], axis=0)

    def gate_up_weight(self, i: int) -> np.ndarray:
        """[2 intermediate, hidden]: gate rows, then up."""
        return np.concatenate([self.layer(i, "mlp.gate_proj.weight"),
                               self.layer(i, "mlp.up_proj.weight")], axis=0)

    @property
    def nbytes(self) -> int:
        return sum(int(t.nbytes) for t in self.tensors.values())


def _allowed_root(d: Path) -> Path:
    real = d.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent  # hub cache: snapshot files link into ../../blobs
    return real


_UNUSABLE = "checkpoint weights cannot be used"
_INSIDE = "; weights must be files inside the checkpoint directory"


def _confine(d: Path, root: Path, name: str) -> tuple[Path | None, str]:
    """``d / name`` when it is a regular file inside ``root``, else (None, why not). Looks at
    the path and stat()s it; never opens it."""
    if not name or "\0" in name:
        return None, f"is not a file name{_INSIDE}"
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        return None, f"is an absolute path{_INSIDE}"
    if ".." in name.replace("\\", "/").split("/"):
        return None, f"climbs out with '..'{_INSIDE}"
    try:
        real = (d / name).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        return None, f"cannot be resolved ({e})"
    if not real.is_relative_to(root):
        return None, f"resolves to {real}, outside the checkpoint directory{_INSIDE}"
    if not real.exists():
        return None, "is missing"
    if not real.is_file():
        return None, "is not a regular file"
    return d / name, ""


def _index_shards(d: Path, index: Path) -> list[Path]:
    def fail(msg: str) -> CheckpointError:
        return CheckpointError(str(d), [msg], _UNUSABLE)

    data = read_json(index, fail)
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict):
        got = json_type(wm) if isinstance(data, dict) else f"the file holds {json_type(data)}"
        raise fail(f"{index.name}: needs a \"weight_map\" object {{tensor: shard file}}, "
                   f"got {got}")
    tensors_of: dict[str, list[str]] = {}
    problems: list[str] = []
    for tensor, f in wm.items():
        if isinstance(f, str):
            tensors_of.setdefault(f, []).append(tensor)
        else:
            problems.append(f"{index.name}: weight_map[{tensor!r}] is {json_type(f)}, not a "
                            "shard file name")
    root = _allowed_root(d)
    files: list[Path] = []
    for f, tensors in sorted(tensors_of.items()):
        path, why = _confine(d, root, f)
        if path is None:
            more = f" (and {len(tensors) - 1} more)" if len(tensors) > 1 else ""
            problems.append(f"{index.name}: shard {f!r} (tensor {tensors[0]}{more}) {why}")
        else:
            files.append(path)
    if problems:
        raise CheckpointError(str(d), problems, _UNUSABLE)
    return files


def _shard_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return _index_shards(d, index)
    root = _allowed_root(d)
    single = d / "model.safetensors"
    names = ([single.name] if single.exists() or single.is_symlink()
             else sorted(p.name for p in d.glob("*.safetensors")))
    if not names:
        raise CheckpointError(str(d), ["no model.safetensors or model.safetensors.index.json"],
                              _UNUSABLE)
    found = [(name, *_confine(d, root, name)) for name in names]
    problems = [f"{name} {why}" for name, path, why in found if path is None]
    if problems:
        raise CheckpointError(str(d), problems, _UNUSABLE)
    return [path for _, path, _ in found if path is not None]


def read_shards(d: Path, strip_prefix: str = "", why: str | None = None
                ) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint directory ``d``'s shards, memory-mapped, by name (with
    ``strip_prefix`` removed); CheckpointError (``why``) listing every unreadable shard and
    every name found twice."""
    raw: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for f in _shard_files(d):
        try:
            for name, arr in open_tensors(f).items():
                name = name.removeprefix(strip_prefix) if strip_prefix else name
                if name in raw:
                    problems.append(f"tensor {name} appears in more than one shard")
                raw[name] = arr
        except SafetensorsError as e:
            problems.append(str(e))
    if problems:
        raise CheckpointError(str(d), problems) if why is None else CheckpointError(
            str(d), problems, why)
    return raw


def load_checkpoint(path: str | os.PathLike[str], config: ModelConfig | None = None,
                    progress: bool | None = None) -> Checkpoint:
    """Memory-map and validate a checkpoint directory. Float tensors other than bf16 are
    converted to bf16 (the engine computes on bf16 weights)."""
    d = Path(path)
    cfg = config or ModelConfig.from_pretrained(d)
    raw = read_shards(d)
    problems: list[str] = []

    want = expected_tensors(cfg)
    optional = optional_tensors(cfg)
    for name, spec in want.items():
        if name not in raw:
            problems.append(f"missing tensor {name} (expected shape {list(spec.shape)})")
            continue
        a = raw[name]
        if tuple(a.shape) != spec.shape:
            problems.append(f"tensor {name} has shape {list(a.shape)}, expected "
                            f"{list(spec.shape)}")
        if a.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name} has dtype {a.dtype}, expected bfloat16 "
                            "(or float16/float32)")
    for name in raw:
        if name not in want and name not in optional and not ignorable(name):
            problems.append(f"unexpected tensor {name}")
    if problems:
        raise CheckpointError(str(d), problems)

    converted = sorted({str(raw[n].dtype) for n in want if raw[n].dtype != BF16})
    if converted:
        log.warning("%s: its %s weights are converted to bfloat16 (the engine computes on "
                    "bf16 weights)", d, " and ".join(converted))
    total = sum(int(raw[n].nbytes) for n in want)
    show = progress if progress is not None else total > (512 << 20)
    tensors: dict[str, np.ndarray] = {}
    with progress_bar(total, f"loading {d.name}", enable=show, unit="B", unit_scale=True) as bar:
        for name in want:
            a = raw[name]
            tensors[name] = a if a.dtype == BF16 else a.astype(BF16)
            bar.update(a.nbytes)
    return Checkpoint(path=d, config=cfg, tensors=tensors)
