"""``psflow launch --ps-threads``: the ps tasks serve each request's rows on several threads
(:mod:`psflow.sparse.stripes`), and the rows they end with are the bits one thread gives."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from psflow.train import CheckpointDir

from .support import ROOT, launch_cmd, run_benchmark_smoke

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

SCRIPT = ROOT / "tests" / "multiproc" / "scripts" / "striped_rows.py"


def rows_saved(logdir: Path) -> dict[str, torch.Tensor]:
    d = CheckpointDir(str(logdir))
    name = d.latest()
    assert name is not None
    return load_file(d.shard_urls(name, 1)[0])


def run(logdir: Path, *flags: str) -> str:
    cmd = launch_cmd(SCRIPT, "--logdir", str(logdir), ps=1, workers=1)
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = list(flags)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_ps_threads_serve_the_rows_in_stripes_with_the_bits_of_one(tmp_path: Path) -> None:
    out = run(tmp_path / "two", "--ps-threads", "2")
    assert "ps:0 PSFLOW_PS_THREADS=2 OMP_NUM_THREADS=2" in out
    assert "worker:0 PSFLOW_PS_THREADS=None" in out  # the ps alone
    assert "ps:0 serving on 127.0.0.1:" in out and "(2 threads)" in out
    run(tmp_path / "one", "--ps-threads", "1")
    two, one = rows_saved(tmp_path / "two"), rows_saved(tmp_path / "one")
    assert sorted(two) == sorted(one)
    for name in one:
        assert torch.equal(two[name], one[name]), name


def test_ps_threads_must_be_a_count(tmp_path: Path) -> None:
    cmd = launch_cmd(SCRIPT, "--logdir", str(tmp_path), ps=1, workers=1)
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = ["--ps-threads", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--ps-threads must be an integer >= 1, got 0" in proc.stderr


def test_the_row_threads_benchmark_runs() -> None:
    result = run_benchmark_smoke("row_threads.py")
    assert result["rows_per_s_1"] > 0 and result["rows_per_s_2"] > 0
    assert result["threads"] == 2 and result["batch"] == 4096
