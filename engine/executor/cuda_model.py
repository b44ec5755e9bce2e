"""The CUDA model: weights and KV pages in one device arena, the compiled kernels, and the
static buffers the forward's kernel launches read and write.

Memory plan (decided once at start-up, ``plan_memory``): weights, then every activation and
static step buffer sized for the worst case (``max_num_batched_tokens`` tokens, ``max_num_seqs``
sequences, page-index rows of ``ceil(max_model_len / page_size)``), then the KV pages from what
``gpu_memory_utilization`` leaves (or ``num_gpu_blocks_override``).

Residual stream as vLLM and Hugging Face keep it: bf16, added in the fused RMSNorm kernel.

Widths the GEMM tiles do not take (a vocabulary of 32001, an intermediate size of 416, a hidden
size of 300) are padded with zeros at load, exactly: the weights, buffers and kernels here are at
the ``Padded`` widths (cuda_shapes.py), which for an aligned model are its own.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from engine import envs
from engine.config import EngineConfig, ModelConfig
from engine.cuda.driver import Arena, Context, CudaError, DeviceBuffer, Stream
from engine.executor.cuda_logits import ProcessorBuffers
from engine.executor.cuda_shapes import Padded, device_weight_shapes, pad_to
from engine.executor.weight_upload import WeightUploader
from engine.model.loader import Checkpoint
from engine.model.reference import cos_sin_table
from engine.progress import progress

if TYPE_CHECKING:
    from cutlass_kernels._parallel import Compiling, Job
    from cutlass_kernels.decode_attention import (
        DecodeAttentionLauncher,
        DecodeRopeAttentionLauncher,
    )
    from cutlass_kernels.embedding import EmbeddingFromSamplesLauncher, EmbeddingLauncher
    from cutlass_kernels.gemm import GemmLauncher
    from cutlass_kernels.logits_process import CountTokensLauncher, LogitsProcessLauncher
    from cutlass_kernels.prefill_attention import PrefillAttentionLauncher
    from cutlass_kernels.rmsnorm import RMSNormLauncher
    from cutlass_kernels.rope_kv import RopeKVLauncher
    from cutlass_kernels.sampling import LogProbsLauncher, SamplerLauncher
    from cutlass_kernels.scale_cols import ScaleColsLauncher
    from cutlass_kernels.silu_mul import SiluMulLauncher

BF16 = np.dtype(ml_dtypes.bfloat16)
MAX_LOGIT_ROWS = 256  # logits are computed in chunks of at most this many rows
# rows (padded) of the graphs that run a mixed step of up to 128 tokens, one decode row per
# token (CudaExecutor.mixed_rows): buckets coarser than the decode ones, to keep start-up short
MIXED_BUCKETS = (16, 32, 64, 96, 128)
GRAPH_RESERVE = 256 << 20  # graph executables, module code, allocator slack


@dataclass(frozen=True)
class Sizes:
    t_max: int  # tokens per step
    b_max: int  # sequences (decode rows) per step
    pages_per_seq: int  # row stride of the page-index table
    logit_rows: int
    max_pos: int

    @classmethod
    def of(cls, mc: ModelConfig, ec: EngineConfig) -> Sizes:
        """``b_max``: max_num_seqs, or more with speculation: a verify step runs one decode row
        per token (``CudaExecutor.verify_rows``), up to (k + 1) rows per sequence of the
        ``disable_by_batch_size - 1`` that may speculate, within the step's token budget."""
        b0 = b = ec.max_num_seqs
        t = max(ec.max_num_batched_tokens, b)
        spec = ec.speculative_config
        if spec is not None:
            seqs = min(b0, spec.disable_by_batch_size - 1)
            b = max(b, min(t, seqs * (1 + spec.num_speculative_tokens)))
        if mixed_graphs_on(ec):  # a mixed step's graph runs one row per token
            b = max(b, min(t, MIXED_BUCKETS[-1]))
        assert ec.max_model_len is not None
        return cls(t, b, math.ceil(ec.max_model_len / ec.block_size),
                   max(min(MAX_LOGIT_ROWS, t), b), ec.max_model_len)


def mixed_graphs_on(ec: EngineConfig) -> bool:
    """Whether mixed steps of up to 128 tokens run as rows (``CudaExecutor.mixed_rows``):
    ``CUTEINFER_MIXED_GRAPHS`` not 0. With graphs they replay a row graph of their bucket; under
    ``enforce_eager`` the same rows, padded to the same bucket, run eagerly, so that an eager
    engine computes a graph engine's bits (mixed steps are the default beside running streams
    since mixed_step_tokens is 128 on cuda). With speculation too: its verify steps take their own
    path first (``verify_rows``), and its other steps (prompt chunks, mixed steps) must run
    as a plain engine runs them, or the prompt's forward differs in bits and speculative
    outputs stop equaling plain decoding's (spec 3/5 and dflash 3/9 GPU tests failed that way
    from v27, when only the plain engine replayed them: docs/perf.md v30)."""
    return envs.mixed_graphs()


def mixed_buckets(ec: EngineConfig, sizes: Sizes) -> list[int]:
    """The rows of the mixed-step graphs (``MIXED_BUCKETS`` that the step buffers hold)."""
    if not mixed_graphs_on(ec):
        return []
    return [r for r in MIXED_BUCKETS if r <= min(sizes.b_max, sizes.t_max)]


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
    """Bytes of the device weights: 2 x num_parameters, plus the padding (``Padded``)."""
    return 2 * sum(math.prod(shape) for _, shape in device_weight_shapes(mc))


def decode_bytes_read(mc: ModelConfig, batch: int, context: int) -> int:
    """Bytes a decode step of ``batch`` sequences of ``context`` tokens must read: every device
    weight once, except an untied embedding table, of which only the ``batch`` gathered rows are
    read (a tied one is read whole, as the LM head), plus the KV of every context token. Over the
    bandwidth: the step's floor."""
    shapes = dict(device_weight_shapes(mc))
    w = weight_bytes(mc)
    if not mc.tie_word_embeddings:
        rows, width = shapes["embed"]
        w += 2 * width * batch - 2 * rows * width
    kv = batch * context * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * 2
    return w + kv


def kv_bytes_per_page(mc: ModelConfig, page_size: int) -> int:
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * page_size * mc.head_dim * 2


def fixed_bytes(mc: ModelConfig, s: Sizes, workspace: int) -> int:
    """Weights plus every activation and step buffer, exactly as the arena will lay them out."""
    arena = CountingArena()
    for _, shape in device_weight_shapes(mc):
        arena.alloc(shape, BF16)
    StepBuffers(mc, s, arena, workspace, _NoStream())  # type: ignore[arg-type]
    return arena.used + 2 * arena.ALIGN * (mc.num_hidden_layers + 1)


def plan_num_pages(mc: ModelConfig, ec: EngineConfig, free: int, total: int,
                   workspace: int, extra_fixed: int = 0, extra_layers: int = 0
                   ) -> tuple[int, int]:
    """(num_pages, arena bytes). ``extra_fixed`` bytes and ``extra_layers`` more layers of KV
    pages (a DFlash drafter's: engine/executor/cuda_dflash.py) come out of the same budget.
    Raises CudaError naming the numbers when nothing fits."""
    s = Sizes.of(mc, ec)
    fixed = fixed_bytes(mc, s, workspace) + extra_fixed
    per_page = kv_bytes_per_page(mc, ec.block_size) // (2 * mc.num_hidden_layers)
    kv_arrays = 2 * (mc.num_hidden_layers + extra_layers)
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


@dataclass(frozen=True)
class Kernels:
    """Every kernel the forward, logits and sampling launch, compiled for one model's shapes."""

    embed: EmbeddingLauncher  # token ids -> rows of the embedding matrix (the DFlash drafter)
    gather_rows: EmbeddingLauncher  # logit_idx -> rows of the final hidden states
    # the forward's embedding: ids, or the previous step's samples (``StepBuffers.input_src``)
    embed_src: EmbeddingFromSamplesLauncher
    norm: RMSNormLauncher  # the final norm; layer 0's input norm on the unfused path
    add_norm: RMSNormLauncher  # residual += delta, then norm (the unfused path)
    rope: RopeKVLauncher  # q/k norm + RoPE + KV-cache write
    # The decoder layer's GEMMs (``fused_layers``: their skinny kernels fused; the forward's
    # docstring): qkv and gate_up normalize their input rows (the norm weights folded into
    # theirs at load: ``fold``), gate_up applies SiLU-and-mul, o and down add into the residual
    qkv: GemmLauncher
    o: GemmLauncher
    gate_up: GemmLauncher
    down: GemmLauncher
    lm_head: GemmLauncher  # fp32 logits
    silu: SiluMulLauncher  # the unfused path; gate and up in 32-column blocks (DeviceWeights)
    fold: ScaleColsLauncher  # W[:, k] *= norm weight[k], once at load
    decode: DecodeAttentionLauncher
    # decode with rope's work in its prologue (plain decode steps, ``rope_attention_options``)
    decode_rope: DecodeRopeAttentionLauncher
    prefill: PrefillAttentionLauncher
    sample: SamplerLauncher
    logprobs: LogProbsLauncher
    logits_process: LogitsProcessLauncher  # logits processors, before the sampler
    count_tokens: CountTokensLauncher  # the sampled tokens into the penalties' counts

    @classmethod
    def compile(cls, mc: ModelConfig, show: bool = True, workers: int | None = None) -> Kernels:
        """Compile every kernel, or load it from the kernel cache on disk; pages of 16 tokens.
        Kernels missing from the cache compile in up to ``workers`` processes at once
        (cutlass_kernels/_parallel.py); ``show``: a progress bar on a terminal."""
        return cls.start(mc, show, workers).result()

    @classmethod
    def start(cls, mc: ModelConfig, show: bool = True, workers: int | None = None
              ) -> PendingKernels:
        """``compile`` under way in a background thread (importing the DSL, loading cached
        kernels, waiting for the worker processes that compile the rest), so the caller can
        upload weights meanwhile; ``result()`` before the first launch."""
        from cutlass_kernels._parallel import Compiling

        n = len(dataclasses.fields(cls))
        bar = progress(n, "compiling kernels", enable=show)
        return PendingKernels(Compiling(lambda: _jobs(mc), lambda _name: bar.update(1), workers,
                                        expect=n - 1), bar)  # gather_rows is embed's kernel


class PendingKernels:
    """What ``Kernels.start`` returns: ``result()`` waits for the kernels (and compiles here any
    that the workers could not); ``cancel()`` when they will not be wanted."""

    def __init__(self, compiling: Compiling, bar: Any) -> None:
        self._compiling, self._bar = compiling, bar

    @property
    def ready_at(self) -> float | None:
        """``time.perf_counter()`` when the last kernel was ready."""
        return self._compiling.ready_at

    def result(self) -> Kernels:
        try:
            return Kernels(**self._compiling.result())
        finally:
            self._bar.close()

    def cancel(self) -> None:
        self._compiling.cancel()
        self._bar.close()


def _jobs(mc: ModelConfig) -> dict[str, Job]:
    """``Kernels`` field -> (compile function, args, kwargs). Imports the kernel modules (and
    with them the DSL, most of a warm start): called in ``Compiling``'s thread."""
    # decode_attention first (the slowest import); the memory plan reads decode_plan, no DSL
    from cutlass_kernels.decode_attention import (
        compile_decode_attention,
        compile_decode_rope_attention,
    )
    from cutlass_kernels.embedding import compile_embedding, compile_embedding_from_samples
    from cutlass_kernels.gemm import compile_gemm, wide_options
    from cutlass_kernels.logits_process import compile_count_tokens, compile_logits_process
    from cutlass_kernels.prefill_attention import compile_prefill_attention
    from cutlass_kernels.rmsnorm import compile_rmsnorm
    from cutlass_kernels.rope_kv import compile_rope_kv
    from cutlass_kernels.sampling import compile_logprobs, compile_sampler
    from cutlass_kernels.scale_cols import compile_scale_cols
    from cutlass_kernels.silu_mul import compile_silu_mul

    pad = Padded.of(mc)  # widths padded to the GEMM tiles; an aligned model's own widths
    h, nq, nkv, hd = pad.hidden, mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    v, inter = mc.vocab_size, pad.intermediate
    pdl = {"pdl": envs.pdl_enabled(), **wide_options(envs.gemm_wide_from())}  # GEMM options
    on = envs.fused_layers()
    # fused up to 128 rows; at hidden > 2048 only up to the 64-row tile: qwen3-8b at batch 128
    # ran 11.12 ms unfused vs 11.45 fused (the row squares at two 64-token tiles a slab), while
    # qwen3-0.6b gains at every M (docs/perf.md v21, v22); CUTEINFER_FUSE_MAX_ROWS overrides
    fmax = {"fuse_max_rows": envs.fuse_max_rows(mc.hidden_size)}
    norm = {"norm_size": mc.hidden_size if on else 0, "eps": mc.rms_norm_eps if on else 0.0,
            **fmax}
    res = {"epilogue": "residual" if on else "store", **fmax}
    # the slowest first: workers take them in order
    return {
        "prefill": (compile_prefill_attention, (nq, nkv, hd, 16), {}),
        "lm_head": (compile_gemm, (pad.vocab, h, "f32"), pdl),  # fp32 logits
        "qkv": (compile_gemm, (mc.qkv_size, h), {**pdl, **norm}),
        "o": (compile_gemm, (h, mc.q_size), {**pdl, **res}),
        "gate_up": (compile_gemm, (2 * inter, h),
                    {**pdl, **norm, "epilogue": "silu" if on else "store"}),
        "down": (compile_gemm, (h, inter), {**pdl, **res}),
        "decode": (compile_decode_attention, (nq, nkv, hd, 16),
                   {**envs.decode_attention_options(), "pdl": envs.pdl_attention()}),
        "sample": (compile_sampler, (v, pad.vocab), {}),  # reads the first v of pad.vocab
        "logprobs": (compile_logprobs, (v,), {"row_stride": pad.vocab}),
        "logits_process": (compile_logits_process, (v, pad.vocab), {}),
        "count_tokens": (compile_count_tokens, (v,), {}),
        "rope": (compile_rope_kv, (nq, nkv, hd, 16, mc.qk_norm), {"pdl": envs.pdl_attention()}),
        # compiled also when the forward does not use it (then at the default warps x stages)
        "decode_rope": (compile_decode_rope_attention, (nq, nkv, hd, 16, mc.qk_norm),
                        {**(rope_attention_options(mc) or {}), "pdl": envs.pdl_attention()}),
        "embed_src": (compile_embedding_from_samples, (h,), {}),
        "embed": (compile_embedding, (h,), {}),
        # bf16 rows of width h too: the compile cache hands back the embed kernel itself
        "gather_rows": (compile_embedding, (h,), {}),
        "norm": (compile_rmsnorm, (h, False, mc.hidden_size), {}),  # mean over the real h
        "add_norm": (compile_rmsnorm, (h, True, mc.hidden_size), {}),
        "silu": (compile_silu_mul, (inter, GATE_UP_BLOCK), {}),
        "fold": (compile_scale_cols, (h,), {}),
    }


GATE_UP_BLOCK = 32  # = gemm_skinny.HALF (not imported here: it loads the DSL)


def rope_attention_options(mc: ModelConfig) -> dict | None:
    """The decode attention's warps x stages when plain decode steps run rope in its prologue
    (``CUTEINFER_FUSE_ROPE`` on, the mma loop, and 32 * warps >= (G + 2) * head_dim / 16 lanes
    for its q heads, k and v), else None: rope_kv then runs as its own kernel."""
    opts = envs.decode_attention_options()
    if not envs.fuse_rope() or not opts.get("mma"):
        return None
    warps = opts.get("warps", 4)
    group = mc.num_attention_heads // mc.num_key_value_heads
    if 32 * warps < (group + 2) * (mc.head_dim // 16):
        return None
    return {k: opts[k] for k in ("warps", "num_stages") if k in opts}


class DeviceWeights:
    """Weights in the arena, fused as the kernels expect, padded with zeros to the kernels'
    widths (``Padded``; shapes: ``device_weight_shapes``): QKV rows q, k, v; gate_up rows in
    blocks of 32 (``GATE_UP_BLOCK``: gate rows 0-31, up rows 0-31, gate rows 32-63, ...), the
    order of the skinny GEMM's fused SiLU epilogue. ``fold_norms`` (once the kernels are
    compiled) folds each layer's input and post-attention norm weights into its qkv and gate_up
    weights."""

    def __init__(self, ckpt: Checkpoint, arena: Arena, stream: Stream, show: bool,
                 uploader: Any = None) -> None:
        """``uploader``: ``weight_upload.WeightUploader`` (default: pinned staging, several
        threads) or ``SerialUploader`` (buffers that are not device memory)."""
        mc = ckpt.config
        self.config = mc
        p = self.padded = Padded.of(mc)
        shapes = iter(device_weight_shapes(mc))
        bar = progress(weight_bytes(mc), "uploading weights", enable=show, unit="B",
                       unit_scale=True)
        lock = threading.Lock()

        def advance(n: int) -> None:  # from the upload threads
            with lock:
                bar.update(n)

        up = uploader or WeightUploader(Context.get(), on_bytes=advance)

        def put(parts: list[np.ndarray], name: str) -> DeviceBuffer:
            """One device weight from ``parts`` stacked along rows (QKV: q, k, v; gate_up: gate,
            up), each copied to its own offset; padded on the host only when its shape needs
            it."""
            want, shape = next(shapes)
            assert want == name, (want, name)  # device_weight_shapes lists them in this order
            buf = arena.alloc(shape, BF16, name)
            rows = sum(a.shape[0] for a in parts)
            if rows != shape[0] or any(a.shape[1:] != shape[1:] for a in parts):
                parts = [pad_to(np.ascontiguousarray(np.concatenate(parts), dtype=BF16), shape)]
            off = 0
            for a in parts:
                up.copy(buf, off, np.asarray(a, dtype=BF16))
                off += a.nbytes
            return buf

        def gate_up(i: int) -> list[np.ndarray]:
            gate, upw = (ckpt.layer(i, f"mlp.{n}_proj.weight") for n in ("gate", "up"))
            if p.intermediate != mc.intermediate_size:
                half = (p.intermediate, mc.hidden_size)  # each padded to I_pad rows
                gate, upw = pad_to(gate, half), pad_to(upw, half)
            b = GATE_UP_BLOCK  # row views, no copy: the uploader reads each from its file range
            return [w[r:r + b] for r in range(0, p.intermediate, b) for w in (gate, upw)]

        def qkv(i: int) -> list[np.ndarray]:
            return [ckpt.layer(i, f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]

        with bar:
            self.embed = put([ckpt["model.embed_tokens.weight"]], "embed")
            self.lm_head = (self.embed if mc.tie_word_embeddings
                            else put([ckpt["lm_head.weight"]], "lm_head"))
            self.norm = put([ckpt["model.norm.weight"]], "norm")
            self.layers: list[dict[str, DeviceBuffer]] = []
            for i in range(mc.num_hidden_layers):
                lw = {
                    "in_norm": put([ckpt.layer(i, "input_layernorm.weight")], "in_norm"),
                    "post_norm": put([ckpt.layer(i, "post_attention_layernorm.weight")],
                                     "post_norm"),
                    "qkv": put(qkv(i), "qkv"),
                    "o": put([ckpt.layer(i, "self_attn.o_proj.weight")], "o"),
                    "gate_up": put(gate_up(i), "gate_up"),
                    "down": put([ckpt.layer(i, "mlp.down_proj.weight")], "down"),
                }
                if mc.qk_norm:
                    lw["q_norm"] = put([ckpt.layer(i, "self_attn.q_norm.weight")], "q_norm")
                    lw["k_norm"] = put([ckpt.layer(i, "self_attn.k_norm.weight")], "k_norm")
                self.layers.append(lw)
            up.run()
        stream.synchronize()  # (the copies ran on the upload threads' own streams)
        self.folded = False

    def fold_norms(self, fold: Any, stream: Stream) -> None:
        """``qkv[:, k] *= in_norm[k]``, ``gate_up[:, k] *= post_norm[k]`` (bf16 products), once:
        the forward normalizes with a unit weight (the unfused path) or inside the GEMM."""
        if self.folded:
            return
        mc, p = self.config, self.padded
        for lw in self.layers:
            fold(lw["qkv"], lw["in_norm"], mc.qkv_size, stream)
            fold(lw["gate_up"], lw["post_norm"], 2 * p.intermediate, stream)
        stream.synchronize()
        self.folded = True


class StepBuffers:
    """Static device buffers every step (and every captured graph) reads and writes."""

    def __init__(self, mc: ModelConfig, s: Sizes, arena: Arena, workspace: int,
                 stream: Stream) -> None:
        p = Padded.of(mc)
        t, b, h = s.t_max, s.b_max, p.hidden
        a = arena.alloc
        # inputs (uploaded per step, in this order: staged_inputs.ORDER, one copy a step).
        # The sampled rows and their sampling parameters (device data: a graph replays them
        # fresh each step)
        r = s.logit_rows
        self.logit_idx = a(r, np.int32, "logit_idx")
        self.temperature = a(r, np.float32, "temperature")
        self.top_k = a(r, np.int32, "top_k")
        self.top_p = a(r, np.float32, "top_p")
        self.min_p = a(r, np.float32, "min_p")
        self.seeds = a(r, np.uint64, "seeds")
        self.steps = a(r, np.uint32, "steps")
        # the token rows: input_src[t] >= 0 takes row t's token from the previous step's
        # ``sampled`` (the forward's embedding gathers it), -1 keeps input_ids[t]
        self.input_src = a(t, np.int32, "input_src")
        self.input_ids = a(t, np.int32, "input_ids")
        self.positions = a(t, np.int32, "positions")
        self.slot_mapping = a(t, np.int64, "slot_mapping")
        self.cu_seqlens = a(b + 1, np.int32, "cu_seqlens")
        self.context_lens = a(b, np.int32, "context_lens")
        self.page_indices = a((b, s.pages_per_seq), np.int32, "page_indices")
        self.targets = a(r, np.int32, "targets")
        self.sampled = a(r, np.int32, "sampled")
        self.lp_token = a(r, np.float32, "lp_token")
        self.lp_rank = a(r, np.int32, "lp_rank")
        self.lp_top_ids = a((r, 20), np.int32, "lp_top_ids")
        self.lp_top = a((r, 20), np.float32, "lp_top")
        # logits processors (engine/executor/cuda_logits.py): rows, and one slot per sequence
        self.procs = ProcessorBuffers(mc.vocab_size, p.vocab, r, b, arena, stream)
        # activations
        self.resid = a((t, h), BF16, "resid")
        self.delta = a((t, h), BF16, "delta")
        self.h = a((t, h), BF16, "h")
        self.ones = a(h, BF16, "ones")  # the unfused path's norm weight (weights are folded)
        ones = np.ones(h, dtype=BF16)
        self.ones.upload(ones, stream)
        self.qkv = a((t, mc.qkv_size), BF16, "qkv")
        self.q = a((t, mc.q_size), BF16, "q")
        self.attn = a((t, mc.q_size), BF16, "attn")
        self.gate_up = a((t, 2 * p.intermediate), BF16, "gate_up")
        self.act = a((t, p.intermediate), BF16, "act")
        self.rows = a((r, h), BF16, "rows")
        self.logits = a((r, p.vocab), np.float32, "logits")  # columns past vocab_size: unread
        self.workspace = a(max(workspace // 4, 1), np.float32, "attn_workspace")
        # decode attention's split counters (its tail: decode_plan.split_counters_offset) start
        # at zero; every launch leaves them so
        self.workspace.fill_bytes(0, stream)
        # a mixed step's prefill sequences, from offset 0 (CudaExecutor.stage_mixed: its
        # one-token rows run in the decode kernel, the rest in the prefill kernel, whose
        # per-sequence arrays must start 16-byte aligned)
        self.pre_cu_seqlens = a(b + 1, np.int32, "pre_cu_seqlens")
        self.pre_context_lens = a(b, np.int32, "pre_context_lens")
        self.pre_page_indices = a((b, s.pages_per_seq), np.int32, "pre_page_indices")
        cs = cos_sin_table(s.max_pos, mc.head_dim, mc.rope_theta, mc.rope_scaling)
        self.cos_sin = a(cs.shape, np.float32, "cos_sin")
        self.cos_sin.upload(cs, stream)
        stream.synchronize()
        # padding rows of graphs read page 0 (the padding page): keep the table zeroed
        self.page_indices.fill_bytes(0, stream)
        self.input_src.fill_bytes(0xFF, stream)  # -1: no token from the samples (warm-ups)
