"""What a user sees of a launched job: psflow's INFO lines without any logging setup, each
once; and a job stopped with SIGTERM or Ctrl-C, every task gone within the grace period
(issue 16, item 11)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import psflow
from psflow.cluster.spec import TaskSpec

from .lines import Lines
from .support import ROOT, launch_cmd, local_cluster, start_ps, stop, task_env, worker_ctx

pytestmark = pytest.mark.timeout(240)

SCRIPTS = ROOT / "tests" / "multiproc" / "scripts"


def _pids(d: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in d.glob("*.pid") if p.read_text()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.split(") ")[1][0] != "Z"  # a zombie is dead


def _train(logdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PSFLOW_LOG_LEVEL"}  # the launcher's default
    return subprocess.run(
        launch_cmd(SCRIPTS / "plain_train.py", "--logdir", str(logdir), "--steps", "40", *args),
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_psflow_info_lines_show_in_a_launched_job_without_logging_setup(tmp_path: Path) -> None:
    proc = _train(tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert re.search(r"^\[ps:0\] .* INFO psflow.ps.server: ps:0 serving on ", err, re.M), err
    assert re.search(
        r"^\[worker:0\] .* INFO psflow.worker.exchange: worker:0 initialised the ps$", err, re.M
    )
    assert re.search(
        r"^\[worker:0\] .* INFO psflow.train.checkpoint: saved checkpoint .* \(global step \d+\)",
        err,
        re.M,
    )
    assert "[ps:0]" in err and "every worker has finished" in err
    # Run again: the chief says what it restored.
    proc = _train(tmp_path / "logs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"^\[worker:0\] .* INFO psflow.train.session: restored Linear from ", proc.stderr, re.M
    )


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_script_that_configures_logging_sees_each_line_once(tmp_path: Path, when: str) -> None:
    proc = _train(tmp_path / "logs", f"--basic-config={when}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines.count("[worker:0] INFO psflow.worker.exchange: worker:0 initialised the ps") == 1
    saved = [line for line in lines if "saved checkpoint" in line]
    assert saved and len(saved) == len(set(saved))
    assert all(line.startswith("[worker:0] INFO psflow.train.checkpoint:") for line in saved)


def _launch_stubborn(
    tmp_path: Path, grace: float
) -> tuple[subprocess.Popen[str], Lines, dict[str, int]]:
    cmd = launch_cmd(SCRIPTS / "stubborn.py", str(tmp_path))
    cmd[cmd.index("launch") + 1 : cmd.index("launch") + 1] = ["--grace", f"{grace:g}"]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "IGNORE_SIGTERM": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err = Lines(proc.stdout), Lines(proc.stderr)
    try:
        for _ in range(3):
            out.wait_for(r"started (ps|worker):\d", 60)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, err, _pids(tmp_path)


def test_sigterm_stops_a_job_whose_tasks_ignore_it_within_the_grace_period(tmp_path: Path) -> None:
    proc, err, pids = _launch_stubborn(tmp_path, grace=3)
    try:
        assert sorted(pids) == ["ps:0", "worker:0", "worker:1"]
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        err.wait_for(r"received SIGTERM; stopping every task \(SIGTERM, then SIGKILL after 3 s", 30)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        assert code == 128 + signal.SIGTERM
        assert elapsed >= 6  # the workers had their grace period, then the ps theirs
        text = err.rest()
        # The workers first (a chief saving on SIGTERM needs its ps), then the ps.
        workers = text.index("worker:0, worker:1 not gone 3 s after SIGTERM (SIGKILL)")
        assert text.index("ps:0 not gone 3 s after SIGTERM (SIGKILL)") > workers, text
        assert not any(_alive(p) for p in pids.values())
    finally:
        proc.kill()
        proc.wait()
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_ctrl_c_kills_at_once(tmp_path: Path) -> None:
    proc, err, pids = _launch_stubborn(tmp_path, grace=600)
    try:
        proc.send_signal(signal.SIGINT)
        err.wait_for(r"received SIGINT; stopping every task", 30)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)  # far within the 600 s grace
        assert code == 128 + signal.SIGINT
        assert "received SIGINT again; killing every task now" in err.rest()
        assert not any(_alive(p) for p in pids.values())
    finally:
        proc.kill()
        proc.wait()
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_ps_given_sigterm_serves_its_workers_on_then_stops() -> None:
    """As Kubernetes stops every pod of a job at once: a chief saving on SIGTERM needs its ps."""
    cluster = local_cluster(1, 1)
    ps = start_ps(cluster)
    assert ps.stderr is not None
    err = Lines(ps.stderr)
    model = torch.nn.Linear(2, 1)
    opt = psflow.DistributedOptimizer(model, worker_ctx(cluster), lr=0.1)
    steps: list[int] = []
    keep_going = threading.Event()
    keep_going.set()

    def train() -> None:
        while keep_going.is_set():
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            steps.append(opt.step())

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        ps.send_signal(signal.SIGTERM)
        err.wait_for(
            r"ps:0 received SIGTERM: serving on while its workers ask \(for worker:0\)", 60
        )
        served = len(steps)
        deadline = time.monotonic() + 60
        while len(steps) < served + 20:  # served on after SIGTERM
            assert trainer.is_alive() and time.monotonic() < deadline
            time.sleep(0.01)
        keep_going.clear()
        trainer.join(60)
        # Once nobody asks any more (no 'done' came: the worker was stopped), it stops.
        assert ps.wait(timeout=60) == 0, err.rest()
        assert "ps:0: stopping on SIGTERM" in err.rest()
    finally:
        keep_going.clear()
        trainer.join(60)
        opt.close(finished=False)
        stop(ps, timeout=1)


def test_a_ps_takes_a_sigterm_that_another_of_its_threads_received() -> None:
    """A SIGTERM sent while the ps is stopped (SIGSTOP) is taken, once it goes on, by any of its
    threads (here sent to one of them); the main thread's join must wake for its handler to
    run (it waited for good: the ps served on until SIGKILL)."""
    cluster = local_cluster(1, 1)
    env = task_env(cluster, TaskSpec(job="ps", index=0))  # a python of its own, not a fork
    ps = subprocess.Popen(
        [sys.executable, "-c", _TERM_TO_A_THREAD], env=env, stderr=subprocess.PIPE, text=True
    )
    assert ps.stderr is not None
    err = Lines(ps.stderr)
    try:
        err.wait_for(r"ps:0 received SIGTERM", 30)
        assert ps.wait(timeout=60) == 0, err.rest()  # nobody asks: it stops on its own
    finally:
        stop(ps, timeout=1)


_TERM_TO_A_THREAD = """
import logging, signal, threading, time, psflow
logging.basicConfig(level=logging.INFO)
ctx, _ = psflow.resolve([])
def term():
    while signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # until the ps's join takes it
        time.sleep(0.05)
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
threading.Thread(target=term, daemon=True).start()
psflow.ParameterServer(ctx).join()
"""
