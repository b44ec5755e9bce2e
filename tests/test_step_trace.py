"""tools/step_trace.py on a hand-made trace: graph, mixed-graph and eager steps apart."""

from __future__ import annotations

from tools.step_trace import summarize


def _line(t0: float, ms: float, steps: int, tokens: int, graphs: int, running: int) -> str:
    return f"{t0:.6f} {t0 + ms / 1e3:.6f} {steps} {tokens} {graphs} {running} 0"


def test_mixed_graph_steps_are_told_apart() -> None:
    # an eager prefill of 2 x 100 tokens, two decode steps of 2, a mixed graph step
    # (2 decodes + a 50-token prompt), then a decode of 3
    lines = [_line(0.0, 20, 1, 200, 0, 2), _line(0.03, 5, 2, 202, 1, 2),
             _line(0.04, 5, 3, 204, 2, 2), _line(0.05, 9, 4, 256, 3, 3),
             _line(0.06, 5, 5, 259, 4, 3)]
    s = summarize(lines)
    assert s["eager"]["n"] == 1 and s["eager"]["tokens"] == 200
    assert s["graph"]["n"] == 4 and s["graph"]["tokens"] == 59
    m = s["graph"]["mixed"]
    assert m["n"] == 1 and m["tokens_mean"] == 52 and abs(m["ms_p50"] - 9) < 1e-6


def test_itl_tail_puts_each_sample_beside_its_steps() -> None:
    """Two streams decode through 40 plain steps (5 ms), one mixed graph step (9 ms) and one
    eager step (20 ms); every chunk reaches the client 0.5 ms after its step ends, one chunk
    of the eager step 1 ms later than the other (jitter)."""
    import numpy as np

    from tools.step_trace import itl_tail

    lines, ends, t, tokens, graphs = [], [], 100.0, 0, 0
    for i in range(42):
        ms, new, graph = (9, 50, 1) if i == 20 else (20, 2, 0) if i == 30 else (5, 2, 1)
        tokens, graphs = tokens + new, graphs + graph
        lines.append(_line(t, ms, i + 1, tokens, graphs, 2))
        t += ms / 1e3
        ends.append(t)
        t += 1e-4
    reqs = []
    for r in range(2):
        arr = [e + 5e-4 + (1e-3 if (r == 1 and i == 30) else 0.0) for i, e in enumerate(ends)]
        reqs.append({"start": 99.0, "ttft": arr[0] - 99.0, "itl": np.diff(arr).tolist()})
    s = itl_tail(lines, reqs)
    assert s["samples"] == 82
    assert s["in_window"] == {"no_step": 0, "decode": 78, "mixed": 2, "eager": 2}
    assert s["over_1_5x"] == {"no_step": 0, "decode": 0, "mixed": 2, "eager": 2}
    # p99 of 82 samples lies between the eager step's two samples (20.1, 21.1 ms)
    assert s["at_or_over_p99"] == {"no_step": 0, "decode": 0, "mixed": 0, "eager": 1}
    assert abs(s["p99_x_without_eager"] - 9.1 / 5.1) < 0.05
    assert abs(s["p50_ms"] - 5.1) < 1e-3 and abs(s["max_ms"] - 21.1) < 1e-3
    assert s["multi_step_windows"] == 0
    lo, mid, hi = s["jitter_ms_p1_p50_p99"]
    assert abs(mid) < 1e-3 and -1.01 < lo < 0 < hi < 1.01  # one chunk 1 ms late, its next one early
