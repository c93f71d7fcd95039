"""Starting real ps processes for the multi-process tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from psflow.cluster.ports import local_cluster
from psflow.cluster.spec import ClusterSpec, TaskContext, TaskSpec
from psflow.train import TrainingSession
from psflow.transport import TransportConfig
from psflow.transport.shm import Lane
from psflow.worker import DistributedOptimizer, ShardedClient
from psflow.worker.engine import ExchangeEngine
from tests.fault_matrix import PRELOAD

from .forked import Forked

ROOT = Path(__file__).resolve().parents[2]

PS_MAIN = "import logging, psflow; logging.basicConfig(level=logging.INFO); ctx, _ = psflow.resolve([]); psflow.ParameterServer(ctx).join()"


def start_ps(
    cluster: ClusterSpec,
    index: int = 0,
    env: dict[str, str] | None = None,
    faults: Sequence[str] = (),
) -> Forked:
    """A ps task as its own process, serving until the workers are done; ``faults``: the
    options of :mod:`tests.faults` (``["--slow-save", "1.5"]``). Forked from a server that has
    imported torch (:mod:`tests.multiproc.forked`), it serves a second or two sooner than
    ``python -c PS_MAIN`` would, at the CPU cost of a fork."""
    return Forked(
        [*faults, "-c", PS_MAIN], env=task_env(cluster, TaskSpec(job="ps", index=index), env)
    )


def task_env(
    cluster: ClusterSpec, task: TaskSpec, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """A task's environment as a launcher gives it: this one's, its ``TF_CONFIG``, unbuffered
    output, and ``extra``."""
    return dict(
        os.environ, TF_CONFIG=cluster.to_tf_config(task), PYTHONUNBUFFERED="1", **(extra or {})
    )


def launch_cmd(
    script: Path,
    *args: str,
    ps: int = 1,
    workers: int = 2,
    grace: float | None = None,
    preload: bool = False,
) -> list[str]:
    """``psflow launch`` of ``script`` as a command line (``grace``: its ``--grace``;
    ``preload``: ``--preload`` :data:`PRELOAD`, each task forked from a server that imported
    torch and psflow, 2-3 s of CPU less a task than a fresh ``python``)."""
    return [
        sys.executable,
        "-m",
        "psflow.cli",
        "launch",
        "--ps",
        str(ps),
        "--workers",
        str(workers),
        *(["--grace", str(grace)] if grace is not None else []),
        *(["--preload", PRELOAD] if preload else []),
        str(script),
        *args,
    ]


CLI_MAIN = "import sys; from psflow.cli import main; sys.exit(main())"
"""The ``psflow`` command as ``-c`` code: ``run_forked(["-c", CLI_MAIN, "data", ...])``."""


def run_forked(
    argv: Sequence[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` for a script (or
    ``-c CODE``) forked from the server that imported torch (:mod:`.forked`) instead of a fresh
    ``python``: its own process, environment (``env``, else this one's) and pipes, 2-3 s of CPU
    sooner. Killed, and ``subprocess.TimeoutExpired`` raised, after ``timeout`` seconds."""
    proc = Forked(argv, dict(os.environ) if env is None else env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode is not None
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def run_benchmark_smoke(script: str, *args: str, timeout: float = 110) -> dict[str, Any]:
    """Runs ``benchmarks/<script> --preset smoke [args]``; returns its last line, which must be
    JSON. The script runs forked (:func:`run_forked`); the tasks it starts are fresh processes,
    as the benchmark starts them."""
    argv = [str(ROOT / "benchmarks" / script), "--preset", "smoke", *args]
    proc = run_forked(argv, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def sharded_client(opt: DistributedOptimizer) -> ShardedClient:
    """The client of an optimizer that trains against the ps."""
    engine = opt.engine
    assert isinstance(engine, ExchangeEngine), engine
    return engine.client


def lanes(opt: DistributedOptimizer) -> dict[str, Lane]:
    """The shared-memory lanes an optimizer's client holds, by peer."""
    transport = sharded_client(opt).transport
    out = {peer: transport.lane(peer) for peer in transport.peers}
    return {peer: lane for peer, lane in out.items() if lane is not None}


def worker_ctx(cluster: ClusterSpec, index: int = 0) -> TaskContext:
    return TaskContext(cluster=cluster, task=TaskSpec(job="worker", index=index))


def quiet_session(
    model: torch.nn.Module,
    cluster: ClusterSpec,
    checkpoint_dir: str,
    *,
    timeout: float = 20.0,
    **kwargs: Any,
) -> TrainingSession:
    """A ``TrainingSession`` of ``model`` as the chief of ``cluster``, as the session tests
    want it: checkpoints under ``checkpoint_dir`` only when a test saves one (the timed ones an
    hour apart), no step logs or summaries, requests failing after ``timeout`` seconds, the end
    waiting at most a second; ``kwargs`` add to or override that."""
    options: dict[str, Any] = {
        "checkpoint_dir": checkpoint_dir,
        "save_checkpoint_secs": 3600,
        "log_step_count_steps": None,
        "save_summaries_steps": None,
        "transport": TransportConfig(timeout=timeout),
        "end_timeout": 1,
    }
    return TrainingSession(model, worker_ctx(cluster), **(options | kwargs))


def freeze(pid: int, timeout: float = 10) -> None:
    """SIGSTOPs a process and returns once every thread of it has stopped.

    The signal is asynchronous: on a loaded machine a thread can go on for milliseconds.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = [
            (Path(d) / "stat").read_text().rsplit(") ", 1)[1][0]
            for d in Path(f"/proc/{pid}/task").iterdir()
        ]
        if all(s == "T" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.001)


def stop(proc: subprocess.Popen[str] | Forked, timeout: float = 10) -> tuple[int, str]:
    """Waits for (or kills) a process; returns its exit code and stderr."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


__all__ = [
    "PRELOAD",
    "ROOT",
    "freeze",
    "launch_cmd",
    "local_cluster",
    "run_benchmark_smoke",
    "run_forked",
    "start_ps",
    "stop",
    "worker_ctx",
]


def in_area(t: torch.Tensor, area: np.ndarray) -> bool:  # type: ignore[type-arg]
    """Whether ``t``'s memory starts inside ``area`` (a lane's area)."""
    return bool(area.ctypes.data <= t.data_ptr() < area.ctypes.data + area.nbytes)
