"""The fork server's own process (:mod:`psflow.cluster.forkserver` starts it): :func:`serve`, and
each task it forks, up to the script's exit.

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
import selectors
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from psflow import env as envvars
from psflow.cluster.cores import bind

__all__ = ["die_with_parent", "serve"]

_PR_SET_PDEATHSIG = 1
_MAX_MESSAGE = 1 << 20
"""Largest request (a task's argv and environment as JSON)."""


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
