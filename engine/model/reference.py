"""The numpy reference forward: float32 math on bf16 weights. The oracle for every backend.

It matches Hugging Face transformers in float32 (checkpoint loaded from disk in float32) to
~1e-6 in logprobs. The layer functions are shared with the numpy paged executor; ``forward``
runs one whole sequence with dense causal attention.

RoPE frequencies (``inv_freq``) follow transformers' ``modeling_rope_utils.py`` op for op in
float32 (``x / t`` of a Python number by a tensor is ``t.reciprocal() * x`` in torch), and the
cuda backend uploads ``cos_sin_table`` of the same values:

- default: ``1 / theta ** (2i / d)``; linear: that divided by the factor.
- llama3: wavelengths above ``original_max / low_freq_factor`` divided by the factor, those
  below ``original_max / high_freq_factor`` kept, a linear blend between.
- yarn: interpolated (``/ factor``) and extrapolated frequencies blended over the dimensions
  that turn between ``beta_fast`` and ``beta_slow`` times in the original context; cos and sin
  multiplied by the attention factor.
- dynamic (NTK): transformers grows the base with the current sequence length, which a paged KV
  cache cannot follow (cached keys keep the rotation they were written with). As vLLM does, one
  base is fixed for the whole scaled context ``L = max_position_embeddings * factor``:
  ``theta * (factor * L / max_position_embeddings - (factor - 1)) ** (d / (d - 2))``. Short
  sequences therefore differ from transformers', which keeps plain theta up to
  max_position_embeddings.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from engine.config import PLAIN_ROPE, ModelConfig, RopeScaling
from engine.model.loader import Checkpoint

F32 = np.float32


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """HF RMSNorm in float32: ``w * (x * rsqrt(mean(x^2) + eps))``."""
    var = np.mean(np.square(x, dtype=F32), axis=-1, keepdims=True, dtype=F32)
    return (w * (x * (F32(1.0) / np.sqrt(var + F32(eps))))).astype(F32)


@functools.lru_cache(maxsize=16)
def inv_freq(head_dim: int, theta: float, scaling: RopeScaling = PLAIN_ROPE) -> np.ndarray:
    """[head_dim/2] float32 (read-only), as transformers computes it for ``scaling``."""
    d, sc = head_dim, scaling
    if sc.rope_type == "dynamic":
        n = sc.original_max_position_embeddings
        longest = n * sc.factor
        theta = theta * ((sc.factor * longest / n) - (sc.factor - 1)) ** (d / (d - 2))
    exps = np.arange(0, d, 2, dtype=np.int64).astype(F32) / F32(d)
    pos_freqs = np.power(F32(theta), exps, dtype=F32)
    out = F32(1.0) / pos_freqs
    if sc.rope_type == "linear":
        out = out / F32(sc.factor)
    elif sc.rope_type == "llama3":
        out = _llama3(out, sc)
    elif sc.rope_type == "yarn":
        out = _yarn(out, pos_freqs, d, theta, sc)
    out = out.astype(F32)
    out.setflags(write=False)
    return out


def _llama3(inv: np.ndarray, sc: RopeScaling) -> np.ndarray:
    factor, old = F32(sc.factor), sc.original_max_position_embeddings
    low_wavelen = F32(old / sc.low_freq_factor)
    high_wavelen = F32(old / sc.high_freq_factor)
    wavelen = (F32(1.0) / inv) * F32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = ((F32(1.0) / wavelen) * F32(old) - F32(sc.low_freq_factor)) / F32(
        sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (F32(1.0) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn(extrapolation: np.ndarray, pos_freqs: np.ndarray, d: int, theta: float,
          sc: RopeScaling) -> np.ndarray:
    interpolation = F32(1.0) / (F32(sc.factor) * pos_freqs)
    orig = sc.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (d * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low: float = correction_dim(sc.beta_fast)
    high: float = correction_dim(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = np.clip((np.arange(d // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), F32(1))
    extrapolation_factor = F32(1.0) - ramp
    return (interpolation * (F32(1.0) - extrapolation_factor)
            + extrapolation * extrapolation_factor)


def rope_cos_sin(positions: np.ndarray, head_dim: int, theta: float,
                 scaling: RopeScaling = PLAIN_ROPE) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [T, head_dim/2] (float32), neox layout (halves share frequencies),
    times the attention factor (yarn), as transformers' rotary embedding returns them."""
    freqs = positions.astype(F32)[:, None] * inv_freq(head_dim, theta, scaling)[None, :]
    att = F32(scaling.attention_factor)
    return (np.cos(freqs) * att).astype(F32), (np.sin(freqs) * att).astype(F32)


def cos_sin_table(max_pos: int, head_dim: int, theta: float,
                  scaling: RopeScaling = PLAIN_ROPE) -> np.ndarray:
    """[max_pos, head_dim]: cos in the first half, sin in the second (the kernels' table)."""
    c, s = rope_cos_sin(np.arange(max_pos), head_dim, theta, scaling)
    return np.concatenate([c, s], axis=1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd]; neox half rotation: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    return (x / (F32(1.0) + np.exp(-x))).astype(F32)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
              scale: float) -> np.ndarray:
    """Causal GQA attention of one sequence. q [Tq, nq, hd] at absolute positions q_pos;
    k, v [Tk, nkv, hd] for positions 0..Tk-1. Returns [Tq, nq, hd] float32."""
    tq, nq, hd = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    qg = q.reshape(tq, nkv, g, hd).transpose(1, 2, 0, 3)  # [nkv, g, Tq, hd]
    kt = k.transpose(1, 2, 0)  # [nkv, hd, Tk]
    s = np.matmul(qg, kt[:, None], dtype=F32) * F32(scale)  # [nkv, g, Tq, Tk]
    mask = np.arange(k.shape[0])[None, :] > q_pos[:, None]  # [Tq, Tk]
    s = np.where(mask, F32(-np.inf), s)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s, dtype=F32)
    p /= p.sum(axis=-1, keepdims=True, dtype=F32)
    o = np.matmul(p, v.transpose(1, 0, 2)[:, None], dtype=F32)  # [nkv, g, Tq, hd]
    return o.transpose(2, 0, 1, 3).reshape(tq, nq, hd).astype(F32)


class ReferenceModel:
    """float32 copies of the weights, fused the way the GPU backend fuses them."""

    def __init__(self, ckpt: Checkpoint) -> None:
        cfg = ckpt.config
        self.config: ModelConfig = cfg

        def f32(a: np.ndarray) -> np.ndarray:
            return np.asarray(a, dtype=F32)

        self.embed = f32(ckpt["model.embed_tokens.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else f32(ckpt["lm_head.weight"])
        self.norm = f32(ckpt["model.norm.weight"])
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            lw = {
                "in_norm": f32(ckpt.layer(i, "input_layernorm.weight")),
                "post_norm": f32(ckpt.layer(i, "post_attention_layernorm.weight")),
                "qkv_t": np.ascontiguousarray(f32(ckpt.qkv_weight(i)).T),
                "o_t": np.ascontiguousarray(f32(ckpt.layer(i, "self_attn.o_proj.weight")).T),
                "gate_up_t": np.ascontiguousarray(f32(ckpt.gate_up_weight(i)).T),
                "down_t": np.ascontiguousarray(f32(ckpt.layer(i, "mlp.down_proj.weight")).T),
            }
            if cfg.qk_norm:
                lw["q_norm"] = f32(ckpt.layer(i, "self_attn.q_norm.weight"))
                lw["k_norm"] = f32(ckpt.layer(i, "self_attn.k_norm.weight"))
            self.layers.append(lw)
        self.scale = cfg.head_dim ** -0.5

    # -- pieces shared with the paged executor ---------------------------------------------------
    def qkv(self, li: int, x: np.ndarray, positions: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Input norm, fused QKV projection, q/k norm (Qwen3), RoPE. Returns q, k, v as
        [T, heads, hd] float32."""
        cfg, lw = self.config, self.layers[li]
        h = rms_norm(x, lw["in_norm"], cfg.rms_norm_eps)
        qkv = np.matmul(h, lw["qkv_t"], dtype=F32)
        t, hd = x.shape[0], cfg.head_dim
        q = qkv[:, :cfg.q_size].reshape(t, cfg.num_attention_heads, hd)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].reshape(t, cfg.num_key_value_heads, hd)
        v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(t, cfg.num_key_value_heads, hd)
        if cfg.qk_norm:
            q = rms_norm(q, lw["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lw["k_norm"], cfg.rms_norm_eps)
        cos, sin = rope_cos_sin(positions, hd, cfg.rope_theta, cfg.rope_scaling)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), np.ascontiguousarray(v)

    def o_proj(self, li: int, attn: np.ndarray) -> np.ndarray:
        """The attention output projection [T, hidden], before the residual add (on a
        tensor-parallel rank: its heads' partial sum, engine/parallel/sim.py)."""
        return np.matmul(attn.reshape(attn.shape[0], -1), self.layers[li]["o_t"], dtype=F32)

    def mlp(self, li: int, x: np.ndarray) -> np.ndarray:
        """Post-attention norm and SwiGLU MLP of the residual stream x [T, hidden], before the
        residual add (on a tensor-parallel rank: its intermediate slice's partial sum)."""
        cfg, lw = self.config, self.layers[li]
        h = rms_norm(x, lw["post_norm"], cfg.rms_norm_eps)
        gu = np.matmul(h, lw["gate_up_t"], dtype=F32)
        i = cfg.intermediate_size
        return np.matmul(silu(gu[:, :i]) * gu[:, i:], lw["down_t"], dtype=F32)

    def attn_out_and_mlp(self, li: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """o projection + residual, post-attention norm, SwiGLU MLP + residual."""
        x = x + self.o_proj(li, attn)
        return (x + self.mlp(li, x)).astype(F32)

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = rms_norm(x, self.norm, self.config.rms_norm_eps)
        return np.matmul(h, self.lm_head.T, dtype=F32)

    # -- whole sequence --------------------------------------------------------------------------
    def forward(self, token_ids: list[int] | np.ndarray,
                layer_outputs: list[np.ndarray] | None = None) -> np.ndarray:
        """Logits [T, vocab] (float32) for one sequence starting at position 0.
        ``layer_outputs``: gets each layer's output residual stream [T, hidden] appended (HF
        ``hidden_states[1:]``; what a DFlash drafter reads)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        pos = np.arange(ids.shape[0])
        x = self.embed[ids]
        for li in range(self.config.num_hidden_layers):
            q, k, v = self.qkv(li, x, pos)
            a = attention(q, k, v, pos, self.scale)
            x = self.attn_out_and_mlp(li, x, a)
            if layer_outputs is not None:
                layer_outputs.append(x)
        return self.logits(x)
