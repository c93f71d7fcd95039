"""Starting one task of a local job (``psflow launch``): its process, fresh or forked from the
fork server, its environment and ``TF_CONFIG``, its output relayed line by line under its name;
and the same again after it failed (``--max-restarts``)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from psflow import env as envvars
from psflow.cluster import shmfiles
from psflow.cluster.cores import bind, task_threads
from psflow.cluster.forkserver import ForkedTask, ForkServer, die_with_parent
from psflow.cluster.launch_config import LaunchConfig
from psflow.cluster.spec import ClusterSpec, TaskSpec


def _start_task(cores: Sequence[int] | None) -> None:
    """Runs in each task's process before it executes the script."""
    die_with_parent()  # a launcher killed outright (SIGKILL) cannot stop its tasks
    if cores is not None:
        bind(cores)


class TaskStarting:
    """Starting each task's process (again after it failed) and relaying its output, for
    :class:`~psflow.cluster.launcher.Launcher` (a mixin: the launcher holds the state below)."""

    config: LaunchConfig
    cluster: ClusterSpec
    cores: dict[TaskSpec, list[int]]
    gpus: dict[TaskSpec, list[str]]
    _gpus_counted: bool
    metrics_at: dict[str, str]
    keys_dir: str | None
    procs: dict[TaskSpec, subprocess.Popen[bytes] | ForkedTask]
    _forks: ForkServer | None
    _threads: list[threading.Thread]
    _out_lock: threading.RLock
    _swept: set[int]
    restarts: int

    def _spawn(self, task: TaskSpec) -> None:
        """Starts ``task``'s process (again, after a failure: same address, same TF_CONFIG)
        and relays its output."""
        cores = self.cores.get(task)
        env = self._task_env(cores)
        if task.job == "ps" and self.config.ps_threads is not None:
            env[envvars.PSFLOW_PS_THREADS] = env[envvars.OMP_NUM_THREADS] = str(
                self.config.ps_threads
            )
        env[envvars.TF_CONFIG] = self.cluster.to_tf_config(task)
        if self.config.mode is not None:
            env[envvars.PSFLOW_MODE] = self.config.mode
        if str(task) in self.metrics_at:
            env[envvars.PSFLOW_METRICS_PORT] = self.metrics_at[str(task)].rsplit(":", 1)[1]
        env["PYTHONUNBUFFERED"] = "1"
        if self.keys_dir is not None:
            env[envvars.PSFLOW_KEYS_DIR] = self.keys_dir
        if self.config.trainer_gpus:  # a trainer's own GPUs; none for the others
            env[envvars.CUDA_VISIBLE_DEVICES] = ",".join(self.gpus.get(task, []))
            if self._gpus_counted:
                env.setdefault(envvars.CUDA_DEVICE_ORDER, "PCI_BUS_ID")
        argv = [self.config.script, *self.config.args]
        proc: subprocess.Popen[bytes] | ForkedTask
        if self._forks is not None:
            proc = self._forks.spawn(argv, env, cores)  # in a session of its own too
        else:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops every task
                preexec_fn=functools.partial(_start_task, cores),
            )
        self.procs[task] = proc
        for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            assert stream is not None
            t = threading.Thread(target=self._relay, args=(task, stream, sink), daemon=True)
            t.start()
            self._threads.append(t)

    def _task_env(self, cores: Sequence[int] | None = None) -> dict[str, str]:
        """The environment every task starts from; ``cores``: the task's, under
        ``--bind-cores``."""
        env = {**envvars.TASK_DEFAULTS, **os.environ, **self.config.env}
        # All of them on this host: the cores shared out, as torchrun does (unless set).
        tasks_here = sum(1 for _ in self.cluster.tasks())
        env.setdefault(envvars.OMP_NUM_THREADS, task_threads(cores, tasks_here))
        return env

    def _relay(self, task: TaskSpec, stream: IO[bytes], sink: IO[str]) -> None:
        prefix = f"[{task}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._out_lock:
                sink.write(prefix + line + "\n")
                sink.flush()
        stream.close()

    def _say(self, message: str) -> None:
        with self._out_lock:
            sys.stderr.write(f"psflow launch: {message}\n")
            sys.stderr.flush()

    def _restart(self, task: TaskSpec, how: str) -> bool:
        """Starts the failed ``task`` again if a restart is left (and the job is not over:
        a ps has exited 0, which it does only once the workers are done); whether it did."""
        limit = self.config.max_restarts
        if self.restarts >= limit:
            if limit:
                self._say(f"no restart left (--max-restarts {limit}, all used)")
            return False
        if any(t.job == "ps" and p.poll() == 0 for t, p in self.procs.items()):
            return False
        old = self.procs[task]
        self._swept.add(old.pid)
        removed = shmfiles.remove_files_of(old.pid)
        self.restarts += 1
        self._say(
            f"task {task} failed with {how}; restarting it with the same address and TF_CONFIG "
            f"(restart {self.restarts} of {limit} for the job"
            + (f"; removed {len(removed)} shared-memory files it left" if removed else "")
            + ")"
        )
        try:
            self._spawn(task)
        except (RuntimeError, OSError):
            if self._forks is None:
                raise
            return False  # the fork server is stopped, hung or gone: _fork_server_failed says
        return True

    def _join_relays(self) -> None:
        for t in self._threads:
            t.join(timeout=5)
