"""SIGTERM (what Kubernetes sends, 30 s before SIGKILL) ends every task cleanly: the chief
finishes its step and saves a final checkpoint, the workers say ``done``, the ps stops serving
once they have, and every task exits 0 within the grace period.

The tasks are the README's example, started directly (one process per task, as a cluster
manager starts them; each forked from a server that imported torch, :mod:`.forked`) and given
SIGTERM while they train towards a step they never reach.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest
import torch

from psflow.cluster.spec import ClusterSpec, TaskSpec
from psflow.train import CheckpointDir, TrainingSession
from psflow.transport import TransportConfig

from .forked import Forked
from .support import ROOT, local_cluster, start_ps, stop, worker_ctx

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150)]

EXAMPLE = ROOT / "examples" / "linear_regression.py"
GRACE = 30.0
"""Kubernetes' default terminationGracePeriodSeconds: SIGKILL follows SIGTERM after it."""


class Task:
    """One task of the job as its own process, its stderr read as it comes."""

    def __init__(
        self, cluster: ClusterSpec, task: TaskSpec, logdir: Path, env: dict[str, str]
    ) -> None:
        self.task = task
        e = dict(os.environ, TF_CONFIG=cluster.to_tf_config(task), PYTHONUNBUFFERED="1", **env)
        args = ["--logdir", str(logdir), "--train_steps", str(10**9)]
        args += ["--save_checkpoint_steps", "500"]
        self.proc = Forked([str(EXAMPLE), *args], env=e)
        self._err: list[str] = []
        for stream, lines in ((self.proc.stdout, []), (self.proc.stderr, self._err)):
            threading.Thread(target=_read, args=(stream, lines), daemon=True).start()

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def exit_code(self, timeout: float) -> int | None:
        """The exit code, or ``None`` if the task is still running after ``timeout``."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def _read(stream: IO[str], lines: list[str]) -> None:
    for line in iter(stream.readline, ""):  # a pipe not read would fill and block the task
        lines.append(line)


@contextmanager
def job(cluster: ClusterSpec, logdir: Path, env: dict[str, str]) -> Iterator[dict[str, Task]]:
    tasks = {str(t): Task(cluster, t, logdir, env) for t in cluster.tasks()}
    try:
        yield tasks
    finally:
        for t in tasks.values():
            if t.proc.poll() is None:
                t.proc.kill()
                t.proc.wait()


def wait_for_a_checkpoint(logdir: Path, tasks: dict[str, Task]) -> None:
    """Until the first scheduled checkpoint exists: the job is training (bounded, for a hang)."""
    deadline = time.monotonic() + 90
    while CheckpointDir(str(logdir)).latest() is None:
        for name, t in tasks.items():
            assert t.proc.poll() is None, f"{name} exited early:\n{t.stderr[-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint within 90 s"
        time.sleep(0.05)


def terminate(tasks: dict[str, Task], names: Sequence[str]) -> None:
    for name in names:
        tasks[name].proc.send_signal(signal.SIGTERM)


def assert_exit_0_within_grace(tasks: dict[str, Task], names: Sequence[str]) -> None:
    deadline = time.monotonic() + GRACE
    for name in names:
        code = tasks[name].exit_code(max(0.0, deadline - time.monotonic()))
        assert code == 0, (
            f"{name} exit code {code} (None: still running)\n{tasks[name].stderr[-3000:]}"
        )


def assert_final_checkpoint(logdir: Path, chief: Task) -> int:
    """The chief stopped at step N on SIGTERM and saved there: the latest checkpoint is at N or
    later, past every scheduled one. Returns N."""
    m = re.search(
        r"stopping at global step (\d+) on SIGTERM.*; saving the final checkpoint", chief.stderr
    )
    assert m, chief.stderr[-3000:]
    stopped_at = int(m.group(1))
    saved = CheckpointDir(str(logdir))
    latest = saved.latest()
    assert latest is not None
    final = saved.manifest(latest).global_step
    scheduled = [c.step for c in saved.checkpoints() if c.complete and c.name != latest]
    assert final >= stopped_at and all(s < final for s in scheduled), (final, scheduled)
    assert f"saved checkpoint {logdir}/{latest} (global step {final})" in chief.stderr
    # Not the job's end (a cluster manager may restart it): an evaluator waits on.
    assert not saved.manifest(latest).final
    return stopped_at


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_sigterm_to_every_task_ends_the_job_with_a_final_checkpoint(
    tmp_path: Path, mode: str
) -> None:
    """Kubernetes deleting the job: every pod gets SIGTERM at once. In synchronous mode the
    worker that stops first leaves the other's step unable to complete: that ends it too."""
    logdir = tmp_path / "run"
    with job(local_cluster(1, 2), logdir, {"PSFLOW_MODE": mode}) as tasks:
        wait_for_a_checkpoint(logdir, tasks)
        terminate(tasks, ["worker:0", "worker:1", "ps:0"])
        assert_exit_0_within_grace(tasks, ["worker:0", "worker:1", "ps:0"])
        assert_final_checkpoint(logdir, tasks["worker:0"])
        # Served until the workers were done (else it could not have saved), then exited.
        assert "every worker has finished; exiting" in tasks["ps:0"].stderr


def test_sigterm_to_the_chief_alone_saves_without_waiting_for_the_others(tmp_path: Path) -> None:
    """One pod evicted: the chief saves and exits within the grace period although worker:1
    trains on (the chief would otherwise wait up to end_timeout, 60 s, for it); SIGTERM to
    the rest later ends them too."""
    logdir = tmp_path / "run"
    with job(local_cluster(1, 2), logdir, {}) as tasks:
        wait_for_a_checkpoint(logdir, tasks)
        terminate(tasks, ["worker:0"])
        assert_exit_0_within_grace(tasks, ["worker:0"])
        assert_final_checkpoint(logdir, tasks["worker:0"])
        assert tasks["worker:1"].proc.poll() is None and tasks["ps:0"].proc.poll() is None
        terminate(tasks, ["worker:1", "ps:0"])
        assert_exit_0_within_grace(tasks, ["worker:1", "ps:0"])


@pytest.mark.parametrize("signalled", [["worker:1"], ["worker:0", "worker:1"]], ids=["one", "all"])
def test_sigterm_in_allreduce_mode_stops_every_rank_after_the_same_step(
    tmp_path: Path, signalled: list[str]
) -> None:
    """A rank that stopped alone would leave the others waiting in a collective: the request
    travels with the next step's gradients, every rank stops after that step, the chief saves."""
    logdir = tmp_path / "run"
    with job(local_cluster(0, 2), logdir, {"PSFLOW_MODE": "allreduce"}) as tasks:
        wait_for_a_checkpoint(logdir, tasks)
        terminate(tasks, signalled)
        assert_exit_0_within_grace(tasks, ["worker:0", "worker:1"])
        stopped_at = assert_final_checkpoint(logdir, tasks["worker:0"])
        m = re.search(r"stopping at global step (\d+) on SIGTERM", tasks["worker:1"].stderr)
        assert m and int(m.group(1)) == stopped_at  # the same step on both ranks
        final = CheckpointDir(str(logdir)).latest()
        assert final == f"ckpt-{stopped_at}"


def test_a_session_in_this_process_stops_on_sigterm_and_gives_the_handler_back(
    tmp_path: Path,
) -> None:
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    before = signal.getsignal(signal.SIGTERM)
    calls: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    mine = signal.getsignal(signal.SIGTERM)
    try:
        model = torch.nn.Linear(2, 1)
        with TrainingSession(
            model,
            worker_ctx(cluster),
            lr=0.1,
            checkpoint_dir=str(tmp_path / "ckpt"),
            save_checkpoint_steps=10**6,
            log_step_count_steps=None,
            save_summaries_steps=None,
            transport=TransportConfig(timeout=20),
        ) as sess:
            assert signal.getsignal(signal.SIGTERM) is not mine  # the session's own
            steps = 0
            while not sess.should_stop():
                sess.zero_grad()
                model(torch.ones(1, 2)).pow(2).sum().backward()
                sess.step()
                steps += 1
                if steps == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
        assert steps == 3 and sess.global_step == 3
        assert signal.getsignal(signal.SIGTERM) is mine and not calls
        assert CheckpointDir(str(tmp_path / "ckpt")).latest() == "ckpt-3"  # the final one
        code, err = stop(ps)
        assert code == 0, err[-3000:]
    finally:
        signal.signal(signal.SIGTERM, before)
        stop(ps, timeout=1)


def test_sigterm_ends_a_workers_wait_for_a_lost_ps(tmp_path: Path) -> None:
    """A ps killed: the workers wait up to PSFLOW_RECOVERY_TIMEOUT (here 600 s) for it to come
    back. SIGTERM (the launcher stopping the job, Kubernetes deleting it) ends that wait within
    the grace period, with an error naming the ps."""
    logdir = tmp_path / "run"
    env = {"PSFLOW_RECOVERY_TIMEOUT": "600"}  # a killed ps's connection closes: no timeout
    with job(local_cluster(1, 2), logdir, env) as tasks:
        wait_for_a_checkpoint(logdir, tasks)
        tasks["ps:0"].proc.kill()
        for name in ("worker:0", "worker:1"):
            deadline = time.monotonic() + 90
            while "waiting up to 600 s for every ps" not in tasks[name].stderr:
                assert tasks[name].proc.poll() is None, tasks[name].stderr[-3000:]
                assert time.monotonic() < deadline, tasks[name].stderr[-3000:]
                time.sleep(0.05)
        terminate(tasks, ["worker:0", "worker:1"])
        for name in ("worker:0", "worker:1"):
            code = tasks[name].exit_code(GRACE)
            err = tasks[name].stderr
            assert code == 1, f"{name} exit code {code} (None: still running)\n{err[-3000:]}"
            assert f"{name} stopped by SIGTERM while it waited for the ps" in err, err[-3000:]
            assert "ps:0" in err.rsplit("stopped by SIGTERM", 1)[1].splitlines()[0]
