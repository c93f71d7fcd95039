"""``benchmarks/job_profile.py``'s smoke preset: a running job's tasks found and measured."""

from __future__ import annotations

import pytest

from .support import run_benchmark_smoke


@pytest.mark.timeout(120)
def test_job_profile_finds_every_task_and_measures_it() -> None:
    result = run_benchmark_smoke(
        "job_profile.py", "--ps", "1", "--workers", "1", "--warmup", "1", "--window", "1"
    )
    assert result["benchmark"] == "job_profile" and result["path"] == "shm"
    tasks = result["tasks"]
    assert sorted(tasks) == ["ps:0", "worker:0"]
    for name, figures in tasks.items():
        # A training job's tasks are never idle for a whole second: both did some work.
        assert 0 < figures["busiest_share"] <= figures["cores"] + 1e-9, (name, figures)
