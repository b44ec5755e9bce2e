"""The numpy executor: the CPU reference backend, paged exactly like the GPU one.

KV pages use the GPU layout (``[num_pages, num_kv_heads, page_size, head_dim]`` per layer, K and
V apart) but hold float32: this backend is the oracle, so it keeps the reference model's float32
math end to end. Attention reads each sequence's KV through its row of the page-index table.

Hidden-state capture (a DFlash drafter, engine/model/dflash.py): after ``enable_capture(ids)``
every step writes the residual stream leaving each layer of ``ids`` (HF ``hidden_states[L + 1]``:
x after layer L's attention and MLP) of every token it computes into ``capture[slot]``, the
token's KV slot, ``[num_pages * page_size, len(ids) * hidden]`` float32. The features thus live
in the paged pool beside the KV: a cached page's features are a function of its prefix, as its KV
is, and a rolled-back slot is overwritten by whichever token takes it next.
"""

from __future__ import annotations

import numpy as np

from engine.executor.base import Executor, ExecutorError
from engine.model.loader import Checkpoint
from engine.model.reference import ReferenceModel, attention
from engine.sampling import SlotState, compute_logprobs, process_logits, sample
from engine.step import Logprobs, StepBatch, StepOutput

F32 = np.float32


class NumpyExecutor(Executor):
    batch_invariant = True  # float32 numpy per row: any step composition, the same logits

    def __init__(self, ckpt: Checkpoint, num_pages: int, page_size: int) -> None:
        self.model = ReferenceModel(ckpt)
        cfg = self.config = ckpt.config
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_pages, cfg.num_key_value_heads, page_size, cfg.head_dim)
        self.k_cache = [np.zeros(shape, F32) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [np.zeros(shape, F32) for _ in range(cfg.num_hidden_layers)]
        self.slots = SlotState(cfg.vocab_size)  # logits processors' per-request state
        self.capture: np.ndarray | None = None  # per-slot target features (enable_capture)
        self.capture_layers: dict[int, int] = {}  # layer -> its column block in capture

    @staticmethod
    def bytes_per_page(ckpt: Checkpoint, page_size: int, capture_width: int = 0) -> int:
        """KV bytes of one page, plus ``capture_width`` float32 features per slot."""
        c = ckpt.config
        kv = 2 * c.num_hidden_layers * c.num_key_value_heads * page_size * c.head_dim * 4
        return kv + page_size * capture_width * 4

    def enable_capture(self, layer_ids: tuple[int, ...] | list[int]) -> np.ndarray:
        """From now on capture the output of layers ``layer_ids`` (in that order) at every
        computed token's slot; returns the store ``[num_pages * page_size, n * hidden]``."""
        n, h = self.config.num_hidden_layers, self.config.hidden_size
        if not layer_ids or any(not 0 <= li < n for li in layer_ids):
            raise ExecutorError(f"capture layers {list(layer_ids)} outside 0..{n - 1}")
        self.capture_layers = {li: j for j, li in enumerate(layer_ids)}
        self.capture = np.zeros((self.num_pages * self.page_size, len(layer_ids) * h), F32)
        return self.capture

    def _check(self, b: StepBatch) -> None:
        check_batch(b, self.num_pages, self.page_size, self.config.vocab_size)

    def attend(self, li: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               b: StepBatch) -> np.ndarray:
        """Layer ``li``'s attention over the paged cache: k, v [T, kv heads, hd] written at the
        batch's slots, then each sequence's queries attend to its context through its row of
        the page-index table. Returns [T, heads, hd]."""
        m, ps = self.model, self.page_size
        page, off = b.slot_mapping // ps, b.slot_mapping % ps
        cu = b.cu_seqlens_q
        kc, vc = self.k_cache[li], self.v_cache[li]
        kc[page, :, off, :] = k
        vc[page, :, off, :] = v
        out = np.empty_like(q)
        for s in range(b.num_seqs):
            lo, hi = int(cu[s]), int(cu[s + 1])
            if hi == lo:
                continue
            ctx = int(b.context_lens[s])
            pages = b.page_indices[s, :-(-ctx // ps)]
            kk = kc[pages].transpose(0, 2, 1, 3).reshape(-1, kc.shape[1], kc.shape[3])[:ctx]
            vv = vc[pages].transpose(0, 2, 1, 3).reshape(-1, vc.shape[1], vc.shape[3])[:ctx]
            out[lo:hi] = attention(q[lo:hi], kk, vv, b.positions[lo:hi], m.scale)
        return out

    def hidden_states(self, b: StepBatch) -> np.ndarray:
        """Run every layer; returns the final hidden states [T, hidden] (before the norm)."""
        self._check(b)
        m = self.model
        x = m.embed[b.input_ids]
        cap, h = self.capture_layers, self.config.hidden_size
        for li in range(self.config.num_hidden_layers):
            q, k, v = m.qkv(li, x, b.positions)
            x = m.attn_out_and_mlp(li, x, self.attend(li, q, k, v, b))
            j = cap.get(li)
            if j is not None:
                self.capture[b.slot_mapping, j * h:(j + 1) * h] = x  # type: ignore[index]
            self.heartbeat += 1
        return x

    def logits(self, b: StepBatch, rows: np.ndarray) -> np.ndarray:
        """Run the step's forward (its KV written); the logits [len(rows), vocab] of token
        rows ``rows``."""
        x = self.hidden_states(b)
        return self.model.logits(x[rows]) if rows.size else np.zeros((0, 1), F32)

    def execute(self, b: StepBatch) -> StepOutput:
        return sample_output(b, self.logits(b, logit_rows(b)), self.slots)


def check_batch(b: StepBatch, num_pages: int, page_size: int, vocab_size: int) -> None:
    """Refuse a batch that would index outside the KV cache or the vocabulary."""
    limit = num_pages * page_size
    if b.num_tokens and (b.slot_mapping.min() < 0 or b.slot_mapping.max() >= limit):
        raise ExecutorError(f"slot_mapping outside the KV cache (0..{limit - 1})")
    if b.page_indices.size and (b.page_indices.min() < 0 or b.page_indices.max() >= num_pages):
        raise ExecutorError("page_indices outside the KV cache")
    if b.num_tokens and b.input_ids.max() >= vocab_size:
        raise ExecutorError("input id outside the vocabulary")


def logit_rows(b: StepBatch) -> np.ndarray:
    """The token rows whose logits a step needs: its sample rows, then its prompt-logprob rows."""
    return np.concatenate([b.sample_token_idx, b.prompt_logprob_idx]).astype(np.int64)


def sample_output(b: StepBatch, logits: np.ndarray,
                  slots: SlotState | None = None) -> StepOutput:
    """Sample and compute logprobs from the logits of ``logit_rows(b)``; ``slots``: the
    executor's logits-processor state (needed when ``b.procs`` is set)."""
    s = b.sample_token_idx.shape[0]
    lg, pl = logits[:s], logits[s:]
    raw = lg
    if b.procs is not None:  # logits processors (engine/logits_processors.py)
        if slots is None:
            raise ExecutorError("this executor keeps no logits-processor state")
        slots.init(b.procs.inits)
        lg, raw = process_logits(lg, b.procs, b.sample_steps, slots)
    tokens = sample(lg, b.temperature, b.top_k, b.top_p, b.min_p, b.seeds, b.sample_steps)
    if b.procs is not None:
        slots.count(b.procs, b.sample_steps, tokens)  # type: ignore[union-attr]
    lp: Logprobs | None = None
    if s and (b.num_logprobs >= 0).any():  # of the logits before the processors (vLLM's)
        lp = compute_logprobs(raw, tokens, int(b.num_logprobs.max()))
    plp = None
    if pl.shape[0]:
        plp = compute_logprobs(pl, b.prompt_logprob_targets, b.prompt_num_logprobs)
    return StepOutput(sampled=tokens, logprobs=lp, prompt_logprobs=plp)
