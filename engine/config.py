"""Frozen configuration: the model (from a Hugging Face ``config.json``) and the engine options.

Both are passed down whole. Derived values are properties. ModelConfig is checked in
``__post_init__`` / its parser; EngineConfig is built, checked and resolved once by
``engine.args.EngineArgs.create_engine_config``. Messages say what to change.

RoPE scaling parses from either config form into one ``RopeScaling``, every default resolved as
transformers' ``modeling_rope_utils.py`` resolves it (the frequencies are computed in
``engine.model.reference``):

    4.x  "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}
    5.x  "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, ...}
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.jsonfile import Fields, is_id, is_int, is_number, json_type, read_json
from engine.sampling_params import resolve_generation_defaults

SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# generation_config.json fields vLLM takes sampling defaults from (get_diff_sampling_param)
GENERATION_FIELDS = {"temperature": "number", "top_p": "number", "top_k": "int",
                     "min_p": "number", "repetition_penalty": "number", "max_new_tokens": "int"}


class ConfigError(ValueError):
    """A config.json or an engine option that cuteinfer cannot use. The message says why."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of a model, defaults resolved; ``default`` is plain RoPE (theta only).

    ``original_max_position_embeddings`` is the pre-training context of llama3 and yarn (the
    config's, else max_position_embeddings, as transformers 5 does) and, for dynamic, the
    context its one fixed NTK base is computed from (max_position_embeddings; see
    ``engine.model.reference``). ``attention_factor`` multiplies cos and sin (yarn; 1 else)."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope type {self.rope_type!r} is not supported; supported rope "
                              f"types: {', '.join(ROPE_TYPES)}")
        for f in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                  "attention_factor"):
            v = getattr(self, f)
            if not is_number(v) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"rope scaling {f} must be a finite number > 0, got {v!r}")
        orig = self.original_max_position_embeddings
        if not is_int(orig) or orig < (0 if self.rope_type == "default" else 1):
            raise ConfigError(f"rope scaling original_max_position_embeddings must be a "
                              f"positive integer, got {orig!r}")
        if not isinstance(self.truncate, bool):
            raise ConfigError(f"rope scaling truncate must be a boolean, got {self.truncate!r}")

    def context_len(self, max_position_embeddings: int) -> int:
        """The context the scaled RoPE covers, as vLLM derives max_model_len from it: linear
        and dynamic stretch max_position_embeddings by the factor, yarn the original context;
        llama3 configs already give the extended max_position_embeddings. Never shorter than
        max_position_embeddings."""
        n = max_position_embeddings
        if self.rope_type in ("linear", "dynamic"):
            n = int(max_position_embeddings * self.factor)
        elif self.rope_type == "yarn":
            n = int(self.original_max_position_embeddings * self.factor)
        return max(n, max_position_embeddings)


PLAIN_ROPE = RopeScaling()
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim", "attention_factor")


def _read_rope(r: Fields) -> tuple[float, str, dict[str, Any], str]:
    """(rope_theta, rope_type, the scaling values, where they were read) from either config
    form; wrong JSON types land in ``r.problems``."""
    theta = r.get("rope_theta", "number", 10000.0)
    rope_type, values, where = "default", {}, "rope_scaling"
    rp, rp_name = r.get("rope_parameters", "object"), "rope_parameters"
    if rp is not None and isinstance(rp.get("full_attention"), dict):
        rp, rp_name = rp["full_attention"], "rope_parameters.full_attention"
    for obj, name in ((rp, rp_name), (r.get("rope_scaling", "object"), "rope_scaling")):
        if obj is None:
            continue
        if name != "rope_scaling":
            theta = r.get("rope_theta", "number", theta, obj=obj, name=f"{name}.rope_theta")
        rope_type = (r.get("rope_type", "str", obj=obj, name=f"{name}.rope_type")
                     or r.get("type", "str", obj=obj, name=f"{name}.type") or "default")
        values = {k: r.get(k, kind, obj=obj, name=f"{name}.{k}") for k, kind in
                  [(k, "number") for k in _ROPE_NUMBERS]
                  + [("original_max_position_embeddings", "int"), ("truncate", "bool")]}
        where = name
    return theta, rope_type, values, where


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_scaling(rope_type: str, v: dict[str, Any], where: str, max_pos: int,
                  top_orig: int | None) -> RopeScaling:
    """transformers' resolution of the scaling values (``_compute_*_parameters``)."""
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}.rope_type {rope_type!r} is not supported; supported rope "
                          f"types: {', '.join(ROPE_TYPES)}")
    if rope_type == "default":
        return PLAIN_ROPE
    # transformers 5 prefers a top-level original_max_position_embeddings (Phi-3 style)
    given_orig = top_orig if top_orig is not None else v["original_max_position_embeddings"]
    orig = max_pos if rope_type == "dynamic" or given_orig is None else given_orig
    factor = v["factor"]
    if factor is None and rope_type == "yarn" and given_orig:
        factor = max_pos / orig  # transformers 5: the stretch from the original context
    if factor is None:
        raise ConfigError(f"{where}: rope type {rope_type!r} needs a factor")
    kw: dict[str, Any] = {"rope_type": rope_type, "factor": factor,
                          "original_max_position_embeddings": orig}
    if rope_type == "llama3":
        for k in ("low_freq_factor", "high_freq_factor"):
            if v[k] is None:
                raise ConfigError(f"{where}: rope type 'llama3' needs {k}")
            kw[k] = v[k]
    elif rope_type == "yarn":
        att, ms, ms_all = v["attention_factor"], v["mscale"], v["mscale_all_dim"]
        if att is None:
            att = (_yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all
                   else _yarn_mscale(factor))
        kw.update(beta_fast=v["beta_fast"] or 32.0, beta_slow=v["beta_slow"] or 1.0,
                  truncate=True if v["truncate"] is None else v["truncate"],
                  attention_factor=float(att))
    try:
        return RopeScaling(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


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
    rope_scaling: RopeScaling = PLAIN_ROPE
    # generation_config.json's sampling fields (GENERATION_FIELDS), as given: see
    # ``sampling_defaults``
    generation_defaults: tuple[tuple[str, float | int], ...] = ()

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
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling must be a RopeScaling, got {self.rope_scaling!r}")
        if self.rope_scaling.rope_type == "dynamic" and self.head_dim <= 2:
            raise ConfigError(f"dynamic RoPE scaling needs head_dim > 2, got {self.head_dim}")

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

    @property
    def kv_per_weight(self) -> float:
        """One token of context's KV bytes over the weight bytes a decode step reads (an untied
        embedding table contributes only the rows it gathers): a step whose rows read C tokens of
        context costs about ``1 + C * kv_per_weight`` weight reads (the scheduler's mixed-step
        lift)."""
        read = self.num_parameters - (0 if self.tie_word_embeddings
                                      else self.vocab_size * self.hidden_size)
        return self.kv_bytes_per_token() / (2 * read)

    @property
    def max_context_len(self) -> int:
        """The longest context the model's RoPE covers: max_model_len's default and bound."""
        return self.rope_scaling.context_len(self.max_position_embeddings)

    def sampling_defaults(self, generation_config: str = "auto") -> dict[str, float | int]:
        """The default sampling parameters requests start from, as vLLM's
        ``get_diff_sampling_param``: generation_config.json's (``auto``) or none (``vllm``: the
        built-in defaults). Fields the engine does not support are dropped with a warning."""
        if generation_config == "vllm":
            return {}
        try:
            return resolve_generation_defaults(dict(self.generation_defaults))
        except ValueError as e:
            raise ConfigError(f"generation_config.json: {e}; fix the file or pass "
                              "--generation-config vllm") from None

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
        rope_theta, rope_type, rope_values, rope_where = _read_rope(r)
        top_orig = r.get("original_max_position_embeddings", "int")
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
        gen_defaults = tuple((k, v) for k, kind in GENERATION_FIELDS.items()
                             if (v := gen.get(k, kind)) is not None)
        if r.problems:
            raise ConfigError(f"{source}: " + "; ".join(r.problems))
        if gen.problems:
            raise ConfigError(f"{generation_source}: " + "; ".join(gen.problems))

        problems: list[str] = []
        rope_scaling = PLAIN_ROPE
        try:
            rope_scaling = _rope_scaling(rope_type, rope_values, rope_where,
                                         max_pos if is_int(max_pos) else 2048, top_orig)
        except ConfigError as e:
            problems.append(str(e))
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
                pad_token_id=pad, dtype=dtype, rope_scaling=rope_scaling,
                generation_defaults=gen_defaults)
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
    tensor_parallel_size: int  # ranks the model is split over (engine/parallel/plan.py)
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int  # 0 = no cap
    mixed_prefill_tokens: int  # prompt tokens per step while others decode; 0 = no cap
    mixed_step_tokens: int  # tokens per step in all while requests decode; 0 = no cap
    speculative_config: Any  # engine.speculative.SpeculativeConfig, or None (off)
    block_size: int
    enable_prefix_caching: bool
    num_gpu_blocks_override: int | None  # None: profile (cuda) or size the pool (numpy)
    gpu_memory_utilization: float
    enforce_eager: bool
    enable_chunked_prefill: bool
    seed: int
    generation_config: str  # "auto" | "vllm": ModelConfig.sampling_defaults
    duplicate_policy: str
    cpu_kv_pages: int
    cuda_graph_max_bs: int | None  # None: graphs.buckets.DEFAULT_MAX
    lazy_graph_capture: bool
    prompt_logprobs_prefix_cache: bool
    async_scheduling: bool = True  # plan decode step N+1 while the GPU runs step N

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
