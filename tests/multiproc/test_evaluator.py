"""``psflow launch --evaluator``: the evaluator task scores every checkpoint of a real job once,
into TensorBoard, and exits after the final one; its failure does not stop training.
(tests/multiproc/test_ctr_example.py has one with hashed tables on 2 ps.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from psflow.cluster.launcher import LaunchConfig, Launcher
from psflow.train import CheckpointDir
from tests.fault_matrix import PRELOAD
from tests.paths import ROOT

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

LAUNCH = [sys.executable, "-m", "psflow.cli", "launch"]


def test_the_evaluator_scores_every_checkpoint_of_the_job_once(tmp_path: Path) -> None:
    logdir = tmp_path / "run"
    script = ROOT / "examples" / "linear_regression.py"
    args = ["--train_steps", "600", "--save_checkpoint_steps", "200", "--logdir", str(logdir)]
    launch = [*LAUNCH, "--ps", "1", "--workers", "1", "--evaluator", "--preload", PRELOAD]
    proc = subprocess.run(
        [*launch, str(script), *args],
        capture_output=True,
        text=True,
        timeout=200,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    d = CheckpointDir(str(logdir))
    names = [c.name for c in d.checkpoints() if c.complete]
    # At most max_to_keep (5) were written, so none was removed: each is there to compare.
    # The first (step 200) and the final (600) always are; one due while the one before is
    # still being written is skipped, and on a loaded machine 200 steps of this model can take
    # less time than writing a checkpoint.
    assert 2 <= len(names) <= 5 and names[0] == "ckpt-200" and names[-1] == "ckpt-600", names
    manifests = [d.manifest(n) for n in names]
    assert [m.final for m in manifests] == [False] * (len(names) - 1) + [True]
    acc = EventAccumulator(str(logdir / "eval"), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("eval/loss")
    assert [e.step for e in events] == [m.global_step for m in manifests]
    assert events[-1].value < events[0].value  # it learns, and the evaluator sees it
    assert f"evaluator: {names[-1]} (global step {manifests[-1].global_step}) is the job's " in out
    assert "job finished: 3 tasks exited 0" in out


FAILING = """
    import os, sys, time
    import psflow

    ctx, argv = psflow.resolve()
    marker = argv[0]
    if ctx.is_evaluator:
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        sys.exit(3)
    deadline = time.monotonic() + 60
    while not os.path.exists(marker):  # the evaluator has not failed yet
        assert time.monotonic() < deadline, "no evaluator"
        time.sleep(0.01)
    pid = int(open(marker).read())
    while os.path.exists(f"/proc/{pid}"):  # until the launcher has seen it end (and reaped it)
        assert time.monotonic() < deadline, "evaluator still there"
        time.sleep(0.01)
    print(f"{ctx.task} trained on", flush=True)
"""


def test_a_failed_evaluator_does_not_stop_training_but_fails_the_job(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FAILING))
    proc = subprocess.run(
        [*LAUNCH, "--ps", "0", "--workers", "2", "--evaluator", str(script), str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "task evaluator:0 failed with exit code 3; training goes on without it" in out
    assert "worker:0 trained on" in out and "worker:1 trained on" in out
    assert "job finished, but evaluator:0 failed" in out


LINGERING = """
    import sys, time
    import psflow

    ctx, argv = psflow.resolve()
    if ctx.is_evaluator:
        print("evaluator waiting for a final checkpoint that never comes", flush=True)
        time.sleep(120)
        sys.exit(4)
"""


def test_an_evaluator_left_waiting_after_the_workers_is_stopped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(LINGERING))
    config = LaunchConfig(
        script=str(script), ps=0, workers=1, evaluators=1, eval_exit_timeout=0.5, grace=5
    )
    assert Launcher(config).run() == 1
    err = capfd.readouterr().err
    assert (
        "evaluator:0 did not exit within 0.5 s of the workers finishing (no final checkpoint "
        "to stop after?); stopping them" in err
    )


def test_one_evaluator_at_most() -> None:
    with pytest.raises(ValueError, match="evaluators must be 0 or 1, got 2"):
        LaunchConfig(script=__file__, evaluators=2)
