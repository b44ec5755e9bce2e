"""The tensor-parallel sharding plan: how every weight of a Qwen3 / Llama checkpoint splits over
``tensor_parallel_size`` (N) ranks, and what one rank holds (its shape, weight and KV bytes).

Megatron-LM's split as vLLM lays it out: two all-reduces per layer (after o_proj, after
down_proj), one all-reduce after the embedding, one all-gather of the logits.

    tensor (HF, [out, in])       split                        rank r holds
    q_proj    [nq*hd, h]         column (output rows)         q heads [r*nq/N, (r+1)*nq/N)
    k_proj,   [nkv*hd, h]        column, by KV head           its KV heads (below)
    v_proj
    o_proj    [h, nq*hd]         row (input columns)          the columns of its q heads
    gate_proj [i, h], up_proj    column                       rows [r*i/N, (r+1)*i/N)
    down_proj [h, i]             row                          the same columns
    embed_tokens [V, h]          vocab (rows), zero-padded    rows [r*Vs, (r+1)*Vs)
    lm_head   [V, h]             vocab, zero-padded           the same rows (tied: the embedding
                                                              shard serves as both)
    every RMSNorm weight         replicated                   all of it

KV heads. N <= nkv: nkv/N heads per rank (nkv % N == 0). N > nkv: one KV head per rank,
replicated on N/nkv ranks (N % nkv == 0), as vLLM's QKVParallelLinear does; rank r's q heads
all read KV head r // (N/nkv), so GQA holds inside the rank. Anything else is refused with a
``TensorParallelError`` that names the config field and the sizes this model takes.

Vocabulary. Each rank holds Vs = ceil(V / N) rows rounded up to 64 (vLLM's vocab padding);
rows past V are zeros, so their logits are 0 and are cut off after the all-gather. The
embedding is vocab-parallel too (vLLM's VocabParallelEmbedding): a rank looks up the ids in its
range, zeros for the rest, and the all-reduce sums exactly one non-zero term per element, so the
result is the replicated lookup bit for bit; it saves (N-1)/N of V*h, 1.1 GiB per rank of
qwen3-8b's 2.3 GiB embedding and head at N=2.

A rank's shape is a ModelConfig (``rank_config``): heads, KV heads, intermediate size and
vocab_size (its vocab shard, padding included) per rank, every other field the model's. Its
tensors are exactly ``expected_tensors(rank_config)`` (``shard_checkpoint`` builds them), so
the per-rank memory plan is the existing one (``engine.executor.cuda_model``'s weight_bytes,
kv_bytes_per_page, plan_num_pages over ``rank_config``); every Qwen3 0.6B-8B shard is already
at the GEMM tile widths (``cuda_shapes.Padded`` pads nothing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.config import ConfigError, ModelConfig
from engine.jsonfile import is_int
from engine.model.loader import Checkpoint
from engine.model.spec import expected_tensors

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: each rank's vocab rows, a multiple of it
MAX_SUGGESTED = 64  # the largest tensor_parallel_size an error message lists
SPLITS = ("column", "row", "vocab", "replicated")


class TensorParallelError(ConfigError):
    """A tensor_parallel_size this model cannot be split over. ``field`` is the config field
    (or the option) that refuses it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _problem(mc: ModelConfig, n: int) -> tuple[str, str] | None:
    """(field, why) when ``mc`` cannot be split over ``n`` ranks, else None."""
    nq, nkv, i = mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size
    if nq % n:
        return "num_attention_heads", (
            f"num_attention_heads ({nq}) is not divisible by tensor_parallel_size {n}: each rank "
            "holds a whole number of query heads")
    if n <= nkv and nkv % n:
        return "num_key_value_heads", (
            f"num_key_value_heads ({nkv}) is not divisible by tensor_parallel_size {n}: each "
            "rank holds a whole number of KV heads")
    if n > nkv and n % nkv:
        return "num_key_value_heads", (
            f"tensor_parallel_size {n} is above num_key_value_heads ({nkv}) but not a multiple "
            "of it: KV heads are then replicated, each on tensor_parallel_size / "
            "num_key_value_heads ranks")
    if i % n:
        return "intermediate_size", (
            f"intermediate_size ({i}) is not divisible by tensor_parallel_size {n}: each rank "
            "holds an equal slice of the MLP")
    return None


def supported_sizes(mc: ModelConfig, up_to: int = MAX_SUGGESTED) -> list[int]:
    """The tensor_parallel_size values (at most ``up_to``) that ``mc`` can be split over."""
    return [n for n in range(1, up_to + 1) if _problem(mc, n) is None]


def check_tensor_parallel(mc: ModelConfig, n: object) -> int:
    """``n`` when ``mc`` splits over ``n`` ranks; else a TensorParallelError naming the field."""
    if not is_int(n) or n < 1:
        raise TensorParallelError("tensor_parallel_size",
                                  f"tensor_parallel_size must be an integer >= 1, got {n!r}")
    assert isinstance(n, int)
    bad = _problem(mc, n)
    if bad is not None:
        field, why = bad
        sizes = ", ".join(map(str, supported_sizes(mc)))
        raise TensorParallelError(field, f"{why}; tensor_parallel_size values this model "
                                  f"takes: {sizes}")
    return n


@dataclass(frozen=True)
class Shard:
    """What one rank holds of one tensor: ``[start, stop)`` along ``dim``, zero-padded to
    ``size`` along it (vocab shards past the vocabulary); ``kind`` is one of ``SPLITS``."""

    kind: str
    dim: int
    start: int
    stop: int
    size: int

    def take(self, a: np.ndarray) -> np.ndarray:
        """This shard of ``a`` (a view where nothing is padded)."""
        index = [slice(None)] * a.ndim
        index[self.dim] = slice(self.start, self.stop)
        part = a[tuple(index)]
        if self.stop - self.start == self.size:
            return part
        shape = list(a.shape)
        shape[self.dim] = self.size
        out = np.zeros(shape, a.dtype)
        index[self.dim] = slice(0, self.stop - self.start)
        out[tuple(index)] = part
        return out


@dataclass(frozen=True)
class TensorParallelPlan:
    """How ``model`` splits over ``world_size`` ranks (checked on construction)."""

    model: ModelConfig
    world_size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.model, self.world_size)

    # -- per-rank shape (the same on every rank) -----------------------------------------------
    @property
    def heads_per_rank(self) -> int:
        return self.model.num_attention_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.model.num_key_value_heads // self.world_size)

    @property
    def kv_head_replicas(self) -> int:
        """On how many ranks each KV head lives (1 unless world_size > num_key_value_heads)."""
        return max(1, self.world_size // self.model.num_key_value_heads)

    @property
    def intermediate_per_rank(self) -> int:
        return self.model.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        return _round_up(-(-self.model.vocab_size // self.world_size), VOCAB_PADDING)

    @property
    def padded_vocab(self) -> int:
        """The all-gathered logits' width (vocab_size and the shards' zero rows)."""
        return self.vocab_per_rank * self.world_size

    @property
    def rank_config(self) -> ModelConfig:
        """One rank's model: its heads, KV heads, MLP slice and vocab shard."""
        return dataclasses.replace(
            self.model, num_attention_heads=self.heads_per_rank,
            num_key_value_heads=self.kv_heads_per_rank,
            intermediate_size=self.intermediate_per_rank, vocab_size=self.vocab_per_rank)

    # -- which part of the model a rank holds --------------------------------------------------
    def _rank(self, rank: int) -> int:
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} outside 0..{self.world_size - 1}")
        return rank

    def q_heads(self, rank: int) -> range:
        n = self.heads_per_rank
        return range(self._rank(rank) * n, (rank + 1) * n)

    def kv_heads(self, rank: int) -> range:
        n = self.kv_heads_per_rank
        first = self._rank(rank) // self.kv_head_replicas * n
        return range(first, first + n)

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """[start, stop) of the vocabulary rank ``rank`` holds (stop - start may be less than
        vocab_per_rank, even 0, on the last ranks: the rest is padding)."""
        v, n = self.model.vocab_size, self.vocab_per_rank
        start = min(self._rank(rank) * n, v)
        return start, min(start + n, v)

    def shards(self, rank: int) -> dict[str, Shard]:
        """Rank ``rank``'s shard of every tensor of the checkpoint, by HF name."""
        mc, hd = self.model, self.model.head_dim
        q, kv = self.q_heads(rank), self.kv_heads(rank)
        i = self.intermediate_per_rank
        i0 = rank * i
        v0, v1 = self.vocab_range(rank)
        out: dict[str, Shard] = {}
        for name, spec in expected_tensors(mc).items():
            if name.endswith("q_proj.weight"):
                s = Shard("column", 0, q.start * hd, q.stop * hd, len(q) * hd)
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                s = Shard("column", 0, kv.start * hd, kv.stop * hd, len(kv) * hd)
            elif name.endswith("o_proj.weight"):
                s = Shard("row", 1, q.start * hd, q.stop * hd, len(q) * hd)
            elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                s = Shard("column", 0, i0, i0 + i, i)
            elif name.endswith("down_proj.weight"):
                s = Shard("row", 1, i0, i0 + i, i)
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                s = Shard("vocab", 0, v0, v1, self.vocab_per_rank)
            else:  # RMSNorm weights: input, post-attention, q/k (Qwen3), final
                assert len(spec.shape) == 1, name
                s = Shard("replicated", 0, 0, spec.shape[0], spec.shape[0])
            out[name] = s
        return out

    # -- per-rank bytes: what a rank's memory plan and its bytes-read floor start from ---------
    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """One rank's weights (a tied embedding counted once, vocab padding included)."""
        return dtype_bytes * self.rank_config.num_parameters

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """One rank's K and V of one token, every layer."""
        return self.rank_config.kv_bytes_per_token(dtype_bytes)

    def kv_bytes_per_page(self, page_size: int, dtype_bytes: int = 2) -> int:
        return page_size * self.kv_bytes_per_token(dtype_bytes)

    def decode_bytes_read(self, batch: int, context: int, dtype_bytes: int = 2) -> int:
        """The bytes one rank must read in a decode step of ``batch`` sequences of ``context``
        tokens each: its weights once -- but of an untied embedding shard only the gathered rows
        (at most ``batch``), as ``cuda_model.decode_bytes_read`` counts them -- and its KV of
        every context token (the memory-bound floor: over the HBM bandwidth, the fastest the
        step can be)."""
        rc = self.rank_config
        w = self.weight_bytes(dtype_bytes)
        if not rc.tie_word_embeddings:
            w += dtype_bytes * rc.hidden_size * (batch - rc.vocab_size)
        return w + batch * context * self.kv_bytes_per_token(dtype_bytes)


def shard_checkpoint(ckpt: Checkpoint, plan: TensorParallelPlan, rank: int) -> Checkpoint:
    """Rank ``rank``'s checkpoint: its shard of every tensor under the HF names, with
    ``plan.rank_config`` as config (so ``ReferenceModel`` or a GPU upload read it as a model of
    its own). Unpadded shards are views of the (memory-mapped) tensors."""
    if ckpt.config != plan.model:
        raise ValueError("the plan was made for another model config")
    tensors = {name: s.take(ckpt[name]) for name, s in plan.shards(rank).items()}
    return Checkpoint(path=Path(ckpt.path), config=plan.rank_config, tensors=tensors)
