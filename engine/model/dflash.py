"""The DFlash drafter (z-lab ``DFlashDraftModel``, b16 checkpoints): config, weights, numpy forward.

A few Qwen3 decoder layers of its own (``layers.*``), ``fc``, ``hidden_norm`` and ``norm``; it
borrows the target's ``embed_tokens`` and ``lm_head`` (the checkpoint has neither). For a request
with committed length L (target features ``F[0:L, n*H]`` of positions 0..L-1: the residual stream
leaving target layers ``target_layer_ids``, concatenated) and pending token t at position L::

    ctx = rms_norm(F @ fc.T, hidden_norm)                 # [L, H], shared by every draft layer
    x   = target_embed[[t] + [MASK] * (B - 1)]            # [B, H] at positions L..L+B-1
    per draft layer: input_layernorm on x only; q from x; k/v from ctx (un-normed, k_norm,
        RoPE at 0..L-1) and from x (k_norm, RoPE at L..); attention NOT causal (the block sees
        all context keys and all block keys), GQA; o_proj + residual; post norm, SwiGLU + residual
    drafts = argmax(rms_norm(x, norm)[1:] @ target_lm_head.T)   # B - 1 drafts, always greedy

(../shared/DFLASH.md 2.1-2.4). Only the anchor-drop b16 schema is read (``block_size`` at top
level or in ``dflash_config``; ``dflash_config.mask_token_id`` / ``target_layer_ids``); the
anchor-first DeepSpec / DSpark schema (``num_anchors``) is refused: reading it as anchor-drop
would collapse acceptance to ~0.

This module is the numpy reference (float32 math on bf16 weights, like ``reference.py``): it
recomputes the context projection and the context K/V of every draft layer on each call, i.e.
O(L * n * H * H + layers * L * H * kv) per draft, which is fine for tests and the CPU backend; the
cuda drafter keeps context K/V in the paged pool instead (DFLASH.md 4.4).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ConfigError, ModelConfig, RopeScaling
from engine.jsonfile import Fields, is_id, read_json
from engine.model.loader import BF16, FLOAT_DTYPES, CheckpointError, read_shards
from engine.model.reference import apply_rope, attention, rms_norm, rope_cos_sin, silu

log = logging.getLogger(__name__)

F32 = np.float32
ARCHITECTURE = "DFlashDraftModel"
# names a drafter checkpoint may hold that the drafter does not use (it borrows the target's)
BORROWED = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class DFlashConfig:
    """A drafter's config.json (DFLASH.md 2.1), checked on its own; ``check_target`` checks it
    against the target model it drafts for."""

    num_hidden_layers: int  # draft layers
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # the draft block: [pending, MASK x (block_size - 1)]
    mask_token_id: int  # a row of the target's embedding table
    target_layer_ids: tuple[int, ...]  # target layers whose output residual stream is captured
    num_target_layers: int | None = None  # the target's num_hidden_layers, when given

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_drafts(self) -> int:
        """Drafts per block: slot 0 (the pending token) is dropped."""
        return self.block_size - 1

    @property
    def capture_width(self) -> int:
        """Floats of captured target features per token: ``len(target_layer_ids) * H``."""
        return len(self.target_layer_ids) * self.hidden_size

    # -- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: Any, source: str = "config.json") -> DFlashConfig:
        """Parse a drafter config.json; a ConfigError lists every problem, each naming its
        field and what to do."""
        if not isinstance(cfg, dict):
            raise ConfigError(f"{source}: must hold a JSON object, got {type(cfg).__name__}")
        r = Fields(cfg)
        archs = r.get("architectures", "strings", [])
        dc = r.get("dflash_config", "object", {})
        ints = {k: r.get(k, "int", required=True) for k in (
            "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
            "vocab_size")}
        n_kv = r.get("num_key_value_heads", "int", ints["num_attention_heads"])
        head_dim = r.get("head_dim", "int")
        if head_dim is None and isinstance(ints["hidden_size"], int) and isinstance(
                ints["num_attention_heads"], int) and ints["num_attention_heads"] > 0:
            head_dim = ints["hidden_size"] // ints["num_attention_heads"]
        eps = r.get("rms_norm_eps", "number", 1e-6)
        theta = r.get("rope_theta", "number")
        rp = r.get("rope_parameters", "object")
        if theta is None and rp is not None:
            theta = r.get("rope_theta", "number", obj=rp, name="rope_parameters.rope_theta")
        block = r.get("block_size", "int")
        if block is None:
            block = r.get("block_size", "int", obj=dc, name="dflash_config.block_size")
        mask = r.get("mask_token_id", "int", obj=dc, name="dflash_config.mask_token_id")
        ids = dc.get("target_layer_ids")
        n_target = r.get("num_target_layers", "int")
        act = r.get("hidden_act", "str", "silu")
        bias = r.get("attention_bias", "bool", False)
        layer_types = r.get("layer_types", "strings")
        problems = list(r.problems)
        if archs and ARCHITECTURE not in archs:
            problems.append(f"architectures {archs!r}: not a DFlash drafter (expected "
                            f"[{ARCHITECTURE!r}]); point speculative_config.model at a z-lab "
                            "DFlash checkpoint")
        if "num_anchors" in cfg:
            problems.append("num_anchors: an anchor-first (DeepSpec / DSpark) drafter, which is "
                            "not supported; use an anchor-drop DFlash b16 checkpoint")
        if theta is None:
            problems.append("rope_theta is missing (it must be a number, the target's)")
        if block is None:
            problems.append("block_size is missing (top level or dflash_config.block_size; "
                            "16 for the b16 checkpoints)")
        elif block < 2:
            problems.append(f"block_size must be >= 2 (the pending token and one draft), got "
                            f"{block}")
        for k in ("mask_token_id", "target_layer_ids"):
            if k in cfg and k not in dc:
                problems.append(f"{k} at top level is the anchor-first (DeepSpec / DSpark) "
                                f"schema, not supported; a DFlash b16 config has "
                                f"dflash_config.{k}")
        if mask is None:
            if "mask_token_id" not in cfg:
                problems.append("dflash_config.mask_token_id is missing (the MASK token's id; "
                                "151669 for Qwen3)")
        elif mask < 0:
            problems.append(f"dflash_config.mask_token_id must be >= 0, got {mask}")
        layer_ids: tuple[int, ...] = ()
        if ids is None:
            if "target_layer_ids" not in cfg:
                problems.append("dflash_config.target_layer_ids is missing (the target layers "
                                "whose outputs the drafter reads, e.g. [1, 9, 17, 25, 33])")
        elif not (isinstance(ids, list) and ids and all(is_id(i) for i in ids)):
            problems.append(f"dflash_config.target_layer_ids must be a non-empty array of "
                            f"layer indices >= 0, got {ids!r:.60}")
        elif any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
            problems.append(f"dflash_config.target_layer_ids must be strictly increasing, got "
                            f"{ids}")
        else:
            layer_ids = tuple(ids)
        if act != "silu":
            problems.append(f"hidden_act {act!r} is not supported (only 'silu')")
        if bias:
            problems.append("attention_bias=true is not supported")
        if layer_types and any(t != "full_attention" for t in layer_types):
            problems.append("layer_types: only full-attention draft layers are supported (a "
                            "sliding-window drafter is causal and windowed)")
        for k, v in (*ints.items(), ("num_key_value_heads", n_kv), ("head_dim", head_dim)):
            if isinstance(v, int) and v <= 0:
                problems.append(f"{k} must be a positive integer, got {v}")
        if (isinstance(n_kv, int) and n_kv > 0 and isinstance(ints["num_attention_heads"], int)
                and ints["num_attention_heads"] % n_kv):
            problems.append(f"num_attention_heads ({ints['num_attention_heads']}) must be a "
                            f"multiple of num_key_value_heads ({n_kv})")
        if isinstance(head_dim, int) and head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {head_dim}")
        if isinstance(eps, float) and not (math.isfinite(eps) and eps > 0):
            problems.append(f"rms_norm_eps must be a finite number > 0, got {eps}")
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        return cls(**ints, num_key_value_heads=n_kv, head_dim=head_dim, rms_norm_eps=eps,
                   rope_theta=theta, block_size=block, mask_token_id=mask,
                   target_layer_ids=layer_ids, num_target_layers=n_target)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str],
                        field: str = "speculative_config.model") -> DFlashConfig:
        d = Path(path)
        if not d.is_dir():
            state = "does not exist" if not d.exists() else "is not a directory"
            raise ConfigError(f"{field} {str(d)!r} {state}; point it at a DFlash drafter "
                              "checkpoint directory (config.json + safetensors)")
        p = d / "config.json"
        if not p.is_file():
            raise ConfigError(f"{field} {str(d)!r}: no config.json; point it at a DFlash "
                              "drafter checkpoint directory")
        return cls.from_dict(read_json(p, ConfigError), source=str(p))

    def check_target(self, target: ModelConfig, source: str = "the DFlash drafter") -> None:
        """The drafter must fit the target it drafts for (DFLASH.md 2.1): ConfigError naming
        every field that does not."""
        problems = []
        for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "vocab_size", "rope_theta"):
            mine, theirs = getattr(self, k), getattr(target, k)
            if mine != theirs:
                problems.append(f"{k} {mine} differs from the target model's {theirs}")
        n = target.num_hidden_layers
        if self.num_target_layers is not None and self.num_target_layers != n:
            problems.append(f"num_target_layers {self.num_target_layers} differs from the "
                            f"target model's num_hidden_layers {n}")
        bad = [i for i in self.target_layer_ids if i >= n]
        if bad:
            problems.append(f"dflash_config.target_layer_ids {list(self.target_layer_ids)} "
                            f"name layers {bad} the target (of {n} layers) does not have")
        if self.mask_token_id >= target.vocab_size:
            problems.append(f"dflash_config.mask_token_id {self.mask_token_id} is outside the "
                            f"target's vocabulary ({target.vocab_size} tokens)")
        if problems:
            raise ConfigError(f"{source} does not fit the target model: "
                              + "; ".join(problems)
                              + "; use the drafter trained for this target model")

    def check_cuda(self, target: ModelConfig, source: str = "the DFlash drafter") -> None:
        """What the cuda drafter needs beyond ``check_target``: it runs the target's fused SiLU
        kernel, so its intermediate_size must be the target's. ConfigError naming the field."""
        if self.intermediate_size != target.intermediate_size:
            raise ConfigError(
                f"{source}: the drafter's intermediate_size {self.intermediate_size} differs "
                f"from the target model's {target.intermediate_size}; the cuda drafter runs the "
                "target's SiLU kernel (every z-lab DFlash checkpoint matches its target): use "
                "--backend numpy for this drafter")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default ``target_layer_ids``: ``round(1 + i * (N - 4) / (n - 1))`` spread from
    layer 1 to layer N - 3 ([1, 9, 17, 25, 33] for 36 target and 5 draft layers)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1)))
            for i in range(num_draft_layers)]


# -- tensors -------------------------------------------------------------------------------------
def expected_tensors(dc: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a drafter checkpoint holds (DFLASH.md 2.2: no ``model.`` prefix, no
    embeddings, no lm_head) and its shape."""
    h, i, hd = dc.hidden_size, dc.intermediate_size, dc.head_dim
    out: dict[str, tuple[int, ...]] = {}
    for li in range(dc.num_hidden_layers):
        p = f"layers.{li}."
        out.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (dc.q_size, h),
            p + "self_attn.k_proj.weight": (dc.kv_size, h),
            p + "self_attn.v_proj.weight": (dc.kv_size, h),
            p + "self_attn.o_proj.weight": (h, dc.q_size),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
    out["fc.weight"] = (h, dc.capture_width)
    out["hidden_norm.weight"] = (h,)
    out["norm.weight"] = (h,)
    return out


@dataclass
class DFlashCheckpoint:
    path: Path
    config: DFlashConfig
    tensors: dict[str, np.ndarray]  # bf16, under the names of ``expected_tensors``

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[name]


def load_drafter(path: str | os.PathLike[str], target: ModelConfig | None = None
                 ) -> DFlashCheckpoint:
    """Read and check a drafter directory: its config (against ``target`` when given), then
    every tensor (missing, unexpected, shape, dtype: one CheckpointError listing them all).
    A ``model.`` prefix (vLLM's naming) is accepted; embed_tokens / lm_head, if a checkpoint
    ships them, are ignored (the target's are used)."""
    d = Path(path)
    dc = DFlashConfig.from_pretrained(d)
    if target is not None:
        dc.check_target(target, f"the DFlash drafter {d}")
    raw = read_shards(d, "model.", "DFlash drafter weights cannot be used")
    problems: list[str] = []
    want = expected_tensors(dc)
    for name, shape in want.items():
        a = raw.get(name)
        if a is None:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
            continue
        if name == "fc.weight" and a.ndim == 2 and a.shape[1] != dc.capture_width:
            problems.append(
                f"fc.weight has {a.shape[1]} input features, but len(target_layer_ids) * "
                f"hidden_size = {len(dc.target_layer_ids)} * {dc.hidden_size} = "
                f"{dc.capture_width}: dflash_config.target_layer_ids does not match the "
                "checkpoint")
        elif tuple(a.shape) != shape:
            problems.append(f"tensor {name} has shape {list(a.shape)}, expected {list(shape)}")
        if a.dtype not in FLOAT_DTYPES:
            problems.append(f"tensor {name} has dtype {a.dtype}, expected bfloat16 (or "
                            "float16/float32)")
    for name in raw:
        if name not in want and name not in BORROWED and not name.endswith("rotary_emb.inv_freq"):
            problems.append(f"unexpected tensor {name}")
    if problems:
        raise CheckpointError(str(d), problems, "DFlash drafter does not match its config.json")
    tensors = {n: raw[n] if raw[n].dtype == BF16 else raw[n].astype(BF16) for n in want}
    return DFlashCheckpoint(d, dc, tensors)


# -- the numpy forward ---------------------------------------------------------------------------
class DFlashDrafter:
    """The drafter's numpy forward (float32 copies of the weights) over the target's embedding
    and lm_head (float32 arrays, shared, not copied) and the target's RoPE scaling."""

    def __init__(self, ckpt: DFlashCheckpoint, embed: np.ndarray, lm_head: np.ndarray,
                 rope_scaling: RopeScaling) -> None:
        self.config = dc = ckpt.config
        self.embed, self.lm_head, self.rope_scaling = embed, lm_head, rope_scaling

        def f32(name: str) -> np.ndarray:
            return np.asarray(ckpt[name], dtype=F32)

        def t(name: str) -> np.ndarray:
            return np.ascontiguousarray(f32(name).T)

        self.fc_t = t("fc.weight")  # [n*H, H]
        self.hidden_norm = f32("hidden_norm.weight")
        self.norm = f32("norm.weight")
        self.layers = []
        for li in range(dc.num_hidden_layers):
            p = f"layers.{li}."
            self.layers.append({
                "in_norm": f32(p + "input_layernorm.weight"),
                "post_norm": f32(p + "post_attention_layernorm.weight"),
                "q_t": t(p + "self_attn.q_proj.weight"),
                "kv_t": np.ascontiguousarray(np.concatenate(
                    [f32(p + "self_attn.k_proj.weight"), f32(p + "self_attn.v_proj.weight")]).T),
                "q_norm": f32(p + "self_attn.q_norm.weight"),
                "k_norm": f32(p + "self_attn.k_norm.weight"),
                "o_t": t(p + "self_attn.o_proj.weight"),
                "gate_up_t": np.ascontiguousarray(np.concatenate(
                    [f32(p + "mlp.gate_proj.weight"), f32(p + "mlp.up_proj.weight")]).T),
                "down_t": t(p + "mlp.down_proj.weight"),
            })
        self.scale = dc.head_dim ** -0.5

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def context(self, features: np.ndarray) -> np.ndarray:
        """``rms_norm(F @ fc.T, hidden_norm)``: [L, n*H] target features -> [L, H]."""
        x = np.matmul(np.asarray(features, F32), self.fc_t, dtype=F32)
        return rms_norm(x, self.hidden_norm, self.config.rms_norm_eps)

    def _kv(self, lw: dict, h: np.ndarray, cos: np.ndarray, sin: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
        dc = self.config
        kv = np.matmul(h, lw["kv_t"], dtype=F32)
        t = h.shape[0]
        k = kv[:, :dc.kv_size].reshape(t, dc.num_key_value_heads, dc.head_dim)
        v = kv[:, dc.kv_size:].reshape(t, dc.num_key_value_heads, dc.head_dim)
        k = apply_rope(rms_norm(k, lw["k_norm"], dc.rms_norm_eps), cos, sin)
        return k, np.ascontiguousarray(v)

    def hidden(self, features: np.ndarray, pending: int) -> np.ndarray:
        """The block's final hidden states [B, H] (after ``norm``) for a request whose
        positions 0..L-1 have the target features ``features`` [L, n*H] and whose pending
        token ``pending`` sits at position L."""
        dc = self.config
        n_ctx, b = features.shape[0], dc.block_size
        eps, hd = dc.rms_norm_eps, dc.head_dim
        ctx = self.context(features)
        ids = np.full(b, dc.mask_token_id, np.int64)
        ids[0] = pending
        x = self.embed[ids].astype(F32)
        pos = np.arange(n_ctx + b)
        cos, sin = rope_cos_sin(pos, hd, dc.rope_theta, self.rope_scaling)
        q_pos = np.full(b, n_ctx + b - 1)  # every key at or before it: no causal mask
        for lw in self.layers:
            h = rms_norm(x, lw["in_norm"], eps)
            q = np.matmul(h, lw["q_t"], dtype=F32).reshape(b, dc.num_attention_heads, hd)
            q = apply_rope(rms_norm(q, lw["q_norm"], eps), cos[n_ctx:], sin[n_ctx:])
            k_ctx, v_ctx = self._kv(lw, ctx, cos[:n_ctx], sin[:n_ctx])  # un-normed context
            k_blk, v_blk = self._kv(lw, h, cos[n_ctx:], sin[n_ctx:])
            a = attention(q, np.concatenate([k_ctx, k_blk]), np.concatenate([v_ctx, v_blk]),
                          q_pos, self.scale)
            x = x + np.matmul(a.reshape(b, -1), lw["o_t"], dtype=F32)
            h2 = rms_norm(x, lw["post_norm"], eps)
            gu = np.matmul(h2, lw["gate_up_t"], dtype=F32)
            i = dc.intermediate_size
            x = (x + np.matmul(silu(gu[:, :i]) * gu[:, i:], lw["down_t"], dtype=F32)).astype(F32)
        return rms_norm(x, self.norm, eps)

    def logits(self, features: np.ndarray, pending: int) -> np.ndarray:
        """[B - 1, vocab]: block slots 1..B-1 through the target's lm_head (slot 0 dropped)."""
        return np.matmul(self.hidden(features, pending)[1:], self.lm_head.T, dtype=F32)

    def propose(self, features: np.ndarray, pending: int) -> np.ndarray:
        """The B - 1 drafts (int64): argmax of each slot's logits, whatever the request
        samples (the drafter is deterministic: verification stays exact, DFLASH.md 3.2)."""
        return np.argmax(self.logits(features, pending), axis=-1)


# -- random-weight checkpoints (engine.model.synthetic's presets) --------------------------------
def hf_drafter_config(preset: dict[str, Any]) -> dict[str, Any]:
    """A preset (engine.model.synthetic.DFLASH_PRESETS) as the config.json of DFLASH.md 2.1."""
    p = dict(preset)
    mask, ids = p.pop("mask_token_id"), p.pop("target_layer_ids")
    cfg = {"architectures": [ARCHITECTURE], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "model_type": "qwen3", **p, "attention_bias": False, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids}}
    return json.loads(json.dumps(cfg))
