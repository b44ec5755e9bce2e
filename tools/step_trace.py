"""Break a serving run down by step from the engine's step trace (``CUTEINFER_STEP_TRACE``).

    python -m tools.step_trace TRACE [--requests SERVE.json] [--admit-trace FILE] [--json OUT]

Each trace line (engine/engine.py ``LLMEngine.step``): start and end (perf_counter), then the
cumulative steps, tokens and graph steps, then the running and waiting counts after the step,
then when the step was scheduled, its batch built and executed (phases, ``phases_ms_p50``).
Prints, for graph (decode replay) and eager steps: how many, their total and median time, the
tokens they computed (and, of the graph steps, the mixed ones: those that computed more tokens
than the requests running before them); the time between steps (the core's own loop: outputs
sent, commands read); and eager step times by tokens in the step.

``--requests``: a ``tools.bench_serving --save-detailed`` result of the same run (each request's
send time is ``perf_counter`` of the same host: the trace's clock). Each ITL sample (the time
between two chunks of a stream) is put beside the engine steps that ended between the two
chunks, and the tail is told apart by the slowest kind among them (``itl_tail``): how many
samples at or over p99 and over 1.5x the median span an eager, a mixed-graph or only plain
decode steps, the p99 without the eager ones, and the delivery jitter (a one-step sample less
the engine's interval that step ended).

``--admit-trace``: the ``CUTEINFER_ADMIT_TRACE`` file of the same run (engine/tracepoints.py):
the server's own ITL and the front end's lags (``delivery``), to tell the jitter the front end
adds from the client's.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def _rows(lines: list[str]) -> np.ndarray:
    return np.array([[float(x) for x in ln.split()] for ln in lines if ln.strip()])


def _tokens_graph_mixed(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: the tokens it computed, whether it replayed a graph, and whether that graph
    was a mixed step's (more tokens than the requests running before it: a decode step
    computes one token for each)."""
    tok = np.diff(rows[:, 3], prepend=0)
    graph = np.diff(rows[:, 4], prepend=0) > 0
    before = np.concatenate([[0.0], rows[:-1, 5]])
    return tok, graph, graph & (tok > before)


def summarize(lines: list[str]) -> dict:
    rows = _rows(lines)
    if rows.shape[0] < 2:
        return {"steps": int(rows.shape[0])}
    t0, t1 = rows[:, 0], rows[:, 1]
    dur = (t1 - t0) * 1e3
    tok, graph, mixed = _tokens_graph_mixed(rows)
    stepped = np.diff(rows[:, 2], prepend=0) > 0  # not a failed / empty step
    gaps = (t0[1:] - t1[:-1]) * 1e3
    busy = gaps < 50  # gaps longer than this: the engine was idle (no work), not slow
    out: dict = {"steps": int(rows.shape[0]), "wall_s": float(t1[-1] - t0[0])}
    for name, m in (("graph", graph & stepped), ("eager", ~graph & stepped)):
        d = dur[m]
        out[name] = {"n": int(m.sum()), "total_s": float(d.sum() / 1e3),
                     "ms_p50": float(np.median(d)) if d.size else None,
                     "ms_p90": float(np.percentile(d, 90)) if d.size else None,
                     "ms_max": float(d.max()) if d.size else None,
                     "tokens": int(tok[m].sum())}
    mixed &= stepped
    d = dur[mixed]
    out["graph"]["mixed"] = {"n": int(mixed.sum()),
                             "ms_p50": float(np.median(d)) if d.size else None,
                             "ms_p90": float(np.percentile(d, 90)) if d.size else None,
                             "tokens_mean": float(tok[mixed].mean()) if d.size else None}
    g = gaps[busy]
    out["between_steps"] = {"total_s": float(g.sum() / 1e3),
                            "ms_p50": float(np.median(g)) if g.size else None,
                            "ms_p99": float(np.percentile(g, 99)) if g.size else None}
    eager = ~graph & stepped
    by = {}
    for lo, hi in ((1, 65), (65, 257), (257, 513), (513, 1025), (1025, 2049), (2049, 1 << 30)):
        m = eager & (tok >= lo) & (tok < hi)
        if m.any():
            by[f"{lo}-{hi - 1}"] = {"n": int(m.sum()), "ms_p50": float(np.median(dur[m])),
                                    "ms_max": float(dur[m].max())}
    out["eager_by_tokens"] = by
    if rows.shape[1] >= 10:  # phase marks: scheduled, batch built, executed
        m0, m1, m2 = rows[:, 7], rows[:, 8], rows[:, 9]
        ok = stepped & (m2 > 0)
        phases = {"schedule": m0 - t0, "build_batch": m1 - m0, "execute": m2 - m1,
                  "update_outputs": t1 - m2}
        for name, m in (("graph", graph & ok), ("eager", ~graph & ok)):
            if m.any():
                out[name]["phases_ms_p50"] = {k: round(float(np.median(v[m])) * 1e3, 4)
                                              for k, v in phases.items()}
    return out


def itl_tail(lines: list[str], requests: list[dict]) -> dict:
    """The ITL samples of ``requests`` (bench_client's detailed results: ``start``, ``ttft``,
    ``itl`` in seconds) against the steps of the trace ``lines``."""
    rows = _rows(lines)
    t1 = rows[:, 1]
    _, graph, mixed = _tokens_graph_mixed(rows)
    kind = np.where(~graph, 2, np.where(mixed, 1, 0))  # eager (or empty) / mixed / decode
    interval = np.diff(t1, prepend=t1[0]) * 1e3
    ms, a_t, b_t = [], [], []
    for r in requests:
        t = r["start"] + r["ttft"]
        for x in r["itl"]:
            ms.append(x * 1e3)
            a_t.append(t)
            t += x
            b_t.append(t)
    if not ms:
        return {"samples": 0}
    itl, a, b = np.array(ms), np.searchsorted(t1, a_t, "right"), np.searchsorted(t1, b_t, "right")
    worst = np.array([kind[i:j].max() if j > i else -1 for i, j in zip(a, b, strict=True)])
    med, p99 = float(np.median(itl)), float(np.percentile(itl, 99))
    names = {-1: "no_step", 0: "decode", 1: "mixed", 2: "eager"}

    def by_kind(m: np.ndarray) -> dict:
        return {names[k]: int((worst[m] == k).sum()) for k in names}

    one = (b - a) == 1
    lag = itl[one] - interval[b[one] - 1]
    out = {"samples": int(itl.size), "p50_ms": med, "p99_ms": p99, "p99_x": p99 / med,
           "max_ms": float(itl.max()),
           "at_or_over_p99": by_kind(itl >= p99), "over_1_5x": by_kind(itl > 1.5 * med),
           "in_window": by_kind(np.ones(itl.size, bool)),
           "multi_step_windows": int(((b - a) > 1).sum())}
    rest = itl[worst != 2]
    if rest.size:
        out["p99_x_without_eager"] = float(np.percentile(rest, 99)) / med
    if lag.size:
        out["jitter_ms_p1_p50_p99"] = [float(v) for v in np.percentile(lag, [1, 50, 99])]
    return out


def delivery(lines: list[str], marks: list[str]) -> dict:
    """Where the front end spends a token's way out (``--admit-trace``: ``deliver`` and ``sse``
    tracepoints of the same run): the server's own ITL (the time between two chunks of a stream
    as its handler yields them: the client's ITL less the client's share), the lag from a
    step's end in the core to the front end handing its deltas out (``deliver``), from there to
    each chunk (``sse``), and the spread of one step's chunks (the first to the last)."""
    t1 = _rows(lines)[:, 1]
    deliver, sse = [], {}
    for ln in marks:
        f = ln.split()
        if len(f) < 3:
            continue
        if f[0] == "deliver":
            deliver.append(float(f[1]))
        elif f[0] == "sse":
            sse.setdefault(f[3] if len(f) > 3 else "", []).append(float(f[1]))
    out: dict = {"deliveries": len(deliver), "streams": len(sse)}
    gaps = [np.diff(v[1:]) for v in sse.values() if len(v) > 2]  # (the first: role / TTFT)
    if gaps:
        g = np.concatenate(gaps) * 1e3
        med = float(np.median(g))
        out["server_itl"] = {"samples": int(g.size), "p50_ms": med,
                             "p99_x": float(np.percentile(g, 99)) / med,
                             "max_x": float(g.max()) / med}
    if deliver:
        d = np.array(deliver)
        i = np.searchsorted(t1, d, "right") - 1
        ok = i >= 0
        lag = (d[ok] - t1[i[ok]]) * 1e3
        out["step_end_to_deliver_ms_p50_p99"] = [float(x) for x in np.percentile(lag, [50, 99])]
        at = np.concatenate(list(sse.values())) if sse else np.zeros(0)
        j = np.searchsorted(d, at, "right") - 1
        ok = j >= 0
        if ok.any():
            lag = (at[ok] - d[j[ok]]) * 1e3
            out["deliver_to_sse_ms_p50_p99_max"] = [float(x) for x in
                                                   np.percentile(lag, [50, 99, 100])]
            order = np.argsort(j[ok], kind="stable")  # chunks grouped by their delivery
            g, lg = j[ok][order], lag[order]
            first = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
            spread = np.maximum.reduceat(lg, first) - np.minimum.reduceat(lg, first)
            out["step_chunk_spread_ms_p50_p99"] = [float(x) for x in
                                                  np.percentile(spread, [50, 99])]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--requests", default=None,
                    help="bench_serving --save-detailed JSON of the same run: the ITL tail")
    ap.add_argument("--admit-trace", default=None,
                    help="CUTEINFER_ADMIT_TRACE file of the same run: the delivery breakdown")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with open(a.trace) as f:
        lines = f.readlines()
    s = summarize(lines)
    if a.requests:
        with open(a.requests) as f:
            s["itl_tail"] = itl_tail(lines, json.load(f)["requests"])
    if a.admit_trace:
        with open(a.admit_trace) as f:
            s["delivery"] = delivery(lines, f.readlines())
    text = json.dumps(s, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
