"""The linear-regression example across hosts: every task in its own network namespace.

Each task has its own address on a bridge, so every byte crosses a real (virtual) network and
the shared-memory path is off. Cutting the ps's link for a few seconds must not hang anything:
the workers go on once it is back, or, cut past the transport's timeout, fail with an error
naming the ps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.hosts.netns import Hosts, hosts, unavailable
from tests.paths import ROOT

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(240)]

_why_not = unavailable()
if _why_not is not None:
    pytestmark.append(pytest.mark.skip(reason=f"no network namespaces: {_why_not}"))

EXAMPLE = ROOT / "examples" / "linear_regression.py"
PORT = 2222
STEP_LINE = re.compile(r"step (\d+)")


class Task:
    """One task's process on its host, with its output read as it comes."""

    def __init__(self, proc: subprocess.Popen[str], name: str) -> None:
        self.proc, self.name = proc, name
        self.out: list[str] = []
        self.err: list[str] = []
        self.steps = threading.Condition()
        self.step = 0
        self._readers = [
            threading.Thread(target=self._read, args=(proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(proc.stderr, self.err), daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: object, sink: list[str]) -> None:
        for line in iter(stream.readline, ""):  # type: ignore[attr-defined]
            sink.append(line)
            m = STEP_LINE.search(line)
            if m:
                with self.steps:
                    self.step = max(self.step, int(m.group(1)))
                    self.steps.notify_all()

    def wait_step(self, step: int, timeout: float) -> None:
        with self.steps:
            reached = self.steps.wait_for(
                lambda: self.step >= step or self.proc.poll() is not None, timeout
            )
        assert reached and self.step >= step, f"{self.name} never reached step {step}: {self.log()}"

    def finish(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            for t in self._readers:
                t.join(5)
        return code

    def log(self) -> str:
        return "".join(self.out[-20:] + self.err[-20:])


@pytest.fixture
def net() -> Iterator[Hosts]:
    with hosts(3) as h:
        yield h


def _start(
    net: Hosts, tmp_path: Path, *, train_steps: int, env: dict[str, str], args: Sequence[str] = ()
) -> list[Task]:
    cluster = {
        "ps": [f"{net.address(0)}:{PORT}"],
        "worker": [f"{net.address(1)}:{PORT}", f"{net.address(2)}:{PORT}"],
    }
    tasks = []
    for host, (job, index) in enumerate([("ps", 0), ("worker", 0), ("worker", 1)]):
        task_env = {
            **os.environ,
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}}),
            "PSFLOW_SHM": "0",  # hosts share no memory: every byte crosses the network
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        cmd = [
            sys.executable,
            str(EXAMPLE),
            f"--train_steps={train_steps}",
            f"--logdir={tmp_path / 'run'}",
            *args,
        ]
        proc = net.popen(host, cmd, env=task_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        tasks.append(Task(proc, f"{job}:{index}"))
    return tasks


def _stop_all(tasks: list[Task]) -> None:
    for t in tasks:
        if t.proc.poll() is None:
            t.proc.kill()
        t.finish(10)


def test_linear_regression_trains_across_hosts_and_rides_out_a_cut_ps_link(
    net: Hosts, tmp_path: Path
) -> None:
    # Twice the example's lr in half the former 6,000 steps, the cut at half the former step
    # (1,000; a progress line every 500 to see it): the same lr x steps at the cut and at the
    # end, so the same W and b bounds hold.
    ps, chief, other = tasks = _start(
        net,
        tmp_path,
        train_steps=3000,
        env={},
        args=["--lr", "0.002", "--log_step_count_steps", "500"],
    )
    try:
        chief.wait_step(500, timeout=120)
        net.cut(0)
        time.sleep(3)  # the fault itself: the ps's cable out for three seconds
        net.mend(0)
        for t in (chief, other, ps):
            assert t.finish(timeout=150) == 0, f"{t.name} failed: {t.log()}"
    finally:
        _stop_all(tasks)
    result = re.search(r"W=(-?[\d.]+) b=(-?[\d.]+)", "".join(chief.out))
    assert result, chief.log()
    w, b = map(float, result.groups())
    assert abs(w - 2.0) < 0.05 and abs(b - 0.3) < 0.05, (w, b)


def test_a_ps_cut_off_past_the_timeout_is_named_by_the_workers(net: Hosts, tmp_path: Path) -> None:
    # A request gives up after PSFLOW_TIMEOUT; the session then waits PSFLOW_RECOVERY_TIMEOUT
    # for the ps to answer again (a restarted ps is restored in that window) before it fails.
    env = {"PSFLOW_TIMEOUT": "10", "PSFLOW_RECOVERY_TIMEOUT": "10"}
    _ps, chief, other = tasks = _start(net, tmp_path, train_steps=10**7, env=env)
    try:
        chief.wait_step(1000, timeout=120)
        net.cut(0)
        cut_at = time.monotonic()
        for t in (chief, other):
            code = t.finish(timeout=60)
            assert code != 0, f"{t.name} went on without its ps: {t.log()}"
            assert "ps:0" in "".join(t.err), f"{t.name}'s error does not name ps:0: {t.log()}"
        elapsed = time.monotonic() - cut_at
        print(f"workers failed {elapsed:.1f} s after the cut ({env})")
    finally:
        net.mend(0)
        _stop_all(tasks)
