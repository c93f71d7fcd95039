"""``psflow launch --max-restarts``: a task killed with SIGKILL starts again, with the same
address and TF_CONFIG, and the job finishes with the right model; restarts are counted per job."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.train import CheckpointDir
from tests.faults import FAULTS

from .support import ROOT, launch_cmd

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

EXAMPLE = ROOT / "examples" / "linear_regression.py"
STEPS = 3000


def test_a_killed_worker_chief_and_ps_are_restarted_and_the_job_finishes(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    faults = [
        *("--once", str(tmp_path / "faults")),  # each task is killed once, not again restarted
        # Once the checkpoint at 500 is complete, however fast the steps run (on a fast host
        # 500 steps took less than its writing: the ps came back with nothing to restore).
        *("--after-checkpoint", str(logdir)),
        # In this order, each kill's outcome is the same however fast the tasks run: the ps
        # (after the checkpoint at 500; the chief restores it from there), then the chief
        # (the ps, alive, keep their state: it must not restore), then worker:1 (it rejoins).
        # A ps killed while the chief is away would be restored by the chief once it is back.
        # The steps alone did not keep that order under load (both waited for the checkpoint
        # and the ps struck at 1559, the chief at 1556): each waits for the one before it.
        "--in-order",
        *("--kill-at", "ps:0@1000"),
        *("--kill-at", "worker:0@1400"),  # the chief
        *("--kill-at", "worker:1@1800"),
    ]
    cmd = launch_cmd(
        FAULTS,
        *faults,
        str(EXAMPLE),
        *("--train_steps", str(STEPS), "--lr", "0.01", "--save_checkpoint_steps", "500"),
        *("--logdir", str(logdir)),
        preload=True,  # each restart forked from the job's server, not a fresh python
    )
    cmd.insert(cmd.index("launch") + 1, "--max-restarts")
    cmd.insert(cmd.index("--max-restarts") + 1, "3")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    restarted = re.findall(
        r"task (\S+) failed with signal 9; restarting it .*\(restart (\d) of 3", err
    )
    assert restarted == [("ps:0", "1"), ("worker:0", "2"), ("worker:1", "3")], err[-4000:]
    # The restarted chief found the ps initialised: it resumed, it did not restore...
    assert "the ps were already initialised: not restoring" in err
    # ... and the restarted ps came back empty: the chief restored it from the last checkpoint.
    assert re.search(r"ps:0 came back empty: every shard restored from ckpt-\d+\b", err), err[
        -4000:
    ]
    m = re.fullmatch(r"\[worker:0\] W=(\S+) b=(\S+)", proc.stdout.strip().splitlines()[-1])
    assert m, proc.stdout[-2000:]
    assert abs(float(m.group(1)) - 2.0) < 0.05 and abs(float(m.group(2)) - 0.3) < 0.05
    assert "job finished: 3 tasks exited 0" in err
    # The chief checkpointed and wrote summaries again after its restart.
    saved = CheckpointDir(str(logdir))
    final = saved.latest()
    assert final is not None and saved.manifest(final).global_step >= STEPS
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    assert max(e.step for e in acc.Scalars("loss")) > 1400


def test_the_job_stops_once_its_restarts_are_used(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import sys; print('started', flush=True); sys.exit(3)\n")
    cmd = [sys.executable, "-m", "psflow.cli", "launch", "--ps", "0", "--workers", "1"]
    proc = subprocess.run(
        [*cmd, "--max-restarts", "2", str(script)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert proc.stdout.count("[worker:0] started") == 3  # the first run and two restarts
    assert proc.stderr.count("restarting it with the same address and TF_CONFIG") == 2
    assert "no restart left (--max-restarts 2, all used)" in proc.stderr
    assert "task worker:0 failed with exit code 3; stopping the other tasks" in proc.stderr


def test_a_worker_that_fails_is_restarted_into_a_job_that_waited_for_it(tmp_path: Path) -> None:
    """A worker whose session fails (an exception, not a kill) does not tell the ps it has
    finished: the only worker of a job, it used to, the ps ended the job, and its restart
    found no ps."""
    script = tmp_path / "fails_once.py"
    marker = tmp_path / "failed"
    script.write_text(
        "import os, sys, torch, psflow\n"
        "ctx, _ = psflow.resolve([])\n"
        "if ctx.job == 'ps':\n"
        "    psflow.ParameterServer(ctx).join()\n"
        "    sys.exit(0)\n"
        "model = torch.nn.Linear(4, 1)\n"
        "with psflow.TrainingSession(model, ctx, optimizer='SGD', lr=0.1) as sess:\n"
        "    for step in range(30):\n"
        f"        if step == 10 and not os.path.exists({str(marker)!r}):\n"
        f"            open({str(marker)!r}, 'w').close()\n"
        "            raise RuntimeError('planned failure')\n"
        "        model(torch.randn(8, 4)).pow(2).mean().backward()\n"
        "        sess.step()\n"
        "    print('finished at global step', sess.global_step, flush=True)\n"
    )
    cmd = launch_cmd(script, ps=1, workers=1)
    cmd.insert(cmd.index("launch") + 1, "--max-restarts")
    cmd.insert(cmd.index("--max-restarts") + 1, "1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    err = proc.stderr
    assert proc.returncode == 0, err[-4000:]
    assert "RuntimeError: planned failure" in proc.stdout + err
    assert "task worker:0 failed with exit code 1; restarting it" in err, err[-4000:]
    assert "worker:0 finished (1/1)" in err  # once: after the restart, not at the failure
    assert err.count("worker:0 finished") == 1, err[-4000:]
    m = re.search(r"\[worker:0\] finished at global step (\d+)", proc.stdout)
    assert m is not None and int(m.group(1)) >= 30, proc.stdout[-2000:]
