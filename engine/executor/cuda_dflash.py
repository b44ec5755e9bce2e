"""The DFlash drafter on the cuda backend: context K/V in the paged pool, draft blocks batched.

What ../shared/DFLASH.md 4.4 recommends, in its simplest correct form:

- **Capture and materialization, in every forward** (prefill chunks, decode, verify and mixed
  steps; eager or replayed from a graph): the residual stream leaving each of the drafter's
  ``target_layer_ids`` is copied (one pitched memcpy a layer) into ``feats[T, n * H]``; after the
  target's last layer ``ctx = rms_norm(feats @ fc.T, hidden_norm)`` and, per draft layer, the
  draft layer's ``k_proj`` / ``v_proj`` of ``ctx`` with ``k_norm`` and RoPE at the token's
  position are written into that draft layer's own K/V pages **at the step's slots** (the
  target's ``rope_kv`` kernel over a qkv GEMM of ``ctx``; its q part is computed and unused).
  So every computed position has, in the draft layers, the context K/V of its target features:
  the block manager's pages carry them, preemption and prefix caching need nothing more (a
  cached page's draft K/V is a function of its prefix, like its target K/V).
- **The draft blocks**, batched over the step's speculating requests: a proposal queues the
  request's block (``enqueue``, the proposer's ``DeviceDrafts`` carries its block index) and
  the step drafts every queued block in one launch of its bucket's ``blocks x B`` rows (padding
  blocks attend to their own keys only). Block j: the request's partly filled last page is
  copied into block j's scratch pages of every draft layer (one pitched copy), the block
  ``[pending, MASK x (B - 1)]`` at positions ``L..L+B-1`` runs the draft layers with its K/V
  written into those scratch pages, and every block row attends to all ``L + B`` keys (the
  decode kernel, each block row as its own sequence over its block's page row: not causal, as
  the drafter wants); ``norm``, the target's lm_head and the greedy sampler over every row give
  block j's B - 1 drafts in rows ``j * B + 1 ..`` of ``buf.sampled``. Pool pages are only
  read, so a draft never changes what a verify step or any other request sees.
- **One graph a speculative step** (``CUTEINFER_SPEC_FUSED``, default on): a bucket's verify
  graph drafts its bucket's blocks, places each span's drafts over its placeholder ids
  (cutlass_kernels/place_tokens.py, from a per-step row map ``buf.src``) and verifies: one
  launch, nothing on the host between draft and verify (CudaExecutor.verify_runner). The step's
  drafts come back with its samples (``drafts_of``), and acceptance is computed from them.
  ``CUTEINFER_SPEC_FUSED=0``: the blocks' own graph (one per block bucket, ``capture_graphs``),
  then the verify graph; ``CUTEINFER_DRAFT_GRAPH=0``: eager blocks; ``CUTEINFER_DEVICE_DRAFTS=0``
  (or more than ``max_blocks`` proposals in a step): a request's block runs alone when proposed
  and its drafts are downloaded (``propose``).

Drafts only decide how many tokens a step commits, never which (verification alone does), so
this path's numbers are checked against the numpy drafter (engine/model/dflash.py) with a
tolerance (tests/gpu/test_dflash_cuda.py), while losslessness is checked token for token.

Not yet: acceptance on the device (the host compares the step's drafts and samples, which it
downloads anyway); a drafter whose intermediate size differs from its target's (refused: it
shares the target's SiLU kernel and buffers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.config import ModelConfig
from engine.cuda.driver import DeviceBuffer
from engine.executor.cuda_model import GATE_UP_BLOCK
from engine.executor.cuda_shapes import Padded, pad_to
from engine.speculative import DeviceDrafts

# blocks one launch drafts at most (16 rows each); a step's proposals past them run alone and
# are downloaded at once
MAX_DRAFT_BLOCKS = 16


def scratch_pages(page_size: int, block_size: int) -> int:
    """Pages the draft block's K/V need past the request's full pages: its last, partly filled
    page (copied) and the block after it."""
    return -(-(page_size - 1 + block_size) // page_size)


@dataclass(frozen=True)
class DrafterShapes:
    hidden: int  # padded (the residual row)
    intermediate: int  # padded
    vocab: int  # padded (the logits row)
    n_layers: int  # draft layers
    n_capture: int  # target layers captured
    block: int
    qkv_size: int
    q_size: int
    kv_heads: int
    head_dim: int
    page_size: int
    scratch: int

    @classmethod
    def of(cls, mc: ModelConfig, dc: Any, page_size: int) -> DrafterShapes:
        p = Padded.of(mc)
        return cls(p.hidden, p.intermediate, p.vocab, dc.num_hidden_layers,
                   len(dc.target_layer_ids), dc.block_size, mc.qkv_size, mc.q_size,
                   mc.num_key_value_heads, mc.head_dim, page_size,
                   scratch_pages(page_size, dc.block_size))

    @property
    def page_bytes(self) -> int:
        return self.kv_heads * self.page_size * self.head_dim * 2


class DrafterBuffers:
    """Everything the drafter keeps on the device, allocated from ``arena`` (a CountingArena
    sizes the memory plan with ``num_pages=0``: then only the scratch pages of its K/V), for up
    to ``blocks`` requests' blocks in one launch (``blocks x block`` rows)."""

    def __init__(self, s: DrafterShapes, t_max: int, pages_per_seq: int, num_pages: int,
                 arena: Any, blocks: int = 1) -> None:
        from engine.executor.cuda_model import BF16

        a, h = arena.alloc, s.hidden
        self.blocks = blocks
        r = self.rows = blocks * s.block
        # weights (uploaded by CudaDrafter; the norms are applied by the norm kernels, so no
        # weight is folded)
        self.fc = a((h, s.n_capture * h), BF16, "d_fc")
        self.hidden_norm = a(h, BF16, "d_hidden_norm")
        self.norm = a(h, BF16, "d_norm")
        self.layers = [{
            "in_norm": a(h, BF16, "d_in_norm"), "post_norm": a(h, BF16, "d_post_norm"),
            "qkv": a((s.qkv_size, h), BF16, "d_qkv"), "o": a((h, s.q_size), BF16, "d_o"),
            "gate_up": a((2 * s.intermediate, h), BF16, "d_gate_up"),
            "down": a((h, s.intermediate), BF16, "d_down"),
            "q_norm": a(s.head_dim, BF16, "d_q_norm"), "k_norm": a(s.head_dim, BF16, "d_k_norm"),
        } for _ in range(s.n_layers)]
        # the target's captured features and their projection, per step token
        self.feats = a((t_max, s.n_capture * h), BF16, "d_feats")
        self.ctx = a((t_max, h), BF16, "d_ctx")
        self.ctxn = a((t_max, h), BF16, "d_ctxn")
        # the draft layers' K/V pages: the pool's page ids, then each block's scratch pages
        shape = (num_pages + blocks * s.scratch, s.kv_heads, s.page_size, s.head_dim)
        self.k_cache = [a(shape, BF16, f"dk{i}") for i in range(s.n_layers)]
        self.v_cache = [a(shape, BF16, f"dv{i}") for i in range(s.n_layers)]
        # the blocks' step: block j is rows j * block .. (j + 1) * block - 1
        self.pps = pages_per_seq + s.scratch
        self.ids = a(r, np.int32, "d_ids")
        self.positions = a(r, np.int32, "d_positions")
        self.slots = a(r, np.int64, "d_slots")
        self.context_lens = a(r, np.int32, "d_context_lens")
        self.page_indices = a((r, self.pps), np.int32, "d_page_indices")
        self.x = a((r, h), BF16, "d_x")
        self.delta = a((r, h), BF16, "d_delta")
        self.h = a((r, h), BF16, "d_h")
        self.qkv = a((r, s.qkv_size), BF16, "d_qkv_out")
        self.q = a((r, s.q_size), BF16, "d_q")
        self.attn = a((r, s.q_size), BF16, "d_attn")
        self.gate_up = a((r, 2 * s.intermediate), BF16, "d_gate_up_out")
        self.act = a((r, s.intermediate), BF16, "d_act")
        self.logits = a((r, s.vocab), np.float32, "d_logits")
        # greedy sampling parameters (zeros, top_p 1: uploaded once)
        self.temperature = a(r, np.float32, "d_temperature")
        self.top_k = a(r, np.int32, "d_top_k")
        self.top_p = a(r, np.float32, "d_top_p")
        self.min_p = a(r, np.float32, "d_min_p")
        self.seeds = a(r, np.uint64, "d_seeds")
        self.steps = a(r, np.uint32, "d_steps")
        # every row's greedy token; block j's drafts are rows j * block + 1 .. (j + 1) * block - 1
        self.sampled = a(r, np.int32, "d_sampled")
        # a verify step's input row -> the row of ``sampled`` placed over it (-1: its own token)
        self.src = a(t_max, np.int32, "d_src")


def drafter_fixed_bytes(s: DrafterShapes, t_max: int, pages_per_seq: int,
                        blocks: int = 1) -> int:
    """Bytes of ``DrafterBuffers`` at zero pool pages (what the memory plan adds to its fixed
    part; the draft layers' K/V per page come on top: ``2 * n_layers`` more KV arrays), with
    256 bytes of alignment slack per array."""
    from engine.executor.cuda_model import CountingArena

    arena = CountingArena()
    DrafterBuffers(s, t_max, pages_per_seq, 0, arena, blocks)
    return arena.used + 2 * s.n_layers * 2 * CountingArena.ALIGN


def gate_up_blocks(gate: np.ndarray, up: np.ndarray, rows: int) -> np.ndarray:
    """gate and up (each padded to ``rows``) interleaved in blocks of 32 rows: gate 0-31, up
    0-31, gate 32-63, ... (``DeviceWeights``' layout)."""
    g = gate.reshape(rows // GATE_UP_BLOCK, GATE_UP_BLOCK, -1)
    u = up.reshape(rows // GATE_UP_BLOCK, GATE_UP_BLOCK, -1)
    return np.stack([g, u], axis=1).reshape(2 * rows, -1)


def padded_fc(fc: np.ndarray, n: int, hidden: int, padded: int) -> np.ndarray:
    """``fc [H, n * H]`` at the padded width: rows to ``padded``, each of the n column blocks
    (one captured layer's residual row, padded with zeros past H) to ``padded``."""
    if hidden == padded:
        return fc
    out = np.zeros((padded, n * padded), fc.dtype)
    for j in range(n):
        out[:hidden, j * padded:j * padded + hidden] = fc[:, j * hidden:(j + 1) * hidden]
    return out


class CudaDrafter:
    """The drafter's weights, buffers and K/V pages in the executor's arena, and its kernels
    (its own plain GEMMs and q/k-norm rope kernel; the target's embedding, norms, SiLU,
    decode attention, lm_head and sampler)."""

    def __init__(self, ckpt: Any, mc: ModelConfig, page_size: int, t_max: int,
                 pages_per_seq: int, num_pages: int, arena: Any, stream: Any,
                 blocks: int = 1, buckets: Sequence[int] = ()) -> None:
        from engine.executor.cuda_model import BF16
        from graphs.buckets import bucket_sizes

        dc = self.config = ckpt.config
        self.mc = mc
        self.shapes = s = DrafterShapes.of(mc, dc, page_size)
        self.num_pages = num_pages  # the first scratch page's id
        self.buf = b = DrafterBuffers(s, t_max, pages_per_seq, num_pages, arena, blocks)
        self.max_blocks = blocks
        # layer -> its column block of feats
        self.capture_index = {li: j for j, li in enumerate(dc.target_layer_ids)}
        h, real = s.hidden, mc.hidden_size

        def up(buf: Any, a: np.ndarray, shape: tuple[int, ...]) -> None:
            buf.upload(np.ascontiguousarray(pad_to(np.asarray(a, BF16), shape)), stream)

        up(b.fc, padded_fc(np.asarray(ckpt["fc.weight"], BF16), s.n_capture, real, h),
           (h, s.n_capture * h))
        up(b.hidden_norm, ckpt["hidden_norm.weight"], (h,))
        up(b.norm, ckpt["norm.weight"], (h,))
        for li, lw in enumerate(b.layers):
            p = f"layers.{li}."
            up(lw["in_norm"], ckpt[p + "input_layernorm.weight"], (h,))
            up(lw["post_norm"], ckpt[p + "post_attention_layernorm.weight"], (h,))
            qkv = np.concatenate([ckpt[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            up(lw["qkv"], qkv, (s.qkv_size, h))
            up(lw["o"], ckpt[p + "self_attn.o_proj.weight"], (h, s.q_size))
            half = (s.intermediate, h)
            gate = pad_to(np.asarray(ckpt[p + "mlp.gate_proj.weight"], BF16), half)
            upw = pad_to(np.asarray(ckpt[p + "mlp.up_proj.weight"], BF16), half)
            up(lw["gate_up"], gate_up_blocks(gate, upw, s.intermediate), (2 * s.intermediate, h))
            up(lw["down"], ckpt[p + "mlp.down_proj.weight"], (h, s.intermediate))
            up(lw["q_norm"], ckpt[p + "self_attn.q_norm.weight"], (s.head_dim,))
            up(lw["k_norm"], ckpt[p + "self_attn.k_norm.weight"], (s.head_dim,))
        r = b.rows
        b.temperature.upload(np.zeros(r, np.float32), stream)
        b.top_k.upload(np.zeros(r, np.int32), stream)
        b.top_p.upload(np.ones(r, np.float32), stream)
        b.min_p.upload(np.zeros(r, np.float32), stream)
        b.seeds.upload(np.zeros(r, np.uint64), stream)
        b.steps.upload(np.zeros(r, np.uint32), stream)
        for c in (*b.k_cache, *b.v_cache):
            c.fill_bytes(0, stream)  # (a position is read only after it was written)
        stream.synchronize()
        # the draft layers' K and V arrays at one pitch (the arena allocates them one after
        # another): a page of every layer is then one pitched copy; else one copy a layer
        caches = (*b.k_cache, *b.v_cache)
        gaps = {y.ptr - x.ptr for x, y in zip(caches, caches[1:], strict=False)}
        self._pitch = gaps.pop() if len(gaps) == 1 and next(iter(gaps), 0) > 0 else 0
        # the block buckets: a launch runs one of these many blocks (the rest padding), so an
        # eager block batch and a graph of that bucket run the same kernels
        self.block_buckets = sorted({x for x in (buckets or bucket_sizes(blocks, blocks))
                                     if x <= blocks} | {blocks})
        self.gemm: dict[str, Any] = {}
        self.rope: Any = None
        self.place_kernel: Any = None
        self.graphs: dict[int, Any] = {}  # block bucket -> the blocks' kernels, captured
        # the blocks proposed for the next step: (n_ctx, pending, page-table row); drafted:
        # whether buf.sampled holds their drafts now
        self.queue: list[tuple[int, int, np.ndarray]] = []
        self.drafted = False

    def compile(self) -> None:
        """The drafter's GEMMs (plain: the target's decoder GEMMs fuse norms, SiLU and residual
        adds at small M, over folded weights) and its q/k-norm rope kernel (the target's own
        when the target has q/k norms: the compile cache)."""
        from cutlass_kernels.gemm import compile_gemm
        from cutlass_kernels.place_tokens import compile_place_tokens
        from cutlass_kernels.rope_kv import compile_rope_kv

        s, mc = self.shapes, self.mc
        h, i = s.hidden, s.intermediate
        self.gemm = {"fc": compile_gemm(h, s.n_capture * h), "qkv": compile_gemm(s.qkv_size, h),
                     "o": compile_gemm(h, s.q_size), "gate_up": compile_gemm(2 * i, h),
                     "down": compile_gemm(h, i)}
        self.rope = compile_rope_kv(mc.num_attention_heads, s.kv_heads, s.head_dim,
                                    s.page_size, True)
        self.place_kernel = compile_place_tokens()

    # -- inside the target's forward -------------------------------------------------------------
    def capture(self, layer: int, resid: Any, t: int, stream: Any) -> None:
        """Target layer ``layer``'s output rows (``resid[:t]``) into their column block of
        ``feats`` (a layer not captured: nothing)."""
        j = self.capture_index.get(layer)
        if j is None or t <= 0:
            return
        row = self.shapes.hidden * 2
        self.buf.feats.copy_rows_from(resid, t, row, row, row * self.shapes.n_capture, stream,
                                      dst_offset=j * row)

    def materialize(self, ex: Any, t: int) -> None:
        """The context K/V of the step's ``t`` tokens into every draft layer's pages at the
        step's slots (after the target's forward: ``ex.buf.qkv`` / ``q`` are free)."""
        if t <= 0:
            return
        k, b, eb, st, dc, g = ex.kernels, self.buf, ex.buf, ex.stream, self.config, self.gemm
        g["fc"](b.feats, b.fc, b.ctx, t, st)
        k.norm(b.ctx, None, b.hidden_norm, b.ctxn, t, dc.rms_norm_eps, st)
        for li, lw in enumerate(b.layers):
            g["qkv"](b.ctxn, lw["qkv"], eb.qkv, t, st)
            self.rope(eb.qkv, eb.positions, eb.slot_mapping, lw["q_norm"], lw["k_norm"],
                      eb.cos_sin, eb.q, b.k_cache[li], b.v_cache[li], t, ex.sizes.max_pos,
                      dc.rms_norm_eps, st)

    # -- the draft blocks --------------------------------------------------------------------------
    def block_inputs(self, n_ctx: int, pending: int, pages: np.ndarray, block: int = 0
                     ) -> dict[str, np.ndarray]:
        """Block ``block``'s host arrays for a request of ``n_ctx`` committed positions on
        ``pages`` (its page-table row): token ids, positions, scratch slots, per-row context
        lengths and page rows (full pool pages, then the block's own scratch pages). A request
        of ``n_ctx`` 0 is padding: the block attends to its own keys only."""
        s, dc = self.shapes, self.config
        ps, bb = s.page_size, s.block
        full, rem = divmod(n_ctx, ps)
        first = self.num_pages + block * s.scratch  # the block's first scratch page
        row = np.zeros(self.buf.pps, np.int32)
        row[:full] = pages[:full]
        row[full:full + s.scratch] = first + np.arange(s.scratch, dtype=np.int32)
        ids = np.full(bb, dc.mask_token_id, np.int32)
        ids[0] = pending
        return {"ids": ids, "positions": (n_ctx + np.arange(bb)).astype(np.int32),
                "slots": (first * ps + rem + np.arange(bb)).astype(np.int64),
                "context_lens": np.full(bb, n_ctx + bb, np.int32),
                "page_indices": np.tile(row, (bb, 1))}

    def blocks_for(self, n: int) -> int:
        """The block bucket that runs ``n`` blocks (at most ``max_blocks``)."""
        from graphs.buckets import bucket_for

        return bucket_for(min(n, self.max_blocks), self.block_buckets) or self.max_blocks

    def stage(self, ex: Any, requests: list[tuple[int, int, np.ndarray]], blocks: int) -> None:
        """The inputs of ``blocks`` blocks on the stream: one per ``(n_ctx, pending, pages)``
        of ``requests`` (each its partly filled last page copied into its block's scratch page
        of every draft layer, so the block's K/V can follow it), padding blocks after them."""
        b, st, s = self.buf, ex.stream, self.shapes
        if len(requests) > blocks or blocks > self.max_blocks:
            raise ValueError(f"{len(requests)} draft blocks in a launch of {blocks} "
                             f"(at most {self.max_blocks})")
        pb = s.page_bytes
        parts = []
        for j in range(blocks):
            n_ctx, pending, pages = requests[j] if j < len(requests) else (0, 0, _NO_PAGES)
            full, rem = divmod(n_ctx, s.page_size)
            if rem:
                src, dst = int(pages[full]) * pb, (self.num_pages + j * s.scratch) * pb
                self._copy_page(src, dst, st)
            parts.append(self.block_inputs(n_ctx, pending, pages, j))
        for name in ("ids", "positions", "slots", "context_lens", "page_indices"):
            getattr(b, name).upload(np.concatenate([p[name] for p in parts]), st)

    def _copy_page(self, src: int, dst: int, st: Any) -> None:
        """Byte offset ``src`` of every draft layer's K and V array to ``dst``."""
        b, pb = self.buf, self.shapes.page_bytes
        caches = (*b.k_cache, *b.v_cache)
        if self._pitch:
            base = caches[0]
            span = DeviceBuffer(base.ptr, (len(caches) - 1) * self._pitch + base.nbytes)
            span.copy_rows_from(span, len(caches), pb, self._pitch, self._pitch, st,
                                dst_offset=dst, src_offset=src)
            return
        for c in caches:
            c.view(dst, pb).copy_from(c.view(src, pb), pb, st)

    def body(self, ex: Any, blocks: int = 1, sample: bool = True) -> None:
        """The kernels of ``blocks`` staged blocks (what a graph records): every row's logits
        into ``buf.logits[:blocks x B]`` and, with ``sample``, its greedy token into
        ``buf.sampled`` (block j's drafts: rows ``j * B + 1 .. j * B + B - 1``; row ``j * B``,
        the pending token's, is computed and unused). The split-KV factor is the one for these
        rows at the longest context, whatever the requests' (a graph's kernels are fixed), so
        eager and replayed blocks of one bucket run the same kernels."""
        k, b, eb, st, dc, s, mc, g = (ex.kernels, self.buf, ex.buf, ex.stream, self.config,
                                      self.shapes, self.mc, self.gemm)
        rows, eps = blocks * s.block, dc.rms_norm_eps
        splits = self._splits(ex, rows, ex.sizes.max_pos)
        k.embed(b.ids, ex.weights.embed, b.x, mc.vocab_size, rows, st)
        for li, lw in enumerate(b.layers):
            if li == 0:
                k.norm(b.x, None, lw["in_norm"], b.h, rows, eps, st)
            else:
                k.add_norm(b.delta, b.x, lw["in_norm"], b.h, rows, eps, st)
            g["qkv"](b.h, lw["qkv"], b.qkv, rows, st)
            self.rope(b.qkv, b.positions, b.slots, lw["q_norm"], lw["k_norm"], eb.cos_sin, b.q,
                      b.k_cache[li], b.v_cache[li], rows, ex.sizes.max_pos, eps, st)
            k.decode(b.q, b.k_cache[li], b.v_cache[li], b.page_indices, b.context_lens, b.attn,
                     eb.workspace, rows, b.pps, splits, ex.scale, st)
            g["o"](b.attn, lw["o"], b.delta, rows, st)
            k.add_norm(b.delta, b.x, lw["post_norm"], b.h, rows, eps, st)
            g["gate_up"](b.h, lw["gate_up"], b.gate_up, rows, st)
            k.silu(b.gate_up, b.act, rows, st)
            g["down"](b.act, lw["down"], b.delta, rows, st)
        k.add_norm(b.delta, b.x, b.norm, b.h, rows, eps, st)
        k.lm_head(b.h, ex.weights.lm_head, b.logits, rows, st)
        if sample:
            k.sample(b.logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps,
                     b.sampled, rows, st)

    def place(self, ex: Any, rows: int) -> None:
        """The staged drafts over a step's input ids: ``input_ids[t] = sampled[src[t]]`` where
        ``src[t] >= 0``, for the step's first ``rows`` rows (``stage_src`` first)."""
        self.place_kernel(self.buf.src, self.buf.sampled, ex.buf.input_ids, self.buf.rows,
                          rows, ex.stream)

    def stage_src(self, ex: Any, dd: np.ndarray, rows: int) -> None:
        """``src`` for a step of ``rows`` input rows whose spans ``dd``
        (``StepBatch.device_drafts``: block, first draft row, k) take their block's first k
        drafts; every other row keeps its token."""
        bb, n = self.shapes.block, self.shapes.block - 1
        src = np.full(rows, -1, np.int32)
        for block, row, k in dd.tolist():
            if not (0 <= block < len(self.queue) and 1 <= k <= n and row + k <= rows):
                raise ValueError(f"device drafts (block {block}, row {row}, k {k}): no such "
                                 f"drafts ({len(self.queue)} blocks proposed, {n} drafts a "
                                 f"block, {rows} rows)")
            src[row:row + k] = block * bb + 1 + np.arange(k, dtype=np.int32)
        self.buf.src.upload(src, ex.stream)

    def logits(self, ex: Any, n_ctx: int, pending: int, pages: np.ndarray) -> None:
        """Run the block of a request with ``n_ctx`` committed positions on ``pages`` (its
        page-table row) and pending token ``pending`` alone, eagerly: its B - 1 draft rows'
        logits into ``buf.logits[1:B]`` (on the stream, not waited for)."""
        self.stage(ex, [(n_ctx, pending, pages)], 1)
        self.body(ex, 1, sample=False)
        self.drafted = False

    def capture_graphs(self, ex: Any) -> float:
        """Record ``body`` as a CUDA graph per block bucket, after a warm-up run over staged
        padding blocks (every kernel loaded). Returns the captures' seconds."""
        from engine.cuda.driver import Graph

        total = 0.0
        for blocks in reversed(self.block_buckets):
            self.stage(ex, [], blocks)
            self.body(ex, blocks)
            self.graphs[blocks] = g = Graph.capture(ex.stream,
                                                    lambda n=blocks: self.body(ex, n))
            total += g.capture_s
        return total

    def run(self, ex: Any, requests: list[tuple[int, int, np.ndarray]], blocks: int) -> None:
        """Stage ``requests``' blocks in a launch of ``blocks`` and enqueue it (its graph when
        captured): block j's greedy drafts land in ``buf.sampled[j * B + 1 .. j * B + B - 1]``."""
        self.stage(ex, requests, blocks)
        g = self.graphs.get(blocks)
        if g is not None:
            g.launch(ex.stream)
        else:
            self.body(ex, blocks)

    def propose(self, ex: Any, n_ctx: int, pending: int, pages: np.ndarray) -> np.ndarray:
        """The B - 1 greedy drafts (int32) of a request with ``n_ctx`` committed positions on
        ``pages``, pending token ``pending``, from its block alone (waits for them)."""
        b, st, bb = self.buf, ex.stream, self.shapes.block
        self.run(ex, [(n_ctx, pending, pages)], 1)
        self.drafted = False  # (the queued blocks' drafts, if any, are overwritten)
        out = b.sampled.view(4, (bb - 1) * 4).download(np.empty(bb - 1, np.int32), st)
        st.synchronize()
        return out

    def enqueue(self, n_ctx: int, pending: int, pages: np.ndarray) -> int | None:
        """Propose a request's block for the next step, drafted on the device inside that
        step (``CudaExecutor``: the drafts go straight over the span's placeholder ids). Returns
        its block index, None when ``max_blocks`` are queued (nothing queued)."""
        if len(self.queue) >= self.max_blocks:
            return None
        full = n_ctx // self.shapes.page_size
        self.queue.append((n_ctx, pending, np.array(pages[:full + 1], np.int32)))
        self.drafted = False
        return len(self.queue) - 1

    def flush(self, ex: Any, blocks: int = 0) -> None:
        """Draft the queued blocks now, in a launch of ``blocks`` (at least their own bucket),
        unless ``buf.sampled`` holds their drafts already."""
        if self.queue and not self.drafted:
            self.run(ex, self.queue, max(blocks, self.blocks_for(len(self.queue))))
            self.drafted = True

    def read_block(self, ex: Any, block: int) -> np.ndarray:
        """Block ``block``'s drafts now (drafts the queue first; waits for the stream)."""
        self.flush(ex)
        bb = self.shapes.block
        out = self.buf.sampled.view((block * bb + 1) * 4, (bb - 1) * 4).download(
            np.empty(bb - 1, np.int32), ex.stream)
        ex.stream.synchronize()
        return out

    def drafts_of(self, dd: np.ndarray, stream: Any) -> list[list[int]]:
        """The drafts of ``dd``'s spans (block, row, k), in its order, as the step placed them
        (one download of the blocks used)."""
        if not dd.shape[0]:
            return []
        bb = self.shapes.block
        top = int(dd[:, 0].max()) + 1
        host = self.buf.sampled.download(np.empty((top, bb), np.int32), stream)
        stream.synchronize()
        return [host[block, 1:1 + k].tolist() for block, _row, k in dd.tolist()]

    def release(self) -> None:
        """No block queued (the step that drafted them is done, or failed)."""
        self.queue = []
        self.drafted = False

    def _splits(self, ex: Any, rows: int, context: int) -> int:
        """The decode kernel's split-KV factor for ``rows`` block rows: the executor's plan for
        that many rows when its workspace holds it, else 1 (no workspace)."""
        from cutlass_kernels.decode_plan import decode_workspace_bytes

        mc = self.mc
        n = ex._num_splits(rows, context)
        if n > 1 and decode_workspace_bytes(rows, mc.num_attention_heads, mc.head_dim,
                                            n) > ex.buf.workspace.nbytes:
            return 1
        return max(1, n)


_NO_PAGES = np.zeros(1, np.int32)


class CudaDFlashProposer:
    """``DFlashProposer`` on the cuda backend: ``(request, k) -> drafts``. With ``device`` (the
    default) a proposal queues the request's block (``CudaDrafter.enqueue``) and returns
    ``DeviceDrafts``: the step drafts every queued block in one launch inside its own graph and
    places the drafts on the device. Otherwise (or past ``max_blocks`` in a step) the request's
    block runs alone at once and its drafts are downloaded (``CudaDrafter.propose``)."""

    def __init__(self, executor: Any, block_manager: Any, max_model_len: int,
                 device: bool = True) -> None:
        self.executor, self.drafter = executor, executor.dflash
        self.bm, self.max_model_len = block_manager, max_model_len
        self.device = device  # drafts left on the device (DeviceDrafts) while blocks last
        self.counts = {"device": 0, "host": 0}  # proposals of each kind

    def __call__(self, req: Any, k: int) -> list[int] | DeviceDrafts:
        n, bb = req.num_computed_tokens, self.drafter.shapes.block
        if n + bb > self.max_model_len or k < 1 or n < 1:
            return []
        pending = req.token_slice(n, 1)[0]
        pages = np.frombuffer(self.bm.page_table_view(req.request_id), np.int32)
        ex, d = self.executor, self.drafter
        if self.device:
            block = d.enqueue(n, pending, pages)
            if block is not None:
                self.counts["device"] += 1
                return DeviceDrafts(min(k, bb - 1), block, lambda: d.read_block(ex, block))
        self.counts["host"] += 1
        return d.propose(ex, n, pending, pages)[:k].tolist()
