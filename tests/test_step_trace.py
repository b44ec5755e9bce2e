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
