"""Graph bookkeeping that needs no GPU: buckets, padding choice, the profiler's report."""

from __future__ import annotations

import importlib.util

import pytest

from graphs.buckets import bucket_for, bucket_sizes
from graphs.profile import plot, table


def test_bucket_sizes_default_and_capped():
    s = bucket_sizes(256)
    assert s[:6] == [1, 2, 4, 8, 16, 24] and s[-1] == 256 and len(s) == 35
    assert all(b - a == 8 for a, b in zip(s[4:], s[5:], strict=False))
    assert bucket_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(1000)[-1] == 256
    assert bucket_sizes(1000, max_bucket=512)[-1] == 512


@pytest.mark.parametrize("b,expect", [(1, 1), (3, 4), (5, 8), (9, 16), (17, 24), (33, 40),
                                      (100, 104), (256, 256), (257, None)])
def test_bucket_for(b, expect):
    assert bucket_for(b, bucket_sizes(256)) == expect


ROWS = [dict(bucket=b, nodes=100, nodes_by_kernel={"GemmSkinny": 60, "RMSNorm": 40},
             capture_ms=12.0, graph_mem_bytes=1 << 20, num_splits=4, replay_ms_median=1.0 + b / 100,
             replay_ms_p99=1.2 + b / 100, eager_ms_median=2.0 + b / 100,
             eager_ms_p99=2.5 + b / 100, saved_ms=1.0, saved_us_per_node=10.0,
             replay_ms_per_token=(1.0 + b / 100) / b) for b in (1, 2, 4, 8)]


def test_profile_table_and_plot(tmp_path):
    t = table(ROWS)
    assert "bucket" in t.splitlines()[0] and len(t.splitlines()) == 2 + len(ROWS) + 1
    assert "GemmSkinny x60" in t
    ok = plot(ROWS, tmp_path / "p.png", "test")
    if importlib.util.find_spec("matplotlib") is None:
        assert ok is False
    else:
        assert ok and (tmp_path / "p.png").stat().st_size > 1000
