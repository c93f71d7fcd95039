"""``psflow launch --ps-threads``: the ps tasks serve each request's rows on several threads
(:mod:`psflow.sparse.stripes`), and the rows they end with are the bits one thread gives."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import psflow
from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import TaskContext, TaskSpec
from psflow.protocol import Code
from psflow.sparse import kernels, stripes
from psflow.train import CheckpointDir
from psflow.transport import PeerError

from .support import ROOT, launch_cmd, quiet_session, run_benchmark_smoke

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

SCRIPT = ROOT / "tests" / "multiproc" / "scripts" / "striped_rows.py"


def rows_saved(logdir: Path) -> dict[str, torch.Tensor]:
    d = CheckpointDir(str(logdir))
    name = d.latest()
    assert name is not None
    return load_file(d.shard_urls(name, 1)[0])


def run(logdir: Path, *flags: str) -> str:
    # Each task forked from a server that imported torch (2 tasks: one import instead of two);
    # the thread settings are each task's own (the fork server sets them after the fork).
    cmd = launch_cmd(SCRIPT, "--logdir", str(logdir), ps=1, workers=1, preload=True)
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = list(flags)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_ps_threads_serve_the_rows_in_stripes(tmp_path: Path) -> None:
    """The ps tasks alone get the threads; their rows are the bits of one thread (the stripes'
    own tests, tests/unit/test_stripes.py, compare them)."""
    out = run(tmp_path, "--ps-threads", "2")
    assert "ps:0 PSFLOW_PS_THREADS=2 OMP_NUM_THREADS=2" in out
    assert "worker:0 PSFLOW_PS_THREADS=None" in out
    assert "ps:0 serving on 127.0.0.1:" in out and "(2 threads)" in out
    saved = rows_saved(tmp_path)
    (values,) = [t for name, t in saved.items() if name.endswith("/values")]
    assert values.shape == (50_000, 32) and bool(values.isfinite().all())


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


class FailingKernels:
    """The row kernels, but every Adagrad update of a stripe fails (a fault no index check
    catches)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def adagrad(self, *args: Any) -> int:
        raise MemoryError("planted")


def test_a_stripe_that_fails_stops_the_shard_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = local_cluster(1, 1)
    ps = psflow.ParameterServer(TaskContext(cluster=cluster, task=TaskSpec(job="ps", index=0)),
                                threads=2).start()  # fmt: skip
    try:
        table = psflow.nn.Embedding(50_000, 8, optimizer="Adagrad")
        sess = quiet_session(table, cluster, str(tmp_path), recovery_timeout=None)
        table(torch.arange(2048)).sum().backward()
        monkeypatch.setattr(kernels, "KERNELS", FailingKernels(kernels.KERNELS))
        with pytest.raises(PeerError, match="ps:0 stops: a stripe of 2048 rows") as e:
            sess.step()
        assert e.value.code == Code.STOPPING
        sess.close(e.value)  # no final checkpoint: the ps is gone
        with pytest.raises(RuntimeError, match=r"ps:0 stopped: .*MemoryError: planted"):
            ps.join(timeout=10)  # it stopped serving, naming the failure
        assert isinstance(ps.error, stripes.StripeError)
    finally:
        ps.stop()
