"""Reading a running process's output line by line, to wait on what it says (never on a guess
of how fast this machine is)."""

from __future__ import annotations

import queue
import re
import threading
import time
from typing import IO


class Lines:
    """Every line of ``stream``, read by a thread as it comes; :meth:`wait_for` returns the
    first new line that matches.

    Example:
        >>> # out = Lines(proc.stderr); out.wait_for(r"waiting for ps:0", timeout=60)
    """

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in iter(stream.readline, ""):
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first line from now on that matches ``pattern``.

        Raises:
            AssertionError: when the stream ends or ``timeout`` (an upper bound) passes first.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line matching {pattern!r} within {timeout:g} s:\n" + self.text()
                ) from None
            if line is None:
                self._queue.put(None)  # later waits see the end too
                raise AssertionError(f"the stream ended before {pattern!r}:\n" + self.text())
            self.seen.append(line)
            m = re.search(pattern, line)
            if m:
                return m

    def rest(self, timeout: float = 30) -> str:
        """Everything, once the stream has ended (its process exited)."""
        self._thread.join(timeout)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.seen.append(line)
        return self.text()

    def text(self) -> str:
        return "\n".join(self.seen)
