"""``psflow launch``: every task of a job as a local process, on ports the OS picks.

Each task gets its own ``TF_CONFIG`` (and :data:`~psflow.env.TASK_DEFAULTS`: psflow's INFO
lines show); its output lines are prefixed with the task (``[worker:1] ...``). The job succeeds
when every worker exits 0 and the ps tasks then exit by themselves. When a task fails, the
launcher names it and its exit code, stops the others and fails; with ``--max-restarts N``
(torchrun's name) it first starts the failed task again, with the same address and
``TF_CONFIG``, up to N times in all for the job (restarts are counted per job, as torchrun
does: N bounds the churn an operator accepts, whichever tasks fail). A restarted ps comes back
empty and the chief restores the last checkpoint into it; a restarted worker rejoins; a
restarted chief resumes as chief (Kubernetes' ``restartPolicy: OnFailure`` and
``backoffLimit`` play this part in the rendered manifests).

A worker still running ``--ps-exit-timeout`` seconds after the chief and every ps exited 0
(hung: the ps declared it dead, :mod:`psflow.ps.liveness`, and ended the job without it) is
named and stopped, and the job fails: nothing waits forever for a hung task.

Each job gets fresh CurveZMQ keys (:mod:`psflow.cluster.keys`) in a private temporary
directory (mode 0700) that every task gets as ``PSFLOW_KEYS_DIR`` and that is removed when the
launcher exits: no other process on the host can reach the job's ps. ``--insecure`` runs
without keys; a ``PSFLOW_KEYS_DIR`` of the user's own stands.

Each task gets ``OMP_NUM_THREADS`` = this host's cores divided by its tasks (unless set);
``--bind-cores`` binds each task to cores of its own
(:func:`~psflow.cluster.cores.core_sets`), its
``OMP_NUM_THREADS`` then their count. ``--gpus-per-task`` gives the chief and each worker GPUs
of their own (:mod:`psflow.cluster.gpus`), through ``CUDA_VISIBLE_DEVICES``; the ps and
evaluator tasks then see none.

An evaluator task (``--evaluator``; outside the cluster in its ``TF_CONFIG``, as TensorFlow
has it) scores checkpoints beside the job and exits by itself after the chief's final one; it
may take up to ``eval_exit_timeout`` for that once the workers are done. Its failure does not
stop training: the launcher names it, goes on, and the job then fails.

``--preload torch,psflow`` starts each task by forking it from a server that imported those
modules once (:mod:`psflow.cluster.forkserver`): a task, and a restarted one, skips the 1.5-2 s
of CPU its ``import torch`` would take. A fork server that stops answering (stopped, hung: it
does not report a task that ended, or fork one, within
:data:`~psflow.cluster.forkserver.ANSWER_TIMEOUT`) or exits fails the job: the launcher names it
and stops the tasks (those that ended have an unknown exit code), then kills it.

Ctrl-C (or SIGTERM) stops the job: the workers get SIGTERM (a chief may save a last
checkpoint), then, once they are gone, the ps tasks; whatever still runs after the grace period
(``--grace``, 30 s; at least 5 s for the ps) gets SIGKILL. A second Ctrl-C kills at once. No task is left behind, nor any shared-memory file a task left
when it died (:mod:`psflow.cluster.shmfiles`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from psflow import env as envvars
from psflow.cluster.cores import core_sets, host_cpus
from psflow.cluster.forkserver import ForkedTask, ForkServer, exit_status
from psflow.cluster.gpus import gpu_sets, host_gpus
from psflow.cluster.launch_config import LAUNCH_MODES, LaunchConfig
from psflow.cluster.launch_metrics import JobMetrics
from psflow.cluster.launch_stop import TaskStopping
from psflow.cluster.ports import local_cluster
from psflow.cluster.progress import ProgressLine
from psflow.cluster.spec import TaskSpec

__all__ = ["LAUNCH_MODES", "PS_GRACE", "LaunchConfig", "Launcher"]

log = logging.getLogger(__name__)

PS_GRACE = 5.0
"""Seconds the ps tasks get at least after SIGTERM, which they get once the workers are gone."""


class Launcher(TaskStopping, JobMetrics):
    """Starts and supervises the processes of one local job.

    Example:
        >>> # code = Launcher(LaunchConfig(script="train.py", ps=1, workers=2)).run()
    """

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.cluster = local_cluster(
            config.ps,
            config.workers,
            chief=config.chief,
            host=config.host,
            evaluators=config.evaluators,
        )
        self.cores = core_sets(self.cluster.tasks(), host_cpus()) if config.bind_cores else {}
        """Task to the cores it is bound to (``--bind-cores``; empty: not bound)."""
        self.gpus: dict[TaskSpec, list[str]] = {}
        """Trainer to the GPUs it sees (``--gpus-per-task``; empty: every task sees them all)."""
        self._gpus_counted = False  # by nvidia-smi: CUDA told to number them as it does
        if config.trainer_gpus:
            environ = {**os.environ, **config.env}
            found, where = host_gpus(environ)
            self.gpus = gpu_sets(self.cluster.trainers, found, config.trainer_gpus, where)
            given = envvars.entries(envvars.CUDA_VISIBLE_DEVICES, environ=environ)
            self._gpus_counted = given is None
        self.procs: dict[TaskSpec, subprocess.Popen[bytes] | ForkedTask] = {}
        self._forks: ForkServer | None = None
        """The server that forks the tasks (``preload``), while it runs."""
        self._forks_failed = False
        """The fork server failed the job (stopped, hung or exited), and the launcher said so."""
        self._threads: list[threading.Thread] = []
        self._out_lock = threading.RLock()  # the signal handler may print too
        self._stopping = threading.Event()
        self._kill_now = threading.Event()
        self._signal: signal.Signals | None = None
        self._swept: set[int] = set()
        self.restarts = 0
        """Tasks started again after they failed (at most ``max_restarts``)."""
        self._ended_at: float | None = None
        """When the chief and every ps had exited 0 (the job is over, by their account)."""
        self.keys_dir: str | None = None
        """The job's own CurveZMQ keys, made by :meth:`run` (``None``: insecure, or the
        user's own)."""
        self.metrics_at = self._metrics_ports()
        """Task (``ps:0``) to the ``host:port`` where it serves its metrics."""
        self._job_file: Path | None = None
        self._live: ProgressLine | None = None
        """The progress line while it shows."""

    def start(self) -> None:
        """Starts every task (ps first, so the workers find them listening sooner)."""
        if self.config.preload and self._forks is None:
            self._forks = ForkServer(self.config.preload, self._task_env())
            self._forks.start()
        order = sorted(self.cluster.tasks(), key=lambda t: t.job != "ps")
        if self.gpus:
            dealt = ", ".join(f"{t} {','.join(g)}" for t, g in self.gpus.items())
            self._say(f"GPUs (CUDA_VISIBLE_DEVICES): {dealt}; the other tasks see none")
        for task in order:
            self._spawn(task)
        self._announce_metrics()

    def wait(self) -> int:
        """Supervises the job until it ends; returns the launcher's exit code."""
        trainers = [t for t in self.procs if t.job in ("chief", "worker")]
        trainers_done_at: float | None = None
        failed_evaluators: list[TaskSpec] = []
        while True:
            if self._stopping.is_set():
                return 128 + (self._signal or signal.SIGINT)
            if self._fork_server_failed("stopping the job"):
                self.stop()
                return 1
            self._sweep()
            restarted = False
            for task, proc in self.procs.items():
                code = proc.poll()
                if code is None or code == 0 or task in failed_evaluators:
                    continue
                if self._fork_server_failed("stopping the job"):  # the task died with it
                    self.stop()
                    return 1
                how = exit_status(code)
                if task.job == "evaluator":
                    failed_evaluators.append(task)
                    self._say(f"task {task} failed with {how}; training goes on without it")
                    continue
                if self._restart(task, how):
                    restarted = True
                    break
                if self._fork_server_failed("stopping the job"):  # it did not fork the task again
                    self.stop()
                    return 1
                self._say(f"task {task} failed with {how}; stopping the other tasks")
                self.stop()
                return 1
            if restarted:
                continue  # self.procs changed (and the new task may have ended already): look again
            if trainers_done_at is None and all(self.procs[t].poll() == 0 for t in trainers):
                trainers_done_at = time.monotonic()
            hung = self._hung_after_the_end()
            if hung is not None:
                self.stop()
                return hung
            # Every task ended, each with 0 (a failed evaluator aside): one that failed since the
            # look above is seen on the next turn, not counted as a success.
            codes = {t: p.poll() for t, p in self.procs.items()}
            if all(c == 0 or (c is not None and t in failed_evaluators) for t, c in codes.items()):
                self._join_relays()
                if failed_evaluators:
                    names = ", ".join(map(str, failed_evaluators))
                    self._say(f"job finished, but {names} failed")
                    return 1
                self._say(f"job finished: {len(self.procs)} tasks exited 0")
                return 0
            if trainers_done_at is not None and self._late(time.monotonic() - trainers_done_at):
                self.stop()
                return 1
            time.sleep(0.05)

    def _hung_after_the_end(self) -> int | None:
        """The job's exit code when a worker or the chief still runs ``ps_exit_timeout`` seconds
        after every ps exited 0 (one the ps declared dead, hung e.g. by SIGSTOP, and ended the
        job without: its requests would wait the recovery timeout, 300 s, for ps that will not
        return); ``None`` while there is none. As TensorFlow's jobs (TFJob's default success
        policy), the job succeeded when its chief did: a straggling worker is stopped with a
        warning (0); a chief still running never saved its final checkpoint (1)."""
        ps = [p for t, p in self.procs.items() if t.job == "ps"]
        if not ps or any(p.poll() != 0 for p in ps):
            self._ended_at = None
            return None
        left = [
            t for t, p in self.procs.items() if t.job in ("chief", "worker") and p.poll() is None
        ]
        now = time.monotonic()
        if not left:
            return None
        if self._ended_at is None:
            self._ended_at = now
        if now - self._ended_at <= self.config.ps_exit_seconds:
            return None
        chief = self.cluster.chief in left
        self._say(
            f"{', '.join(map(str, left))} still running {self.config.ps_exit_seconds:g} s after "
            "the ps exited 0 (they declared it dead and ended the job without it): hung? "
            "stopping it"
            + (
                "; the chief's final checkpoint was not saved"
                if chief
                else f"; the job succeeded with its chief ({self.cluster.chief} exited 0)"
            )
        )
        return 1 if chief else 0

    def _fork_server_failed(self, then: str) -> bool:
        """Whether the fork server (``--preload``) fails the job: stopped, hung, or exited by
        itself; the first time, says so in one line naming it (and ``then``)."""
        why = self._forks.problem() if self._forks is not None else None
        if why is None:
            return self._forks_failed
        if not self._forks_failed:
            self._forks_failed = True
            for task, proc in self.procs.items():  # the server knows pids; this, the tasks
                why = why.replace(f"task {proc.pid} ", f"task {task} (pid {proc.pid}) ")
            self._say(f"{why}; {then}")
        return True

    def _make_keys(self) -> None:
        """Fresh CurveZMQ keys for this job in a private directory, unless ``insecure`` or the
        user gave keys (``PSFLOW_KEYS_DIR`` in the environment)."""
        if self.config.insecure:
            return
        if self.config.env.get(envvars.PSFLOW_KEYS_DIR) or envvars.text(envvars.PSFLOW_KEYS_DIR):
            return
        # Imported here: `psflow --help` imports this module, and must not load ZeroMQ.
        from psflow.cluster.keys import generate_keys

        d = tempfile.mkdtemp(prefix="psflow-keys-")  # mode 0700, this user's alone
        try:
            generate_keys(d)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        self.keys_dir = d

    def _remove_keys(self) -> None:
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)
            self.keys_dir = None

    def _late(self, waited: float) -> bool:
        """Whether a task still running ``waited`` seconds after the workers finished has
        overstayed (the ps: ``ps_exit_timeout``; an evaluator: ``eval_exit_timeout``)."""
        for job, limit, why in (
            ("ps", self.config.ps_exit_seconds, ""),
            ("evaluator", self.config.eval_exit_timeout, " (no final checkpoint to stop after?)"),
        ):
            left = [str(t) for t, p in self.procs.items() if t.job == job and p.poll() is None]
            if left and waited > limit:
                self._say(
                    f"{', '.join(left)} did not exit within {limit:g} s of the workers "
                    f"finishing{why}; stopping them"
                )
                return True
        return False

    def stop(self, timeout: float | None = None) -> None:
        """Stops every task still running: SIGTERM, then SIGKILL after the grace period (at
        once after a second Ctrl-C); then removes the shared-memory files they left.

        The workers (and chief, evaluator) go first: a chief stopped by SIGTERM may save a
        last checkpoint, and needs its ps for that. The ps tasks get SIGTERM once the workers
        are gone, and :data:`PS_GRACE` seconds at least.
        """
        grace = self.config.grace if timeout is None else timeout
        deadline = time.monotonic() + grace
        trainers = [t for t in self.procs if t.job != "ps"]
        self._terminate(trainers, deadline)
        ps = [t for t in self.procs if t.job == "ps"]
        self._terminate(ps, max(deadline, time.monotonic() + min(grace, PS_GRACE)))
        self._fork_server_failed("killing it")
        self._sweep()
        self._join_relays()
        self._stop_fork_server()
        self._forget_job()

    def _stop_fork_server(self) -> None:
        if self._forks is not None:
            self._forks.stop()
            self._forks = None

    def run(self) -> int:
        """Starts the job, supervises it, and stops it on SIGINT/SIGTERM."""

        def on_signal(signum: int, _frame: object) -> None:
            name = signal.Signals(signum).name
            if self._stopping.is_set():
                if not self._kill_now.is_set():
                    self._kill_now.set()
                    self._say(f"received {name} again; killing every task now")
                return
            self._signal = signal.Signals(signum)
            self._stopping.set()
            self._say(
                f"received {name}; stopping every task (SIGTERM, then SIGKILL after "
                f"{self.config.grace:g} s; {name} again kills at once)"
            )

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        self._start_progress()  # first: the tasks' output then goes above its line
        try:
            self._make_keys()
            self.start()
            code = self.wait()
            if self._stopping.is_set():
                self.stop()
            return code
        except BaseException:
            self.stop()
            raise
        finally:
            self._stop_fork_server()
            self._remove_keys()
            self._stop_progress()
            self._forget_job()
            for s, handler in old.items():
                signal.signal(s, handler)
