"""A training script's ``psflow.resolve()`` under ``psflow launch``: its own flags reach it, and a
mistake in the cluster flags is one line per task, not a traceback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .support import launch_cmd

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import psflow

ctx, argv = psflow.resolve()
print("resolved", ctx.task, argv)
"""


def launch(script: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    proc = subprocess.run(
        launch_cmd(script, *args, ps=1, workers=1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=100,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout.splitlines()


def test_every_task_gets_the_scripts_own_flags(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    flags = ["--cluster", "{}", "--job", "ps", "--ps", "1", "--worker=2", "--task", "3"]
    rc, lines = launch(script, *flags)
    assert rc == 0, lines
    assert f"[ps:0] resolved ps:0 {flags}" in lines
    assert f"[worker:0] resolved worker:0 {flags}" in lines


def test_a_mistake_is_one_line_in_each_tasks_output(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    rc, lines = launch(script, "--job_name", "wroker")
    assert rc != 0
    assert not any("Traceback" in line for line in lines), lines
    error = "train.py: error: unknown job 'wroker' (did you mean 'worker'?)"
    from_tasks = [line for line in lines if line.startswith("[")]
    # The first task to fail stops the other, which may or may not have printed by then.
    assert from_tasks and all(error in line for line in from_tasks), lines
    assert any("failed with exit code 2" in line for line in lines), lines

    rc, lines = launch(script, "--job_name", "wroker", env={"PSFLOW_LOG_LEVEL": "DEBUG"})
    assert rc != 0
    assert any("Traceback (most recent call last)" in line for line in lines), lines


AFFINITY = """
import os
import psflow

ctx, _ = psflow.resolve()
print("cores", ctx.task, sorted(os.sched_getaffinity(0)), os.environ["OMP_NUM_THREADS"])
"""


def test_bind_cores_binds_each_task_to_the_cores_it_was_dealt(tmp_path: Path) -> None:
    from psflow.cluster.cores import core_sets, host_cpus
    from psflow.cluster.spec import TaskSpec

    script = tmp_path / "train.py"
    script.write_text(AFFINITY)
    cmd = launch_cmd(script, ps=2, workers=1)
    cmd.insert(cmd.index(str(script)), "--bind-cores")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100, env=env
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, lines
    tasks = [TaskSpec(job="ps", index=0), TaskSpec(job="ps", index=1), TaskSpec(job="worker")]
    for task, cores in core_sets(tasks, host_cpus()).items():
        assert f"[{task}] cores {task} {cores} {len(cores)}" in lines, lines


DEVICES = """
import os
import psflow

ctx, _ = psflow.resolve()
print("gpus", ctx.task, repr(os.environ.get("CUDA_VISIBLE_DEVICES")))
"""


def test_gpus_per_task_gives_each_trainer_its_own_and_the_ps_none(tmp_path: Path) -> None:
    """The job's GPUs are CUDA_VISIBLE_DEVICES's (here: made up, no GPU is touched): the
    chief and each worker see their own, dealt in order, and the ps sees none; too few GPUs for
    the trainers is an error before any task starts."""
    script = tmp_path / "train.py"
    script.write_text(DEVICES)
    cmd = launch_cmd(script, ps=1, workers=2)
    cmd[cmd.index(str(script)) : cmd.index(str(script))] = ["--chief", "--gpus-per-task", "1"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "3,5,7"}
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100, env=env
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, lines
    for task, seen in (("chief:0", "3"), ("worker:0", "5"), ("worker:1", "7"), ("ps:0", "")):
        assert f"[{task}] gpus {task} {seen!r}" in lines, lines
    assert "psflow launch: GPUs (CUDA_VISIBLE_DEVICES): chief:0 3, worker:0 5, worker:1 7; " \
        "the other tasks see none" in lines, lines  # fmt: skip

    env["CUDA_VISIBLE_DEVICES"] = "3,5"
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=100, env=env
    )
    assert proc.returncode != 0
    assert "needs 3 GPU(s); this host has 2 (CUDA_VISIBLE_DEVICES=3,5)" in proc.stdout
    assert "[" not in proc.stdout, proc.stdout  # no task started
