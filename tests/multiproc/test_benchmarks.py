"""The benchmarks' smoke presets run, so that they never rot; their last line is JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .support import ROOT


@pytest.mark.parametrize("script", ["linreg.py", "transport.py"])
def test_benchmark_smoke_preset(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--preset", "smoke"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["preset"] == "smoke"
    figures = [v for k, v in result.items() if k.endswith(("steps_per_s", "gbps"))]
    assert figures and all(isinstance(v, float) and v > 0 for v in figures)
