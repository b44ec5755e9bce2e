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


def test_delivery_splits_the_way_out() -> None:
    """20 plain steps of 5 ms; the front end hands each step's deltas out 0.3 ms after the step
    ends and yields two streams' chunks 0.1 and 0.4 ms after that, the second stream's chunk of
    step 10 1 ms late: the server's ITL, the lags and one step's chunk spread."""
    import numpy as np

    from tools.step_trace import delivery

    lines, marks, t = [], [], 50.0
    for i in range(20):
        lines.append(_line(t, 5, i + 1, 2 * (i + 1), i + 1, 2))
        end = t + 5e-3
        marks.append(f"deliver {end + 3e-4:.6f} 7 2")
        marks.append(f"sse {end + 4e-4:.6f} 7 111")
        late = 1e-3 if i == 10 else 0.0
        marks.append(f"sse {end + 7e-4 + late:.6f} 7 222")
        t = end + 1e-4
    d = delivery(lines, marks)
    assert d["deliveries"] == 20 and d["streams"] == 2
    si = d["server_itl"]
    assert si["samples"] == 2 * 18 and abs(si["p50_ms"] - 5.1) < 1e-3
    assert abs(si["max_x"] - 6.1 / 5.1) < 1e-3  # the late chunk's interval
    lo, hi = d["step_end_to_deliver_ms_p50_p99"]
    assert abs(lo - 0.3) < 1e-3 and abs(hi - 0.3) < 1e-3
    p50, p99, mx = d["deliver_to_sse_ms_p50_p99_max"]
    assert abs(mx - 1.4) < 1e-3 and 0.1 - 1e-3 < p50 < 0.4 + 1e-3
    s50, s99 = d["step_chunk_spread_ms_p50_p99"]
    assert abs(s50 - 0.3) < 1e-3 and s99 > 0.3
    assert np.isfinite(p99)
