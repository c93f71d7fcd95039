"""Every benchmark's smoke preset runs, so that none rots; each prints its figures as JSON last."""

from __future__ import annotations

import pytest

from .support import run_benchmark_smoke


@pytest.mark.parametrize("script", ["linreg.py", "transport.py"])
def test_runtime_benchmarks(script: str) -> None:
    result = run_benchmark_smoke(script)
    assert result["preset"] == "smoke"
    figures = [v for k, v in result.items() if k.endswith(("steps_per_s", "gbps"))]
    assert figures and all(isinstance(v, float) and v > 0 for v in figures)


def test_mlp_benchmark_runs_every_mode_and_ddp() -> None:
    result = run_benchmark_smoke("mlp.py")
    assert result["preset"] == "smoke"
    for key in ("async_psflow", "sync_psflow", "allreduce_psflow", "allreduce_ddp"):
        for unit in ("steps_per_s", "gbps"):
            assert result[f"{key}_{unit}"] > 0, key


@pytest.mark.timeout(60)
def test_checkpoint_pause_benchmark() -> None:
    result = run_benchmark_smoke("checkpoint_pause.py", timeout=50)
    assert result["benchmark"] == "checkpoint_pause" and result["ps_pause_ms"] >= 0
