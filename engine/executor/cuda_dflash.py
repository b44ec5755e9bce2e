"""The DFlash drafter on the cuda backend: context K/V in the paged pool, the draft block eager.

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
- **The draft block** (``propose_device`` / ``propose``), per speculating request, on the
  executor's stream between steps (nothing is in flight then: the scheduler proposes only
  outside the pipelined continuation), replayed from one captured graph (``capture_graph``;
  eager kernel calls with ``CUTEINFER_DRAFT_GRAPH=0``): the request's partly filled last page
  is copied into a scratch page of each
  draft layer, the block ``[pending, MASK x (B - 1)]`` at positions ``L..L+B-1`` runs the draft
  layers with its K/V written into the scratch pages, and every block row attends to all
  ``L + B`` keys (the decode kernel, each block row as its own sequence over the same page row:
  not causal, as the drafter wants); ``norm``, the target's lm_head on rows 1..B-1 and the
  greedy sampler give the B - 1 drafts. Pool pages are only read, so a draft never changes
  what a verify step or any other request sees.
- **Drafts stay on the device** (``DeviceDrafts``, default; ``CUTEINFER_DEVICE_DRAFTS=0``
  downloads them at once): the block's drafts are copied into a slot of ``buf.pending``; the
  scheduler gives the span placeholder ids, the executor copies the slot over them after the
  step's upload (``place``) and reads the drafts back with the step's samples (``drafts_of``),
  so nothing waits between draft and verify and the host builds the verify step while the GPU
  drafts.

Drafts only decide how many tokens a step commits, never which (verification alone does), so
this path's numbers are checked against the numpy drafter (engine/model/dflash.py) with a
tolerance (tests/gpu/test_dflash_cuda.py), while losslessness is checked token for token.

Not yet: the block batched over requests (one block per speculating request, each its own
graph launch; DFLASH.md 6) and inside the verify graph itself (two launches back to back, no
sync between); a drafter whose intermediate size differs from its target's (refused: it shares
the target's SiLU kernel and buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.config import ModelConfig
from engine.executor.cuda_model import GATE_UP_BLOCK
from engine.executor.cuda_shapes import Padded, pad_to
from engine.speculative import DeviceDrafts

# drafts a step may leave on the device (one slot per speculating request); past them the
# proposer downloads its drafts at once
DRAFT_SLOTS = 64


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
    sizes the memory plan with ``num_pages=0``: then only the scratch pages of its K/V)."""

    def __init__(self, s: DrafterShapes, t_max: int, pages_per_seq: int, num_pages: int,
                 arena: Any) -> None:
        from engine.executor.cuda_model import BF16

        a, h, b = arena.alloc, s.hidden, s.block
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
        # the draft layers' K/V pages: the pool's page ids, then the scratch pages
        shape = (num_pages + s.scratch, s.kv_heads, s.page_size, s.head_dim)
        self.k_cache = [a(shape, BF16, f"dk{i}") for i in range(s.n_layers)]
        self.v_cache = [a(shape, BF16, f"dv{i}") for i in range(s.n_layers)]
        # the block's step
        self.pps = pages_per_seq + s.scratch
        self.ids = a(b, np.int32, "d_ids")
        self.positions = a(b, np.int32, "d_positions")
        self.slots = a(b, np.int64, "d_slots")
        self.context_lens = a(b, np.int32, "d_context_lens")
        self.page_indices = a((b, self.pps), np.int32, "d_page_indices")
        self.x = a((b, h), BF16, "d_x")
        self.delta = a((b, h), BF16, "d_delta")
        self.h = a((b, h), BF16, "d_h")
        self.qkv = a((b, s.qkv_size), BF16, "d_qkv_out")
        self.q = a((b, s.q_size), BF16, "d_q")
        self.attn = a((b, s.q_size), BF16, "d_attn")
        self.gate_up = a((b, 2 * s.intermediate), BF16, "d_gate_up_out")
        self.act = a((b, s.intermediate), BF16, "d_act")
        self.logits = a((b, s.vocab), np.float32, "d_logits")
        # greedy sampling parameters (zeros, top_p 1: uploaded once)
        self.temperature = a(b, np.float32, "d_temperature")
        self.top_k = a(b, np.int32, "d_top_k")
        self.top_p = a(b, np.float32, "d_top_p")
        self.min_p = a(b, np.float32, "d_min_p")
        self.seeds = a(b, np.uint64, "d_seeds")
        self.steps = a(b, np.uint32, "d_steps")
        self.sampled = a(b, np.int32, "d_sampled")
        # drafts left on the device (DeviceDrafts), a row per slot, until the verify step
        self.pending = a((DRAFT_SLOTS, b - 1), np.int32, "d_pending")


def drafter_fixed_bytes(s: DrafterShapes, t_max: int, pages_per_seq: int) -> int:
    """Bytes of ``DrafterBuffers`` at zero pool pages (what the memory plan adds to its fixed
    part; the draft layers' K/V per page come on top: ``2 * n_layers`` more KV arrays), with
    256 bytes of alignment slack per array."""
    from engine.executor.cuda_model import CountingArena

    arena = CountingArena()
    DrafterBuffers(s, t_max, pages_per_seq, 0, arena)
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
                 pages_per_seq: int, num_pages: int, arena: Any, stream: Any) -> None:
        from engine.executor.cuda_model import BF16

        dc = self.config = ckpt.config
        self.mc = mc
        self.shapes = s = DrafterShapes.of(mc, dc, page_size)
        self.num_pages = num_pages  # the first scratch page's id
        self.buf = b = DrafterBuffers(s, t_max, pages_per_seq, num_pages, arena)
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
        bb = s.block
        b.temperature.upload(np.zeros(bb, np.float32), stream)
        b.top_k.upload(np.zeros(bb, np.int32), stream)
        b.top_p.upload(np.ones(bb, np.float32), stream)
        b.min_p.upload(np.zeros(bb, np.float32), stream)
        b.seeds.upload(np.zeros(bb, np.uint64), stream)
        b.steps.upload(np.zeros(bb, np.uint32), stream)
        for c in (*b.k_cache, *b.v_cache):
            c.fill_bytes(0, stream)  # (a position is read only after it was written)
        stream.synchronize()
        self.gemm: dict[str, Any] = {}
        self.rope: Any = None
        self.graph: Any = None  # the block's kernels, captured (capture_graph)
        self.n_pending = 0  # slots of buf.pending taken since the last release()

    def compile(self) -> None:
        """The drafter's GEMMs (plain: the target's decoder GEMMs fuse norms, SiLU and residual
        adds at small M, over folded weights) and its q/k-norm rope kernel (the target's own
        when the target has q/k norms: the compile cache)."""
        from cutlass_kernels.gemm import compile_gemm
        from cutlass_kernels.rope_kv import compile_rope_kv

        s, mc = self.shapes, self.mc
        h, i = s.hidden, s.intermediate
        self.gemm = {"fc": compile_gemm(h, s.n_capture * h), "qkv": compile_gemm(s.qkv_size, h),
                     "o": compile_gemm(h, s.q_size), "gate_up": compile_gemm(2 * i, h),
                     "down": compile_gemm(h, i)}
        self.rope = compile_rope_kv(mc.num_attention_heads, s.kv_heads, s.head_dim,
                                    s.page_size, True)

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

    # -- the draft block -------------------------------------------------------------------------
    def block_inputs(self, n_ctx: int, pending: int, pages: np.ndarray
                     ) -> dict[str, np.ndarray]:
        """The block step's host arrays for a request of ``n_ctx`` committed positions on
        ``pages`` (its page-table row): token ids, positions, scratch slots, per-row context
        lengths and page rows (full pool pages, then the scratch pages)."""
        s, dc = self.shapes, self.config
        ps, bb = s.page_size, s.block
        full, rem = divmod(n_ctx, ps)
        row = np.zeros(self.buf.pps, np.int32)
        row[:full] = pages[:full]
        row[full:full + s.scratch] = self.num_pages + np.arange(s.scratch, dtype=np.int32)
        ids = np.full(bb, dc.mask_token_id, np.int32)
        ids[0] = pending
        return {"ids": ids, "positions": (n_ctx + np.arange(bb)).astype(np.int32),
                "slots": (self.num_pages * ps + rem + np.arange(bb)).astype(np.int64),
                "context_lens": np.full(bb, n_ctx + bb, np.int32),
                "page_indices": np.tile(row, (bb, 1))}

    def stage(self, ex: Any, n_ctx: int, pending: int, pages: np.ndarray) -> None:
        """The block's inputs for a request with ``n_ctx`` committed positions on ``pages`` (its
        page-table row) and pending token ``pending``, on the stream: its partly filled last
        page copied into the scratch page of every draft layer, and ``block_inputs``."""
        b, st, s = self.buf, ex.stream, self.shapes
        full, rem = divmod(n_ctx, s.page_size)
        if rem:  # the partly filled page, so the block's K/V can follow it
            pb = s.page_bytes
            src, dst = int(pages[full]) * pb, self.num_pages * pb
            for c in (*b.k_cache, *b.v_cache):
                c.view(dst, pb).copy_from(c.view(src, pb), pb, st)
        for name, a in self.block_inputs(n_ctx, pending, pages).items():
            getattr(b, name).upload(a, st)

    def body(self, ex: Any, sample: bool = True) -> None:
        """The block's kernels over the staged inputs (what ``capture_graph`` records): its
        B - 1 draft rows' logits into ``buf.logits[:B - 1]`` and, with ``sample``, their greedy
        tokens into ``buf.sampled``. The split-KV factor is the one for the longest context,
        whatever the request's (a graph's kernels are fixed), so eager and replayed blocks run
        the same kernels."""
        k, b, eb, st, dc, s, mc, g = (ex.kernels, self.buf, ex.buf, ex.stream, self.config,
                                      self.shapes, self.mc, self.gemm)
        bb, eps = s.block, dc.rms_norm_eps
        splits = self._splits(ex, ex.sizes.max_pos)
        k.embed(b.ids, ex.weights.embed, b.x, mc.vocab_size, bb, st)
        for li, lw in enumerate(b.layers):
            if li == 0:
                k.norm(b.x, None, lw["in_norm"], b.h, bb, eps, st)
            else:
                k.add_norm(b.delta, b.x, lw["in_norm"], b.h, bb, eps, st)
            g["qkv"](b.h, lw["qkv"], b.qkv, bb, st)
            self.rope(b.qkv, b.positions, b.slots, lw["q_norm"], lw["k_norm"], eb.cos_sin, b.q,
                      b.k_cache[li], b.v_cache[li], bb, ex.sizes.max_pos, eps, st)
            k.decode(b.q, b.k_cache[li], b.v_cache[li], b.page_indices, b.context_lens, b.attn,
                     eb.workspace, bb, b.pps, splits, ex.scale, st)
            g["o"](b.attn, lw["o"], b.delta, bb, st)
            k.add_norm(b.delta, b.x, lw["post_norm"], b.h, bb, eps, st)
            g["gate_up"](b.h, lw["gate_up"], b.gate_up, bb, st)
            k.silu(b.gate_up, b.act, bb, st)
            g["down"](b.act, lw["down"], b.delta, bb, st)
        k.add_norm(b.delta, b.x, b.norm, b.h, bb, eps, st)
        row = s.hidden * 2
        k.lm_head(b.h.view(row, (bb - 1) * row), ex.weights.lm_head, b.logits, bb - 1, st)
        if sample:
            k.sample(b.logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.steps,
                     b.sampled, bb - 1, st)

    def logits(self, ex: Any, n_ctx: int, pending: int, pages: np.ndarray) -> None:
        """Run the block of a request with ``n_ctx`` committed positions on ``pages`` (its
        page-table row) and pending token ``pending``, eagerly: its B - 1 draft rows' logits
        into ``buf.logits[:B - 1]`` (on the stream, not waited for)."""
        self.stage(ex, n_ctx, pending, pages)
        self.body(ex, sample=False)

    def capture_graph(self, ex: Any) -> float:
        """Record ``body`` as a CUDA graph, after a warm-up block over a staged dummy request
        (every kernel loaded; the scratch pages are overwritten by every block). Returns the
        capture's seconds."""
        from engine.cuda.driver import Graph

        self.stage(ex, 1, 0, np.zeros(self.buf.pps, np.int32))
        self.body(ex)
        self.graph = Graph.capture(ex.stream, lambda: self.body(ex))
        return self.graph.capture_s

    def run(self, ex: Any, n_ctx: int, pending: int, pages: np.ndarray) -> None:
        """Stage a request's block and enqueue it (its graph when captured): its greedy drafts
        land in ``buf.sampled[:B - 1]``."""
        self.stage(ex, n_ctx, pending, pages)
        if self.graph is not None:
            self.graph.launch(ex.stream)
        else:
            self.body(ex)

    def propose(self, ex: Any, n_ctx: int, pending: int, pages: np.ndarray) -> np.ndarray:
        """The B - 1 greedy drafts (int32) of a request with ``n_ctx`` committed positions on
        ``pages``, pending token ``pending`` (waits for them)."""
        b, st, bb = self.buf, ex.stream, self.shapes.block
        self.run(ex, n_ctx, pending, pages)
        out = b.sampled.download(np.empty(bb - 1, np.int32), st)
        st.synchronize()
        return out

    def propose_device(self, ex: Any, n_ctx: int, pending: int, pages: np.ndarray
                       ) -> int | None:
        """Enqueue the block and keep its B - 1 drafts on the device, in a free slot of
        ``buf.pending`` (returned; None when every slot is taken: nothing enqueued). The slots
        are free again after ``release`` (the executor's, at the end of each step)."""
        if self.n_pending >= DRAFT_SLOTS:
            return None
        slot, n = self.n_pending, self.shapes.block - 1
        self.run(ex, n_ctx, pending, pages)
        self.buf.pending.view(slot * n * 4, n * 4).copy_from(self.buf.sampled, n * 4, ex.stream)
        self.n_pending += 1
        return slot

    def read_slot(self, ex: Any, slot: int) -> np.ndarray:
        """The drafts in ``slot`` now (waits for the stream)."""
        n = self.shapes.block - 1
        out = self.buf.pending.view(slot * n * 4, n * 4).download(np.empty(n, np.int32),
                                                                   ex.stream)
        ex.stream.synchronize()
        return out

    def place(self, dd: np.ndarray, input_ids: Any, stream: Any) -> None:
        """Copy each ``(slot, row, k)`` of ``dd`` (``StepBatch.device_drafts``): the slot's
        first k drafts over input rows ``row .. row + k - 1`` (after the step's upload)."""
        n = self.shapes.block - 1
        for slot, row, k in dd.tolist():
            if not (0 <= slot < self.n_pending and 1 <= k <= n):
                raise ValueError(f"device drafts (slot {slot}, k {k}): no such drafts "
                                 f"({self.n_pending} slots taken, {n} drafts a slot)")
            input_ids.view(row * 4, k * 4).copy_from(self.buf.pending.view(slot * n * 4, k * 4),
                                                     k * 4, stream)

    def drafts_of(self, dd: np.ndarray, stream: Any) -> list[list[int]]:
        """The drafts of ``dd``'s spans, in its order (one download of the slots used)."""
        if not dd.shape[0]:
            return []
        n = self.shapes.block - 1
        top = int(dd[:, 0].max()) + 1
        host = self.buf.pending.download(np.empty((top, n), np.int32), stream)
        stream.synchronize()
        return [host[slot, :k].tolist() for slot, _row, k in dd.tolist()]

    def release(self) -> None:
        """Every slot free again (the step that read them is done, or failed)."""
        self.n_pending = 0

    def _splits(self, ex: Any, context: int) -> int:
        """The decode kernel's split-KV factor for the block's rows: the executor's plan for
        that many rows when its workspace holds it, else 1 (no workspace)."""
        from cutlass_kernels.decode_plan import decode_workspace_bytes

        bb, mc = self.shapes.block, self.mc
        n = ex._num_splits(bb, context)
        if n > 1 and decode_workspace_bytes(bb, mc.num_attention_heads, mc.head_dim,
                                            n) > ex.buf.workspace.nbytes:
            return 1
        return max(1, n)


class CudaDFlashProposer:
    """``DFlashProposer`` on the cuda backend: ``(request, k) -> drafts`` through
    ``CudaDrafter.propose`` over the request's page-table row."""

    def __init__(self, executor: Any, block_manager: Any, max_model_len: int,
                 device: bool = True) -> None:
        self.executor, self.drafter = executor, executor.dflash
        self.bm, self.max_model_len = block_manager, max_model_len
        self.device = device  # drafts left on the device (DeviceDrafts) while slots last
        self.counts = {"device": 0, "host": 0}  # proposals of each kind

    def __call__(self, req: Any, k: int) -> list[int] | DeviceDrafts:
        n, bb = req.num_computed_tokens, self.drafter.shapes.block
        if n + bb > self.max_model_len or k < 1 or n < 1:
            return []
        pending = req.token_slice(n, 1)[0]
        pages = np.frombuffer(self.bm.page_table_view(req.request_id), np.int32)
        ex, d = self.executor, self.drafter
        if self.device:
            slot = d.propose_device(ex, n, pending, pages)
            if slot is not None:
                self.counts["device"] += 1
                return DeviceDrafts(min(k, bb - 1), slot, lambda: d.read_slot(ex, slot))
        self.counts["host"] += 1
        return d.propose(ex, n, pending, pages)[:k].tolist()
