"""Session-wide fixtures: no test leaves a child process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from psflow.env import OMP_NUM_THREADS, TASK_DEFAULTS, threads_per_task
from tests.yields import yields  # noqa: F401 (a fixture: a thread's looks counted)

ROOT = Path(__file__).resolve().parent.parent

# What psflow launch gives every task, here before torch loads: the test process and every ps
# and worker it starts. OpenMP's spinning threads otherwise take the cores the other
# processes of a test need (a profiled sparse step: 36 ms spinning, 6 ms passive).
for _name, _value in TASK_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
# And the cores shared out, as launch does for its tasks: the pytest processes (pytest-xdist's,
# PYTEST_XDIST_WORKER_COUNT) each run torch on one share instead of all of them.
os.environ.setdefault(
    OMP_NUM_THREADS, threads_per_task(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux /proc), deepest last."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        for child in map(int, text.split()):
            out.append(child)
            out.extend(_children(child))
    return out


@pytest.fixture(autouse=True, scope="session")
def reap_children() -> Iterator[None]:
    """Kills whatever child process the tests left behind, and fails loudly if any were."""
    yield
    leftover = _children(os.getpid())
    for pid in leftover:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[None]:
    before = set(_children(os.getpid()))
    yield
    now = _children(os.getpid())
    after = set(now) - before
    # Some keep a long-lived child on purpose: pyspark's JVM, and multiprocessing's fork server
    # (and its resource tracker) that tests/multiproc/forked.py forks ps tasks from. Only python
    # tasks count; a forked task left behind is the server's child, and counts. The JVM's own
    # short-lived helpers do not (a `getconf PAGESIZE` was once caught between start and exit).
    leaked = []
    jvm_helpers: set[int] = set()
    for pid in now:  # a JVM started by an earlier test (a module's Spark session) too
        with contextlib.suppress(OSError):
            if b"java" in Path(f"/proc/{pid}/cmdline").read_bytes():
                jvm_helpers.update(_children(pid))
    for pid in after:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "java" in cmd or "pyspark" in cmd or "from multiprocessing." in cmd:
            continue
        leaked.append((pid, cmd))
    leaked = [(pid, cmd) for pid, cmd in leaked if pid not in jvm_helpers]
    for pid, _ in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not leaked, f"test left processes behind: {leaked}"


@pytest.fixture(params=["native", "fallback"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test on both paths of psflow's compiled modules (``tests/kernels.py`` lists them):
    the C code (the sparse tables' row kernels, the data layer's hash and Example parser) and
    the fallback of an install without a compiler or ``PSFLOW_KERNELS=0`` (torch's index
    operations; numpy and Python)."""
    from tests.kernels import need_kernels, wrappers

    if request.param == "fallback":
        for module, attr in wrappers():
            monkeypatch.setattr(module, attr, None)
    else:
        need_kernels()
    return str(request.param)


@pytest.fixture(autouse=True)
def subnormal_mode_given_back() -> Iterator[None]:
    """An optimizer left open (a test that simulates a kill) leaves its thread taking subnormals
    as zero, as psflow's workers do while one is open: the next test on this process's main
    thread starts with torch's default mode and no optimizer holding it, whatever ran before
    (``psflow.worker.optimizer``'s holds are per thread)."""
    yield
    from psflow.worker import optimizer

    optimizer._flush_holds.pop(threading.get_ident(), None)
    torch.set_flush_denormal(False)
