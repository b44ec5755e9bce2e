"""What the cuda kernels take: model widths padded to the GEMM tiles, and the head shapes the
attention kernels support.

The GEMMs need N % 8 == 0 and K % 64 == 0 (cutlass_kernels/gemm.py); checkpoints people have do
not always fit (fine-tunes add tokens: vocabularies of 32001, 128257; intermediate sizes of 416;
hidden sizes of 300). Rather than a generic slow path, the widths are padded once, at load, with
zero weights (``Padded``, ``device_weight_shapes``, ``pad_to``), which changes no number and
leaves every aligned model (all Qwen3 0.6B-8B shapes) exactly as it was: same weights, buffers,
kernels and graphs. Head dims and head counts are not padded: ``check_supported`` refuses, before
anything is compiled or allocated, what the attention kernels do not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.config import ConfigError, ModelConfig

GEMM_N = 8  # gemm.py: N is a whole number of 16-byte rows of C
GEMM_K = 64  # gemm.py: K is a whole number of K tiles
HEAD_DIMS = (64, 128)  # decode_attention.py, prefill_attention.py
MAX_GQA_GROUP = 8  # decode_attention.py: query heads per KV head
PAGE_SIZE = 16  # the attention kernels' page (KV block) size


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Padded:
    """The model widths the kernels run at, each rounded up to what the GEMMs take.

    ``hidden``: K of qkv / gate_up / lm_head, N of o / down, the residual stream's row: a multiple
    of 64 (1024, 576: as is; 300 -> 320). ``intermediate``: K of down, half of gate_up's N: a
    multiple of 64 (416 -> 448). ``vocab``: N of lm_head, the logits' row stride: a multiple of 8
    (32001 -> 32008). Every Qwen3 0.6B-8B shape pads nothing: same weights, buffers and kernels.

    The padding is zeros put into the weights at load (``DeviceWeights``) and changes no number:
    - hidden: embedding rows, every norm weight and the rows of o / down are zero past the real
      width, so the residual's padding columns stay exactly 0 (and meet zero K columns in qkv,
      gate_up, lm_head); RMSNorm divides by the real width (``compile_rmsnorm(norm_size=)``).
    - intermediate: gate and up each get zero rows (padded separately: the SiLU kernel, run at
      the padded width, finds up at column ``intermediate``) and down zero columns:
      SiLU(0) * 0 = 0.
    - vocab: lm_head gets zero rows (a tied embedding is padded once and serves as both; the
      embedding gather reads real ids only); the sampler and logprobs kernels read columns
      ``[0, vocab_size)`` of logits rows of ``vocab`` floats, so no padding id is ever sampled,
      ranked or listed.
    """

    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, mc: ModelConfig) -> Padded:
        return cls(_round_up(mc.hidden_size, GEMM_K), _round_up(mc.intermediate_size, GEMM_K),
                   _round_up(mc.vocab_size, GEMM_N))

    def is_identity(self, mc: ModelConfig) -> bool:
        return (self.hidden, self.intermediate, self.vocab) == (
            mc.hidden_size, mc.intermediate_size, mc.vocab_size)


def check_supported(mc: ModelConfig, page_size: int = PAGE_SIZE) -> None:
    """Refuse, before anything is compiled or allocated, the shapes no cuda kernel runs. Widths
    never are (``Padded``); these are the attention kernels' head dims and head counts."""
    hint = "; run this checkpoint with --backend numpy"
    if mc.head_dim not in HEAD_DIMS:
        raise ConfigError(f"head_dim={mc.head_dim}: the cuda attention kernels support head_dim "
                          f"{' or '.join(map(str, HEAD_DIMS))}{hint}")
    group = mc.num_attention_heads // mc.num_key_value_heads
    if group > MAX_GQA_GROUP:
        raise ConfigError(
            f"num_attention_heads / num_key_value_heads = {mc.num_attention_heads} / "
            f"{mc.num_key_value_heads} = {group}: the cuda decode attention supports at most "
            f"{MAX_GQA_GROUP} query heads per KV head{hint}")
    if page_size != PAGE_SIZE:
        raise ConfigError(f"block_size={page_size}: the cuda attention kernels use KV pages of "
                          f"{PAGE_SIZE} tokens; pass block_size={PAGE_SIZE} (--block-size)")
    p = Padded.of(mc)
    rows = p.vocab if mc.tie_word_embeddings else mc.vocab_size
    if rows * p.hidden >= 2**31:
        raise ConfigError(f"vocab_size x hidden_size = {rows} x {p.hidden} (padded) passes 2^31 "
                          f"elements: the cuda embedding gather indexes with 32 bits{hint}")


def device_weight_shapes(mc: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight buffer, padded (``Padded``), in ``DeviceWeights``' order."""
    p = Padded.of(mc)
    h, i = p.hidden, p.intermediate
    out: list[tuple[str, tuple[int, ...]]] = [
        ("embed", (p.vocab if mc.tie_word_embeddings else mc.vocab_size, h))]
    if not mc.tie_word_embeddings:
        out.append(("lm_head", (p.vocab, h)))
    out.append(("norm", (h,)))
    layer = [("in_norm", (h,)), ("post_norm", (h,)), ("qkv", (mc.qkv_size, h)),
             ("o", (h, mc.q_size)), ("gate_up", (2 * i, h)), ("down", (h, i))]
    if mc.qk_norm:
        layer += [("q_norm", (mc.head_dim,)), ("k_norm", (mc.head_dim,))]
    return out + layer * mc.num_hidden_layers


def pad_to(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` itself when it has ``shape``, else a zero array of ``shape`` with ``a`` in its
    leading corner (``a.shape <= shape`` in every dim)."""
    if a.shape == shape:
        return a
    if len(shape) != a.ndim or any(n < m for n, m in zip(shape, a.shape, strict=True)):
        raise ValueError(f"cannot pad an array of shape {a.shape} to {shape}")
    out = np.zeros(shape, a.dtype)
    out[tuple(slice(0, m) for m in a.shape)] = a
    return out
