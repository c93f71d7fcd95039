"""The Ray actor that runs one psflow task: the training script as a child process on its node.

:class:`TaskRunner` starts ``python SCRIPT ARGS`` with the task's ``TF_CONFIG`` when the actor is
created, keeps its output lines until the driver (:mod:`psflow.cluster.ray_backend`) takes them,
and reports its exit code. When Ray restarts the actor (its ``max_restarts``), the constructor
runs again with the same arguments in the same placement-group bundle: the same node, address
and ``TF_CONFIG``, as ``psflow launch --max-restarts`` restarts a local task.

This module imports no Ray: the driver wraps the class with ``ray.remote`` itself.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import IO

from psflow import env as envvars

_PR_SET_PDEATHSIG = 1
STDOUT, STDERR = 1, 2
"""Which stream a line came from."""


def _die_with_parent() -> None:
    # The script must not outlive its actor (killed outright, or by Ray on the job's end).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str) -> int:
    """A port free on ``host`` a moment ago, for a task's address (see :mod:`~.ports`)."""
    from psflow.cluster.ports import free_ports

    return free_ports(1, host)[0]


class TaskRunner:
    """One task's process on a Ray node, its output and its exit code.

    Args:
        task: the task, ``worker:1``.
        argv: the command line (``[python, SCRIPT, *ARGS]``; ``python`` is this node's).
        env: what the task's environment adds to the node's (``TF_CONFIG`` included).
        cwd: the directory the script runs in.
        keys: the job's CurveZMQ key files (name to bytes), written into a private directory on
            this node (``None``: the environment says where they are, or none).
    """

    def __init__(
        self,
        task: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        keys: dict[str, bytes] | None = None,
    ) -> None:
        self.task = task
        self._cond = threading.Condition()
        self._lines: collections.deque[tuple[int, str]] = collections.deque()
        self._code: int | None = None
        self._keys_dir: str | None = None
        full = {**os.environ, **env}
        if keys:
            d = tempfile.mkdtemp(prefix="psflow-keys-")  # mode 0700: this user's alone
            for name, data in keys.items():
                path = os.path.join(d, os.path.basename(name))
                with open(path, "wb") as f:
                    f.write(data)
                os.chmod(path, 0o600)
            self._keys_dir = full[envvars.PSFLOW_KEYS_DIR] = d
        started = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        # The child is started and waited for by a thread that lives as long as it does: the
        # kernel's parent-death signal follows the thread that forked, not the process.
        self._owner = threading.Thread(
            target=self._own, args=(argv, full, cwd, started), daemon=True, name=f"run-{task}"
        )
        self._owner.start()
        started.wait()
        if self._proc is None:
            raise RuntimeError(f"{task}: could not start {argv!r}")

    def _own(
        self, argv: list[str], env: dict[str, str], cwd: str, started: threading.Event
    ) -> None:
        try:
            self._proc = subprocess.Popen(
                argv,
                env=env,
                # The driver's directory where this node has it (a shared file system, or the
                # same image); else the actor's own.
                cwd=cwd if os.path.isdir(cwd) else None,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # stop() signals its whole process group
                preexec_fn=_die_with_parent,
            )
        finally:
            started.set()
        proc = self._proc
        relays = [
            threading.Thread(target=self._relay, args=(stream, tag), daemon=True)
            for stream, tag in ((proc.stdout, STDOUT), (proc.stderr, STDERR))
        ]
        for t in relays:
            t.start()
        code = proc.wait()
        for t in relays:
            t.join(timeout=5)
        # The keys go before the code is told: a driver that sees it may kill the actor at once
        # (ray.kill runs nothing more here), and the keys would outlive the job on this node.
        self.remove_keys()
        with self._cond:
            self._code = code
            self._cond.notify_all()

    def _relay(self, stream: IO[bytes] | None, tag: int) -> None:
        assert stream is not None
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                self._lines.append((tag, line))
                self._cond.notify_all()
        stream.close()

    def where(self) -> tuple[str, int, int]:
        """The node's IP address, the actor's process id and the script's."""
        import ray

        assert self._proc is not None
        return ray.util.get_node_ip_address(), os.getpid(), self._proc.pid

    def poll(self, timeout: float) -> tuple[int, list[tuple[int, str]], int | None]:
        """Waits up to ``timeout`` seconds for output or the end; returns this run's id (the
        actor's process id: a restarted actor has another), the lines not yet taken, and the exit
        code once the script has exited and every line of it was taken (else ``None``)."""
        with self._cond:
            self._cond.wait_for(lambda: self._lines or self._code is not None, timeout)
            lines = list(self._lines)
            self._lines.clear()
            return os.getpid(), lines, self._code

    def stop(self, grace: float) -> int | None:
        """SIGTERM to the script's process group, SIGKILL after ``grace`` seconds; its code."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped task takes SIGTERM only then
            deadline = time.monotonic() + grace
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        with self._cond:
            self._cond.wait_for(lambda: self._code is not None, 10)
            return self._code

    def die(self) -> None:
        """Ends the actor's process so that Ray restarts it (its script has exited already)."""
        self.remove_keys()
        os._exit(1)

    def remove_keys(self) -> None:
        """Removes this node's copy of the job's private keys. The driver calls it before it
        kills the actor (``ray.kill`` ends the process with nothing run: no ``finally``, no
        ``atexit``), whether or not the script has exited: killed with the actor, it needs
        them no more."""
        d, self._keys_dir = self._keys_dir, None
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def node_address() -> tuple[str, int]:
    """Runs in a placement-group bundle: that node's IP address and a port free there."""
    import ray

    host = ray.util.get_node_ip_address()
    return host, free_port(host)


def answers(host: str, port: int, timeout: float) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` within ``timeout``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
