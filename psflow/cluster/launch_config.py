"""What ``psflow launch`` starts: :class:`LaunchConfig`, checked before any task starts.

:mod:`psflow.cluster.launcher` runs the job it describes (and exports it with its modes).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from psflow import env as envvars
from psflow.cluster.gpus import check_per_task
from psflow.cluster.modes import MODES, Mode

LAUNCH_MODES = MODES
"""The modes ``psflow launch --mode`` takes: every one (:data:`psflow.cluster.modes.MODES`)."""


WORKERS_PER_PS = 3
"""Workers to a ps task when ``psflow launch`` chooses (no ``--ps``). Every worker's step
reaches every shard (each holds a share of the dense parameters and of every table), so a
shard's serving thread sees the whole job's steps and only its share of each shrinks with more
ps. On 16 cores, ``examples/ctr.py`` at 4 ps x 12 workers had each ps's serving thread 73-91%
busy with the workers waiting for them (50% of the cores' plain-torch rate once its Adam was
fused; 2 ps x 4 workers 82% of its 6 cores): ``benchmarks/results/scaling.md``. Other ratios at
16 cores are still to measure; ``--ps`` chooses."""


PS_EXIT_MARGIN = 30.0
"""Seconds past the workers' timeout the ps tasks get to exit once every worker has finished
(``--ps-exit-timeout``'s default): a ps waits one worker timeout for a worker that never spoke
to it (one that finished before the ps restarted empty) before it exits without it, so a
deadline of one worker timeout alone raced that wait and could fail a job whose chief had
finished."""

DEFAULT_WORKER_TIMEOUT = 30.0
"""The ps's worker timeout where ``PSFLOW_WORKER_TIMEOUT`` is not set: ``psflow.protocol``'s
``WORKER_TIMEOUT``, not imported here (that package loads torch, which the launcher never
needs); a test holds the two equal."""


def planned_ps(workers: int, mode: str | None) -> int:
    """The ps tasks ``psflow launch`` starts when ``--ps`` is not given: none in all-reduce,
    else one for every :data:`WORKERS_PER_PS` workers, at least one.

    Example:
        >>> [planned_ps(w, None) for w in (1, 2, 3, 4, 12)], planned_ps(4, "allreduce")
        ([1, 1, 1, 2, 4], 0)
    """
    if mode == Mode.ALLREDUCE:
        return 0
    return max(1, -(-workers // WORKERS_PER_PS))


@dataclass(kw_only=True)
class LaunchConfig:
    """What ``psflow launch`` starts."""

    script: str
    """The training script every task runs (with ``python``)."""
    args: Sequence[str] = ()
    """Arguments passed to the script."""
    ps: int = 1
    """Number of ps tasks."""
    workers: int = 2
    """Number of worker tasks."""
    chief: bool = False
    """Add a separate ``chief`` task (otherwise ``worker:0`` is the chief)."""
    evaluators: int = 0
    """Evaluator tasks: 0 or 1 (one evaluator writes ``<logdir>/eval``)."""
    eval_exit_timeout: float = 600.0
    """Seconds the evaluator may take, once the workers are done, to score the checkpoints
    left and exit (then it is stopped, and the job fails)."""
    host: str = "127.0.0.1"
    """Address every task listens on."""
    ps_exit_timeout: float | None = None
    """Seconds the ps tasks may take to exit once every worker has finished; ``None``: the
    workers' timeout the tasks get (``PSFLOW_WORKER_TIMEOUT`` in :attr:`env`, else in this
    environment, else 30) and :data:`PS_EXIT_MARGIN` more (:attr:`ps_exit_seconds`)."""
    grace: float = 30.0
    """Seconds the tasks get between SIGTERM and SIGKILL when the job is stopped (Ctrl-C,
    SIGTERM, or a failed task): time for a chief to finish a checkpoint."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every task."""
    mode: str | None = None
    """Training mode for every task (``PSFLOW_MODE``): ``async``, ``sync`` or ``allreduce``;
    ``allreduce`` starts no ps task. ``None`` leaves it to the script."""
    max_restarts: int = 0
    """How many times in all (for the whole job) a failed task is started again before the
    job stops."""
    insecure: bool = False
    """Run the job without CurveZMQ keys; otherwise it gets fresh ones (unless the environment
    names its own in ``PSFLOW_KEYS_DIR``)."""
    metrics: bool = True
    """Each task serves its Prometheus metrics on a free port (``PSFLOW_METRICS_PORT``), listed
    in a job file that ``psflow top`` finds (:mod:`psflow.cluster.jobs`)."""
    progress: bool | None = None
    """One live progress line below the tasks' output (step, rate, loss, ETA, tasks up), read
    from their metrics; ``None``: when standard output is a terminal."""
    ps_threads: int | None = None
    """Threads each ps task serves one request with (its ``PSFLOW_PS_THREADS`` and
    ``OMP_NUM_THREADS``: :mod:`psflow.sparse.stripes`); ``None``: the host's cores shared out
    among all the tasks, as for the others."""
    bind_cores: bool = False
    """Bind each task to cores of its own (:func:`~psflow.cluster.cores.core_sets`), as
    ``mpirun --bind-to core`` does: the scheduler then neither moves a task between cores nor
    puts two ps that answer the same step on one core while another idles."""
    trainer_gpus: float = 0.0
    """GPUs of the chief's and each worker's own (``--gpus-per-task``): a whole number, or a
    share of one below 1 (``0.5``: two trainers a GPU), seen through ``CUDA_VISIBLE_DEVICES``
    (:mod:`psflow.cluster.gpus`); the ps and evaluator tasks then see none. ``0``: no task's
    ``CUDA_VISIBLE_DEVICES`` is touched."""
    preload: Sequence[str] = ()
    """Modules to import once in a fork server that starts every task by forking
    (:mod:`psflow.cluster.forkserver`; ``("torch", "psflow")``): a task, started or restarted,
    skips their import. Empty: each task is a fresh ``python`` process."""

    def __post_init__(self) -> None:
        if self.ps < 0:
            raise ValueError(f"--ps must be >= 0, got {self.ps}")
        if self.workers < 0 or (self.workers == 0 and not self.chief):
            raise ValueError(f"--workers must be >= 1 (or give --chief), got {self.workers}")
        if not os.path.isfile(self.script):
            raise ValueError(f"script {self.script!r} does not exist")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"--mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == Mode.ALLREDUCE and self.ps:
            raise ValueError(f"--mode allreduce runs without ps tasks: drop --ps {self.ps}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int):
            raise TypeError(f"--max-restarts must be an integer, got {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.ps_threads is not None and (
            isinstance(self.ps_threads, bool)
            or not isinstance(self.ps_threads, int)
            or self.ps_threads < 1
        ):
            raise ValueError(f"--ps-threads must be an integer >= 1, got {self.ps_threads!r}")
        check_per_task(self.trainer_gpus)
        if isinstance(self.preload, str):
            raise TypeError(f"preload must be a sequence of module names, got {self.preload!r}")
        bad = [m for m in self.preload if not all(p.isidentifier() for p in m.split("."))]
        if bad:
            raise ValueError(f"--preload takes module names (torch,psflow), got {bad}")
        if self.evaluators not in (0, 1):
            raise ValueError(f"evaluators must be 0 or 1, got {self.evaluators}")
        for what, seconds in (
            ("ps_exit_timeout", self.ps_exit_seconds),
            ("grace", self.grace),
            ("eval_exit_timeout", self.eval_exit_timeout),
        ):
            if not seconds > 0:
                raise ValueError(f"{what} must be > 0 seconds, got {seconds}")

    @property
    def ps_exit_seconds(self) -> float:
        """:attr:`ps_exit_timeout`, or its default: the tasks' worker timeout plus
        :data:`PS_EXIT_MARGIN`.

        Raises:
            ValueError: naming ``PSFLOW_WORKER_TIMEOUT`` when it is not a number of seconds.
        """
        if self.ps_exit_timeout is not None:
            return self.ps_exit_timeout
        tasks_env = {**os.environ, **self.env}  # what the tasks get
        timeout = envvars.seconds(
            envvars.PSFLOW_WORKER_TIMEOUT, DEFAULT_WORKER_TIMEOUT, environ=tasks_env
        )
        return timeout + PS_EXIT_MARGIN
