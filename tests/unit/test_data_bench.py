"""The TFRecord benchmark's smoke preset runs and reports every figure, so it never rots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psflow.data.synth_ctr import SynthCTRConfig, write_synth_ctr
from tests.multiproc.support import run_forked

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_tfrecord_read_smoke(tmp_path: Path) -> None:
    # Forked from the server that imported torch (:mod:`tests.multiproc.forked`), as the other
    # benchmarks' smoke runs are: its own process, 2 s of CPU sooner.
    script = str(ROOT / "benchmarks" / "tfrecord_read.py")
    ctr = tmp_path / "ctr"
    write_synth_ctr(str(ctr), SynthCTRConfig(train_examples=12_000, test_examples=100, scale=1e-3))
    args = ["--preset", "smoke", "--file", str(tmp_path / "bench.tfrecord"), "--ctr", str(ctr)]
    proc = run_forked([script, *args], timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["records"] == 2000
    figures = ("psflow_raw_rps", "psflow_raw_mbps", "psflow_raw_list_rps", "psflow_parse_rps")
    for key in (*figures, "psflow_shuffle_parse_rps", "ctr_us_a_batch"):
        assert result[key] > 0, key
