"""Synthetic Hugging Face-format checkpoints: seeded random bf16 weights at a preset's shape.

Presets at real shapes (vocab 151936) and small test shapes, Qwen3 or Llama. Benchmarks, the graph
profiler and the tests build their models with this (``write_checkpoint`` to disk, or
``hf_config`` + ``make_weights`` in memory); ``python -m tools.make_checkpoint`` is its command
line. Weights are random but scaled so activations and logits look like a trained model's in
magnitude (logit std ~2), which keeps softmax and sampling non-trivial. The golden cases in
``tests/goldens`` record the sha256 of what this writes: a change here that alters the bytes needs
the goldens regenerated (``python -m tools.make_goldens``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from engine.config import ModelConfig
from engine.model.safetensors_io import save_file
from engine.model.spec import expected_tensors

log = logging.getLogger(__name__)

BF16 = np.dtype(ml_dtypes.bfloat16)

QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
             head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
             max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645)
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0,
             rms_norm_eps=1e-5, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288,
                 "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "tie_word_embeddings": False},
    # small test shapes (head_dim 64 or 128, as the kernels support)
    "tiny-qwen3": {**QWEN3, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 64, "tie_word_embeddings": True,
                   "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "tiny-llama": {**LLAMA, "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                   "tie_word_embeddings": False},
    "small-qwen3": {**QWEN3, "hidden_size": 256, "intermediate_size": 768,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "tie_word_embeddings": True},
    "small-llama": {**LLAMA, "vocab_size": 2048, "hidden_size": 192, "intermediate_size": 512,
                    "num_hidden_layers": 3, "num_attention_heads": 3, "num_key_value_heads": 1,
                    "head_dim": 64, "tie_word_embeddings": True},
}


def hf_config(preset: str, form: int = 4, overrides: dict | None = None) -> dict:
    """The config.json dict in the transformers 4.x form (top-level rope_theta, torch_dtype)
    or the 5.x form (rope_parameters, dtype). An override ``rope_scaling`` (the scaling
    values, without rope_theta) goes where the form keeps it."""
    cfg = dict(PRESETS[preset])
    cfg.update(overrides or {})
    scaling = cfg.pop("rope_scaling", None)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.update(hidden_act="silu", attention_bias=False, attention_dropout=0.0,
               initializer_range=0.02, use_cache=True)
    if cfg["model_type"] == "qwen3":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=28)
    else:
        cfg.update(mlp_bias=False, pretraining_tp=1)
    theta = cfg.pop("rope_theta")
    if form == 4:
        cfg.update(rope_theta=theta, rope_scaling=scaling, torch_dtype="bfloat16",
                   transformers_version="4.51.0")
    elif form == 5:
        cfg.update(rope_parameters={"rope_type": "default", **(scaling or {}),
                                    "rope_theta": theta},
                   dtype="bfloat16", transformers_version="5.0.0")
    else:
        raise ValueError("form must be 4 or 5")
    return cfg


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def random_bf16(shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
    """Fast seeded random bf16: sign and 7 mantissa bits uniform, exponent spread over four
    octaves below 2^E (log-uniform magnitudes). std ~ 0.88 * 2^E; E chosen from ``std``."""
    n = int(np.prod(shape))
    r = np.random.default_rng(seed).integers(0, 1 << 16, n, dtype=np.uint16)
    e = int(round(math.log2(std / 0.88))) + 127
    exp = (np.uint16(e) - ((r >> np.uint16(7)) & np.uint16(3))) << np.uint16(7)
    bits = (r & np.uint16(0x807F)) | exp
    return bits.view(BF16).reshape(shape)


def norm_weight(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(BF16)


def make_weights(cfg: ModelConfig, seed: int, threads: int = 8) -> dict[str, np.ndarray]:
    specs = expected_tensors(cfg)
    h = cfg.hidden_size
    # Embedding / lm_head scaled so that logits = norm(x) . w have std ~2.
    emb_std = 2.0 / math.sqrt(h)

    def one(name: str) -> tuple[str, np.ndarray]:
        shape = specs[name].shape
        s = _seed_for(seed, name)
        if name.endswith("norm.weight"):
            return name, norm_weight(shape, s)
        if "embed_tokens" in name or name == "lm_head.weight":
            return name, random_bf16(shape, emb_std, s)
        fan_in = shape[1]
        return name, random_bf16(shape, 1.0 / math.sqrt(fan_in), s)

    with ThreadPoolExecutor(threads) as ex:
        return dict(ex.map(one, list(specs)))


def write_checkpoint(out: str | Path, preset: str, *, seed: int = 0, form: int = 4,
                     max_shard_bytes: int = 2 << 30, tokenizer: bool = False,
                     overrides: dict | None = None, quiet: bool = False) -> Path:
    """Write config.json, generation_config.json, safetensors shards (+ index when more than
    one) and optionally the real Qwen3 tokenizer files. Returns the directory."""
    if preset in DFLASH_PRESETS:
        if tokenizer:
            raise ValueError(f"preset {preset} is a DFlash drafter: it uses its target's "
                             "tokenizer (write none)")
        return write_drafter_checkpoint(out, preset, seed=seed, max_shard_bytes=max_shard_bytes,
                                        overrides=overrides, quiet=quiet)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cfg_dict = hf_config(preset, form, overrides)
    cfg = ModelConfig.from_dict(cfg_dict)
    (d / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    gen = {"bos_token_id": cfg_dict.get("bos_token_id"),
           "eos_token_id": cfg_dict.get("eos_token_id"), "do_sample": False}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    weights = make_weights(cfg, seed)
    shards = _save_shards(d, weights, max_shard_bytes)
    if tokenizer:
        if cfg.vocab_size < 151669:
            raise ValueError(f"preset {preset} has vocab {cfg.vocab_size}: the Qwen3 tokenizer "
                             "needs the real vocab (151936)")
        from engine.model.fetch import qwen3_tokenizer_dir

        src = qwen3_tokenizer_dir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(src / f, d / f)
    if not quiet:
        gb = sum(a.nbytes for a in weights.values()) / 1e9
        log.info("wrote %s (%.3f B params, %.2f GB, %d shard(s)) to %s", preset,
                 cfg.num_parameters / 1e9, gb, len(shards), d)
    return d


def _save_shards(d: Path, weights: dict[str, np.ndarray],
                 max_shard_bytes: int) -> list[dict[str, np.ndarray]]:
    """Write ``weights`` as model.safetensors, or as shards (greedily, in order) plus the
    index when they exceed ``max_shard_bytes``; older model files in ``d`` are removed."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in weights.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    for old in list(d.glob("model*.safetensors")) + list(d.glob("model.safetensors.index.json")):
        old.unlink()
    if len(shards) == 1:
        save_file(shards[0], d / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        n = len(shards)
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(sh, d / fname, metadata={"format": "pt"})
            weight_map.update({k: fname for k in sh})
        total = sum(a.nbytes for a in weights.values())
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return shards


# DFlash drafters (engine/model/dflash.py) at the z-lab b16 checkpoints' shapes (DFLASH.md 2.1-2.2:
# no embed_tokens / lm_head, they borrow the target's), and a tiny one for the tiny-qwen3 target
_DFLASH_QWEN3 = dict(num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, block_size=16, num_target_layers=36,
                     mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33])
DFLASH_PRESETS: dict[str, dict] = {
    "qwen3-8b-dflash": {**_DFLASH_QWEN3, "hidden_size": 4096, "intermediate_size": 12288},
    "qwen3-4b-dflash": {**_DFLASH_QWEN3, "hidden_size": 2560, "intermediate_size": 9728},
    # for tiny-qwen3 (2 layers, vocab 1024): both its layers captured, the last id the mask
    "tiny-qwen3-dflash": {**_DFLASH_QWEN3, "num_hidden_layers": 2, "hidden_size": 128,
                          "intermediate_size": 256, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
                          "max_position_embeddings": 4096, "num_target_layers": 2,
                          "mask_token_id": 1023, "target_layer_ids": [0, 1]},
}


def drafter_config(preset: str, overrides: dict | None = None) -> dict:
    """The drafter preset's config.json dict (DFLASH.md 2.1)."""
    from engine.model.dflash import hf_drafter_config

    return hf_drafter_config({**DFLASH_PRESETS[preset], **(overrides or {})})


def make_drafter_weights(cfg_dict: dict, seed: int) -> dict[str, np.ndarray]:
    """Seeded random bf16 drafter weights, scaled as ``make_weights`` scales a target's."""
    from engine.model.dflash import DFlashConfig, expected_tensors

    out = {}
    for name, shape in expected_tensors(DFlashConfig.from_dict(cfg_dict)).items():
        s = _seed_for(seed, "dflash:" + name)
        out[name] = (norm_weight(shape, s) if name.endswith("norm.weight")
                     else random_bf16(shape, 1.0 / math.sqrt(shape[1]), s))
    return out


def write_drafter_checkpoint(out: str | Path, preset: str, *, seed: int = 0,
                             max_shard_bytes: int = 2 << 30, overrides: dict | None = None,
                             quiet: bool = False) -> Path:
    """Write a DFlash drafter preset: config.json and its safetensors (DFLASH.md 2.2 names)."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    cfg_dict = drafter_config(preset, overrides)
    (d / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    weights = make_drafter_weights(cfg_dict, seed)
    shards = _save_shards(d, weights, max_shard_bytes)
    if not quiet:
        n = sum(a.size for a in weights.values())
        log.info("wrote %s (%.3f B params, %.2f GB, %d shard(s)) to %s", preset, n / 1e9,
                 2 * n / 1e9, len(shards), d)
    return d
