"""benchmarks/shard_load.py's smoke preset: hollow CTR workers against shards on a core of their
own, the figures as JSON last."""

from __future__ import annotations

import pytest

from .support import run_benchmark_smoke


@pytest.mark.timeout(120)
def test_the_shard_load_benchmark_runs() -> None:
    result = run_benchmark_smoke("shard_load.py", "--ps", "2", "--workers", "2", timeout=100)
    assert result["benchmark"] == "shard_load" and result["ps"] == 2
    assert result["steps_per_s"] > 0 and result["worker_us_a_step"] > 0
    assert result["us_a_request"] > 0 and result["per_core"] > 0
    # An estimate (the warm-up's slow first requests in its CPU): above 1 in a short run.
    assert result["ps_core_busy"] > 0
    # Every push_pull went the native way (psflow/ps/native_push.py): its cost is the figure.
    assert result["native_share"] == 1.0
