"""The CUDA executor: CuTe DSL kernels over a device arena, driven through cuda-python.

Per step: upload the plan's arrays into static device buffers, run the forward (kernel by kernel,
eagerly; decode steps can replay a captured CUDA graph instead, see ``graphs/``), compute logits
for the sampled (and prompt-logprob) rows, sample on the GPU, download token ids.

Start-up: the kernels load from the disk cache, and those missing from it compile in worker
processes, in a background thread (``Kernels.start``) while the context comes up, the memory plan
is made and the weights upload; the thread is joined before the first launch (graph capture).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from engine import envs
from engine.config import EngineConfig, ModelConfig
from engine.cuda.driver import (
    Arena,
    Context,
    Event,
    PinnedBuffer,
    Stream,
    check,
    register_host,
    unregister_host,
)
from engine.executor.base import Executor, ExecutorError
from engine.executor.cuda_model import (
    BF16,
    DeviceWeights,
    Kernels,
    Sizes,
    StepBuffers,
    kv_bytes_per_page,
    mixed_buckets,
    plan_num_pages,
)
from engine.executor.cuda_shapes import check_supported
from engine.executor.staged_inputs import StagedInputs
from engine.model.loader import Checkpoint
from engine.step import Logprobs, ProcessorRows, StepBatch, StepOutput
from graphs.buckets import bucket_for, bucket_sizes
from graphs.runner import DecodePlan, GraphRunner

if TYPE_CHECKING:
    from engine.executor.cuda_dflash import CudaDrafter

log = logging.getLogger(__name__)

# A mixed step replays its row graph (``mixed_rows``) only while its prompt rows read at most
# this many KV tokens in all, or no more than its decode rows do: each prompt row reads its
# whole context, where the prefill kernel reads a chunk's context once per query tile.
MIXED_KV_TOKENS = 16384


class _Done:
    """A launched step that ran at once (``CudaExecutor.launch``)."""

    __slots__ = ("out",)

    def __init__(self, out: StepOutput) -> None:
        self.out = out


class _InFlight:
    """A launched graph step: its samples land in ``tokens`` (pinned) once ``event`` fires."""

    __slots__ = ("tokens", "event")

    def __init__(self, tokens: np.ndarray, event: Event) -> None:
        self.tokens, self.event = tokens, event


class _Heads:
    """A deferred step whose heads graph runs (``queued``: will run, right after the tail of
    the deferred step before it); its tail waits for ``launch_procs``."""

    __slots__ = ("batch", "bucket", "src_rows", "queued", "tokens_up")

    def __init__(self, batch: StepBatch, bucket: int, src_rows: np.ndarray | None = None,
                 queued: bool = False) -> None:
        self.batch, self.bucket, self.src_rows, self.queued = batch, bucket, src_rows, queued
        self.tokens_up = False  # (queued) its token rows went up before the tail ahead of it


class CudaExecutor(Executor):
    # a DFlash drafter (engine/executor/cuda_dflash.py), with speculative_config "dflash"
    dflash: CudaDrafter | None = None
    # enforce_eager: the buckets whose rows a mixed step runs eagerly, as the graphs would
    # (``mixed_rows``; set in ``_allocate``)
    mixed_eager: tuple[int, ...] = ()

    def __init__(self, ckpt: Checkpoint, config: EngineConfig, verbose: bool = True) -> None:
        check_supported(ckpt.config, config.block_size)  # before any GPU work; widths are padded
        t0 = time.perf_counter()
        # kernels in a background thread (see above); the memory plan needs no compiled kernel,
        # only decode_attention's split and workspace functions (its import waits for the DSL's)
        pending = Kernels.start(ckpt.config, show=verbose)
        try:
            self._allocate(ckpt, config, verbose)
            t1 = time.perf_counter()
            self.kernels = pending.result()
            self.weights.fold_norms(self.kernels.fold, self.stream)
            if self.dflash is not None:
                self.dflash.compile()
        except BaseException:
            pending.cancel()
            raise
        done = time.perf_counter()
        self.compile_s = (pending.ready_at or done) - t0  # start to the last kernel ready
        self.kernel_wait_s = done - t1  # of it, after the weights and buffers were in place
        if verbose:
            log.info("cuda: %s, kernels compiled in %.1fs (waited %.1fs for them after the "
                     "upload), arena %.2f GiB, KV %d pages (%.2f GiB)", self.ctx.name,
                     self.compile_s, self.kernel_wait_s, self.arena.capacity / 2**30,
                     self.num_pages, self.kv_bytes / 2**30)
        self.graphs: GraphRunner | None = None  # decode steps replay per-bucket graphs
        # per bucket, the forward and the LM head alone: a step with grammar-constrained rows
        # replays it, computes the grammar masks on the host meanwhile, then replays the
        # bucket's sampling tail (decode_tail: processors, sampler, counts), one launch instead
        # of three eager kernel calls (~0.2 ms of host time at 0.6b, docs/perf.md v20)
        self.heads: GraphRunner | None = None
        self.tails: GraphRunner | None = None
        self._gate_base = 0  # the grammar worker's shared memory, registered (launch_gated)
        self._gate_flag = 0  # its gate flag's device address
        self._gate_old: list[int] = []  # earlier workers' memory, registered till shutdown
        # per bucket of sequences that speculate (speculative_config): a verify step of
        # bucket x (k + 1) rows (verify_body)
        self.verify: GraphRunner | None = None
        # mixed steps of up to 128 tokens (decode rows beside prompt chunks): a graph of one
        # decode row per token (``mixed_rows``), per bucket of rows (cuda_model.MIXED_BUCKETS)
        self.mixed: GraphRunner | None = None
        # DFlash: each verify graph drafts its bucket's blocks first (``verify_runner``)
        self.fused_spec = (self.dflash is not None and envs.draft_graph()
                           and envs.device_drafts() and envs.fused_spec())
        self._inflight: _Done | _InFlight | None = None  # the last launched step (launch)
        self._mixed_memo: tuple[StepBatch, StepBatch | None] | None = None  # (_mixed_async)
        # deferred steps (launch_deferred): the last one whose processors have not come yet,
        # and a step queued behind it (its heads replay right after that one's tail)
        self._awaiting: Any = None
        self._queued: _Heads | None = None
        self.queued_heads = 0  # forwards launched right behind the tail before them
        self._pinned: list[PinnedBuffer] | None = None  # its samples, double-buffered
        self._events: list[Event] = []
        self._flip = 0
        self.graph_stats: dict[str, float] = {}
        if not config.enforce_eager:
            self.graphs = self.graph_runner()
            self.heads = self.graph_runner(body=self.decode_head)
            self.tails = self.graph_runner(body=lambda bucket, _splits: self.decode_tail(bucket))
            self.verify = self.verify_runner()
            self.mixed = self.mixed_runner()
            if not self.graphs.lazy:
                self.graph_stats = self.graphs.capture_all(show=verbose)
                heads = self.heads.capture_all(show=False)
                tails = self.tails.capture_all(show=False)
                self.graph_stats["head_capture_s"] = heads["capture_s"] + tails["capture_s"]
                if self.verify is not None:
                    ver = self.verify.capture_all(show=False)
                    self.graph_stats["verify_capture_s"] = ver["capture_s"]
                if self.mixed is not None:
                    mix = self.mixed.capture_all(show=False)
                    self.graph_stats["mixed_capture_s"] = mix["capture_s"]
            if self.dflash is not None and envs.draft_graph():  # draft blocks alone: a graph
                self.graph_stats["draft_capture_s"] = self.dflash.capture_graphs(self)  # a bucket

    # -- set-up ----------------------------------------------------------------------------------
    def _allocate(self, ckpt: Checkpoint, config: EngineConfig, verbose: bool) -> None:
        """Context, memory plan, arena, weights, static buffers and KV pages: all that needs no
        compiled kernel."""
        t0 = time.perf_counter()
        self.ctx = Context.get()
        self.stream = Stream()
        t1 = time.perf_counter()
        mc = self.mc = ckpt.config
        self.config = config
        self.page_size = config.block_size
        self.sizes = s = Sizes.of(mc, config)
        if config.enforce_eager:
            self.mixed_eager = tuple(mixed_buckets(config, s))
        self.scale = mc.head_dim ** -0.5
        free, total = self.ctx.mem_info()
        ws = self._workspace_bytes()
        # a DFlash drafter (speculative_config method "dflash"): its weights, buffers and
        # K/V pages share the arena (engine/executor/cuda_dflash.py)
        draft_ckpt, extra, extra_layers = self._drafter_plan(mc, config)
        self.num_pages, arena_bytes = plan_num_pages(mc, config, free, total, ws, extra,
                                                     extra_layers)
        self.arena = Arena(arena_bytes)
        t2 = time.perf_counter()
        self.weights = DeviceWeights(ckpt, self.arena, self.stream, show=verbose)
        t3 = time.perf_counter()
        # start-up phases in seconds (tools/profile_startup.py prints them)
        self.startup_phases = {"context_s": t1 - t0, "plan_arena_s": t2 - t1,
                               "weights_s": t3 - t2}
        self.buf = StepBuffers(mc, s, self.arena, ws, self.stream)
        self.staged: StagedInputs | None = None  # a step's inputs through one pinned mirror
        try:
            self.staged = StagedInputs(self.buf)
        except ValueError as e:  # another layout: one pageable copy per array, as before
            log.warning("cuda: per-step inputs not staged (%s)", e)
        kv_shape = (self.num_pages, mc.num_key_value_heads, self.page_size, mc.head_dim)
        self.k_cache = [self.arena.alloc(kv_shape, BF16, f"k{i}")
                        for i in range(mc.num_hidden_layers)]
        self.v_cache = [self.arena.alloc(kv_shape, BF16, f"v{i}")
                        for i in range(mc.num_hidden_layers)]
        self.kv_bytes = self.num_pages * kv_bytes_per_page(mc, self.page_size)
        if draft_ckpt is not None:
            from engine.executor.cuda_dflash import CudaDrafter

            self.dflash = CudaDrafter(draft_ckpt, mc, self.page_size, s.t_max, s.pages_per_seq,
                                      self.num_pages, self.arena, self.stream,
                                      self._draft_blocks(), self._buckets())

    def _drafter_plan(self, mc: ModelConfig, config: EngineConfig
                      ) -> tuple[Any, int, int]:
        """(drafter checkpoint, fixed bytes, KV layers) of a DFlash drafter, (None, 0, 0)
        without one."""
        spec = config.speculative_config
        if spec is None or spec.method != "dflash":
            return None, 0, 0
        from engine.executor.cuda_dflash import (
            DrafterShapes,
            drafter_fixed_bytes,
        )
        from engine.model.dflash import load_drafter

        ckpt = load_drafter(spec.model, mc)
        ckpt.config.check_cuda(mc, f"speculative_config.model {spec.model!r}")
        shapes = DrafterShapes.of(mc, ckpt.config, self.page_size)
        s = self.sizes
        return ckpt, drafter_fixed_bytes(shapes, s.t_max, s.pages_per_seq,
                                         self._draft_blocks()), shapes.n_layers

    def _draft_blocks(self) -> int:
        """Draft blocks one launch holds: the largest bucket of speculating sequences (those
        below ``disable_by_batch_size``), so a verify graph drafts its whole bucket, at most
        ``MAX_DRAFT_BLOCKS``."""
        from engine.executor.cuda_dflash import MAX_DRAFT_BLOCKS

        most, top = self._spec_most()
        if most <= 1:
            return 1
        return max(1, min(top or most, MAX_DRAFT_BLOCKS))

    def _spec_most(self) -> tuple[int, int | None]:
        """The most sequences that may speculate together (fewer than
        ``disable_by_batch_size``, at most ``max_num_seqs``; < 1: none) and their bucket."""
        most = min(self._spec_below() - 1, self.config.max_num_seqs)
        return most, bucket_for(most, self._buckets()) if most >= 1 else None

    def dflash_proposer(self, block_manager: Any, max_model_len: int) -> Any:
        """The proposer seam's DFlash drafter (engine/speculative.py)."""
        from engine.executor.cuda_dflash import CudaDFlashProposer

        if self.dflash is None:
            raise ExecutorError("this executor was built without a DFlash drafter "
                                "(speculative_config method 'dflash')")
        return CudaDFlashProposer(self, block_manager, max_model_len,
                                  device=envs.device_drafts())

    def _num_splits(self, batch: int, max_context: int) -> int:
        from cutlass_kernels.decode_plan import choose_num_splits

        return choose_num_splits(batch, self.mc.num_key_value_heads, max_context,
                                 self.ctx.num_sms, self.page_size, mma=self._attention_mma)

    @functools.cached_property
    def _rope_in_attention(self) -> bool:
        """Whether plain decode steps run ``decode_rope`` (read once, like ``_attention_mma``:
        cuda_model compiled it for these options)."""
        from engine.executor.cuda_model import rope_attention_options

        return rope_attention_options(self.mc) is not None

    @functools.cached_property
    def _attention_mma(self) -> bool:
        """Whether decode attention runs its tensor-core loop (read once: every step's split
        plan and the memory plan must agree with the kernel cuda_model compiled)."""
        return bool(envs.decode_attention_options().get("mma", False))

    def _workspace_bytes(self) -> int:
        """The split-KV workspace of the largest decode launch: B rows at B's splits, or the
        verify rows of B speculating sequences at B's splits (``verify_body``)."""
        from cutlass_kernels.decode_plan import decode_workspace_bytes

        mc, s = self.mc, self.sizes

        def need(rows: int, splits_of: int) -> int:
            return decode_workspace_bytes(rows, mc.num_attention_heads, mc.head_dim,
                                          self._num_splits(splits_of, s.max_pos))

        plain = max(need(b, b) for b in range(1, self.config.max_num_seqs + 1))
        spec, bks = self._spec_rows(), self._buckets()
        # a verify graph runs its bucket's rows (padding included) at its bucket's splits; an
        # eager verify step its own rows at its bucket's splits
        verify = max((need(min(s.b_max, b * spec), bucket_for(b, bks) or b)
                      for b in range(1, min(self._spec_below(), s.b_max + 1))), default=0)
        graphs = max((need(bk * spec, bk) for bk in self._verify_buckets()), default=0)
        # a mixed-step graph: its rows at their own split (``decode_splits``)
        mixed = max((need(r, bucket_for(r, bks) or r)
                     for r in mixed_buckets(self.config, s)), default=0)
        return max(plain, verify, graphs, mixed)

    def _verify_buckets(self) -> list[int]:
        """The buckets of speculating sequences that get a verify graph: those up to the bucket
        of the most that may speculate together (``_spec_most``) whose ``bucket x (k + 1)`` rows
        fit the buffers."""
        rows, (_most, top) = self._spec_rows(), self._spec_most()
        if rows == 1 or top is None:
            return []
        return [b for b in self._buckets() if b <= top and b * rows <= self.sizes.b_max]

    def _spec_rows(self) -> int:
        """Rows per speculating sequence (1 + k), 1 without speculation."""
        spec = self.config.speculative_config
        return 1 + spec.num_speculative_tokens if spec is not None else 1

    def _spec_below(self) -> int:
        """Sequences speculate while fewer than this run (0: never)."""
        spec = self.config.speculative_config
        return spec.disable_by_batch_size if spec is not None else 0

    # -- per step --------------------------------------------------------------------------------
    def _check(self, b: StepBatch) -> None:
        s = self.sizes
        t, n = b.num_tokens, b.num_seqs
        if t > s.t_max or n > s.b_max:
            raise ExecutorError(f"step of {t} tokens / {n} sequences exceeds the buffers "
                                f"({s.t_max} tokens / {s.b_max} sequences)")
        width = -(-b.context_lens // self.page_size)
        over = np.nonzero(width > s.pages_per_seq)[0]
        if over.size:
            e = ExecutorError(f"context of {int(b.context_lens[over[0]])} tokens needs "
                              f"{int(width[over[0]])} pages; the page-index buffer holds "
                              f"{s.pages_per_seq} per sequence (max_model_len)")
            e.rows = set(over.tolist())
            raise e
        if b.num_tokens and (b.slot_mapping.max() >= self.num_pages * self.page_size
                             or b.page_indices.max() >= self.num_pages):
            raise ExecutorError("slot_mapping / page_indices outside the KV cache")

    def upload(self, b: StepBatch, pad_to: int | None = None,
               src_rows: np.ndarray | None = None) -> None:
        """Copy the step's arrays into the static buffers. ``pad_to`` (decode graphs): rows
        B..pad_to-1 become padding rows (token 0, position 0, no KV write, context 1, page 0).
        ``src_rows`` (decode rows): row i's input token is the previous step's sample
        ``src_rows[i]``, which the forward's embedding gathers on the device (-1: as given)."""
        buf, st = self.buf, self.stream
        n = b.num_seqs
        pad = 0 if pad_to is None else pad_to - n
        if self.staged is not None:
            self.staged.put_tokens(b, pad, st, src_rows)
            return
        ids, pos, slots, cu, ctx = (b.input_ids, b.positions, b.slot_mapping, b.cu_seqlens_q,
                                    b.context_lens)
        src = (np.full(b.num_tokens, -1, np.int32) if src_rows is None
               else src_rows.astype(np.int32))
        table = b.page_indices.astype(np.int32, copy=False)
        if pad > 0:
            src = np.concatenate([src, np.full(pad, -1, np.int32)])
            ids = np.concatenate([ids, np.zeros(pad, np.int32)])
            pos = np.concatenate([pos, np.zeros(pad, np.int32)])
            slots = np.concatenate([slots, np.full(pad, -1, np.int64)])
            cu = np.arange(n + pad + 1, dtype=np.int32)
            ctx = np.concatenate([ctx, np.ones(pad, np.int32)])
            table = np.concatenate([table, np.zeros((pad, table.shape[1]), np.int32)])
        buf.input_src.upload(src, st)
        buf.input_ids.upload(ids, st)
        buf.positions.upload(pos, st)
        buf.slot_mapping.upload(slots, st)
        buf.cu_seqlens.upload(cu, st)
        buf.context_lens.upload(ctx, st)
        buf.page_indices.upload_rows(table, self.sizes.pages_per_seq * 4, st)

    def upload_step(self, b: StepBatch, pad_to: int | None = None,
                    src_rows: np.ndarray | None = None, procs: bool = True) -> None:
        """``upload`` and ``upload_sampling`` of ``b``: one copy when the inputs are staged."""
        if self.staged is None:
            self.upload(b, pad_to, src_rows)
            self.upload_sampling(b, pad_to, procs)
            return
        n, s = b.num_seqs, b.sample_token_idx.shape[0]
        if procs:
            self.buf.procs.stage(b.procs, s if pad_to is None else max(pad_to, s), self.stream)
        self.staged.put_step(b, 0 if pad_to is None else pad_to - n, self.stream, src_rows,
                             pad_sampling=0 if pad_to is None else pad_to - s)

    def upload_sampling(self, b: StepBatch, pad_to: int | None = None,
                        procs: bool = True) -> None:
        """Per-row sampling parameters as device data (padding rows: greedy); ``procs``: the
        logits processors' rows too (else ``buf.procs.stage`` later, before the tail)."""
        buf, st = self.buf, self.stream
        n = b.sample_token_idx.shape[0]
        pad = 0 if pad_to is None else pad_to - n

        if procs:
            buf.procs.stage(b.procs, n + max(pad, 0), st)  # logits processors (cuda_logits.py)
        if self.staged is not None:
            self.staged.put_sampling(b, pad, st)
            return

        def p(a: np.ndarray, v: float | int) -> np.ndarray:
            return a if pad <= 0 else np.concatenate([a, np.full(pad, v, a.dtype)])

        # padding rows gather token rows n.. (a graph's rows; decode: row i samples token i)
        buf.logit_idx.upload(b.sample_token_idx if pad <= 0 else np.concatenate(
            [b.sample_token_idx, np.arange(n, n + pad, dtype=np.int32)]), st)
        buf.temperature.upload(p(b.temperature, 0.0), st)
        buf.top_k.upload(p(b.top_k, 0), st)
        buf.top_p.upload(p(b.top_p, 1.0), st)
        buf.min_p.upload(p(b.min_p, 0.0), st)
        buf.seeds.upload(p(b.seeds, 0), st)
        buf.steps.upload(p(b.sample_steps, 0), st)

    def forward(self, num_tokens: int, num_seqs: int, decode: bool, max_q_len: int,
                num_splits: int, tile_as: int | None = None, decode_rows: int = 0) -> None:
        """All layers and the final norm over the static buffers (eager, or under capture).
        A step whose GEMMs all run their skinny kernels (M <= 128: decode buckets, verify
        rows, small prefills and mixed steps) runs the fused layer, six kernels (qkv with the
        input norm, rope, attention, o adding into the residual, gate_up with the post norm and
        SiLU, down adding into the residual); a bigger one the unfused layer of nine.
        ``tile_as``: the GEMMs run the kernels of a ``tile_as``-row call (verify rows,
        ``verify_body``). ``decode_rows`` (a mixed step, not ``decode``; ``stage_mixed`` first):
        its first sequences are that many one-token rows, whose attention runs in the decode
        kernel (at the split-KV factor of a decode step of that many rows); the prefill kernel
        takes the other sequences (token rows stay absolute)."""
        k, buf, w, st, mc = self.kernels, self.buf, self.weights, self.stream, self.mc
        t, eps = num_tokens, mc.rms_norm_eps
        pps = self.sizes.pages_per_seq
        d = decode_rows if not decode and 0 < decode_rows < num_seqs else 0
        d_splits = self.decode_splits(d) if d else 1
        cu, ctx, table = ((buf.pre_cu_seqlens, buf.pre_context_lens, buf.pre_page_indices) if d
                          else (buf.cu_seqlens, buf.context_lens, buf.page_indices))
        # Fused (every decoder GEMM runs its fused skinny kernel for this M): qkv and gate_up
        # normalize their input rows of resid themselves (the norm weights are folded into
        # theirs), gate_up writes silu(gate) * up, o and down add into resid: six nodes a layer.
        # Unfused (prefill and big mixed steps): the separate kernels, norms with a unit weight.
        m = t if tile_as is None else tile_as
        flags = [g.fuses(m) for g in (k.qkv, k.o, k.gate_up, k.down)]
        fused = all(flags)
        if any(flags) and not fused:  # the four share their path options: never expected
            raise ExecutorError(f"M={m}: the decoder GEMMs disagree on fusing (qkv, o, "
                                f"gate_up, down: {flags}); compile them with the same paths")
        # plain decode (one token per sequence, its slot at position ctx - 1): rope's work in
        # the attention's prologue, five nodes a layer; verify rows read each other's new K / V
        rope_in_attention = decode and tile_as is None and self._rope_in_attention
        # a DFlash drafter: the residual rows leaving its target layers (complete after the
        # layer's down adds into resid, or, unfused, after the next add_norm), and at the end
        # the context K/V of the step's tokens in its own pages
        draft = self.dflash
        # (a row of input_src >= 0 takes its token from the previous step's samples)
        k.embed_src(buf.input_ids, buf.input_src, buf.sampled, w.embed, buf.resid,
                    mc.vocab_size, self.sizes.logit_rows, t, st)
        for li, lw in enumerate(w.layers):
            if fused:
                k.qkv(buf.resid, lw["qkv"], buf.qkv, t, st, tile_as)
            else:
                if li == 0:
                    k.norm(buf.resid, None, buf.ones, buf.h, t, eps, st)
                else:
                    k.add_norm(buf.delta, buf.resid, buf.ones, buf.h, t, eps, st)
                    if draft is not None:
                        draft.capture(li - 1, buf.resid, t, st)
                k.qkv.unfused(buf.h, lw["qkv"], buf.qkv, t, st, tile_as)
            if rope_in_attention:
                k.decode_rope(buf.qkv, buf.positions, buf.slot_mapping, lw.get("q_norm"),
                              lw.get("k_norm"), buf.cos_sin, self.k_cache[li], self.v_cache[li],
                              buf.page_indices, buf.context_lens, buf.attn, buf.workspace,
                              num_seqs, pps, num_splits, self.scale, self.sizes.max_pos, eps, st)
            else:
                k.rope(buf.qkv, buf.positions, buf.slot_mapping, lw.get("q_norm"),
                       lw.get("k_norm"), buf.cos_sin, buf.q, self.k_cache[li], self.v_cache[li],
                       t, self.sizes.max_pos, eps, st)
            if rope_in_attention:
                pass
            elif decode:
                k.decode(buf.q, self.k_cache[li], self.v_cache[li], buf.page_indices,
                         buf.context_lens, buf.attn, buf.workspace, num_seqs, pps, num_splits,
                         self.scale, st)
            else:
                if d:
                    k.decode(buf.q, self.k_cache[li], self.v_cache[li], buf.page_indices,
                             buf.context_lens, buf.attn, buf.workspace, d, pps, d_splits,
                             self.scale, st)
                k.prefill(buf.q, self.k_cache[li], self.v_cache[li], cu, ctx, table, buf.attn,
                          t, num_seqs - d, pps, max_q_len, self.scale, st)
            if fused:
                k.o(buf.attn, lw["o"], buf.resid, t, st, tile_as)
                k.gate_up(buf.resid, lw["gate_up"], buf.act, t, st, tile_as)
                k.down(buf.act, lw["down"], buf.resid, t, st, tile_as)
                if draft is not None:
                    draft.capture(li, buf.resid, t, st)
            else:
                k.o.unfused(buf.attn, lw["o"], buf.delta, t, st, tile_as)
                k.add_norm(buf.delta, buf.resid, buf.ones, buf.h, t, eps, st)
                k.gate_up.unfused(buf.h, lw["gate_up"], buf.gate_up, t, st, tile_as)
                k.silu(buf.gate_up, buf.act, t, st)
                k.down.unfused(buf.act, lw["down"], buf.delta, t, st, tile_as)
        if fused:
            k.norm(buf.resid, None, w.norm, buf.h, t, eps, st)
        else:
            k.add_norm(buf.delta, buf.resid, w.norm, buf.h, t, eps, st)
            if draft is not None:
                draft.capture(mc.num_hidden_layers - 1, buf.resid, t, st)
        if draft is not None:
            draft.materialize(self, t)

    def logits(self, num_tokens: int, row_offset: int, n: int, tile_as: int | None = None
               ) -> None:
        """Logits of rows ``logit_idx[row_offset:row_offset+n]`` into ``logits[:n]``."""
        k, buf, st = self.kernels, self.buf, self.stream
        idx = buf.logit_idx.ptr + 4 * row_offset
        k.gather_rows(idx, buf.h, buf.rows, num_tokens, n, st)
        k.lm_head(buf.rows, self.weights.lm_head, buf.logits, n, st, tile_as)

    def decode_body(self, batch: int, num_splits: int) -> None:
        """A decode step of ``batch`` rows over the static buffers: forward, logits of every
        row, sampling. This is what a graph captures (per bucket); eager decode runs it too."""
        self.decode_head(batch, num_splits)
        self.decode_tail(batch)

    def decode_head(self, batch: int, num_splits: int) -> None:
        """The forward and the logits of every row (the ``heads`` graphs)."""
        self.forward(batch, batch, True, 1, num_splits)
        self.logits(batch, 0, batch)

    def verify_body(self, rows: int, num_seqs: int) -> None:
        """A step whose every token is sampled (speculative spans ``[pending, *drafts]`` beside
        plain decode rows), as ``rows`` decode rows, one per token (``verify_rows``): each row
        attends over its own context in its sequence's pages, the GEMMs run the kernels and
        the attention the split-KV factor of plain decoding of the step's ``num_seqs``
        sequences, so every row's logits are the bits plain decoding computes at that position
        (same prefix): speculative output equals plain output token for token."""
        tile = num_seqs
        self.forward(rows, rows, True, 1, self.decode_splits(num_seqs), tile)
        self.logits(rows, 0, rows, tile)
        self.decode_tail(rows)

    def decode_tail(self, batch: int) -> None:
        """Logits processors, sampling, token counts over ``logits[:batch]``."""
        b = self.buf
        b.procs.apply(self.kernels, b.logits, b.steps, batch, self.stream)
        self.kernels.sample(b.logits, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds,
                            b.steps, b.sampled, batch, self.stream)
        b.procs.count(self.kernels, b.steps, b.sampled, batch, self.stream)

    def decode_splits(self, batch: int) -> int:
        """Split-KV factor of a decode step: fixed per bucket (from max_model_len), so an eager
        step and its bucket's graph run the same kernels with the same launch parameters."""
        bk = bucket_for(batch, self._buckets())
        return self._num_splits(bk or batch, self.sizes.max_pos)

    def _buckets(self) -> list[int]:
        return bucket_sizes(self.config.max_num_seqs, self.config.cuda_graph_max_bs)

    # -- decode graphs ---------------------------------------------------------------------------
    def graph_runner(self, buckets: Sequence[int] | None = None,
                     body: Callable[[int, int], None] | None = None,
                     splits: int | None = None) -> GraphRunner:
        """A runner of decode graphs over this executor's static buffers: the engine's buckets,
        or the given ones (tools, the mixed-step rows), each captured with the split-KV factor
        ``decode_splits`` gives it (tools: ``splits`` for all); ``body``: what each graph runs
        (default ``decode_body``, a whole step)."""
        bks = tuple(sorted(set(buckets))) if buckets else tuple(self._buckets())
        plan = DecodePlan(bks, {b: splits or self.decode_splits(b) for b in bks},
                          lazy=bool(self.config.lazy_graph_capture))
        return GraphRunner(plan, self.stage_padding, body or self.decode_body, self.stream)

    def verify_runner(self) -> GraphRunner | None:
        """Verify graphs (``verify_body``), one per bucket of speculating sequences (those below
        ``disable_by_batch_size``) whose ``bucket x (k + 1)`` rows fit the step buffers; None
        without speculation. With the cuda DFlash drafter's device drafts (``fused_spec``) a
        bucket's graph is the whole speculative step: the bucket's draft blocks, their drafts
        placed over the spans' placeholder ids (``CudaDrafter.place``), then the verify."""
        rows = self._spec_rows()
        bks = self._verify_buckets()
        if not bks:
            return None
        plan = DecodePlan(tuple(bks), {b: self.decode_splits(b) for b in bks},
                          lazy=bool(self.config.lazy_graph_capture))

        def stage(b: int) -> None:
            self.stage_padding(b * rows)
            if self._fused(b):
                d = self._drafter()
                d.stage(self, [], b)
                d.buf.src.upload(np.full(b * rows, -1, np.int32), self.stream)

        def body(b: int, _splits: int) -> None:
            if self._fused(b):
                d = self._drafter()
                d.body(self, b)
                d.place(self, b * rows)
            self.verify_body(b * rows, b)

        return GraphRunner(plan, stage, body, self.stream)

    def mixed_runner(self) -> GraphRunner | None:
        """Mixed-step graphs, one per bucket of rows (``mixed_buckets``): ``verify_body`` over
        that many decode rows, each GEMM running its own M's kernels; None when off."""
        bks = mixed_buckets(self.config, self.sizes)
        return self.graph_runner(bks, body=lambda r, _splits: self.verify_body(r, r)) \
            if bks else None

    def mixed_rows(self, b: StepBatch) -> StepBatch | None:
        """A multi-token step (prompt chunks, with or without decode rows) that replays a
        mixed-step graph, as ``token_rows``: at most the largest bucket's tokens, no prompt
        logprobs or device drafts, and prompt rows whose contexts sum to at most
        ``MIXED_KV_TOKENS`` or to the decode rows' (the decode kernel reads each row's whole
        context). None: the step runs eagerly (prefill kernel for its chunks). Under
        ``enforce_eager`` the same steps run the same rows eagerly (``mixed_eager``)."""
        m = self.mixed
        bks = m.buckets if m is not None else self.mixed_eager
        t = b.num_tokens
        if (not bks or b.is_decode or t == 0 or t > bks[-1]
                or b.prompt_logprob_idx.shape[0] or b.device_drafts.shape[0]
                or (m is not None and not m.can_replay(t))):
            return None
        rows = self.token_rows(b)
        q = b.query_lens
        prompt = int(rows.context_lens[np.repeat(q > 1, q)].sum())
        if prompt > max(MIXED_KV_TOKENS, int(b.context_lens[q == 1].sum())):
            return None
        return rows

    def _fused(self, bucket: int) -> bool:
        """Whether the verify graph of ``bucket`` drafts too (``verify_runner``)."""
        return self.fused_spec and self.dflash is not None and bucket <= self.dflash.max_blocks

    @staticmethod
    def verify_rows(b: StepBatch) -> StepBatch | None:
        """A step whose every token is sampled, in token order (speculative spans beside plain
        decode rows), as a decode step of one row per token: the row of token j of a sequence
        whose span starts at position p attends over p + j + 1 tokens of that sequence's pages
        (the span's KV is written before attention, layer by layer). None for any other step."""
        t = b.num_tokens
        if (b.is_decode or t == 0 or b.sample_token_idx.shape[0] != t
                or b.prompt_logprob_idx.shape[0]
                or not np.array_equal(b.sample_token_idx, np.arange(t))):
            return None
        return CudaExecutor.token_rows(b)

    @staticmethod
    def token_rows(b: StepBatch) -> StepBatch:
        """``b`` as a decode step of one row per token, in token order: the row of token j of
        a sequence whose new tokens start at position p attends over p + j + 1 tokens of that
        sequence's pages (causal; the step's KV is written before attention, layer by layer).
        Sample rows, slots and positions stay the token rows they were."""
        t, n = b.num_tokens, b.num_seqs
        q = b.query_lens
        seq = np.repeat(np.arange(n), q)
        # context of row j of sequence i: context_lens[i] - q[i] + 1 + j
        ctx = (b.context_lens[seq] - q[seq] + 1
               + np.arange(t, dtype=np.int32) - b.cu_seqlens_q[:-1][seq]).astype(np.int32)
        return dataclasses.replace(b, cu_seqlens_q=np.arange(t + 1, dtype=np.int32),
                                   context_lens=ctx, page_indices=b.page_indices[seq])

    def stage_padding(self, bucket: int) -> None:
        """Valid padding inputs in every row of ``bucket`` (graphs are captured over real
        buffers): an empty step padded to the bucket."""
        z = np.zeros(0, np.int32)
        b = StepBatch(input_ids=z, positions=z, slot_mapping=np.zeros(0, np.int64),
                      cu_seqlens_q=np.zeros(1, np.int32), context_lens=z,
                      page_indices=np.zeros((0, 1), np.int32), sample_token_idx=z,
                      temperature=np.zeros(0, np.float32), top_k=z,
                      top_p=np.zeros(0, np.float32), min_p=np.zeros(0, np.float32),
                      seeds=np.zeros(0, np.uint64), sample_steps=np.zeros(0, np.uint32),
                      num_logprobs=z)
        self.upload_step(b, pad_to=bucket)

    def execute(self, b: StepBatch) -> StepOutput:
        try:
            out = self._execute(b)
            if b.device_drafts.shape[0]:
                out.drafts = self._drafter().drafts_of(b.device_drafts, self.stream)
            return out
        finally:
            if self.dflash is not None:
                self.dflash.release()  # a step consumes (or drops) every draft left before it

    def _drafter(self) -> CudaDrafter:
        if self.dflash is None:
            raise ExecutorError("a step with device drafts on an executor without a drafter")
        return self.dflash

    def _place_drafts(self, b: StepBatch, rows: int, num_seqs: int) -> None:
        """After ``upload(b)`` of ``rows`` input rows: the device drafts of ``b``'s spans,
        drafted now (unless they are) in a launch of ``num_seqs``' block bucket, copied over
        their placeholder ids."""
        dd = b.device_drafts
        if dd.shape[0]:
            d = self._drafter()
            d.flush(self, d.blocks_for(num_seqs))
            d.stage_src(self, dd, rows)
            d.place(self, rows)

    def _execute(self, b: StepBatch) -> StepOutput:
        self._check(b)
        st, buf = self.stream, self.buf
        s_rows = b.sample_token_idx.shape[0]
        p_rows = b.prompt_logprob_idx.shape[0]
        graph = False
        tokens = np.zeros(0, np.int32)
        if b.is_decode and s_rows == b.num_seqs:
            bucket = None
            if self.graphs is not None and self.graphs.can_replay(b.num_seqs):
                bucket = self.graphs.pad(b.num_seqs)  # a lazy capture runs here, before upload
            # grammar rows whose masks are still to compute: replay the head graph alone
            split = (bucket is not None and b.procs is not None and b.procs.fill is not None
                     and self.heads is not None and self.heads.can_replay(b.num_seqs))
            if split:
                self.heads.pad(b.num_seqs)  # (lazy captures, before the upload)
                self.tails.pad(b.num_seqs)
            if split:
                self.upload_step(b, pad_to=bucket, procs=False)
                self.heads.replay(bucket)  # the GPU runs the forward ...
                b.procs.fill_masks()  # ... while the host computes the grammar masks
                buf.procs.stage(b.procs, bucket, st)
                self._tail(bucket)
                graph = True
            elif self.graphs is not None and bucket is not None:
                self.upload_step(b, pad_to=bucket)
                self.graphs.replay(bucket)
                graph = True
            else:
                self.upload_step(b, pad_to=bucket)
                self.decode_body(b.num_seqs, self.decode_splits(b.num_seqs))
            tokens = self._sampled(b, s_rows)
        elif (rows := self.verify_rows(b)) is not None and rows.num_tokens <= self.sizes.b_max:
            tokens, graph = self._verify(rows, b.num_seqs)
        elif (rows := self.mixed_rows(b)) is not None:
            if self.mixed is not None:
                bucket = self.mixed.pad(rows.num_tokens)  # (a lazy capture, before the upload)
                self.upload_step(rows, pad_to=bucket)
                self.mixed.replay(bucket)
                graph = True
            else:  # enforce_eager: the graph's body, over the same padded rows
                bucket = bucket_for(rows.num_tokens, self.mixed_eager)
                self.upload_step(rows, pad_to=bucket)
                self.verify_body(bucket, bucket)
            if s_rows:
                tokens = self._sampled(b, s_rows)
        else:
            if b.num_tokens:
                self.upload(b)
                self._place_drafts(b, b.num_tokens, b.num_seqs)
                ones = self.stage_mixed(b)
                self.forward(b.num_tokens, b.num_seqs, False, int(b.query_lens.max()), 1,
                             decode_rows=ones)
            if s_rows:
                self.upload_sampling(b)
                self.logits(b.num_tokens, 0, s_rows)
                buf.procs.apply(self.kernels, buf.logits, buf.steps, s_rows, st)
                self.kernels.sample(buf.logits, buf.temperature, buf.top_k, buf.top_p,
                                    buf.min_p, buf.seeds, buf.steps, buf.sampled, s_rows, st)
                buf.procs.count(self.kernels, buf.steps, buf.sampled, s_rows, st)
                tokens = self._sampled(b, s_rows)
        lp = None
        if s_rows and (b.num_logprobs >= 0).any():
            # logprobs are of the logits before the processors (the grammar mask aside)
            buf.procs.raw_logits(self.kernels, buf.rows, self.weights.lm_head, buf.logits,
                                 buf.steps, s_rows, st)
            lp = self._logprobs(s_rows, tokens, int(b.num_logprobs.max()))
        plp = self._prompt_logprobs(b) if p_rows else None
        return StepOutput(sampled=tokens, logprobs=lp, prompt_logprobs=plp, graph=graph)

    def stage_mixed(self, b: StepBatch) -> int:
        """A multi-token step whose first sequences are one-token (decode) rows (the scheduler
        puts them first): upload the other sequences' cu_seqlens, context lengths and page rows
        to the prefill part's own buffers. Returns how many leading one-token rows the forward
        runs in the decode kernel (0: none, or every row, or no sequence after them)."""
        q = b.query_lens
        more = q != 1
        if not more.any():
            return 0
        d = int(np.argmax(more))
        if d == 0:
            return 0
        buf, st = self.buf, self.stream
        buf.pre_cu_seqlens.upload(np.ascontiguousarray(b.cu_seqlens_q[d:]), st)
        buf.pre_context_lens.upload(np.ascontiguousarray(b.context_lens[d:]), st)
        buf.pre_page_indices.upload_rows(b.page_indices[d:].astype(np.int32, copy=False),
                                         self.sizes.pages_per_seq * 4, st)
        return d

    def _verify(self, rows: StepBatch, num_seqs: int) -> tuple[np.ndarray, bool]:
        """Run ``verify_rows``' step: its bucket's verify graph when one holds its rows (with
        ``fused_spec``, the graph drafts the step's queued blocks first), else eagerly with the
        same kernels. (sampled ids, whether a graph ran)"""
        v, d = self.verify, self.dflash
        n = rows.num_seqs
        if v is not None and v.can_replay(num_seqs):
            bk = v.pad(num_seqs)
            r = bk * self._spec_rows()
            if n <= r:
                drafting = self._fused(bk)  # the graph drafts and places (verify_runner)
                # its blocks: the queued ones (some may be of requests that are not in this
                # step after all: more than the bucket's, then drafted first, below)
                fused = drafting and len(d.queue) <= bk
                if fused:
                    d.stage(self, d.queue, bk)
                self.upload(rows, pad_to=r)
                if drafting:
                    if not fused:  # the graph redrafts the first bk blocks as staged here
                        d.flush(self, d.blocks_for(num_seqs))
                    d.stage_src(self, rows.device_drafts, r)  # (every step: the graph places)
                else:
                    self._place_drafts(rows, r, num_seqs)
                self.upload_sampling(rows, pad_to=r)
                v.replay(bk)
                if fused:
                    d.drafted = True
                return self._sampled(rows, n), True
        self.upload(rows)
        self._place_drafts(rows, n, num_seqs)
        self.upload_sampling(rows)
        self.verify_body(n, num_seqs)
        return self._sampled(rows, n), False

    # -- async scheduling ------------------------------------------------------------------------
    def launch(self, b: StepBatch, src_rows: np.ndarray | None = None) -> Any:
        """A decode step that replays its bucket's graph, or a mixed step its rows' graph
        (``_mixed_async``), is enqueued and left running: its input tokens of ``src_rows``
        (per token) come from the previous step's samples on the device (the embedding
        gathers them, ``upload``), its samples go to a pinned buffer behind an event
        (``finish`` waits). Any other step runs now (``execute``; a continuation's tokens are
        then taken from the previous step's output on the host)."""
        n = b.num_seqs
        g = self.graphs
        if (rows := self._mixed_async(b)) is not None:  # a mixed step: its rows' graph
            m = self.mixed
            self._check(b)
            bucket = m.plan.bucket(rows.num_tokens)
            self.upload_step(rows, pad_to=bucket, src_rows=src_rows)
            m.replay(bucket)
            return self._download_async(b.sample_token_idx.shape[0])
        if not self._decode_async(b):
            if src_rows is not None:
                prev = self._last_tokens()
                take = src_rows >= 0
                b.input_ids[take] = prev[src_rows[take]]
            out = self.execute(b)
            self._inflight = _Done(out)
            return self._inflight
        self._replay_continuation(g, b, src_rows, procs=True)
        return self._download_async(n)

    def in_flight(self, handle: Any) -> bool:
        """Whether the launched step ``handle`` still runs (``launch`` ran it at once: no).
        The engine completes a step that ran at once (unless it is a decode step) rather than
        keep its outputs while it plans the next."""
        return not isinstance(handle, _Done)

    def launches_async(self, b: StepBatch) -> bool:
        """Whether ``launch`` leaves ``b`` running (else it runs it at once)."""
        return self._decode_async(b) or self._mixed_async(b) is not None

    def _decode_async(self, b: StepBatch) -> bool:
        """A decode step ``launch`` leaves running in its bucket's captured graph (a bucket
        still to capture lazily runs synchronously: its warm-up step would overwrite the
        previous step's samples before they are gathered)."""
        g = self.graphs
        return self._async_ok(b) and g is not None and g.plan.bucket(b.num_seqs) in g.graphs

    def _mixed_async(self, b: StepBatch) -> StepBatch | None:
        """``b``'s token rows (``mixed_rows``) when ``launch`` leaves it running in a captured
        mixed-step graph: rows to sample, no logits processors or logprobs, no DFlash drafter
        (each step releases its drafts: those run through ``execute``)."""
        memo = self._mixed_memo
        if memo is not None and memo[0] is b:
            return memo[1]
        m = self.mixed
        rows = None
        if (m is not None and self.dflash is None and not b.is_decode and b.procs is None
                and b.sample_token_idx.shape[0] and not (b.num_logprobs >= 0).any()):
            rows = self.mixed_rows(b)
            if rows is not None and m.plan.bucket(rows.num_tokens) not in m.graphs:
                rows = None  # (a lazy capture would overwrite the samples to gather)
        self._mixed_memo = (b, rows)
        return rows

    def _replay_continuation(self, runner: GraphRunner, b: StepBatch,
                             src_rows: np.ndarray | None, procs: bool) -> int:
        """Stage a decode step in ``runner``'s bucket (its input tokens of ``src_rows`` taken
        on the device from the previous step's samples) and replay it; returns the bucket."""
        self._check(b)
        bucket = runner.pad(b.num_seqs)
        self.upload_step(b, pad_to=bucket, src_rows=src_rows, procs=procs)
        runner.replay(bucket)
        return bucket

    def launch_deferred(self, b: StepBatch, src_rows: np.ndarray | None = None) -> Any:
        """A decode continuation whose logits processors come later (``launch_procs``): the
        bucket's heads graph (forward and LM head) is enqueued now, from the previous step's
        samples on the device, and the host computes the processors' rows (grammar masks)
        while it runs. A step that cannot replay a heads graph runs whole in launch_procs."""
        h = self.heads
        n = b.num_seqs
        if not (self._async_ok(b) and h is not None and h.plan.bucket(n) in h.graphs):
            out = super().launch_deferred(b, src_rows)
        elif self._awaiting is None:
            out = _Heads(b, self._replay_continuation(h, b, src_rows, procs=False))
        else:
            # the deferred step before still waits for its processors: its tail samples this
            # step's input tokens (and reads the sampling rows this step would overwrite), so
            # this forward is queued behind it (``launch_procs``). Behind a heads step the
            # token rows go up now (its tail reads none): between the tail and this forward the
            # host only copies the input tokens and the sampling rows, and the GPU barely
            # waits. Behind any other deferred step they wait (it runs whole in launch_procs,
            # and its own upload would overwrite them)
            self._check(b)
            out = self._queued = _Heads(b, h.pad(n), src_rows, queued=True)
            if self.staged is not None and isinstance(self._awaiting, _Heads):
                self.staged.put_tokens(b, out.bucket - n, self.stream, src_rows)
                out.tokens_up = True
            return out
        self._awaiting = out
        return out

    def can_gate(self, b: StepBatch) -> bool:
        """Whether the decode continuation ``b`` (its rows built without masks) can be launched
        gated (``launch_gated``): a step the async path launches (no logprobs), its bucket's
        heads and tail graphs captured, no deferred step waiting for its processors."""
        h, t = self.heads, self.tails
        if (h is None or t is None or self._awaiting is not None or self._queued is not None
                or not self._async_ok(b)):
            return False
        bucket = h.plan.bucket(b.num_seqs)
        return bucket in h.graphs and bucket in t.graphs

    def launch_gated(self, b: StepBatch, src_rows: np.ndarray | None, gate: Any) -> Any:
        """A decode continuation whose grammar masks are not computed yet, launched whole: its
        processor rows (built ahead, ``b.procs``, without masks) and inputs go up, the heads
        graph runs, then the stream waits until the gate flag in host memory reaches
        ``gate.seq`` (``cuStreamWaitValue32``; the grammar worker sets it once it has written
        the masks), copies the ``gate.rows`` mask rows from host memory and runs the tail.
        ``gate``: ``(host address, bytes, rows' address, flag address)`` as ``gate.region``
        (registered with the device once), ``seq`` and ``rows``. Whoever cannot write the masks
        must still set the flag (engine/structured/remote.py: ``open_gate``), or the stream
        waits for ever."""
        from cuda.bindings import driver as cu

        n = b.num_seqs
        assert self._async_ok(b)
        base, nbytes, rows_ptr, flag_ptr = gate.region
        if self._gate_base != base:  # (a new worker's memory: registered once)
            if self._gate_base:  # a restarted worker: a gated step in flight may still read
                self._gate_old.append(self._gate_base)  # the old memory (until shutdown)
            self._gate_flag = register_host(base, nbytes) + (flag_ptr - base)
            self._gate_base = base
        h, st = self.heads, self.stream
        self._check(b)
        bucket = h.pad(n)
        self.upload_step(b, pad_to=bucket, src_rows=src_rows, procs=True)
        h.replay(bucket)
        check(cu.cuStreamWaitValue32(st.handle, self._gate_flag, gate.seq,
                                     cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
              "cuStreamWaitValue32")
        if gate.rows:
            check(cu.cuMemcpyHtoDAsync(self.buf.procs.gmask.ptr, rows_ptr,
                                       gate.rows * self.buf.procs.words * 4, st.handle),
                  "cuMemcpyHtoDAsync")
        self._tail(bucket)
        return self._download_async(n)

    def launch_procs(self, handle: Any, procs: ProcessorRows | None) -> Any:
        if handle is self._awaiting:
            self._awaiting = None
        if not isinstance(handle, _Heads):
            out = super().launch_procs(handle, procs)
        else:
            n, bucket = handle.batch.num_seqs, handle.bucket
            self.buf.procs.stage(procs, bucket, self.stream)  # (computes the grammar masks)
            self._tail(bucket)
            out = self._download_async(n)
        q, self._queued = self._queued, None
        if q is not None:  # the forward queued behind this tail
            h = self.heads
            if q.tokens_up:
                self.upload_sampling(q.batch, pad_to=q.bucket, procs=False)
            else:
                self.upload_step(q.batch, pad_to=q.bucket, src_rows=q.src_rows, procs=False)
            h.replay(q.bucket)
            q.queued = False
            self._awaiting = q
            self.queued_heads += 1
        return out

    def _tail(self, bucket: int) -> None:
        """The sampling tail of a heads-graph step: its bucket's tail graph when captured (a
        lazy capture would overwrite the staged step: it runs in ``execute``, before the
        upload), else the same kernels eagerly."""
        t = self.tails
        if t is not None and bucket in t.graphs:
            t.replay(bucket)
        else:
            self.decode_tail(bucket)

    def _download_async(self, n: int) -> _InFlight:
        """The samples of rows 0..n-1 into a pinned buffer behind an event."""
        if self._pinned is None:
            self._pinned = [PinnedBuffer(self.sizes.logit_rows, np.int32) for _ in range(2)]
            self._events = [Event(timing=False) for _ in range(2)]
        k = self._flip
        self._flip ^= 1
        out = self._pinned[k].array[:n]
        self.buf.sampled.download(out, self.stream)
        self._events[k].record(self.stream)
        self._inflight = _InFlight(out, self._events[k])
        return self._inflight

    def finish(self, handle: Any) -> StepOutput:
        if isinstance(handle, _Done):
            return handle.out
        if handle is self._awaiting:
            self._awaiting = None
        if isinstance(handle, _Heads):  # discarded before its processors came
            if handle is self._queued:  # (never launched)
                self._queued = None
            elif not handle.queued:
                self.stream.synchronize()
            return StepOutput(sampled=np.zeros(0, np.int32))
        if not isinstance(handle, _InFlight):
            return super().finish(handle)
        handle.event.synchronize()
        return StepOutput(sampled=handle.tokens.copy(), graph=True)

    def _last_tokens(self) -> np.ndarray:
        """The tokens of the last launched step (waits for it)."""
        h = self._inflight
        if h is None:
            raise ExecutorError("a continuation step without a launched step before it")
        return h.out.sampled if isinstance(h, _Done) else (h.event.synchronize(), h.tokens)[1]

    @staticmethod
    def _async_ok(b: StepBatch) -> bool:
        """A step the async path launches: a decode step sampling every row, without grammar
        masks to compute or logprobs (those run through ``execute``). Other logits processors
        (penalties, logit_bias, allowed ids, bans) are staged with the step's inputs and run
        inside the whole decode graph."""
        return (b.is_decode and b.sample_token_idx.shape[0] == b.num_seqs
                and (b.procs is None or not b.procs.grammar_mask.shape[0])
                and not (b.num_logprobs >= 0).any())

    # -- sampling and logprobs -------------------------------------------------------------------
    def _sampled(self, b: StepBatch, n: int) -> np.ndarray:
        """Download the ids the GPU sampler drew (rows ``0..n-1``)."""
        st, buf = self.stream, self.buf
        out = buf.sampled.download(np.empty(n, np.int32), st)
        st.synchronize()
        return out

    def _logprobs(self, n: int, targets: np.ndarray, top_n: int) -> Logprobs:
        st, buf = self.stream, self.buf
        buf.targets.upload(targets.astype(np.int32), st)
        self.kernels.logprobs(buf.logits, buf.targets, buf.lp_token, buf.lp_rank,
                              buf.lp_top_ids, buf.lp_top, n, top_n, st)
        tok = buf.lp_token.download(np.empty(n, np.float32), st)
        rank = buf.lp_rank.download(np.empty(n, np.int32), st)
        ids = buf.lp_top_ids.download(np.empty((n, 20), np.int32), st)
        top = buf.lp_top.download(np.empty((n, 20), np.float32), st)
        st.synchronize()
        return Logprobs(tok, rank, ids[:, :top_n].copy(), top[:, :top_n].copy())

    def _prompt_logprobs(self, b: StepBatch) -> Logprobs:
        """Prompt rows in chunks of ``logit_rows`` (the logits buffer's height)."""
        rows, tgt, n = b.prompt_logprob_idx, b.prompt_logprob_targets, b.prompt_num_logprobs
        chunk = self.sizes.logit_rows
        parts = []
        for lo in range(0, rows.shape[0], chunk):
            r = rows[lo:lo + chunk]
            self.buf.logit_idx.upload(r, self.stream)
            self.logits(b.num_tokens, 0, r.shape[0])
            parts.append(self._logprobs(r.shape[0], tgt[lo:lo + chunk], n))
        return Logprobs(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                          ("token_logprob", "token_rank", "top_ids", "top_logprobs")))

    def shutdown(self) -> None:
        self.stream.synchronize()
        for e in self._events:
            e.destroy()
        self._events = []
        for p in self._pinned or []:
            p.close()
        self._pinned = None
        self.buf.procs.close()
        for base in (*self._gate_old, self._gate_base):  # (the workers' memory may be unmapped
            unregister_host(base)  # already)
        self._gate_base, self._gate_old = 0, []
        if self.staged is not None:
            self.staged.close()
            self.staged = None
