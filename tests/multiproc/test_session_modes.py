"""A TrainingSession takes the mode's keywords as its own, in every mode, and keeps them apart
from the optimizer's arguments; PSFLOW_LOGDIR is where a job saves when its script names no
directory."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from psflow.protocol import OptimizerSpec
from psflow.train import CheckpointDir, TrainingSession

from .support import ROOT, launch_cmd, local_cluster, quiet_session, start_ps, stop, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def _train(sess: TrainingSession, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        sess.zero_grad()
        loss = model(torch.ones(1, 8)).pow(2).sum()
        loss.backward()
        sess.step(loss=loss)


@pytest.mark.parametrize(
    "mode",
    [
        {"mode": "sync", "replicas_to_aggregate": 1, "total_num_replicas": 1, "sync_timeout": 30.0},
        {"max_staleness": 2, "sync_timeout": 30.0},
    ],
    ids=["sync", "staleness"],
)
def test_mode_keywords_survive_a_restore(tmp_path: Path, mode: dict[str, object]) -> None:
    """The chief's restore sends the optimizer to the ps: the mode's keywords must not be in
    it (they once were, and the ps refused to build ``SGD(mode='sync')``)."""
    url = str(tmp_path / "ckpt")
    cluster = local_cluster(1, 1)

    def session(model: torch.nn.Module) -> TrainingSession:
        return quiet_session(
            model, cluster, url, optimizer=OptimizerSpec.of("SGD", lr=0.1, momentum=0.5), **mode
        )

    for run in range(2):
        ps = start_ps(cluster)
        try:
            torch.manual_seed(run)
            model = torch.nn.Linear(8, 2)
            with session(model) as sess:
                assert sess.opt.mode == mode.get("mode", "async")
                assert dict(sess.spec.kwargs) == {"lr": 0.1, "momentum": 0.5}
                if run == 1:
                    assert sess.restored_from == "ckpt-3" and sess.global_step == 3
                _train(sess, model, 3)
            code, err = stop(ps)
            assert code == 0, err[-3000:]
        finally:
            stop(ps, timeout=1)
    latest = CheckpointDir(url).latest()
    assert latest == "ckpt-6"
    assert CheckpointDir(url).manifest(latest).optimizer["kwargs"] == {"lr": 0.1, "momentum": 0.5}


def test_a_misspelt_optimizer_argument_is_named_before_any_request() -> None:
    cluster = local_cluster(1, 1)  # no ps runs: the error comes first
    with pytest.raises(ValueError, match="unexpected keyword argument 'checkpoint_dri'"):
        TrainingSession(torch.nn.Linear(2, 1), worker_ctx(cluster), lr=0.1, checkpoint_dri="x")


def test_psflow_logdir_is_where_the_example_saves(tmp_path: Path) -> None:
    logdir = tmp_path / "logs"
    proc = subprocess.run(
        launch_cmd(
            ROOT / "examples" / "linear_regression.py", "--train_steps", "2000", preload=True
        ),
        capture_output=True,
        text=True,
        timeout=100,
        env=dict(os.environ, PSFLOW_LOGDIR=str(logdir)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = CheckpointDir(str(logdir))
    latest = saved.latest()
    assert latest is not None and saved.manifest(latest).global_step >= 2000
    assert list(logdir.glob("events.out.tfevents.*")), sorted(os.listdir(logdir))
