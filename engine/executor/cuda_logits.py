"""The logits processors' device buffers (cutlass_kernels/logits_process.py), allocated once.

Everything the processors read is device data of fixed size, indexed by the step's sample rows
(``flags``, ``slot``, ...) and by slot (counts, bitmasks): a decode graph captured once runs the
processors of whatever rows the step uploads. A step without processors uploads nothing (the
flags stay zero; every CTA of the kernel returns at once).

Per step: ``stage`` uploads the rows' arrays and applies slot inits; in the step body
``apply`` (before the sampler) and ``count`` (after it) launch the kernels.

Logprobs are of the logits after the grammar mask and before the other processors (vLLM's
default). A step whose logprob rows had other processors (FLAG_SAVE_RAW) recomputes its logits
from the hidden states the step left in ``rows`` and applies the grammar masks alone
(``raw_logits``): one more lm_head GEMM, paid by such steps only, instead of a second logits
buffer of ``rows x vocab`` floats that every deployment would hold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.cuda.driver import DeviceBuffer, Event, PinnedBuffer, Stream
from engine.executor.base import ExecutorError
from engine.executor.staged_inputs import PinnedMirror
from engine.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from engine.step import FLAG_GRAMMAR, FLAG_SAVE_RAW, ProcessorRows

# sparse entries one row may need: its logit_bias, min_tokens' stops and EOS, bad words (two
# spellings each)
ROW_SPARSE = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + 2 * MAX_BAD_WORDS + 64
ROWS = ("flags", "slot", "penalties", "grammar_row", "sparse_start", "sparse_ids", "sparse_vals")


def _view(buf: DeviceBuffer, offset: int, nbytes: int) -> DeviceBuffer:
    return DeviceBuffer(buf.ptr + offset, nbytes, owner=buf)


class ProcessorBuffers:
    def __init__(self, vocab: int, row_stride: int, rows: int, slots: int, arena: Any,
                 stream: Stream) -> None:
        a = arena.alloc
        self.vocab, self.stride, self.rows, self.slots = vocab, row_stride, rows, slots
        self.words = w = (vocab + 31) // 32
        self.sparse_cap = rows * ROW_SPARSE
        # the per-step rows, in ROWS order (one pinned mirror, ``_upload_rows``)
        self.flags = a(rows, np.uint32, "proc_flags")
        self.slot = a(rows, np.int32, "proc_slot")
        self.penalties = a((rows, 3), np.float32, "proc_penalties")
        self.grammar_row = a(rows, np.int32, "proc_grammar_row")
        self.sparse_start = a(rows + 1, np.int32, "proc_sparse_start")
        self.sparse_ids = a(self.sparse_cap, np.int32, "proc_sparse_ids")
        self.sparse_vals = a(self.sparse_cap, np.float32, "proc_sparse_vals")
        self.gmask = a((rows, w), np.uint32, "proc_gmask")
        self.counts = a((slots, vocab), np.int32, "proc_counts")
        self.counted = a(slots, np.int32, "proc_counted")
        self.last = a(slots, np.int32, "proc_last")
        self.prompt_bits = a((slots, w), np.uint32, "proc_prompt_bits")
        self.allowed_bits = a((slots, w), np.uint32, "proc_allowed_bits")
        self.flags.fill_bytes(0, stream)
        self.counted.fill_bytes(0, stream)
        self.clear = True  # flags all zero: a step without processors uploads nothing
        self._last_rows: tuple | None = None  # the steady rows on the device (``_same_rows``)
        # the grammar masks go up from pinned memory, double-buffered: a pageable copy this
        # size (rows x V/8 bytes) blocks the host until the stream reaches it, which would
        # serialize the host with the forward it overlaps (async scheduling)
        self._mask_pin: list[PinnedBuffer] = []
        self._mask_ev: list[Event] = []
        self._mask_flip = 0
        self._mirror: PinnedMirror | None = None  # the rows' pinned copy (made on first use)
        self._mirror_ev: Event | None = None  # behind its last copies
        self.grammar_flags: np.ndarray | None = None  # set when a logprob row needs raw logits

    def stage(self, rows: ProcessorRows | None, num_rows: int, stream: Stream) -> None:
        """Upload a step's processor rows (None: none) for ``num_rows`` (padded) rows."""
        self.grammar_flags = None
        if rows is None:
            if not self.clear:
                self.flags.fill_bytes(0, stream)
                self.clear = True
            return
        n = rows.flags.shape[0]
        k = int(rows.sparse_start[-1])
        if k > self.sparse_cap or rows.grammar_mask.shape[0] > self.rows:
            raise ExecutorError(f"logits processors: {k} sparse entries / "
                                f"{rows.grammar_mask.shape[0]} grammar rows exceed the "
                                f"buffers ({self.sparse_cap} / {self.rows})")
        for init in rows.inits:
            self._init_slot(init, stream)
        pad = num_rows - n
        if not self._same_rows(rows, pad):
            self._last_rows = None
            self._upload_rows(rows, max(pad, 0), k, stream)
            if not rows.flags.flags.writeable:  # (steady rows: the next step may reuse them)
                self._last_rows = (_row_arrays(rows), pad, rows.grammar_row.copy())
        self.clear = False
        # the grammar masks last: the rows above go up while the mask threads finish
        rows.fill_masks()  # (computes them, or waits for fill_async's)
        if rows.grammar_mask.shape[0]:
            self._upload_masks(rows.grammar_mask, stream)
        if (rows.flags & FLAG_SAVE_RAW).any():
            self.grammar_flags = np.concatenate([rows.flags & FLAG_GRAMMAR,
                                                 np.zeros(max(pad, 0), np.uint32)])

    def _same_rows(self, rows: ProcessorRows, pad: int) -> bool:
        """Whether the device holds ``rows`` already: a steady batch's rows are the previous
        step's read-only arrays (``LogitsProcessorState.prepare``), so the same objects, the
        same grammar rows and padding, and no upload of other rows since, need no copy."""
        last = self._last_rows
        return (last is not None and not self.clear and not rows.inits and last[1] == pad
                and all(a is b for a, b in zip(_row_arrays(rows), last[0], strict=True))
                and np.array_equal(rows.grammar_row, last[2]))

    def _upload_rows(self, rows: ProcessorRows, pad: int, k: int, stream: Stream) -> None:
        """flags (+ ``pad`` zero rows), slot, penalties, grammar_row, sparse_start and the
        ``k`` sparse entries: written into the pinned mirror, up in one copy (three with sparse
        entries). Seven small pageable copies took ~5 us each of the stream's time between the
        heads graph and the tail (docs/perf.md v20)."""
        if self._mirror is None:
            try:
                self._mirror = PinnedMirror(self, ROWS)
            except ValueError:  # not one span (buffers of their own): one copy per array
                self._upload_each(rows, pad, k, stream)
                return
            self._mirror_ev = Event(timing=False)
        else:
            self._mirror_ev.synchronize()  # its previous copies are done (nearly always)
        v, n = self._mirror.v, rows.flags.shape[0]
        v["flags"][:n] = rows.flags
        v["flags"][n:n + pad] = 0
        v["slot"][:n] = rows.slot
        v["penalties"][:n] = rows.penalties
        v["grammar_row"][:n] = rows.grammar_row
        v["sparse_start"][:n + 1] = rows.sparse_start
        self._mirror.copy("flags", "sparse_start", stream)
        if k:
            v["sparse_ids"][:k] = rows.sparse_ids
            v["sparse_vals"][:k] = rows.sparse_vals
            self._mirror.copy("sparse_ids", "sparse_ids", stream, last_bytes=4 * k)
            self._mirror.copy("sparse_vals", "sparse_vals", stream, last_bytes=4 * k)
        self._mirror_ev.record(stream)

    def _upload_each(self, rows: ProcessorRows, pad: int, k: int, stream: Stream) -> None:
        self.flags.upload(np.concatenate([rows.flags, np.zeros(pad, np.uint32)]), stream)
        self.slot.upload(rows.slot, stream)
        self.penalties.upload(rows.penalties, stream)
        self.grammar_row.upload(rows.grammar_row, stream)
        self.sparse_start.upload(rows.sparse_start, stream)
        if k:
            self.sparse_ids.upload(rows.sparse_ids, stream)
            self.sparse_vals.upload(rows.sparse_vals, stream)

    def _upload_masks(self, mask: np.ndarray, stream: Stream) -> None:
        if not self._mask_pin:
            self._mask_pin = [PinnedBuffer((self.rows, self.words), np.uint32) for _ in range(2)]
            self._mask_ev = [Event(timing=False) for _ in range(2)]
        k = self._mask_flip
        self._mask_flip ^= 1
        self._mask_ev[k].synchronize()  # its copy of two steps ago is done (nearly always)
        pin = self._mask_pin[k].array[:mask.shape[0]]
        np.copyto(pin, mask)
        self.gmask.upload(pin, stream)
        self._mask_ev[k].record(stream)

    def close(self) -> None:
        """Free the pinned mirrors and their events, each after its last copy is done."""
        for e in (*self._mask_ev, *([self._mirror_ev] if self._mirror_ev else [])):
            e.synchronize()
            e.destroy()
        self._mask_ev, self._mirror_ev = [], None
        for p in self._mask_pin:
            p.close()
        self._mask_pin = []
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None

    def _init_slot(self, init: Any, stream: Stream) -> None:
        s, v, w = init.slot, self.vocab, self.words
        row = _view(self.counts, s * v * 4, v * 4)
        if init.output_ids.size:
            row.upload(np.bincount(init.output_ids, minlength=v).astype(np.int32)[:v], stream)
        else:
            row.fill_bytes(0, stream)
        n = int(init.output_ids.size)
        _view(self.counted, s * 4, 4).upload(np.array([n], np.int32), stream)
        _view(self.last, s * 4, 4).upload(
            np.array([init.output_ids[-1] if n else -1], np.int32), stream)
        _view(self.prompt_bits, s * w * 4, w * 4).upload(init.prompt_bits, stream)
        if init.allowed_bits is not None:
            _view(self.allowed_bits, s * w * 4, w * 4).upload(init.allowed_bits, stream)

    def apply(self, kernels: Any, logits: Any, steps: Any, num_rows: int, stream: Any) -> None:
        """The processors over ``logits`` rows [0, num_rows), in place (before the sampler)."""
        kernels.logits_process(logits, self.flags, self.slot, steps, self.penalties,
                               self.grammar_row, self.gmask, self.sparse_start, self.sparse_ids,
                               self.sparse_vals, self.counts, self.counted, self.last,
                               self.prompt_bits, self.allowed_bits, num_rows, self.slots,
                               self.sparse_cap, stream)

    def count(self, kernels: Any, steps: Any, sampled: Any, num_rows: int, stream: Any) -> None:
        """The sampled tokens into their slots' counts (after the sampler)."""
        kernels.count_tokens(self.flags, self.slot, steps, sampled, self.counts, self.counted,
                             self.last, num_rows, self.slots, stream)

    def raw_logits(self, kernels: Any, rows: Any, lm_head: Any, logits: Any, steps: Any,
                   num_rows: int, stream: Stream) -> None:
        """Before logprobs, when a logprob row had processors: ``logits`` again from the step's
        hidden ``rows``, with the grammar masks only (the logits vLLM's logprobs are of)."""
        if self.grammar_flags is None:
            return
        kernels.lm_head(rows, lm_head, logits, num_rows, stream)
        self.flags.upload(self.grammar_flags, stream)
        self._last_rows = None  # (the flags on the device are these now)
        self.apply(kernels, logits, steps, num_rows, stream)
        self.grammar_flags = None


def _row_arrays(rows: ProcessorRows) -> tuple:
    """The arrays of ``rows`` a steady step reuses (``LogitsProcessorState.prepare``)."""
    return (rows.flags, rows.slot, rows.penalties, rows.sparse_start, rows.sparse_ids,
            rows.sparse_vals)
