"""Kill -9 a running job, run the same command again: it resumes from the last checkpoint."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.train import CheckpointDir
from tests.faults import FAULTS

from .support import ROOT, launch_cmd

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150)]  # two launches of up to 60 s

_PROGRESS = re.compile(r"\[worker:0\] step (\d+)/\d+ .*\| loss (\S+) \|")
# The example's run at twice its default lr (0.001) in half its steps, every interval halved
# with them (checkpoints, progress, the kill): the same lr x steps at each point, so the same
# losses and end values as 10,000 steps at the default, in half the time.
_SCALED = ["--lr", "0.002", "--save_checkpoint_steps", "500", "--log_step_count_steps", "500"]


def _launch(logdir: Path, faults: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """The example through ``psflow launch`` (through :mod:`tests.faults` with ``faults``)."""
    example = ROOT / "examples" / "linear_regression.py"
    cmd = launch_cmd(
        *((FAULTS, *faults, str(example)) if faults else (example,)),
        "--train_steps",
        "5000",
        *_SCALED,
        "--logdir",
        str(logdir),
        preload=True,
    )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_killed_job_resumes_step_and_loss_from_the_last_checkpoint(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    # Killed once the checkpoint at 1500 is complete, however fast the steps run.
    first = _launch(logdir, ["--after-checkpoint", f"{logdir}@1500", "--kill-at", "worker:0@1750"])
    assert first.returncode == 1, first.stderr[-3000:]
    assert "task worker:0 failed with signal 9" in first.stderr
    saved = CheckpointDir(str(logdir))
    latest = saved.latest()
    assert latest is not None
    step = saved.manifest(latest).global_step
    assert 1450 <= step <= 1750
    assert not saved.manifest(latest).final  # killed: not the end of training
    losses_before = [float(m.group(2)) for m in _PROGRESS.finditer(first.stderr)]

    second = _launch(logdir)  # the same command
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"global step {step}, saved on 1 ps" in second.stderr
    resumed = [(int(m.group(1)), float(m.group(2))) for m in _PROGRESS.finditer(second.stderr)]
    assert resumed and resumed[0][0] > step
    # The loss goes on from where it was: far below where the first run started.
    assert resumed[0][1] < losses_before[0] / 4, (losses_before, resumed)
    m = re.fullmatch(r"\[worker:0\] W=(\S+) b=(\S+)", second.stdout.strip().splitlines()[-1])
    assert m and abs(float(m.group(1)) - 2.0) < 0.05 and abs(float(m.group(2)) - 0.3) < 0.05
    assert "job finished: 3 tasks exited 0" in second.stderr

    final = saved.latest()
    assert final is not None and saved.manifest(final).global_step >= 5000
    assert saved.manifest(final).final  # training ended there
    assert len([c for c in saved.checkpoints() if c.complete]) <= 5  # max_to_keep

    # Both runs wrote TensorBoard events; TensorBoard's own reader sees them.
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"loss", "global_step/sec", "learning_rate"} <= set(tags["scalars"])
    assert {"weight", "bias"} <= set(tags["histograms"])
    steps = [e.step for e in acc.Scalars("loss")]
    assert min(steps) < step < max(steps)
