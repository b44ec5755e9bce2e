"""What each decode graph costs and what graphs buy (``cuteinfer profile-graphs``, whose command
line is ``engine.commands.profile_graphs``).

For every bucket: capture time, kernel nodes by name, graph memory, replay time (median and p99
over many replays, CUDA events) against the same step launched eagerly, and the launch overhead
saved. Writes a table (stdout), JSON, a PNG plot (matplotlib, if installed: replay vs eager time
per bucket, and time per token), and optionally the DOT dump of one graph.

Importable: ``profile_graphs(executor, iters=...) -> list[dict]``, given an executor built by the
caller (``graphs`` knows no executor class), and ``make_batch``, the synthetic decode step it times
(also the decode benchmark's, tools/bench_decode.py).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.step import StepBatch

if TYPE_CHECKING:
    from graphs.runner import GraphRunner


class Hooked:
    """A kernel launcher seen through ``hook(fn, *args, **kwargs)`` (the tools' timing and
    counting wrappers): its calls and its ``unfused`` calls go through the hook, every other
    attribute (``fuses``, ``path``, ...) is the launcher's own."""

    def __init__(self, inner: Any, hook: Any) -> None:
        self._inner, self._hook = inner, hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._hook(self._inner, *args, **kwargs)

    def unfused(self, *args: Any, **kwargs: Any) -> Any:
        return self._hook(self._inner.unfused, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hook_kernels(kernels: Any, hook: Any, names: list[str] | None = None) -> Any:
    """``kernels`` (cuda_model.Kernels) with the launchers in ``names`` (default: all) seen
    through ``hook(name, fn, *args, **kwargs)``."""
    names = [f.name for f in dataclasses.fields(kernels)] if names is None else names
    return dataclasses.replace(kernels, **{
        n: Hooked(getattr(kernels, n), lambda fn, *a, _n=n, **k: hook(_n, fn, *a, **k))
        for n in names})


def _short(name: str) -> str:
    """A readable kernel name: the CuTe class the mangled name carries, when it can be found."""
    for tag in ("GemmSkinny", "GemmSm90", "DecodeAttention", "Combine", "PrefillAttention",
                "RMSNorm", "RopeKV", "SiluMul", "Embedding", "Sampler", "LogProbs"):
        if tag.lower() in name.lower():
            return tag
    return name[:48]


def make_batch(b: int, ctx: int, page_size: int, num_pages: int, vocab: int,
               seed: int = 0, spread: int = 0) -> StepBatch:
    """A decode step of ``b`` sequences at context ``ctx`` on random distinct pages (random tokens,
    greedy sampling): what a graph replays when it is timed. ``spread``: contexts drawn
    uniformly from ``ctx - spread .. ctx + spread`` instead (a served batch's mix)."""
    rng = np.random.default_rng(seed)
    ctxs = (rng.integers(ctx - spread, ctx + spread + 1, b) if spread else np.full(b, ctx))
    ppseq = -(-int(ctxs.max()) // page_size)
    pages = rng.permutation(np.arange(1, num_pages))[: b * ppseq].reshape(b, ppseq)
    pos = (ctxs - 1).astype(np.int32)
    slots = pages[np.arange(b), pos // page_size] * page_size + pos % page_size
    z = np.zeros(b, np.float32)
    return StepBatch(
        input_ids=rng.integers(0, vocab, b).astype(np.int32), positions=pos,
        slot_mapping=slots.astype(np.int64), cu_seqlens_q=np.arange(b + 1, dtype=np.int32),
        context_lens=ctxs.astype(np.int32), page_indices=pages.astype(np.int32),
        sample_token_idx=np.arange(b, dtype=np.int32), temperature=z,
        top_k=np.zeros(b, np.int32), top_p=np.ones(b, np.float32), min_p=z,
        seeds=np.arange(b, dtype=np.uint64), sample_steps=np.zeros(b, np.uint32),
        num_logprobs=np.full(b, -1, np.int32))


def make_span_batch(b: int, ctx: int, q: int, page_size: int, num_pages: int, vocab: int,
                    seed: int = 0) -> StepBatch:
    """A speculative verify step: ``b`` sequences, each ``q`` new tokens (``[pending,
    *drafts]``) at positions ``ctx - q .. ctx - 1`` on random distinct pages, every token
    sampled (greedy), what ``CudaExecutor.verify_rows`` turns into decode rows."""
    rng = np.random.default_rng(seed)
    ppseq = -(-ctx // page_size)
    pages = rng.permutation(np.arange(1, num_pages))[: b * ppseq].reshape(b, ppseq)
    pos = np.tile(np.arange(ctx - q, ctx, dtype=np.int32), b)
    seq = np.repeat(np.arange(b), q)
    slots = pages[seq, pos // page_size] * page_size + pos % page_size
    t = b * q
    z = np.zeros(t, np.float32)
    return StepBatch(
        input_ids=rng.integers(0, vocab, t).astype(np.int32), positions=pos,
        slot_mapping=slots.astype(np.int64),
        cu_seqlens_q=np.arange(0, t + 1, q, dtype=np.int32),
        context_lens=np.full(b, ctx, np.int32), page_indices=pages.astype(np.int32),
        sample_token_idx=np.arange(t, dtype=np.int32), temperature=z,
        top_k=np.zeros(t, np.int32), top_p=np.ones(t, np.float32), min_p=z,
        seeds=np.repeat(np.arange(b, dtype=np.uint64), q),
        sample_steps=np.tile(np.arange(q, dtype=np.uint32), b),
        num_logprobs=np.full(t, -1, np.int32))


def profile_graphs(ex: Any, iters: int = 200, ctx: int = 512,
                   buckets: list[int] | None = None) -> list[dict]:
    """Profile every bucket of ``ex`` (a CudaExecutor) at context length ``ctx``."""
    from engine.cuda.driver import time_ms

    runner, own = _runner(ex, buckets or [])
    rows = []
    for bk in sorted(set(buckets or runner.buckets), reverse=True):
        g = runner.graphs.get(bk) or runner.capture(bk)
        batch = make_batch(bk, min(ctx, ex.sizes.max_pos - 1), ex.page_size, ex.num_pages,
                           ex.mc.vocab_size)
        ex.upload(batch)
        ex.upload_sampling(batch)

        rep = time_ms(ex.stream, lambda bk=bk: runner.replay(bk), iters, warmup=5)
        eag = time_ms(ex.stream, lambda bk=bk, s=g.num_splits: ex.decode_body(bk, s), iters,
                      warmup=5)
        by_name = Counter(_short(n) for n in g.kernel_names)
        r = dict(bucket=bk, nodes=len(g.kernel_names), nodes_by_kernel=dict(by_name),
                 capture_ms=round(g.capture_s * 1e3, 2), graph_mem_bytes=g.mem_bytes,
                 num_splits=g.num_splits, replay_ms_median=round(float(np.median(rep)), 4),
                 replay_ms_p99=round(float(np.percentile(rep, 99)), 4),
                 eager_ms_median=round(float(np.median(eag)), 4),
                 eager_ms_p99=round(float(np.percentile(eag, 99)), 4))
        saved = r["eager_ms_median"] - r["replay_ms_median"]
        r["saved_ms"] = round(saved, 4)
        r["saved_us_per_node"] = round(saved * 1e3 / max(len(g.kernel_names), 1), 3)
        r["replay_ms_per_token"] = round(r["replay_ms_median"] / bk, 5)
        rows.append(r)
    if own:
        runner.destroy()
    return sorted(rows, key=lambda r: r["bucket"])


def _runner(ex: Any, buckets: list[int]) -> tuple[GraphRunner, bool]:
    """The executor's graph runner when its plan holds ``buckets``, else a runner of their own
    (True: the caller destroys it)."""
    if ex.graphs is not None and set(buckets) <= set(ex.graphs.buckets):
        return ex.graphs, False
    return ex.graph_runner(buckets or None), True


def table(rows: list[dict]) -> str:
    head = (f"{'bucket':>6} {'nodes':>5} {'capture ms':>10} {'graph MiB':>9} {'replay ms':>9} "
            f"{'p99':>8} {'eager ms':>9} {'saved ms':>8} {'us/node':>7} {'ms/token':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['bucket']:>6} {r['nodes']:>5} {r['capture_ms']:>10.1f} "
                     f"{r['graph_mem_bytes'] / 2**20:>9.2f} {r['replay_ms_median']:>9.3f} "
                     f"{r['replay_ms_p99']:>8.3f} {r['eager_ms_median']:>9.3f} "
                     f"{r['saved_ms']:>8.3f} {r['saved_us_per_node']:>7.2f} "
                     f"{r['replay_ms_per_token']:>9.4f}")
    if rows:
        lines.append("nodes by kernel (largest bucket): " + ", ".join(
            f"{k} x{v}" for k, v in sorted(rows[-1]["nodes_by_kernel"].items())))
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path, title: str = "") -> bool:
    """Replay vs eager time per bucket, and time per token. False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    b = [r["bucket"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(b, [r["eager_ms_median"] for r in rows], "o-", label="eager")
    a1.plot(b, [r["replay_ms_median"] for r in rows], "s-", label="graph replay")
    a1.set_xlabel("batch bucket")
    a1.set_ylabel("decode step (ms, median)")
    a1.legend()
    a1.grid(alpha=0.3)
    a2.plot(b, [r["eager_ms_median"] / r["bucket"] for r in rows], "o-", label="eager")
    a2.plot(b, [r["replay_ms_per_token"] for r in rows], "s-", label="graph replay")
    a2.set_xlabel("batch bucket")
    a2.set_ylabel("ms per token")
    a2.set_yscale("log")
    a2.legend()
    a2.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def dump_dot(ex: Any, bucket: int, path: str | Path) -> None:
    """Write ``bucket``'s decode graph as DOT (captured now when profiling did not keep it)."""
    runner, own = _runner(ex, [bucket])
    g = runner.graphs.get(bucket) or runner.capture(bucket)
    g.graph.write_dot(str(path))
    if own:
        runner.destroy()
