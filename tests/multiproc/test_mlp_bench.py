"""benchmarks/mlp.py's smoke preset runs every mode (and DDP) and prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

from .support import ROOT


def test_mlp_benchmark_smoke_preset() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mlp.py"), "--preset", "smoke"],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["preset"] == "smoke"
    for key in ("async_psflow", "sync_psflow", "allreduce_psflow", "allreduce_ddp"):
        for unit in ("steps_per_s", "gbps"):
            assert result[f"{key}_{unit}"] > 0, key
