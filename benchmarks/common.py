"""Shared plumbing for the benchmarks: run one job's tasks as processes and collect results.

Each worker task prints one line ``RESULT {json}``; ps tasks print nothing. psflow's ps tasks
exit by themselves; TensorFlow's never do, so whatever is still running at the end is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from psflow import env as envvars
from psflow.cluster.cores import bind, core_sets, host_cpus, task_threads
from psflow.cluster.forkserver import ForkedTask, ForkServer
from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import ClusterSpec, TaskSpec


def run_job(
    cluster: ClusterSpec,
    command: Callable[[TaskSpec], list[str]],
    *,
    python: str = sys.executable,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    ps_exit_timeout: float | None = 10.0,
    share_cores: bool = True,
    bind_cores: bool = False,
    ps_results: dict[str, dict[str, Any]] | None = None,
    preload: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Runs every task of ``cluster``; returns each worker's ``RESULT`` keyed by task name
    (and puts each ps task's, where it prints one, into ``ps_results`` when given).

    ``ps_exit_timeout`` is how long the ps tasks get to exit by themselves once the workers are
    done (a ps still running then is an error); ``None`` kills them (TensorFlow's never exit).
    ``share_cores``: each task gets ``OMP_NUM_THREADS`` as ``psflow launch`` gives it
    (``psflow.env.threads_per_task``), unless set; TensorFlow's tasks keep their own defaults.
    ``bind_cores``: each task is bound to the cores ``psflow launch --bind-cores`` gives it
    (``psflow.cluster.cores.core_sets``). ``preload``: modules (``torch``, ``psflow``) a fork
    server of this process imports once, every task then forked from it as ``psflow launch
    --preload`` does (this Python's tasks only): what a smoke preset, run again and again by
    the tests, spends mostly on importing torch in each task.
    """
    procs: dict[TaskSpec, _Task] = {}
    base_env = {**envvars.TASK_DEFAULTS, **os.environ, **(env or {})}  # as psflow launch does
    tasks_here = sum(1 for _ in cluster.tasks())
    cores = core_sets(cluster.tasks(), host_cpus()) if bind_cores else {}
    server = _fork_server(preload, base_env) if preload and python == sys.executable else None
    try:
        for task in sorted(cluster.tasks(), key=lambda t: t.job != "ps"):
            e = dict(base_env, TF_CONFIG=cluster.to_tf_config(task), PYTHONUNBUFFERED="1")
            bound = cores.get(task)
            if share_cores or bound:  # as psflow launch does, unless set
                e.setdefault(envvars.OMP_NUM_THREADS, task_threads(bound, tasks_here))
            if server is not None:
                procs[task] = _Task(server.spawn(command(task), e, bound))
                continue
            procs[task] = _Task(
                subprocess.Popen(
                    [python, *command(task)],
                    env=e,
                    preexec_fn=None if bound is None else functools.partial(bind, bound),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        results: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        for task, proc in procs.items():
            if task.job == "ps":
                continue
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            out, err = proc.output()
            if code != 0:
                raise RuntimeError(f"{task} failed with exit code {code}:\n{err[-3000:]}")
            result = _result(out)
            if result is not None:
                results[str(task)] = result
        if ps_exit_timeout is not None:
            for task, proc in procs.items():
                if task.job == "ps":
                    try:
                        code = proc.wait(timeout=ps_exit_timeout)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(
                            f"{task} did not exit after the workers finished"
                        ) from None
                    out, err = proc.output()
                    if code != 0:
                        raise RuntimeError(f"{task} exited with {code}: {err[-3000:]}")
                    result = _result(out)
                    if ps_results is not None and result is not None:
                        ps_results[str(task)] = result
        return results
    finally:
        for proc in procs.values():
            proc.kill()


def _result(out: str) -> dict[str, Any] | None:
    """A task's last ``RESULT`` line, read."""
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


class _Task:
    """A task's process (started fresh, or forked by a :class:`ForkServer`) with its output
    read as it comes: a task that prints much never waits on a full pipe."""

    def __init__(self, proc: subprocess.Popen[bytes] | ForkedTask) -> None:
        self.proc = proc
        self._out: list[bytes] = []
        self._err: list[bytes] = []
        self._readers = [
            threading.Thread(target=_drain, args=(stream, into), daemon=True)
            for stream, into in ((proc.stdout, self._out), (proc.stderr, self._err))
        ]
        for reader in self._readers:
            reader.start()

    def wait(self, timeout: float | None) -> int:
        """The exit code (``subprocess.TimeoutExpired`` after ``timeout`` seconds)."""
        return self.proc.wait(timeout)

    def output(self) -> tuple[str, str]:
        """Its standard output and error, once it has ended (and closed them)."""
        for reader in self._readers:
            reader.join(10.0)
        return (
            b"".join(self._out).decode(errors="replace"),
            b"".join(self._err).decode(errors="replace"),
        )

    def kill(self) -> None:
        """Kills it if it still runs, and waits for it."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30.0)


def _drain(stream: IO[bytes] | None, into: list[bytes]) -> None:
    if stream is None:
        return
    with stream:
        for chunk in iter(lambda: stream.read1(1 << 16), b""):  # type: ignore[attr-defined]
            into.append(chunk)


PRELOAD = ("torch", "torch._dynamo", "psflow", "psflow.ps", "psflow.worker")
"""What a smoke preset's tasks are forked from (:func:`smoke_preload`). ``torch._dynamo``:
torch imports it at a process's first ``torch.optim`` optimizer (each ps builds one), 1.5 s of
CPU a task."""


def smoke_preload(preset: str) -> tuple[str, ...]:
    """``run_job``'s ``preload`` for a benchmark's ``preset``: the smoke preset, which the test
    suite runs again and again, forks its tasks from one server (:data:`PRELOAD`); the presets
    that measure start every task fresh, as ``psflow launch`` does by default."""
    return PRELOAD if preset == "smoke" else ()


_servers: dict[tuple[str, ...], ForkServer] = {}


def _fork_server(modules: Sequence[str], env: dict[str, str]) -> ForkServer:
    """This process's fork server for ``modules``, started at its first job (with that job's
    environment: each task gets its own) and stopped at exit."""
    key = tuple(modules)
    server = _servers.get(key)
    if server is None:
        server = _servers[key] = ForkServer(modules, env)
        server.start()
        atexit.register(server.stop)
    return server


def run_tf_job(cluster: ClusterSpec, argv: list[str], tf_python: str) -> dict[str, dict[str, Any]]:
    """TensorFlow's side of a comparison: every task runs ``argv`` in ``tf_python``, on the CPU.

    Its ps tasks never exit by themselves (tensorflow#25858), so they are killed at the end.
    """
    return run_job(
        cluster,
        lambda _task: argv,
        python=tf_python,
        ps_exit_timeout=None,
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""},
        share_cores=False,
    )


def new_cluster(ps: int, workers: int) -> ClusterSpec:
    return local_cluster(ps, workers)


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def emit(result: dict[str, Any]) -> None:
    """The benchmark's last line: one JSON object."""
    print(json.dumps(result, sort_keys=True))


def keys_dir() -> str:
    """A fresh directory of CurveZMQ keys for one job (``PSFLOW_KEYS_DIR``), as ``psflow launch``
    makes by default; left in the system's temporary directory."""
    from psflow.cluster.keys import generate_keys

    return str(generate_keys(Path(tempfile.mkdtemp(prefix="psflow-bench-keys-")) / "keys"))


def run_in_tree(script: str, tree: Path, args: Sequence[str], timeout: float = 900) -> Any:
    """``script`` (a benchmark's own file) run with ``args`` in a fresh process whose psflow is
    ``tree``'s (first on ``PYTHONPATH``, run from there): an A/B against another checkout. Its
    last line, as JSON; ``SystemExit`` with its errors' tail when it fails."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    cmd = [sys.executable, script, *args]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        name = Path(script).stem
        raise SystemExit(f"{name} in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
