"""Helpers the GPU tests share: the results log and hand-built step batches."""

from __future__ import annotations

import json
import os

import numpy as np

from engine.step import StepBatch


def report(rec: dict) -> None:
    """Print a test's numbers and append them to $OUT/gpu_results.jsonl (the GPU scripts'
    results file) when $OUT is set."""
    print(json.dumps(rec))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_results.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def distinct_pages(rng: np.random.Generator, num_pages: int, starts, qs,
                   page_size: int = 16) -> np.ndarray:
    """A page table for sequences that hold ``starts[i] + qs[i]`` tokens: distinct random
    pages (never the padding page 0), zero past each sequence's own."""
    width = -(-(np.asarray(starts) + np.asarray(qs)) // page_size)
    perm = rng.permutation(np.arange(1, num_pages))
    pages = np.zeros((len(width), int(width.max())), np.int32)
    off = 0
    for i, w in enumerate(width):
        pages[i, :w] = perm[off:off + w]
        off += int(w)
    return pages


def span_batch(pages: np.ndarray, starts, toks, *, every_token: bool = True, temps=None,
               seeds=None, steps=None, page_size: int = 16) -> StepBatch:
    """Sequence i computes tokens ``toks[i]`` at positions ``starts[i]..`` over page row
    ``pages[i]``. Sampled rows: every token (row j of sequence i at the request's step
    ``steps[i] + j``) or each sequence's last token; ``temps`` / ``seeds`` per sequence
    (default greedy, seed 0, step 0)."""
    q = np.array([len(t) for t in toks], np.int32)
    n, tot = len(toks), int(q.sum())
    seq = np.repeat(np.arange(n), q)
    cu = np.zeros(n + 1, np.int32)
    np.cumsum(q, out=cu[1:])
    j = np.arange(tot) - cu[:-1][seq]
    pos = (np.asarray(starts)[seq] + j).astype(np.int32)
    slots = pages[seq, pos // page_size] * page_size + pos % page_size
    rows = np.arange(tot) if every_token else cu[1:] - 1
    of = seq[rows]  # the sequence of each sample row
    temps = np.zeros(n) if temps is None else np.asarray(temps)
    seeds = np.zeros(n, np.uint64) if seeds is None else np.asarray(seeds, np.uint64)
    steps = np.zeros(n, np.int64) if steps is None else np.asarray(steps)
    s = rows.shape[0]
    return StepBatch(
        input_ids=np.concatenate(toks).astype(np.int32), positions=pos,
        slot_mapping=slots.astype(np.int64), cu_seqlens_q=cu,
        context_lens=(np.asarray(starts) + q).astype(np.int32),
        page_indices=pages.astype(np.int32), sample_token_idx=rows.astype(np.int32),
        temperature=temps[of].astype(np.float32), top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32), min_p=np.zeros(s, np.float32), seeds=seeds[of],
        sample_steps=(steps[of] + (j[rows] if every_token else 0)).astype(np.uint32),
        num_logprobs=np.full(s, -1, np.int32))
