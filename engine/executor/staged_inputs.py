"""A step's inputs through one pinned mirror: one copy a step instead of fourteen.

The per-step input buffers of ``StepBuffers`` lie in the arena one after the other (it bump-
allocates in order): the sampling group (logit_idx, temperature, top_k, top_p, min_p, seeds,
steps), the token group (input_src, input_ids, positions, slot_mapping, cu_seqlens,
context_lens), then page_indices. ``StagedInputs`` keeps a page-locked host copy of that whole
span, with a numpy view per buffer at the buffer's own offset. A step writes its arrays (and its
padding rows) into the views, then uploads both groups with the page rows it uses in one
asynchronous copy straight from pinned memory (``put_step``); a group can also go up alone
(``put_tokens``, ``put_sampling``: a deferred step's token rows go up before its sampling rows).
Before v14: one pageable copy per array, ~57 us of host time a step on the H200 host
(docs/perf.md v12); v28: two copies (~10 us each a step at batch 1) and a device copy of the
previous samples, which the forward's embedding now gathers itself (``input_src``).

A group is copied whole (its buffers are sized for the largest step, ~45 KB for 2,048 tokens),
so entries past a step's rows carry what earlier steps left there; no kernel reads them (the
same holds for the page-index columns past a sequence's pages, as before). A group's views are
rewritten only after its previous copies are done (an event recorded behind them: a step that
samples nothing does not wait for the GPU, so the next one could otherwise overwrite bytes still
queued for copying).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.cuda.driver import DeviceBuffer, Event, PinnedBuffer, Stream, _cu, check

SAMPLING = ("logit_idx", "temperature", "top_k", "top_p", "min_p", "seeds", "steps")
TOKENS = ("input_src", "input_ids", "positions", "slot_mapping", "cu_seqlens", "context_lens")
ORDER = (*SAMPLING, *TOKENS, "page_indices")
GAP = 256  # the arena's alignment: buffers allocated one after the other lie closer than this


class PinnedMirror:
    """A page-locked host copy of device buffers that lie one after the other in the arena
    (``names``, in address order): a numpy view per buffer at its own offset, and copies of
    any run of them straight from pinned memory. ValueError when they are not in that order."""

    def __init__(self, owner: Any, names: tuple[str, ...]) -> None:
        dev = [getattr(owner, n) for n in names]
        if any(not 0 <= b.ptr - (a.ptr + a.nbytes) < GAP
               for a, b in zip(dev, dev[1:], strict=False)):
            raise ValueError(f"{names[0]}..{names[-1]} are not consecutive in the arena")
        self.base = dev[0].ptr
        self.pinned = PinnedBuffer(dev[-1].ptr + dev[-1].nbytes - self.base, np.uint8)
        self.dev: dict[str, DeviceBuffer] = dict(zip(names, dev, strict=True))
        self.v: dict[str, np.ndarray] = {n: self._view(d) for n, d in self.dev.items()}

    def _view(self, d: DeviceBuffer) -> np.ndarray:
        off = d.ptr - self.base
        return self.pinned.array[off:off + d.nbytes].view(d.dtype).reshape(d.shape)

    def copy(self, first: str, last: str, stream: Stream, last_bytes: int | None = None) -> None:
        """Buffers ``first``..``last`` to the device (of ``last`` its first ``last_bytes``)."""
        lo, d = self.dev[first].ptr, self.dev[last]
        n = d.ptr + (d.nbytes if last_bytes is None else last_bytes) - lo
        check(_cu().cuMemcpyHtoDAsync(lo, self.pinned.ptr + (lo - self.base), n, stream.handle),
              "cuMemcpyHtoDAsync")

    def close(self) -> None:
        self.pinned.close()


class StagedInputs(PinnedMirror):
    def __init__(self, buf: Any) -> None:
        """``buf``: ``StepBuffers``. ValueError when its buffers are not laid out in ORDER."""
        super().__init__(buf, ORDER)
        self.row_bytes = buf.page_indices.shape[1] * 4
        self.copied = {"tokens": Event(timing=False), "sampling": Event(timing=False)}
        self.pending = {"tokens": False, "sampling": False}

    def _wait(self, group: str) -> None:
        if self.pending[group]:
            self.copied[group].synchronize()  # (nearly always complete already)
            self.pending[group] = False

    def _done(self, group: str, stream: Stream) -> None:
        self.copied[group].record(stream)
        self.pending[group] = True

    def put_tokens(self, b: Any, pad: int, stream: Stream,
                   src_rows: np.ndarray | None = None) -> None:
        """The token group and the page rows of StepBatch ``b``, plus ``pad`` padding rows
        (token 0, position 0, no KV write, context 1, page 0; one query token each).
        ``src_rows`` (decode rows): row t's token is the previous step's sample
        ``src_rows[t]`` (gathered on the device), -1 keeps ``b.input_ids[t]``."""
        self._wait("tokens")
        self._write_tokens(b, pad, src_rows)
        # one copy: the token group and the page rows it uses (page_indices follows the group
        # in the arena; the alignment gap between them belongs to no buffer)
        self.copy("input_src", "page_indices", stream, last_bytes=self._table_bytes(b, pad))
        self._done("tokens", stream)

    def put_sampling(self, b: Any, pad: int, stream: Stream) -> None:
        """The sampling group of ``b``'s S sample rows, plus ``pad`` greedy padding rows."""
        self._wait("sampling")
        self._write_sampling(b, pad)
        self.copy("logit_idx", "steps", stream)
        self._done("sampling", stream)

    def put_step(self, b: Any, pad: int, stream: Stream, src_rows: np.ndarray | None = None,
                 pad_sampling: int | None = None) -> None:
        """``put_sampling`` and ``put_tokens`` in one copy (the groups lie one after the
        other; page_indices follows them). ``pad_sampling``: the sampling group's padding rows
        (default ``pad``)."""
        self._wait("sampling")
        self._wait("tokens")
        self._write_sampling(b, pad if pad_sampling is None else pad_sampling)
        self._write_tokens(b, pad, src_rows)
        self.copy("logit_idx", "page_indices", stream, last_bytes=self._table_bytes(b, pad))
        self._done("sampling", stream)
        self._done("tokens", stream)

    def _table_bytes(self, b: Any, pad: int) -> int:
        return (b.page_indices.shape[0] + max(pad, 0)) * self.row_bytes

    def _write_tokens(self, b: Any, pad: int, src_rows: np.ndarray | None) -> None:
        v, n, t = self.v, b.num_seqs, b.num_tokens
        v["input_ids"][:t] = b.input_ids
        if src_rows is None:
            v["input_src"][:t] = -1
        else:
            if src_rows.shape[0] != t:
                raise ValueError(f"src_rows has {src_rows.shape[0]} rows, the step {t} tokens")
            v["input_src"][:t] = src_rows
        v["positions"][:t] = b.positions
        v["slot_mapping"][:t] = b.slot_mapping
        v["context_lens"][:n] = b.context_lens
        table = b.page_indices
        rows, width = table.shape
        v["page_indices"][:rows, :width] = table
        if pad > 0:  # (decode graphs: t == n)
            v["input_src"][t:t + pad] = -1
            v["input_ids"][t:t + pad] = 0
            v["positions"][t:t + pad] = 0
            v["slot_mapping"][t:t + pad] = -1
            v["cu_seqlens"][:n + pad + 1] = np.arange(n + pad + 1, dtype=np.int32)
            v["context_lens"][n:n + pad] = 1
            v["page_indices"][rows:rows + pad, :width] = 0
        else:
            v["cu_seqlens"][:n + 1] = b.cu_seqlens_q

    def _write_sampling(self, b: Any, pad: int) -> None:
        v, n = self.v, b.sample_token_idx.shape[0]
        v["logit_idx"][:n] = b.sample_token_idx
        if pad > 0:  # graph padding rows gather token rows n.. (decode: row i samples token i)
            v["logit_idx"][n:n + pad] = np.arange(n, n + pad, dtype=np.int32)
        for name, src, fill in (("temperature", b.temperature, 0.0), ("top_k", b.top_k, 0),
                                ("top_p", b.top_p, 1.0), ("min_p", b.min_p, 0.0),
                                ("seeds", b.seeds, 0), ("steps", b.sample_steps, 0)):
            v[name][:n] = src
            if pad > 0:
                v[name][n:n + pad] = fill

    def close(self) -> None:
        for g in self.copied:
            self._wait(g)
            self.copied[g].destroy()
        super().close()
