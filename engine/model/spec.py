"""Model definitions: the checkpoint's weight names and shapes, and the layer plan.

Qwen3 and Llama share one decoder layer:

    x -> RMSNorm -> q,k,v proj -> [q/k per-head RMSNorm: Qwen3] -> RoPE -> GQA attention -> o proj
      -> + residual -> RMSNorm -> gate,up proj -> SiLU(gate) * up -> down proj -> + residual

then a final RMSNorm and lm_head (tied to the embeddings or not).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint of this config must hold (HF names)."""
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    out: list[TensorSpec] = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for li in range(cfg.num_hidden_layers):
        p = layer_prefix(li)
        out += [
            TensorSpec(p + "input_layernorm.weight", (h,)),
            TensorSpec(p + "self_attn.q_proj.weight", (cfg.q_size, h)),
            TensorSpec(p + "self_attn.k_proj.weight", (cfg.kv_size, h)),
            TensorSpec(p + "self_attn.v_proj.weight", (cfg.kv_size, h)),
            TensorSpec(p + "self_attn.o_proj.weight", (h, cfg.q_size)),
            TensorSpec(p + "post_attention_layernorm.weight", (h,)),
            TensorSpec(p + "mlp.gate_proj.weight", (i, h)),
            TensorSpec(p + "mlp.up_proj.weight", (i, h)),
            TensorSpec(p + "mlp.down_proj.weight", (h, i)),
        ]
        if cfg.qk_norm:
            out += [TensorSpec(p + "self_attn.q_norm.weight", (hd,)),
                    TensorSpec(p + "self_attn.k_norm.weight", (hd,))]
    out.append(TensorSpec("model.norm.weight", (h,)))
    if not cfg.tie_word_embeddings:
        out.append(TensorSpec("lm_head.weight", (cfg.vocab_size, h)))
    return {t.name: t for t in out}


def optional_tensors(cfg: ModelConfig) -> set[str]:
    """Tensors a checkpoint may hold that we ignore (a tied lm_head saved anyway, rotary caches)."""
    names = set()
    if cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    return names


def ignorable(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")
