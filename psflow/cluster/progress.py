"""``psflow launch``'s live progress line, below the tasks' output, read from their metrics.

While the line shows, the launcher's standard output and error print above it, each line as
it is (:class:`_AboveLive`); :meth:`ProgressLine.stop` gives them back.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping

from rich.console import Console
from rich.live import Live
from rich.text import Text

from psflow.cluster.watch import JobView, progress_line


class _AboveLive:
    """A text stream whose lines a rich console prints above its live display, unwrapped."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._partial = ""

    def write(self, text: str) -> int:
        *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            self.console.print(line, markup=False, highlight=False, emoji=False, soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


class ProgressLine:
    """One live line (step, rate, loss, ETA, tasks up) below the output on ``sys.stdout``.

    Args:
        metrics_at: task (``ps:0``) to the ``host:port`` where it serves its metrics.
        alive: whether a task's process runs (the launcher knows).
    """

    def __init__(self, metrics_at: Mapping[str, str], alive: Callable[[str], bool]) -> None:
        self._view = JobView(metrics_at, alive=alive, timeout=0.5)
        self._console = Console(file=sys.stdout)
        self._live = Live(
            Text("starting ..."),
            console=self._console,
            refresh_per_second=2,
            redirect_stdout=False,  # rich's proxies would wrap the tasks' lines
            redirect_stderr=False,
        )
        self._std = sys.stdout, sys.stderr
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="psflow-progress", daemon=True)

    def start(self) -> None:
        """Shows the line; from now on ``sys.stdout`` and ``sys.stderr`` print above it."""
        self._std = sys.stdout, sys.stderr
        self._live.start()
        # The tasks' lines (and the launcher's) go above the progress line, as they are.
        sys.stdout = sys.stderr = _AboveLive(self._console)  # type: ignore[assignment]
        self._watcher.start()

    def _watch(self) -> None:
        while True:
            _, summary = self._view.poll()
            self._live.update(progress_line(summary))
            if self._done.wait(1.0):
                return

    def stop(self) -> None:
        """Removes the line and gives ``sys.stdout`` and ``sys.stderr`` back (once started)."""
        self._done.set()
        self._watcher.join(timeout=5)
        self._live.stop()
        sys.stdout, sys.stderr = self._std
        self._view.close()
