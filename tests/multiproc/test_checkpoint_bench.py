"""The checkpoint-pause benchmark's smoke preset runs and prints its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .support import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]


def test_checkpoint_pause_benchmark_smoke() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "checkpoint_pause.py"), "--preset", "smoke"],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "checkpoint_pause" and result["ps_pause_ms"] >= 0
