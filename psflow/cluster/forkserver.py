"""``psflow launch --preload``: tasks forked from a server that imported torch once.

A task started as ``python script.py`` spends 1.5-2 s of CPU importing torch before its first
line runs, and a task restarted by ``--max-restarts`` pays it again before it serves. With
``--preload torch,psflow`` the launcher starts one fork server (:class:`ForkServer`), which
imports those modules once; each task is then forked from it, as multiprocessing's
``forkserver`` start method with ``set_forkserver_preload`` or gunicorn's ``--preload`` do.

Each task is still a process of its own: its own session, environment, standard streams (the
pipes the launcher relays) and cores. It runs the script as ``python script.py`` would:
``__name__ == "__main__"``, ``sys.argv``, the script's directory first on ``sys.path``, an
uncaught exception printed with exit code 1, ``sys.exit``'s code, non-daemon threads joined,
``atexit`` handlers run. It then exits with :func:`os._exit` once its streams are flushed,
skipping the interpreter's teardown (half a second of CPU with torch loaded).

What a task inherits from the server: the preloaded modules as their import left them, and what
they read from the environment as they were imported (OpenMP reads ``OMP_WAIT_POLICY`` then):
the server runs with the job's environment, the one every task starts from. What differs
between tasks is set again in each one after the fork: torch's thread count from the task's
``OMP_NUM_THREADS``, numpy's global random state reseeded (as a fresh process's would be).
Python's string hashes are the server's in every task. A module that starts a Python thread as
it is imported cannot be preloaded (a fork copies only the thread that forks): the server
refuses. Native thread pools that handle a fork themselves are fine (OpenBLAS's, which numpy
starts as it loads, is stopped before the fork and started again after it).

The server is single-threaded and stays so: it reads requests (the task's argv, environment
and cores, its stdout and stderr passed as file descriptors) from a Unix socket, answers each
with the task's pid, and reports each task's exit status as it reaps it. It exits when the
launcher closes the socket (or dies); its tasks die with it (``PR_SET_PDEATHSIG``).

The launcher does not rely on the server alone to learn that a task ended: it watches each
task's pid too (a pidfd, readable once the task exited, zombie or not). A server that does not
fork a task, or report the exit of one that ended, within ``answer_timeout`` seconds (it is
stopped, hung, or its own tasks are zombies it does not reap) is named
(:meth:`ForkServer.problem`); the tasks that ended then have :data:`UNKNOWN_EXIT` as their code.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import io
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

from psflow import env as envvars
from psflow.cluster.cores import bind

__all__ = ["ANSWER_TIMEOUT", "UNKNOWN_EXIT", "ForkServer", "ForkedTask", "die_with_parent"]

_PR_SET_PDEATHSIG = 1
_MAX_MESSAGE = 1 << 20
"""Largest request (a task's argv and environment as JSON)."""

ANSWER_TIMEOUT = 10.0
"""Seconds the server gets to fork a task, or to report the exit of a task seen to have ended,
before it is declared stopped or hung."""

UNKNOWN_EXIT = -256
"""The code of a task seen to have ended whose exit status the server did not report (it is
stopped or hung): no status ``subprocess.Popen`` gives (0-255: exit codes, negative: signals)."""

_LOOK = 0.25
"""Seconds between looks at a task's pid while :meth:`ForkedTask.wait` waits."""


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent exits (Linux; elsewhere nothing): a task must
    not outlive a launcher that is killed outright, which cannot pass on SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _send(
    sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = (), flags: int = 0
) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds), flags)
    else:
        sock.send(data, flags)


def _status(code: int) -> str:
    """``subprocess``'s return code in words."""
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _state(pid: int) -> str:
    """What ``/proc`` says of process ``pid`` when that explains it not answering: stopped
    (SIGSTOP) or gone; else ``""``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[:1]
    except FileNotFoundError:
        return " (it is gone)"
    except OSError:
        return ""
    if state in ([b"T"], [b"t"]):
        return " (it is stopped: SIGSTOP?)"
    return " (it is gone)" if state in ([b"Z"], [b"X"]) else ""


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
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    return stat.rsplit(b")", 1)[-1].split()[:1] in ([b"Z"], [b"X"])


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
                how = "" if code is None else f" ({_status(code)})"
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


# -- the server process -----------------------------------------------------------------------


def serve() -> None:
    """The server's main (``python -c ... FD MODULES``): imports the modules, then forks a task
    for each request on socket ``FD`` until the launcher closes it."""
    fd, modules = int(sys.argv[1]), [m for m in sys.argv[2].split(",") if m]
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the job, and then this
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # the launcher's one line says it; the traceback only to debug
            if (envvars.text(envvars.PSFLOW_LOG_LEVEL) or "").strip().upper() == "DEBUG":
                traceback.print_exc()
            _send(sock, {"error": f"importing {name}: {type(e).__name__}: {e}"})
            return
    # Python threads only: native pools (OpenBLAS's, started as numpy loads) handle a fork
    # themselves (pthread_atfork).
    if threading.active_count() > 1:
        started = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        why = f"preloading {modules} started threads {started}: a fork would not copy them"
        _send(sock, {"error": why})
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)  # wakes the select
    _send(sock, {"ready": True})
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    server = os.getpid()
    while True:
        for key, _ in selector.select():
            if key.fileobj is sock:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
                if not data:
                    return  # the launcher is done: the tasks left die with this process
                assert len(fds) == 2, fds  # the launcher sends a task's stdout and stderr
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(data), fds, server, [sock.fileno(), wake_r, wake_w])
                for f in fds:
                    os.close(f)
                _send(sock, {"pid": pid})
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _child(request: dict[str, Any], fds: list[int], server: int, close: list[int]) -> None:
    """The forked task: never returns (:func:`os._exit` with the script's exit code)."""
    code = 1
    try:
        os.setsid()
        die_with_parent()
        if os.getppid() != server:
            os._exit(code)  # the server died before the line above
        signal.set_wakeup_fd(-1)
        for f in close:
            os.close(f)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["cores"]:
            bind(request["cores"])
        out, err = fds
        _streams(out, err, request["env"])
        os.environ.clear()
        os.environ.update(request["env"])
        _after_fork(request["env"])
        code = _run_script(request["argv"])
    except BaseException:
        with contextlib.suppress(BaseException):
            sys.excepthook(*sys.exc_info())
            _flush()
    finally:
        os._exit(code)


def _streams(out: int, err: int, env: Mapping[str, str]) -> None:
    """Standard input from /dev/null, output and error onto the launcher's pipes, buffered as
    a fresh interpreter with ``env`` would buffer them."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    # The server's sys.stdout and sys.stderr write to descriptors 1 and 2 too, but buffered as
    # the server's environment had it; these follow the task's (PYTHONUNBUFFERED), as a fresh
    # interpreter's would (stderr line-buffered, as Python's is since 3.9).
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"

    def text(fd: int, errors: str, *, line: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        binary: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            binary,  # type: ignore[arg-type]
            encoding=encoding,
            errors=errors,
            line_buffering=line,
            write_through=unbuffered,
        )

    sys.stdout = text(1, "strict", line=False)
    sys.stderr = text(2, "backslashreplace", line=True)


def _after_fork(env: Mapping[str, str]) -> None:
    """What a preloaded module set from the server's state, set again for this task."""
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _run_script(argv: list[str]) -> int:
    """Runs ``argv[0]`` as ``__main__`` as the interpreter would; its exit code."""
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        # The traceback from the script's first frame, as the interpreter shows it (not runpy's
        # nor this module's).
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        if tb is not None:
            e.__traceback__ = tb  # what the hook prints (its third argument is not)
        sys.excepthook(type(e), e, e.__traceback__)
        interrupted = isinstance(e, KeyboardInterrupt)
        code = 1
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    _flush()
    if interrupted:  # as Python does: ended by the SIGINT it did not handle
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 128 + signal.SIGINT
    return code


def _exit_code(value: object) -> int:
    """The exit status of ``sys.exit(value)``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
