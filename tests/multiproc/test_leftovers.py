"""Nothing left in /dev/shm: no way a task ends (killed, refused, timed out) leaves a lane file
of its job behind (issue 16, item 9)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from psflow.cluster import shmfiles

from .lines import Lines
from .support import ROOT, freeze, launch_cmd

pytestmark = pytest.mark.timeout(240)

SCRIPTS = ROOT / "tests" / "multiproc" / "scripts"
FAULTS = ROOT / "tests" / "faults.py"


def _pids(d: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in d.glob("*.pid") if p.read_text()}


def _wait_pids(d: Path, names: set[str], timeout: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while not names <= set(_pids(d)):
        assert time.monotonic() < deadline, f"no pid of {names - set(_pids(d))} within {timeout} s"
        time.sleep(0.05)
    return _pids(d)


def _lane_files_of(pids: dict[str, int]) -> list[str]:
    return [f for pid in pids.values() for f in shmfiles.files_of(pid)]


def _open_lane_files(pid: int) -> set[str]:
    """The ``/dev/shm/psflow-*`` files process ``pid`` has mapped or open (whatever they are
    named: this reads the process, not the directory)."""
    found = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        m = re.search(r"(/dev/shm/psflow-\S+)", line)
        if m:
            found.add(m.group(1).removesuffix(" (deleted)"))
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("/dev/shm/psflow-") and not target.endswith(" (deleted)"):
            found.add(target)
    return found


def _launch(script: Path, *args: str, **env: str) -> tuple[subprocess.Popen[str], Lines]:
    proc = subprocess.Popen(
        # A short grace: a frozen ps cannot act on SIGTERM, and the launcher's 30 s of grace
        # (for a chief's last checkpoint) would only make this test wait.
        launch_cmd(script, *args, workers=1, grace=3, preload=True),
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, Lines(proc.stdout)


@pytest.mark.parametrize("then", ["ps_goes_on", "ps_killed", "attach_times_out"])
def test_a_worker_stopped_in_the_middle_of_an_attach_leaves_no_file(
    tmp_path: Path, then: str
) -> None:
    """The worker has made its lane's files and waits for the ps (frozen) to attach them."""
    env = {"PSFLOW_TIMEOUT": "2"} if then == "attach_times_out" else {}
    proc, out = _launch(SCRIPTS / "lane_attach.py", str(tmp_path), **env)
    ps = None
    try:
        out.wait_for(r"^\[worker:0\] ready$", 60)
        pids = _wait_pids(tmp_path, {"ps:0", "worker:0"})
        ps, worker = pids["ps:0"], pids["worker:0"]
        freeze(ps)
        (tmp_path / "go").touch()
        deadline = time.monotonic() + 60
        while len(files := _open_lane_files(worker)) < 3:  # the segment and its two FIFOs
            assert time.monotonic() < deadline, files
            time.sleep(0.01)
        assert all(os.path.exists(f) for f in files)
        if then == "attach_times_out":
            # The worker's own attach gives up (PSFLOW_TIMEOUT) and the worker fails.
            proc.wait(timeout=120)
        else:
            os.kill(worker, signal.SIGKILL)
            if then == "ps_killed":
                os.kill(ps, signal.SIGKILL)  # nobody will ever attach them
            else:
                os.kill(ps, signal.SIGCONT)  # it attaches them for a client that is gone
            proc.wait(timeout=120)
        assert proc.returncode == 1
        left = [f for f in files if os.path.exists(f)]
        assert not left, f"left in /dev/shm: {left}"
        assert _lane_files_of(pids) == []
    finally:
        if ps is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(ps, signal.SIGCONT)
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("fault", ["kill_worker", "kill_ps", "ps_refuses_lanes"])
def test_no_lane_file_of_a_job_remains(tmp_path: Path, fault: str) -> None:
    logdir, pid_dir = tmp_path / "logs", tmp_path / "pids"
    pid_dir.mkdir()
    script = [str(SCRIPTS / "plain_train.py"), "--logdir", str(logdir), "--pid-dir", str(pid_dir)]
    if fault == "kill_worker":
        args = [str(FAULTS), "--kill-at", "worker:1@60", *script, "--steps", "100000"]
    elif fault == "kill_ps":
        args = [*script, "--steps", "100000"]
    else:
        args = [*script, "--steps", "200", "--ps-no-shm"]
    proc = subprocess.Popen(
        launch_cmd(Path(args[0]), *args[1:], workers=2, preload=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    err = Lines(proc.stderr)
    try:
        pids = _wait_pids(pid_dir, {"ps:0", "worker:0", "worker:1"})
        if fault == "kill_ps":
            err.wait_for(r"saved checkpoint", 120)  # training, with lanes attached
            os.kill(pids["ps:0"], signal.SIGKILL)
        code = proc.wait(timeout=180)
        text = err.rest()
        if fault == "ps_refuses_lanes":
            assert code == 0, text
            assert "no shared-memory lane: shared memory is off on this server" in text
        else:
            assert code == 1, text
            killed = "worker:1" if fault == "kill_worker" else "ps:0"
            assert f"task {killed} failed with signal 9" in text
        assert _lane_files_of(pids) == []
    finally:
        proc.kill()
        proc.wait()
