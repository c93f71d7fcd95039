"""Task processes forked from a server that imported torch and psflow once.

A task started as ``python -c ...`` spends 1.5-2 s of CPU importing torch before it serves: on a
2-core machine, the tests' hundred-odd ps processes cost minutes that way. Here each one is
forked from multiprocessing's fork server, which imported torch, psflow and the tests' fault
injection once per test process. The child is still a process of its own, with its own
environment, its own stdout and stderr (pipes the test reads, as ``subprocess.Popen``'s) and
its own sockets; what it skips is the import. The fork server is single-threaded and has run no
torch operation, so nothing a child inherits is half-initialised (no OpenMP pool, no ZeroMQ
context, no lock held by another thread).

:class:`Forked` answers what the tests ask of a ``subprocess.Popen`` (``pid``, ``poll``,
``wait``, ``communicate``, ``send_signal``, ``kill``, ``stdout``, ``stderr``, ``returncode``).
"""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing import reduction
from pathlib import Path
from typing import IO, Any

_CONTEXT = multiprocessing.get_context("forkserver")
# torch._dynamo too: torch imports it at the first torch.optim optimizer a process builds (a ps
# builds one for its first variables), 1.5 s of CPU and 800 modules more in each task else. It
# starts no thread (multiprocessing's preload would not say so: the ForkServer of psflow launch
# --preload checks, and tests.fault_matrix.PRELOAD has it too).
_CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "psflow", "psflow.ps", "tests.faults"])


class _Fd:
    """A file descriptor that travels to the forked child (``SCM_RIGHTS``, as multiprocessing's
    own pipes do); the child's copy comes from :meth:`detach`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _Fd._rebuild, (reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup: Any) -> int:
        return int(dup.detach())


def _child(argv: Sequence[str], env: dict[str, str], out: int, err: int) -> None:
    """The forked child: its stdout and stderr onto the pipes, its environment, then ``argv``
    as ``tests/faults.py`` takes it (``[flags...] -c CODE``)."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
    os.environ.clear()
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from tests import faults

    faults.main(list(argv))


class Forked:
    """A child of the fork server running ``argv`` (see :func:`_child`) with ``env``.

    ``output``: a file that gets the child's stdout and stderr both (written from the start),
    for a child nobody reads while it runs; :attr:`stdout` and :attr:`stderr` are then empty.
    """

    def __init__(
        self, argv: Sequence[str], env: dict[str, str], output: Path | None = None
    ) -> None:
        if output is None:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
        else:  # the child's two streams onto the file; ours read nothing
            out_r, err_r = os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_RDONLY)
            out_w = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err_w = os.dup(out_w)
        self.args = list(argv)
        self._process = _CONTEXT.Process(
            target=_child, args=(self.args, env, _Fd(out_w), _Fd(err_w)), daemon=True
        )
        try:
            self._process.start()
        finally:
            os.close(out_w)
            os.close(err_w)
        self.pid: int = self._process.pid  # type: ignore[assignment]
        self.stdout: IO[str] = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.stderr: IO[str] = open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.returncode: int | None = None
        self._readers: list[threading.Thread] = []
        self._texts: dict[str, str] = {}

    def poll(self) -> int | None:
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both streams to their end and the exit, as ``Popen.communicate`` (called again after
        a timeout, it goes on with the same readers: nothing read is lost)."""
        if not self._readers:
            self._readers = [
                threading.Thread(target=self._read, args=(n, s), daemon=True)
                for n, s in (("out", self.stdout), ("err", self.stderr))
            ]
            for r in self._readers:
                r.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for r in self._readers:
            r.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if r.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._texts["out"], self._texts["err"]

    def _read(self, name: str, stream: IO[str]) -> None:
        self._texts[name] = stream.read()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
