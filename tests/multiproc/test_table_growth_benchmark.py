"""benchmarks/table_growth.py's smoke preset: a hashed table grown from empty, its longest
pushes and memory as JSON last."""

from __future__ import annotations

import pytest

from .support import run_benchmark_smoke


@pytest.mark.timeout(120)
def test_the_table_growth_benchmark_runs() -> None:
    result = run_benchmark_smoke("table_growth.py", timeout=100)
    assert result["benchmark"] == "table_growth" and result["rows"] == 20_000
    assert 0 < result["push_median_ms"] <= result["push_p99_ms"] <= result["push_longest_ms"]
    assert result["peak_rss_mb"] > result["rows_need_mb"] >= 0
    assert 0 < result["evicting_push_median_ms"] <= result["evicting_push_longest_ms"]
