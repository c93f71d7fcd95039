"""The TFRecord benchmark's smoke preset runs and reports every figure, so it never rots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_tfrecord_read_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "tfrecord_read.py"),
            "--preset",
            "smoke",
            "--file",
            str(tmp_path / "bench.tfrecord"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["records"] == 2000
    for key in ("psflow_raw_rps", "psflow_raw_mbps", "psflow_raw_list_rps", "psflow_parse_rps"):
        assert result[key] > 0, key
