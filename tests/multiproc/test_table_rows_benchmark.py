"""benchmarks/table_rows.py's smoke preset: a hashed table's CTR work, its figures as JSON last."""

from __future__ import annotations

import pytest

from .support import run_benchmark_smoke


@pytest.mark.timeout(120)
def test_the_table_rows_benchmark_runs() -> None:
    result = run_benchmark_smoke("table_rows.py", timeout=100)
    assert result["benchmark"] == "table_rows"
    assert result["unique_ids_per_step"] > 0
    # The first pass makes rows; the second finds every id held.
    assert result["first_new_rows_per_step"] > 0 and result["seen_new_rows_per_step"] == 0
    assert all(result[f"{p}_{op}_us"] > 0 for p in ("first", "seen") for op in ("apply", "lookup"))
