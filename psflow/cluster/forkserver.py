"""``psflow launch --preload``: tasks forked from a server that imported torch once.

A task started as ``python script.py`` spends 1.5-2 s of CPU importing torch before its first
line runs, and a task restarted by ``--max-restarts`` pays it again before it serves. With
``--preload torch,psflow`` the launcher starts one fork server (:class:`ForkServer`), which
imports those modules once; each task is then forked from it, as multiprocessing's
``forkserver`` start method with ``set_forkserver_preload`` or gunicorn's ``--preload`` do.

This module is the launcher's side (:class:`ForkServer`, :class:`ForkedTask`); the server's own
process, what each task inherits from it and how it runs the script, is
:mod:`psflow.cluster.forkserver_process`.

The launcher does not rely on the server alone to learn that a task ended: it watches each
task's pid too (a pidfd, readable once the task exited, zombie or not). A server that does not
fork a task, or report the exit of one that ended, within ``answer_timeout`` seconds (it is
stopped, hung, or its own tasks are zombies it does not reap) is named
(:meth:`ForkServer.problem`); the tasks that ended then have :data:`UNKNOWN_EXIT` as their code.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from psflow.cluster.forkserver_process import _MAX_MESSAGE, _send, die_with_parent, serve

# serve: the server's main, which ForkServer.start runs by this module's name.
__all__ = [
    "ANSWER_TIMEOUT",
    "UNKNOWN_EXIT",
    "ForkServer",
    "ForkedTask",
    "die_with_parent",
    "exit_status",
    "serve",
]

ANSWER_TIMEOUT = 10.0
"""Seconds the server gets to fork a task, or to report the exit of a task seen to have ended,
before it is declared stopped or hung."""

UNKNOWN_EXIT = -256
"""The code of a task seen to have ended whose exit status the server did not report (it is
stopped or hung): no status ``subprocess.Popen`` gives (0-255: exit codes, negative: signals)."""

_LOOK = 0.25
"""Seconds between looks at a task's pid while :meth:`ForkedTask.wait` waits."""


def exit_status(code: int) -> str:
    """``subprocess``'s return code in words (a task's, for the launcher's messages)."""
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _proc_state(pid: int) -> bytes | None:
    """Process ``pid``'s state letter in ``/proc`` (``b"Z"``: a zombie, ``b"T"``: stopped);
    ``None`` when it is gone, ``b""`` when ``/proc`` does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        return b""


def _state(pid: int) -> str:
    """What ``/proc`` says of process ``pid`` when that explains it not answering: stopped
    (SIGSTOP) or gone; else ``""``."""
    state = _proc_state(pid)
    if state in (b"T", b"t"):
        return " (it is stopped: SIGSTOP?)"
    return " (it is gone)" if state in (None, b"Z", b"X") else ""


class ForkedTask:
    """A task forked by a :class:`ForkServer`: what the launcher asks of a ``subprocess.Popen``
    (``pid``, ``poll``, ``wait``, ``stdout``, ``stderr``, ``returncode``).

    Its exit code is the server's report; a task seen to have ended (by its pid, the server
    aside) that the server has not reported within its ``answer_timeout`` has
    :data:`UNKNOWN_EXIT` (the server is then stopped or hung: :meth:`ForkServer.problem`)."""

    def __init__(self, server: ForkServer, pid: int, stdout: int, stderr: int) -> None:
        self._server = server
        self.pid = pid
        self.stdout: IO[bytes] = open(stdout, "rb")  # noqa: SIM115
        self.stderr: IO[bytes] = open(stderr, "rb")  # noqa: SIM115
        self.returncode: int | None = None
        self._lock = threading.Lock()  # poll() from the launcher's threads (its progress line)
        self._ended_at: float | None = None
        """When the task was first seen to have ended, not yet reported by the server."""
        self._pidfd: int | None = None
        self._watch: select.poll | None = None
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # ended and reaped already: the server's report is on its way
            self._ended_at = time.monotonic()
        except (OSError, AttributeError):  # no pidfd here (Linux < 5.3): /proc tells
            pass
        else:
            self._watch = select.poll()
            self._watch.register(self._pidfd, select.POLLIN)

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it; :data:`UNKNOWN_EXIT`: ended,
        unreported by a stopped or hung server) once it ended, else ``None``."""
        with self._lock:
            if self.returncode is None:
                code = self._server.exit_code(self.pid)
                if code is None and self._exited():
                    assert self._ended_at is not None
                    code = self._server.unreported(self.pid, self._ended_at)
                if code is not None:
                    self.returncode = code
                    self._forget_pid()
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the task to end; its exit code (``subprocess.TimeoutExpired`` after
        ``timeout`` seconds; ``None``: as long as the task runs, and no longer than the
        server's ``answer_timeout`` after it ended)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = _LOOK if deadline is None else min(_LOOK, deadline - time.monotonic())
            if left <= 0:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0)
            self._server.wait_for(self.pid, left)  # woken at once by the server's report
        return code

    def ended(self) -> bool:
        """Whether the task has ended: its code is known, or it was seen to exit (a zombie
        the server has not reaped or reported yet)."""
        with self._lock:
            return self.returncode is not None or self._exited()

    def _exited(self) -> bool:
        """Whether the task has exited (a zombie the server has not reaped counts)."""
        if self._ended_at is not None:
            return True
        ended = bool(self._watch.poll(0)) if self._watch is not None else _exited(self.pid)
        if ended:
            self._ended_at = time.monotonic()
        return ended

    def _forget_pid(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = self._watch = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._forget_pid()


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (is a zombie, or gone), from ``/proc`` (or, without
    it, whether it still exists)."""
    state = _proc_state(pid)
    if state != b"":
        return state in (None, b"Z", b"X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class ForkServer:
    """Starts a server process that imports ``modules``, then forks tasks from it.

    Args:
        modules: what the server imports once (``["torch", "psflow"]``).
        env: the server's environment: the job's, that every task starts from.

    Example:
        >>> # server = ForkServer(["torch"], dict(os.environ)); server.start()
        >>> # task = server.spawn(["train.py", "--steps", "10"], env, cores=None)
        >>> # task.wait(); server.stop()
    """

    def __init__(
        self, modules: Sequence[str], env: Mapping[str, str], answer_timeout: float = ANSWER_TIMEOUT
    ) -> None:
        self.modules = list(modules)
        self.env = dict(env)
        self.answer_timeout = answer_timeout
        """Seconds the server gets to fork a task, or to report a task that ended, before it is
        declared stopped or hung (:meth:`problem`)."""
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._spawning = threading.Lock()
        self._changed = threading.Condition()
        self._pids: list[int] = []
        """Pids the server answered, not yet taken by :meth:`spawn`."""
        self._codes: dict[int, int] = {}
        self._gone = False
        """The server exited (or its socket broke): its tasks died with it."""
        self._stopping = False
        """:meth:`stop` was called: the server's exit is ours, no problem."""
        self._hung: str | None = None
        """Why the server is taken for stopped or hung (once it did not answer in time)."""
        self.pid: int | None = None
        """The server's pid, once started."""

    def start(self, timeout: float = 600.0) -> None:
        """Starts the server and returns once it imported the modules (``RuntimeError`` naming
        the module and its error when it could not; with ``PSFLOW_LOG_LEVEL=DEBUG`` the
        server's traceback is on this process's stderr too)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = "from psflow.cluster.forkserver import serve; serve()"
        argv = [sys.executable, "-c", code, str(theirs.fileno()), ",".join(self.modules)]
        try:
            self._proc = subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops the tasks
                preexec_fn=die_with_parent,
            )
        finally:
            theirs.close()
        ours.settimeout(timeout)
        try:
            reply = ours.recv(_MAX_MESSAGE)
        except TimeoutError:
            reply = b""
        if not reply or "ready" not in (answer := json.loads(reply)):
            ours.close()
            self._proc.kill()
            self._proc.wait()
            why = "" if not reply else f": {answer.get('error')}"
            raise RuntimeError(f"the fork server could not preload {self.modules}{why}")
        ours.settimeout(None)
        self._sock = ours
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, name="psflow-forkserver", daemon=True)
        self._reader.start()

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cores: Sequence[int] | None = None
    ) -> ForkedTask:
        """Forks a task that runs ``argv`` (a script and its arguments) with ``env``, bound to
        ``cores`` (``None``: not bound)."""
        if self._sock is None:
            raise RuntimeError("the fork server is not running: start() it first")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        request = {"argv": list(argv), "env": dict(env), "cores": cores and list(cores)}
        try:
            with self._spawning, self._changed:
                if self._gone:
                    raise RuntimeError(f"the fork server (pid {self.pid}) exited")
                if self._hung is not None:
                    raise RuntimeError(self._hung)
                try:  # one request at a time: the server read the one before (it answered)
                    _send(self._sock, request, [out_w, err_w], socket.MSG_DONTWAIT)
                except BlockingIOError:
                    self._hang("did not take a request to fork a task")
                    raise RuntimeError(self._hung) from None
                self._changed.wait_for(lambda: self._pids or self._gone, self.answer_timeout)
                if not self._pids:
                    if not self._gone:
                        self._hang(f"did not fork a task within {self.answer_timeout:g} s")
                        raise RuntimeError(self._hung)
                    raise RuntimeError(
                        f"the fork server (pid {self.pid}) exited before it forked the task"
                    )
                pid = self._pids.pop(0)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return ForkedTask(self, pid, out_r, err_r)

    def exit_code(self, pid: int) -> int | None:
        """Task ``pid``'s exit code once the server reaped it, else ``None`` (``-SIGKILL`` once
        the server is gone: its tasks died with it)."""
        with self._changed:
            if pid in self._codes:
                return self._codes[pid]
            return -signal.SIGKILL if self._gone else None

    def wait_for(self, pid: int, timeout: float) -> int | None:
        """Task ``pid``'s exit code as the server reports it, waiting up to ``timeout``
        seconds for that (``None``: not yet)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._codes or self._gone, timeout)
        return self.exit_code(pid)

    def unreported(self, pid: int, ended_at: float) -> int | None:
        """The code of task ``pid``, seen to have ended at ``ended_at`` (``time.monotonic``):
        the server's report, else :data:`UNKNOWN_EXIT` once the server had ``answer_timeout``
        seconds to report it (the server is then taken for stopped or hung), else ``None``."""
        with self._changed:
            code = self.exit_code(pid)
            if code is not None:
                return code
            if self._hung is None:
                if time.monotonic() - ended_at < self.answer_timeout:
                    return None
                self._hang(
                    f"did not report the exit of task {pid} within {self.answer_timeout:g} s "
                    "(its exit code is unknown)"
                )
            return UNKNOWN_EXIT

    def problem(self) -> str | None:
        """Why the server fails the job, on one line naming it: it is stopped or hung (did not
        answer within ``answer_timeout``), or it exited by itself (its tasks died with it);
        ``None`` while it serves, and once :meth:`stop` stopped it."""
        with self._changed:
            if self._hung is not None:
                return self._hung
            if self._gone and not self._stopping:
                code = None if self._proc is None else self._proc.poll()
                how = "" if code is None else f" ({exit_status(code)})"
                return f"the fork server (pid {self.pid}) exited{how}; its tasks died with it"
            return None

    def _hang(self, what: str) -> None:
        """Takes the server for stopped or hung, as it ``what``. Holds ``_changed``."""
        if self._hung is None:
            state = _state(self.pid) if self.pid is not None else ""
            self._hung = f"the fork server (pid {self.pid}) {what}: stopped or hung?{state}"
            self._changed.notify_all()

    def _read(self) -> None:
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._gone = True
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "pid" in message:
                    self._pids.append(int(message["pid"]))
                else:
                    self._codes[int(message["exit"])] = int(message["code"])
                self._changed.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Closes the server's socket: it exits (killed after ``timeout`` seconds, at once when
        it is taken for stopped or hung), and any task still running dies with it."""
        with self._changed:
            self._stopping = True
            if self._hung is not None:
                timeout = 0.0
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()  # a stopped (SIGSTOP) process dies of it too
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout or 10.0)
            self._proc = None
        if self._reader is not None:
            self._reader.join(timeout)
            self._reader = None
