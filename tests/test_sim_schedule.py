"""tools/sim_schedule.py: the real scheduler under the step-cost model delivers every token, and
the numbers it reports follow from the steps it ran."""

from __future__ import annotations

import pytest

from tools import sim_schedule as S


def run(*argv: str) -> dict:
    return S.simulate(S.defaults(S.parser().parse_args(list(argv))))


@pytest.mark.parametrize("workload", ["waves", "burst"])
def test_every_request_gets_its_tokens(workload: str) -> None:
    r = run("--preset", "qwen3-0.6b", "--workload", workload, "--num-prompts", "40",
            "--output-len", "8", "--concurrency", "16", "--prefix-len", "200")
    steps = r["steps"]
    assert r["tok_s"] > 0 and r["ttft_mean_ms"] > 0
    assert r["itl_p99_x"] >= 1.0 and r["itl_max_x"] >= r["itl_p99_x"]
    assert sum(n for n, _ in steps.values()) >= 8  # at least one step per output token


def test_mixed_step_tokens_keeps_waves_in_graphs() -> None:
    """Without a cap the next prompts of a wave land in eager steps; with 128 the steps beside
    decodes fit the mixed-step graphs (a few stay eager: prompt rows that read too much KV)."""
    base = run("--num-prompts", "96", "--output-len", "32")
    capped = run("--num-prompts", "96", "--output-len", "32", "--mixed-step-tokens", "128")
    assert capped["steps"]["mixed"][0] > base["steps"]["mixed"][0]
    assert capped["steps"]["eager"][0] < base["steps"]["eager"][0]
    assert capped["itl_max_x"] < base["itl_max_x"]
