"""Stopping a local job's tasks: SIGTERM, then SIGKILL at a deadline (at once after a second
Ctrl-C); and removing the shared-memory files each task left once it ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time

from psflow.cluster import shmfiles
from psflow.cluster.forkserver import ANSWER_TIMEOUT, ForkedTask
from psflow.cluster.launch_start import TaskStarting
from psflow.cluster.spec import TaskSpec

KILLED_WAIT = ANSWER_TIMEOUT + 5.0
"""Seconds a task gets to be gone after SIGKILL (a forked one: for its fork server to report it,
or be taken for stopped)."""


class TaskStopping(TaskStarting):
    """Stopping the tasks, for :class:`~psflow.cluster.launcher.Launcher` (a mixin: the launcher
    holds the state below)."""

    _kill_now: threading.Event

    def _terminate(self, tasks: list[TaskSpec], deadline: float) -> None:
        """SIGTERM to ``tasks``; SIGKILL to those still running at ``deadline``."""
        started = time.monotonic()
        for task in tasks:
            if self.procs[task].poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.procs[task].pid, signal.SIGTERM)
                    # A stopped (SIGSTOP) task takes SIGTERM only once it runs again.
                    os.killpg(self.procs[task].pid, signal.SIGCONT)
        while any(self._running(t) for t in tasks):
            if self._kill_now.is_set() or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        left = [t for t in tasks if self._running(t)]
        if left:
            names = ", ".join(map(str, left))
            if self._kill_now.is_set():
                self._say(f"killing {names} (SIGKILL)")
            else:
                self._say(f"{names} not gone {deadline - started:.0f} s after SIGTERM (SIGKILL)")
        for task in left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[task].pid, signal.SIGKILL)
        for task in tasks:  # and those that ended, for their code
            if self.procs[task].poll() is not None:
                continue
            try:
                self.procs[task].wait(KILLED_WAIT)
            except subprocess.TimeoutExpired:
                pid = self.procs[task].pid
                self._say(f"{task} (pid {pid}) still there {KILLED_WAIT:g} s after SIGKILL")

    def _running(self, task: TaskSpec) -> bool:
        """Whether ``task`` still runs (a forked one that exited, its code not yet reported by
        its fork server, does not)."""
        proc = self.procs[task]
        if isinstance(proc, ForkedTask):
            return not proc.ended()
        return proc.poll() is None

    def _sweep(self) -> None:
        """Removes the shared-memory files of each task that has exited (once per task)."""
        for task, proc in self.procs.items():
            if proc.pid in self._swept or proc.poll() is None:
                continue
            self._swept.add(proc.pid)
            removed = shmfiles.remove_files_of(proc.pid)
            if removed:
                self._say(f"removed {len(removed)} shared-memory files {task} left behind")
