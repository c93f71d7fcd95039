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
