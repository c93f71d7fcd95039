"""The names of a task's shared-memory files, and removing a dead task's (issue 16, item 9)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from psflow.cluster import shmfiles

pytestmark = pytest.mark.unit


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


def _touch(d: Path, name: str) -> Path:
    path = d / name
    path.write_bytes(b"")
    return path


def test_a_name_says_whose_it_is() -> None:
    name = shmfiles.new_name()
    assert shmfiles.NAME.match(name)
    assert shmfiles.owner(name) == (os.getpid(), shmfiles.pid_namespace())
    assert shmfiles.owner(name + ".q") == shmfiles.owner(name)
    assert shmfiles.owner("psflow-" + "0" * 32) is None  # the old, anonymous form
    assert shmfiles.owner(name + ".x") is None
    assert new_names_differ()


def new_names_differ() -> bool:
    return len({shmfiles.new_name() for _ in range(10)}) == 10


def test_only_files_of_dead_processes_of_this_namespace_go(tmp_path: Path) -> None:
    ns = shmfiles.pid_namespace()
    dead = _dead_pid()
    tag = "ab" * 16
    gone = [_touch(tmp_path, f"psflow-{dead}-{ns}-{tag}{s}") for s in ("", ".q", ".r")]
    kept = [
        _touch(tmp_path, f"psflow-{os.getpid()}-{ns}-{tag}"),  # alive: this process
        _touch(tmp_path, f"psflow-{dead}-{ns + 1}-{tag}"),  # another pid namespace
        _touch(tmp_path, f"psflow-{dead}-{ns}-{tag}.other"),  # not a lane file
        _touch(tmp_path, "psflow-" + "0" * 32),  # not named for anyone
        _touch(tmp_path, f"torch-{dead}"),
    ]
    os.symlink("/etc/hostname", tmp_path / f"psflow-{dead}-{ns}-{'cd' * 16}")
    removed = shmfiles.remove_stale(str(tmp_path))
    assert sorted(removed) == sorted(map(str, gone))
    assert all(p.exists() for p in kept)
    assert os.path.lexists(tmp_path / f"psflow-{dead}-{ns}-{'cd' * 16}")  # never a link


def test_the_files_of_one_process(tmp_path: Path) -> None:
    ns = shmfiles.pid_namespace()
    mine = [_touch(tmp_path, f"psflow-4242-{ns}-{'ef' * 16}{s}") for s in ("", ".q")]
    other = _touch(tmp_path, f"psflow-4243-{ns}-{'ef' * 16}")
    assert shmfiles.files_of(4242, str(tmp_path)) == sorted(map(str, mine))
    assert shmfiles.remove_files_of(4242, str(tmp_path)) == sorted(map(str, mine))
    assert not any(p.exists() for p in mine) and other.exists()
    assert shmfiles.files_of(4242, str(tmp_path / "missing")) == []


def test_a_lane_of_a_killed_process_goes_when_the_next_one_is_made() -> None:
    """A real lane, made by a process SIGKILLed before anyone could remove its files."""
    from psflow.transport import shm

    if not os.path.isdir(shm.SHM_DIR):
        pytest.skip("no /dev/shm")
    code = (
        "import os, signal, sys; from psflow.transport.shm import Lane; "
        "lane = Lane.create(4096, 4096); print(lane.name, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == -9
    name = proc.stdout.strip()
    paths = [os.path.join(shm.SHM_DIR, name + s) for s in ("", ".q", ".r")]
    assert all(os.path.exists(p) for p in paths)  # left behind: nobody could remove them
    try:
        code = "from psflow.transport.shm import Lane; Lane.create(0, 0).unlink()"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        assert not any(os.path.exists(p) for p in paths)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
