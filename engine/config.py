"""Frozen configuration: the model (from a Hugging Face ``config.json``) and the engine options.

Both are passed down whole. Derived values are properties; validation happens in
``__post_init__`` / the parser, with messages that say what to change.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


class ConfigError(ValueError):
    """A config.json or an engine option that cuteinfer cannot use. The message says why."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "qwen3" | "llama"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ConfigError(f"architecture {self.architecture!r}: use 'qwen3' or 'llama'")
        for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{f} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    # -- derived -------------------------------------------------------------------------------
    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalizes each q and k head (RMSNorm over head_dim) before RoPE."""
        return self.architecture == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def gqa_ratio(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * self.qkv_size + self.q_size * h + 3 * h * i + 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    # -- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None,
                  source: str = "config.json") -> ModelConfig:
        """Parse a Hugging Face config (transformers 4.x or 5.x form)."""
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None:
            raise ConfigError(
                f"{source}: architectures {archs!r} are not supported; cuteinfer runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        problems: list[str] = []
        # RoPE: 4.x puts rope_theta (and rope_scaling) at top level; 5.x nests rope_parameters.
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict) and "full_attention" in rp and isinstance(rp["full_attention"],
                                                                          dict):
            rp = rp["full_attention"]
        rope_theta = cfg.get("rope_theta")
        rope_type = "default"
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            rope_type = rp.get("rope_type", rp.get("type", "default")) or "default"
        scaling = cfg.get("rope_scaling")
        if isinstance(scaling, dict):
            rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if rope_type != "default":
            problems.append(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
        if rope_theta is None:
            rope_theta = 10000.0
        if cfg.get("attention_bias"):
            problems.append("attention_bias=true is not supported (Qwen3/Llama without biases)")
        if cfg.get("mlp_bias"):
            problems.append("mlp_bias=true is not supported")
        if cfg.get("use_sliding_window"):
            problems.append("sliding-window attention (use_sliding_window=true) is not supported")
        layer_types = cfg.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            problems.append("only full-attention layers are supported (layer_types has others)")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act {act!r} is not supported (only 'silu')")
        n_heads = cfg.get("num_attention_heads")
        hidden = cfg.get("hidden_size")
        head_dim = cfg.get("head_dim")
        if head_dim is None and isinstance(n_heads, int) and isinstance(hidden, int) and n_heads:
            head_dim = hidden // n_heads
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))

        eos: list[int] = []
        for src in (cfg, generation_config or {}):
            e = src.get("eos_token_id")
            for x in (e if isinstance(e, list) else [e]):
                if isinstance(x, int) and x not in eos:
                    eos.append(x)
        dtype = cfg.get("dtype", cfg.get("torch_dtype", "bfloat16")) or "bfloat16"
        try:
            return cls(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=cfg.get("intermediate_size"),
                num_hidden_layers=cfg.get("num_hidden_layers"),
                num_attention_heads=n_heads,
                num_key_value_heads=cfg.get("num_key_value_heads", n_heads),
                head_dim=head_dim,
                vocab_size=cfg.get("vocab_size"),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                eos_token_ids=tuple(eos),
                bos_token_id=cfg.get("bos_token_id"),
                pad_token_id=cfg.get("pad_token_id"),
                dtype=str(dtype),
            )
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        d = Path(path)
        cfg_path = d / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{d}: no config.json; point --model at a Hugging Face checkpoint "
                              "directory")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from None
        gen = None
        gen_path = d / "generation_config.json"
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except json.JSONDecodeError:
                gen = None
        return cls.from_dict(cfg, gen, source=str(cfg_path))


BACKENDS = ("auto", "numpy", "cuda")
DUPLICATE_POLICIES = ("allow", "reject")


@dataclass(frozen=True)
class EngineConfig:
    """Engine options, with vLLM's names."""

    model: str = ""
    backend: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_chunked_prefill: bool = True
    seed: int = 0
    duplicate_policy: str = "allow"
    # numpy backend: KV pages to allocate when num_gpu_blocks_override is not given.
    cpu_kv_pages: int = 512
    cuda_graph_max_bs: int | None = None  # largest captured bucket (default: max_num_seqs)
    lazy_graph_capture: bool = False
    # Prompt-logprob requests skip the prefix cache (as in vLLM) unless this is set; then cached
    # positions report None (their logits were never computed). Used by the golden gate.
    prompt_logprobs_prefix_cache: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("num_gpu_blocks_override must be >= 2 (one page is the padding "
                              f"page), got {self.num_gpu_blocks_override}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1], got "
                              f"{self.gpu_memory_utilization}")
        if self.duplicate_policy not in DUPLICATE_POLICIES:
            raise ConfigError(f"duplicate_policy {self.duplicate_policy!r}: use 'allow' or "
                              "'reject'")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in kwargs if k not in known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def resolve(self, model_config: ModelConfig) -> EngineConfig:
        """Fill model-dependent defaults and check the options against the model."""
        mml = self.max_model_len or model_config.max_position_embeddings
        if mml > model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {mml} exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings}); lower max_model_len")
        return replace(self, max_model_len=mml)

    @property
    def max_pages_per_seq(self) -> int:
        assert self.max_model_len is not None, "call resolve() first"
        return math.ceil(self.max_model_len / self.block_size)
