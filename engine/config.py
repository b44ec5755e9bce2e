"""Frozen configuration: the model (from a Hugging Face ``config.json``) and the engine options.

Both are passed down whole. Derived values are properties. ModelConfig is checked in
``__post_init__`` / its parser; EngineConfig is built, checked and resolved once by
``engine.args.EngineArgs.create_engine_config``. Messages say what to change.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.jsonfile import Fields, is_id, is_int, is_number, json_type, read_json

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
            if not is_int(v) or v <= 0:
                raise ConfigError(f"{f} must be a positive integer, got {v!r}")
        for f in ("rms_norm_eps", "rope_theta"):  # NaN here loads and then generates token 0
            v = getattr(self, f)
            if not is_number(v) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{f} must be a finite number > 0, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"tie_word_embeddings must be a boolean, got "
                              f"{self.tie_word_embeddings!r}")
        if not all(is_id(t) for t in self.eos_token_ids):
            raise ConfigError(f"eos_token_ids must be integers >= 0, got {self.eos_token_ids!r}")
        for f in ("bos_token_id", "pad_token_id"):
            if getattr(self, f) is not None and not is_int(getattr(self, f)):
                raise ConfigError(f"{f} must be an integer or None, got {getattr(self, f)!r}")
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
                  source: str = "config.json",
                  generation_source: str = "generation_config.json") -> ModelConfig:
        """Parse a Hugging Face config (transformers 4.x or 5.x form). Every field is read with
        its JSON type checked: ``"tie_word_embeddings": "false"`` is an error, not true."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source}: must hold a JSON object ({{...}}), got {json_type(cfg)}")
        if generation_config is not None and not isinstance(generation_config, dict):
            raise ConfigError(f"{generation_source}: must hold a JSON object ({{...}}), got "
                              f"{json_type(generation_config)}")
        r = Fields(cfg)
        archs = r.get("architectures", "strings", [])
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None and not r.problems:
            raise ConfigError(
                f"{source}: architectures {archs!r} are not supported; cuteinfer runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        # RoPE: 4.x puts rope_theta (and rope_scaling) at top level; 5.x nests rope_parameters.
        rope_theta = r.get("rope_theta", "number", 10000.0)
        rope_type = "default"
        rp, rp_name = r.get("rope_parameters", "object"), "rope_parameters"
        if rp is not None and isinstance(rp.get("full_attention"), dict):
            rp, rp_name = rp["full_attention"], "rope_parameters.full_attention"
        for obj, name in ((rp, rp_name), (r.get("rope_scaling", "object"), "rope_scaling")):
            if obj is None:
                continue
            if name != "rope_scaling":
                rope_theta = r.get("rope_theta", "number", rope_theta, obj=obj,
                                   name=f"{name}.rope_theta")
            rope_type = (r.get("rope_type", "str", obj=obj, name=f"{name}.rope_type")
                         or r.get("type", "str", obj=obj, name=f"{name}.type") or "default")
        flags = {k: r.get(k, "bool", False) for k in ("attention_bias", "mlp_bias",
                                                       "use_sliding_window")}
        layer_types = r.get("layer_types", "strings")
        act = r.get("hidden_act", "str", "silu")
        n_heads = r.get("num_attention_heads", "int", required=True)
        hidden = r.get("hidden_size", "int", required=True)
        head_dim = r.get("head_dim", "int")
        if head_dim is None and isinstance(n_heads, int) and isinstance(hidden, int) and n_heads:
            head_dim = hidden // n_heads
        ints = {k: r.get(k, "int", required=True)
                for k in ("intermediate_size", "num_hidden_layers", "vocab_size")}
        n_kv = r.get("num_key_value_heads", "int", n_heads)
        max_pos = r.get("max_position_embeddings", "int", 2048)
        eps = r.get("rms_norm_eps", "number", 1e-6)
        tie = r.get("tie_word_embeddings", "bool", False)
        bos, pad = r.get("bos_token_id", "int"), r.get("pad_token_id", "int")
        dtype = r.get("dtype", "str") or r.get("torch_dtype", "str") or "bfloat16"
        eos: list[int] = []
        gen = Fields(generation_config or {})
        for fr in (r, gen):
            e = fr.get("eos_token_id", "ids", [])
            for x in e if isinstance(e, list) else [e]:
                if x not in eos:
                    eos.append(x)
        if r.problems:
            raise ConfigError(f"{source}: " + "; ".join(r.problems))
        if gen.problems:
            raise ConfigError(f"{generation_source}: " + "; ".join(gen.problems))

        problems: list[str] = []
        if rope_type != "default":
            problems.append(f"rope scaling {rope_type!r} is not supported (only plain RoPE)")
        if flags["attention_bias"]:
            problems.append("attention_bias=true is not supported (Qwen3/Llama without biases)")
        if flags["mlp_bias"]:
            problems.append("mlp_bias=true is not supported")
        if flags["use_sliding_window"]:
            problems.append("sliding-window attention (use_sliding_window=true) is not supported")
        if layer_types and any(t != "full_attention" for t in layer_types):
            problems.append("only full-attention layers are supported (layer_types has others)")
        if act != "silu":
            problems.append(f"hidden_act {act!r} is not supported (only 'silu')")
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        try:
            return cls(
                architecture=arch or "", hidden_size=hidden, num_attention_heads=n_heads,
                num_key_value_heads=n_kv, head_dim=head_dim, **ints, rms_norm_eps=eps,
                rope_theta=rope_theta, max_position_embeddings=max_pos,
                tie_word_embeddings=tie, eos_token_ids=tuple(eos), bos_token_id=bos,
                pad_token_id=pad, dtype=dtype)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` when present: its eos ids end
        generation, so a malformed one is an error, not silently skipped)."""
        d = Path(path)
        if not d.is_dir():
            state = "does not exist" if not d.exists() else "is not a directory"
            raise ConfigError(f"{d}: {state}; point --model at a Hugging Face checkpoint "
                              "directory")
        cfg_path = d / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{d}: no config.json; point --model at a Hugging Face checkpoint "
                              "directory")
        cfg = read_json(cfg_path, ConfigError)
        gen_path = d / "generation_config.json"
        gen = read_json(gen_path, ConfigError) if gen_path.is_file() else None
        return cls.from_dict(cfg, gen, source=str(cfg_path), generation_source=str(gen_path))


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine options, resolved: every value concrete (the backend chosen, max_model_len and
    the prefill cap filled in from the model and the backend). Built once, and checked, by
    ``engine.args.EngineArgs.create_engine_config``, where the defaults, the help text and the
    validation live; vLLM's names. ``None`` is left only where it is an option's own meaning
    (no override, the default graph cap)."""

    model: str
    backend: str  # "numpy" | "cuda" (engine.executor.registry.BACKENDS)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # 0 = no cap
    block_size: int
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None  # None: profile (cuda) or size the pool (numpy)
    gpu_memory_utilization: float
    enforce_eager: bool
    enable_chunked_prefill: bool
    seed: int
    duplicate_policy: str
    cpu_kv_pages: int
    cuda_graph_max_bs: int | None  # None: graphs.buckets.DEFAULT_MAX
    lazy_graph_capture: bool
    prompt_logprobs_prefix_cache: bool

    def check_kv_capacity(self, num_usable_pages: int) -> None:
        """Refuse a KV pool that cannot hold one request of max_model_len (vLLM refuses it at
        start-up too): otherwise requests would be accepted and fail part-way."""
        need = self.max_pages_per_seq
        if num_usable_pages < need:
            fits = num_usable_pages * self.block_size
            raise ConfigError(
                f"the KV cache holds {fits} tokens ({num_usable_pages} pages of "
                f"{self.block_size}), fewer than one request of max_model_len "
                f"{self.max_model_len} needs ({need} pages); lower max_model_len to at most "
                f"{fits}, or give the cache more pages (num_gpu_blocks_override >= {need + 1}, "
                "one is the padding page, or a higher gpu_memory_utilization)")

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)
