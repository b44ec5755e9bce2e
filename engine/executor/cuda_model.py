"""The CUDA model: weights and KV pages in one device arena, and the forward as kernel launches.

Memory plan (decided once at start-up, ``plan_memory``): weights, then every activation and
static step buffer sized for the worst case (``max_num_batched_tokens`` tokens, ``max_num_seqs``
sequences, page-index rows of ``ceil(max_model_len / page_size)``), then the KV pages from what
``gpu_memory_utilization`` leaves (or ``num_gpu_blocks_override``).

Residual stream as vLLM and Hugging Face keep it: bf16, added in the fused RMSNorm kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.config import EngineConfig, ModelConfig
from engine.cuda.driver import Arena, CudaError, DeviceBuffer, Stream
from engine.model.loader import Checkpoint
from engine.model.reference import cos_sin_table
from engine.progress import Progress

BF16 = np.dtype(ml_dtypes.bfloat16)
MAX_LOGIT_ROWS = 256  # logits are computed in chunks of at most this many rows
GRAPH_RESERVE = 256 << 20  # graph executables, module code, allocator slack


@dataclass(frozen=True)
class Sizes:
    t_max: int  # tokens per step
    b_max: int  # sequences per step
    pages_per_seq: int  # row stride of the page-index table
    logit_rows: int
    max_pos: int

    @classmethod
    def of(cls, mc: ModelConfig, ec: EngineConfig) -> Sizes:
        b = ec.max_num_seqs
        t = max(ec.max_num_batched_tokens, b)
        assert ec.max_model_len is not None
        return cls(t, b, math.ceil(ec.max_model_len / ec.block_size),
                   max(min(MAX_LOGIT_ROWS, t), b), ec.max_model_len)


class _Placeholder:
    """What a CountingArena hands out: a size, no memory; uploads do nothing."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.ptr = nbytes, 0

    def upload(self, *args: object, **kwargs: object) -> None:
        pass

    def fill_bytes(self, *args: object, **kwargs: object) -> None:
        pass


class CountingArena:
    """The Arena's arithmetic (256-byte alignment) without device memory: sizes a plan."""

    ALIGN = 256

    def __init__(self) -> None:
        self.used = 0

    def alloc(self, shape: tuple[int, ...] | int, dtype: object, name: str = "") -> _Placeholder:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        self.used = -(-self.used // self.ALIGN) * self.ALIGN + n
        return _Placeholder(n)


class _NoStream:
    def synchronize(self) -> None:
        pass


def weight_bytes(mc: ModelConfig) -> int:
    return 2 * mc.num_parameters


def kv_bytes_per_page(mc: ModelConfig, page_size: int) -> int:
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * page_size * mc.head_dim * 2


def fixed_bytes(mc: ModelConfig, s: Sizes, workspace: int) -> int:
    """Weights plus every activation and step buffer, exactly as the arena will lay them out."""
    from engine.model.spec import expected_tensors

    arena = CountingArena()
    for spec in expected_tensors(mc).values():  # fused QKV / gate_up take the same bytes
        arena.alloc(spec.shape, BF16)
    StepBuffers(mc, s, arena, workspace, _NoStream())  # type: ignore[arg-type]
    return arena.used + 2 * arena.ALIGN * (mc.num_hidden_layers + 1)


def plan_num_pages(mc: ModelConfig, ec: EngineConfig, free: int, total: int,
                   workspace: int) -> tuple[int, int]:
    """(num_pages, arena bytes). Raises CudaError naming the numbers when nothing fits."""
    s = Sizes.of(mc, ec)
    fixed = fixed_bytes(mc, s, workspace)
    per_page = kv_bytes_per_page(mc, ec.block_size) // (2 * mc.num_hidden_layers)
    kv_arrays = 2 * mc.num_hidden_layers
    if ec.num_gpu_blocks_override is not None:
        n = ec.num_gpu_blocks_override
    else:
        used_by_others = total - free
        budget = int(total * ec.gpu_memory_utilization) - used_by_others - GRAPH_RESERVE
        n = (budget - fixed - kv_arrays * 256) // (per_page * kv_arrays)
        if n < 2:
            raise CudaError(
                f"no room for the KV cache: {total / 2**30:.1f} GiB x gpu_memory_utilization "
                f"{ec.gpu_memory_utilization} leaves {budget / 2**30:.2f} GiB, weights and "
                f"buffers take {fixed / 2**30:.2f} GiB; raise gpu_memory_utilization or lower "
                "max_num_batched_tokens / max_num_seqs")
    kv = kv_arrays * (-(-(n * per_page) // 256) * 256)
    return n, fixed + kv


class DeviceWeights:
    """Weights in the arena, fused as the kernels expect (QKV rows; gate then up rows)."""

    def __init__(self, ckpt: Checkpoint, arena: Arena, stream: Stream, show: bool) -> None:
        mc = ckpt.config
        self.config = mc

        def put(a: np.ndarray, name: str) -> DeviceBuffer:
            a = np.ascontiguousarray(a, dtype=BF16)
            buf = arena.alloc(a.shape, BF16, name)
            buf.upload(a, stream)
            stream.synchronize()  # the host array may be a temporary
            return buf

        with Progress(weight_bytes(mc), "uploading weights", " GB", enabled=show,
                      scale=1e9) as bar:
            self.embed = put(ckpt["model.embed_tokens.weight"], "embed")
            bar.update(self.embed.nbytes)
            self.lm_head = (self.embed if mc.tie_word_embeddings
                            else put(ckpt["lm_head.weight"], "lm_head"))
            self.norm = put(ckpt["model.norm.weight"], "norm")
            self.layers: list[dict[str, DeviceBuffer]] = []
            for i in range(mc.num_hidden_layers):
                lw = {
                    "in_norm": put(ckpt.layer(i, "input_layernorm.weight"), "in_norm"),
                    "post_norm": put(ckpt.layer(i, "post_attention_layernorm.weight"), "post"),
                    "qkv": put(ckpt.qkv_weight(i), "qkv"),
                    "o": put(ckpt.layer(i, "self_attn.o_proj.weight"), "o"),
                    "gate_up": put(ckpt.gate_up_weight(i), "gate_up"),
                    "down": put(ckpt.layer(i, "mlp.down_proj.weight"), "down"),
                }
                if mc.qk_norm:
                    lw["q_norm"] = put(ckpt.layer(i, "self_attn.q_norm.weight"), "q_norm")
                    lw["k_norm"] = put(ckpt.layer(i, "self_attn.k_norm.weight"), "k_norm")
                self.layers.append(lw)
                bar.update(sum(b.nbytes for b in lw.values()))


class StepBuffers:
    """Static device buffers every step (and every captured graph) reads and writes."""

    def __init__(self, mc: ModelConfig, s: Sizes, arena: Arena, workspace: int,
                 stream: Stream) -> None:
        t, b, h = s.t_max, s.b_max, mc.hidden_size
        a = arena.alloc
        # inputs (uploaded per step)
        self.input_ids = a(t, np.int32, "input_ids")
        self.positions = a(t, np.int32, "positions")
        self.slot_mapping = a(t, np.int64, "slot_mapping")
        self.cu_seqlens = a(b + 1, np.int32, "cu_seqlens")
        self.context_lens = a(b, np.int32, "context_lens")
        self.page_indices = a((b, s.pages_per_seq), np.int32, "page_indices")
        self.logit_idx = a(s.logit_rows, np.int32, "logit_idx")
        # sampling parameters (device data: a graph replays them fresh each step)
        r = s.logit_rows
        self.temperature = a(r, np.float32, "temperature")
        self.top_k = a(r, np.int32, "top_k")
        self.top_p = a(r, np.float32, "top_p")
        self.min_p = a(r, np.float32, "min_p")
        self.seeds = a(r, np.uint64, "seeds")
        self.steps = a(r, np.uint32, "steps")
        self.targets = a(r, np.int32, "targets")
        self.sampled = a(r, np.int32, "sampled")
        self.lp_token = a(r, np.float32, "lp_token")
        self.lp_rank = a(r, np.int32, "lp_rank")
        self.lp_top_ids = a((r, 20), np.int32, "lp_top_ids")
        self.lp_top = a((r, 20), np.float32, "lp_top")
        # activations
        self.resid = a((t, h), BF16, "resid")
        self.delta = a((t, h), BF16, "delta")
        self.h = a((t, h), BF16, "h")
        self.qkv = a((t, mc.qkv_size), BF16, "qkv")
        self.q = a((t, mc.q_size), BF16, "q")
        self.attn = a((t, mc.q_size), BF16, "attn")
        self.gate_up = a((t, 2 * mc.intermediate_size), BF16, "gate_up")
        self.act = a((t, mc.intermediate_size), BF16, "act")
        self.rows = a((r, h), BF16, "rows")
        self.logits = a((r, mc.vocab_size), np.float32, "logits")
        self.workspace = a(max(workspace // 4, 1), np.float32, "attn_workspace")
        cs = cos_sin_table(s.max_pos, mc.head_dim, mc.rope_theta)
        self.cos_sin = a(cs.shape, np.float32, "cos_sin")
        self.cos_sin.upload(cs, stream)
        stream.synchronize()
        # padding rows of graphs read page 0 (the padding page): keep the table zeroed
        self.page_indices.fill_bytes(0, stream)
