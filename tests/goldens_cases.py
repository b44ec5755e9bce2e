"""The golden cases: which synthetic checkpoint each golden in ``tests/goldens`` was made from.

Shared by the golden fixtures (``tests/conftest.py``) and ``python -m tools.make_goldens``, which
regenerates the goldens: each case's checkpoint is rebuilt deterministically by
``engine.model.synthetic`` (no weights in git), and its safetensors sha256, recorded in
``tests/goldens/index.json``, catches generator drift.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.model.synthetic import write_checkpoint

# name -> (preset, config form, seed, overrides)
# The Qwen3 cases are wider than the tiny-qwen3 preset: at hidden 128 the model's own bf16 noise
# floor (HF bf16 vs HF fp32, mean 0.023-0.024 nat) was above the 0.02 bound a bf16 backend is held
# to; at this shape HF bf16 lands at ~0.015 (recorded per case as hf_bf16_vs_f32 in index.json).
_QW = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
       "num_key_value_heads": 4}
# The RoPE scaling cases shrink original_max_position_embeddings to 64 so that the scaling
# moves the logprobs of the 130- and 300-token sequences by far more than any tolerance: llama3
# divides the frequencies with wavelengths over 64 by 8, yarn also scales cos and sin by 1.139.
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
CASES: dict[str, tuple[str, int, int, dict]] = {
    "qwen3-tiny-f4": ("tiny-qwen3", 4, 1, dict(_QW)),
    "qwen3-tiny-f5": ("tiny-qwen3", 5, 2, {**_QW, "tie_word_embeddings": False}),
    "llama-tiny-f4": ("tiny-llama", 4, 3, {}),
    "llama-small-f5": ("small-llama", 5, 4, {}),
    "llama-rope-llama3-f4": ("tiny-llama", 4, 5, {"rope_scaling": _LLAMA3}),  # 4.x rope_scaling
    "qwen3-rope-yarn-f5": ("tiny-qwen3", 5, 6, {**_QW, "rope_scaling": _YARN}),  # rope_parameters
    # Widths no GEMM tile takes, which the cuda backend pads (engine/executor/cuda_shapes.Padded):
    # a vocabulary of 32001 (tied: the padded embedding is lm_head), an intermediate size of 416
    # (untied Llama) and a hidden size of 300 (not even a multiple of 8; Qwen3's explicit
    # head_dim keeps the heads at 64)
    "qwen3-vocab-32001-f4": ("tiny-qwen3", 4, 7, {**_QW, "vocab_size": 32001}),
    "llama-inter-416-f5": ("tiny-llama", 5, 8, {"intermediate_size": 416}),
    "qwen3-hidden-300-f4": ("tiny-qwen3", 4, 9, {**_QW, "hidden_size": 300}),
}


def weights_sha256(d: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(d.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def build_case(name: str, root: Path) -> Path:
    preset, form, seed, ov = CASES[name]
    return write_checkpoint(root / name, preset, seed=seed, form=form, overrides=ov, quiet=True)
