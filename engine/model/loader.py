"""Load a Hugging Face checkpoint without torch: config, single or sharded safetensors, checked.

Every tensor is checked against the config before anything is used: missing, unexpected, wrong
shape or dtype all go into one ``CheckpointError`` that lists every problem.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from engine.config import ModelConfig
from engine.model.safetensors_io import SafetensorsError, open_tensors
from engine.model.spec import expected_tensors, ignorable, layer_prefix, optional_tensors
from engine.progress import Progress

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = (BF16, np.dtype(np.float16), np.dtype(np.float32))


class CheckpointError(ValueError):
    """A checkpoint that does not match its config. Lists every problem found."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.problems = problems
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20
                                 else [])
        super().__init__(f"{path}: checkpoint does not match its config.json:\n  - "
                         + "\n  - ".join(shown))


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


def _shard_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(str(d), [f"model.safetensors.index.json unreadable: {e}"]) \
                from None
        files = sorted(set(wm.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise CheckpointError(str(d), [f"shard {f} listed in the index is missing"
                                           for f in missing])
        return [d / f for f in files]
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(str(d), ["no model.safetensors or model.safetensors.index.json"])


def load_checkpoint(path: str | os.PathLike[str], config: ModelConfig | None = None,
                    progress: bool | None = None) -> Checkpoint:
    """Memory-map and validate a checkpoint directory. Float tensors other than bf16 are
    converted to bf16 (the engine computes on bf16 weights)."""
    d = Path(path)
    cfg = config or ModelConfig.from_pretrained(d)
    files = _shard_files(d)
    raw: dict[str, np.ndarray] = {}
    problems: list[str] = []
    for f in files:
        try:
            for name, arr in open_tensors(f).items():
                if name in raw:
                    problems.append(f"tensor {name} appears in more than one shard")
                raw[name] = arr
        except SafetensorsError as e:
            problems.append(str(e))
    if problems:
        raise CheckpointError(str(d), problems)

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

    total = sum(int(raw[n].nbytes) for n in want)
    show = progress if progress is not None else total > (512 << 20)
    tensors: dict[str, np.ndarray] = {}
    with Progress(total, f"loading {d.name}", " GB", enabled=show, scale=1e9) as bar:
        for name in want:
            a = raw[name]
            tensors[name] = a if a.dtype == BF16 else a.astype(BF16)
            bar.update(a.nbytes)
    return Checkpoint(path=d, config=cfg, tensors=tensors)
