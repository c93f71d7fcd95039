"""Cores for a local job's tasks: ``psflow launch --bind-cores`` and ``OMP_NUM_THREADS``.

:func:`core_sets` deals this host's cores (:func:`host_cpus`) out to the tasks, :func:`bind`
binds a task's process to its own, and :func:`task_threads` sizes each task's thread pool.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from psflow import env as envvars
from psflow.cluster.spec import TaskSpec


def core_sets(tasks: Sequence[TaskSpec], cpus: Sequence[int]) -> dict[TaskSpec, list[int]]:
    """The cores each of ``tasks`` (all on this host) is bound to with ``--bind-cores``.

    The trainers come first (chief, workers, evaluators), then the ps. With at least as many
    ``cpus`` as tasks, each task gets a contiguous run of them of its own (the first ones one
    core more where they do not divide evenly); with fewer, the tasks are dealt out over the
    cores in that order, so that a ps shares a core with a trainer before two ps share one: a
    ps works while its trainer waits for it, and the shards of one step work at once.

    Example:
        >>> from psflow.cluster.spec import TaskSpec
        >>> tasks = [TaskSpec(job="ps", index=i) for i in (0, 1)] + [TaskSpec(job="worker")]
        >>> {str(t): c for t, c in core_sets(tasks, [0, 1]).items()}
        {'worker:0': [0], 'ps:0': [1], 'ps:1': [0]}
    """
    if not cpus:
        raise ValueError("no cores to bind the tasks to")
    rank = {"chief": 0, "worker": 1, "evaluator": 2}
    order = sorted(tasks, key=lambda t: (rank.get(t.job, 3), t.index))
    if len(order) > len(cpus):
        return {t: [cpus[i % len(cpus)]] for i, t in enumerate(order)}
    share, extra = divmod(len(cpus), len(order))
    out: dict[TaskSpec, list[int]] = {}
    start = 0
    for i, task in enumerate(order):
        end = start + share + (i < extra)
        out[task] = list(cpus[start:end])
        start = end
    return out


def task_threads(cores: Sequence[int] | None, tasks_here: int) -> str:
    """``OMP_NUM_THREADS`` for a task bound to ``cores`` (their count), or, unbound, for one of
    ``tasks_here`` tasks sharing this host (:func:`psflow.env.threads_per_task`)."""
    return str(len(cores)) if cores else envvars.threads_per_task(tasks_here)


def host_cpus() -> list[int]:
    """The cores this process may run on (a container's cpuset, ``taskset``), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def bind(cores: Sequence[int]) -> None:
    """Binds this process to ``cores``; where it cannot (a core taken away since), says so on
    its stderr and leaves it unbound. Safe between fork and exec (``preexec_fn``)."""
    try:
        os.sched_setaffinity(0, cores)
    except OSError as e:  # a core taken away since (a cgroup changed): run unbound
        os.write(2, f"psflow launch: cannot bind this task to cores {list(cores)}: {e}\n".encode())
