"""Shared plumbing for the benchmarks: run one job's tasks as processes and collect results.

Each worker task prints one line ``RESULT {json}``; ps tasks print nothing. psflow's ps tasks
exit by themselves; TensorFlow's never do, so whatever is still running at the end is killed.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psflow import env as envvars
from psflow.cluster.cores import bind, core_sets, host_cpus, task_threads
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
) -> dict[str, dict[str, Any]]:
    """Runs every task of ``cluster``; returns each worker's ``RESULT`` keyed by task name
    (and puts each ps task's, where it prints one, into ``ps_results`` when given).

    ``ps_exit_timeout`` is how long the ps tasks get to exit by themselves once the workers are
    done (a ps still running then is an error); ``None`` kills them (TensorFlow's never exit).
    ``share_cores``: each task gets ``OMP_NUM_THREADS`` as ``psflow launch`` gives it
    (``psflow.env.threads_per_task``), unless set; TensorFlow's tasks keep their own defaults.
    ``bind_cores``: each task is bound to the cores ``psflow launch --bind-cores`` gives it
    (``psflow.cluster.cores.core_sets``).
    """
    procs: dict[TaskSpec, subprocess.Popen[str]] = {}
    base_env = {**envvars.TASK_DEFAULTS, **os.environ, **(env or {})}  # as psflow launch does
    tasks_here = sum(1 for _ in cluster.tasks())
    cores = core_sets(cluster.tasks(), host_cpus()) if bind_cores else {}
    try:
        for task in sorted(cluster.tasks(), key=lambda t: t.job != "ps"):
            e = dict(base_env, TF_CONFIG=cluster.to_tf_config(task), PYTHONUNBUFFERED="1")
            bound = cores.get(task)
            if share_cores or bound:  # as psflow launch does, unless set
                e.setdefault(envvars.OMP_NUM_THREADS, task_threads(bound, tasks_here))
            procs[task] = subprocess.Popen(
                [python, *command(task)],
                env=e,
                preexec_fn=None if bound is None else functools.partial(bind, bound),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        results: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        for task, proc in procs.items():
            if task.job == "ps":
                continue
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(
                    f"{task} failed with exit code {proc.returncode}:\n{err[-3000:]}"
                )
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if lines:
                results[str(task)] = json.loads(lines[-1][len("RESULT ") :])
        if ps_exit_timeout is not None:
            for task, proc in procs.items():
                if task.job == "ps":
                    try:
                        code = proc.wait(timeout=ps_exit_timeout)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(
                            f"{task} did not exit after the workers finished"
                        ) from None
                    if code != 0:
                        raise RuntimeError(
                            f"{task} exited with {code}: {proc.stderr.read()[-3000:]}"
                        )  # type: ignore[union-attr]
                    if ps_results is not None:
                        lines = [
                            ln for ln in proc.stdout.read().splitlines()  # type: ignore[union-attr]
                            if ln.startswith("RESULT ")
                        ]  # fmt: skip
                        if lines:
                            ps_results[str(task)] = json.loads(lines[-1][len("RESULT ") :])
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


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
