"""Every environment variable psflow reads, in one place.

`TF_CONFIG` keeps TensorFlow's and Kubeflow's name so that the same manifests work; every other
variable is prefixed `PSFLOW_`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

TF_CONFIG = "TF_CONFIG"
"""The cluster and this task, as JSON: ``{"cluster": {...}, "task": {"type": ..., "index": ...}}``."""

TASK_DEFAULTS: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "PSFLOW_LOG_LEVEL": "INFO"}
"""Set in every task psflow starts (``psflow launch``, the rendered manifests, the Docker image)
unless the user sets them, as torchrun sets ``OMP_NUM_THREADS``.

``OMP_WAIT_POLICY``: OpenMP's threads otherwise spin for milliseconds after each parallel torch
op, on the core that ZeroMQ's I/O thread needs to move the next message: a 64 MB push and pull
through the socket ran at 2.2 GB/s spinning and 2.7-3.0 GB/s passive (2 cores). It is read once,
when torch loads OpenMP: too late to set it from inside a script that has imported torch.

``PSFLOW_LOG_LEVEL``: psflow's own INFO lines (initialised, restored, saved, waiting for ...)
show in every task without the script configuring logging."""

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""The GPUs a process may use (CUDA's). ``psflow launch --gpus-per-task`` reads the job's from it
(else from ``nvidia-smi -L``) and sets each task's: a trainer's own GPUs, none for the others
(:mod:`psflow.cluster.gpus`)."""

CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
"""How CUDA numbers the GPUs: ``psflow launch --gpus-per-task`` sets ``PCI_BUS_ID`` (unless
set) where it counted them with ``nvidia-smi``, so that its indices are CUDA's."""

OMP_NUM_THREADS = "OMP_NUM_THREADS"
"""OpenMP's (and torch's) threads per process: ``psflow launch`` sets it for each task it starts,
unless the user does (:func:`threads_per_task`, or the count of its cores under
``--bind-cores``); a ps reads it for its row threads (:func:`ps_threads`)."""


def threads_per_task(tasks_here: int) -> str:
    """``OMP_NUM_THREADS`` for each of ``tasks_here`` tasks started on one host (``psflow
    launch``), unless the user sets it: this host's cores shared out, at least 1. torchrun sets
    1 whenever it starts several processes on a node, for the same reason: torch otherwise runs
    each operation on every core in every process, and the processes' threads fight for the
    cores. Measured on 2 cores, a sparse table step (one worker and 2 ps, 4,096 rows of 64):
    2.9-4.5 ms a step with 1 thread a task against 3.7-5.6 ms with torch's default of 2
    (alternating runs); torch's ``index_add_`` of those rows alone took 0.73 ms on 2 threads
    and 0.09 ms on one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return str(max(1, cores // max(1, tasks_here)))


PSFLOW_PS_THREADS = "PSFLOW_PS_THREADS"
"""Threads a ps task serves one request with: the rows of a lookup or push in stripes, one a
thread (:mod:`psflow.sparse.stripes`), and torch's threads for the dense optimizer
(:func:`ps_threads`). ``psflow launch --ps-threads N`` sets it (and ``OMP_NUM_THREADS``) for its
ps tasks."""


def ps_threads() -> int:
    """``PSFLOW_PS_THREADS``; else the task's ``OMP_NUM_THREADS`` when it is one count (the
    cores ``psflow launch`` or a manifest gave the task); else 1: a ps that nothing told of its
    cores does not take every core of its host (a container's limit is not torch's count)."""
    omp = text(OMP_NUM_THREADS)
    given = int(omp) if omp is not None and omp.isdigit() and int(omp) >= 1 else 1
    return count(PSFLOW_PS_THREADS, given)


def count(name: str, default: int) -> int:
    """The integer >= 1 the environment variable ``name`` holds, else ``default``.

    Raises:
        ValueError: naming the variable, for anything else.
    """
    raw = text(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {raw!r}")
    return int(raw)


PSFLOW_PRELOAD = "PSFLOW_PRELOAD"
"""Modules, comma-separated (``torch,psflow``), that ``psflow launch`` imports once in a fork
server and forks every task from (its ``--preload``, which takes precedence):
:mod:`psflow.cluster.forkserver`. Unset or empty: each task is a fresh ``python`` process."""

PSFLOW_CLUSTER_FILE = "PSFLOW_CLUSTER_FILE"
"""Path of a YAML or JSON cluster file, used when no flags or TF_CONFIG give the cluster."""

PSFLOW_KEYS_DIR = "PSFLOW_KEYS_DIR"
"""Directory made by ``psflow keys generate``: when set, all traffic uses CurveZMQ."""

PSFLOW_TIMEOUT = "PSFLOW_TIMEOUT"
"""Seconds one request to a peer that is up may take before it fails with an error naming the
peer (default 60). Waiting for a peer to come up at all is bounded by ``PSFLOW_READY_TIMEOUT``
instead."""

PSFLOW_LINK_TIMEOUT = "PSFLOW_LINK_TIMEOUT"
"""Seconds a client's connection to a peer may go without a sign of life before it is closed as
dead (default 20): ZeroMQ's heartbeats, every quarter of it, are answered by the peer's own I/O
thread, busy Python or not, so only a hung (SIGSTOP) peer, a host gone or a cut network stays
silent that long. A request in flight on the connection then fails naming the peer, before its
``PSFLOW_TIMEOUT``: a worker's recovery begins sooner when a ps's host dies."""

PSFLOW_LOG_LEVEL = "PSFLOW_LOG_LEVEL"
"""Level of psflow's own log lines (the ``psflow`` logger): DEBUG, INFO (the default), WARNING
or ERROR. :func:`psflow.resolve` sets it and gives the ``psflow`` logger a handler on stderr
that prints only while nothing else would (no handler on the root logger, as before the
script's ``logging.basicConfig``), so a script that configures logging sees each line once and
one that does not still sees psflow's. The root logger is never touched."""

PSFLOW_LOGDIR = "PSFLOW_LOGDIR"
"""Default directory for checkpoints and TensorBoard summaries: a
:class:`~psflow.train.TrainingSession` whose script gives no ``checkpoint_dir`` uses it."""

PSFLOW_CHECKPOINT_DIR = "PSFLOW_CHECKPOINT_DIR"
"""The job's checkpoint directory, for a :class:`~psflow.ps.ParameterServer` whose script gives
it no ``checkpoint_dir``: the ps then writes its shard only into ``ckpt-<step>`` directories
right under it, whatever a ``save`` request names. Unset (and no ``checkpoint_dir``): the ps
writes where the chief's ``save`` says, and warns once."""

PSFLOW_MODE = "PSFLOW_MODE"
"""Training mode when the script does not pass one: ``async`` (default), ``sync`` or
``allreduce`` (``psflow launch --mode`` sets it for every task)."""

PSFLOW_SYNC_TIMEOUT = "PSFLOW_SYNC_TIMEOUT"
"""Seconds a synchronous worker waits for its step to complete (default: ``PSFLOW_TIMEOUT``)."""

PSFLOW_READY_TIMEOUT = "PSFLOW_READY_TIMEOUT"
"""Seconds a task waits, at its start, for every ps to answer and (workers other than the chief)
for the chief to initialise them (default 300). Each status request within that wait is bounded
by ``PSFLOW_TIMEOUT``; the wait as a whole by this. The chief waits this long for the ps to come
up, then initialises them itself."""

PSFLOW_RECOVERY_TIMEOUT = "PSFLOW_RECOVERY_TIMEOUT"
"""Seconds a worker waits, after a ps stopped answering (each request bounded by
``PSFLOW_TIMEOUT``), for every ps to answer again before it fails naming the ps (default 300):
the window in which a crashed ps is restarted and restored, or a cut link mended. A
``SessionConfig(recovery_timeout=...)`` given in the script wins."""

PSFLOW_WAIT_LOG_SECONDS = "PSFLOW_WAIT_LOG_SECONDS"
"""Seconds between the lines a waiting task logs (default 10): which ps tasks have not
answered (and what the connection says: nothing listening, key refused) or are not yet
initialised by the chief, how long it has waited and how long it will still wait."""

PSFLOW_PS_IDLE_TIMEOUT = "PSFLOW_PS_IDLE_TIMEOUT"
"""Seconds a ps serves without any request before it gives up, naming the workers it still
waits for (default 1800)."""

PSFLOW_WORKER_TIMEOUT = "PSFLOW_WORKER_TIMEOUT"
"""Seconds a ps waits without hearing from a worker (or the chief) that has joined before it
declares it dead (default 30): a worker sends a heartbeat every fifth of this (its requests
count too), so only a dead, hung (SIGSTOP) or cut-off task stays silent that long. A dead
worker no longer holds the others back (a synchronous step goes on with the backups, or fails
its waiting workers naming it; bounded staleness lets the others run), and the ps exits at the
end of the job without waiting for it; one that comes back (restarted) rejoins. Set it alike in
every task (``psflow launch`` and the manifests pass the environment to all)."""

PSFLOW_MALLOC = "PSFLOW_MALLOC"
"""``tuned`` (default): ps and worker processes keep freed memory in glibc's heap for reuse
instead of returning it to the system, and ask for embedding tables in transparent huge pages
(see :mod:`psflow.allocator`); ``system`` leaves the C allocator and the pages as they are."""

PSFLOW_GC_FREEZE = "PSFLOW_GC_FREEZE"
"""``1`` (default): once a worker is set up, the objects alive then are hidden from Python's cycle
collector (``gc.freeze``, see :func:`psflow.allocator.freeze_gc`); ``0`` leaves the collector
alone."""

PSFLOW_SHM = "PSFLOW_SHM"
"""``1`` (default): requests between a worker and a ps on the same host go through shared
memory (:mod:`psflow.transport.shm`); ``0`` sends everything through the socket."""

PSFLOW_SEALED = "PSFLOW_SEALED"
"""``1`` (default): with CurveZMQ keys, a client that reaches a ps only by socket moves its
requests (once one of them or a reply carried 64 KiB of tensors) to the ps's sealed socket,
each message sealed with AES-256-GCM under keys handed over through CurveZMQ
(:mod:`psflow.transport.seal`: a sixth of CurveZMQ's cipher's CPU); ``0`` keeps every byte
inside CurveZMQ (a ps then opens no second port)."""

PSFLOW_SPIN_US = "PSFLOW_SPIN_US"
"""Microseconds (default 2000) that a side of a shared-memory lane looks for the next message
after its last one, yielding its core, before it sleeps on its FIFO (:mod:`psflow.transport.shm`,
the doorbells), while its last waits ended that soon (:mod:`psflow.transport.looks`); ``0``
sleeps at once. Looking spares both sides a wake-up per message."""

PSFLOW_IO_THREADS = "PSFLOW_IO_THREADS"
"""ZeroMQ I/O threads of a task's context (default 1): they encrypt and decrypt every byte
through the socket with CurveZMQ keys, a ps's for all its workers' connections, which ZeroMQ
shares out among them as they connect (:class:`psflow.transport.TransportConfig`). It takes
effect where psflow's server or client makes the task's first ZeroMQ socket."""

PSFLOW_KERNELS = "PSFLOW_KERNELS"
"""``1`` (default): psflow's C extensions are used where the install built them: a ps applies
the row-wise optimizers of embedding tables with the fused kernels of
:mod:`psflow.sparse.kernels`, and the data layer hashes ids (FarmHash) and decodes
fixed-length Examples with :mod:`psflow.data.native`; ``0`` turns both off, for torch's index
operations, the pure-Python hash and the vectorized decoder (the references, and the fallbacks
without a C compiler)."""

PSFLOW_NATIVE_REQUESTS = "PSFLOW_NATIVE_REQUESTS"
"""``1`` (default): a ps serves lookups and the tables' part of pushes in native code, from the
request's bytes to the reply's (:mod:`psflow.ps.native`); ``0`` serves every request in Python,
the reference path (the kernels, :data:`PSFLOW_KERNELS`, are used in both)."""

PSFLOW_FLUSH_DENORMALS = "PSFLOW_FLUSH_DENORMALS"
"""``1`` (default): a ps task's serving thread and its row threads, and a worker's training
thread while its optimizer is open, take subnormal floats as zero (``torch.set_flush_denormal``,
the CPU's flush-to-zero and denormals-are-zero modes), as TensorFlow's runtime does on its
threads; ``0`` keeps IEEE subnormals (a worker's thread is then left as it is). A CTR shard's
dense Adam ran 6-7x slower once the moments of idle units had decayed into the subnormal range
(``benchmarks/results/profile.md``)."""

PSFLOW_PINNED = "PSFLOW_PINNED"
"""``1`` (default): a worker whose model is on a CUDA device moves rows, values and gradients
through pinned host memory with copies it does not wait for, waiting for its device once a step
(:mod:`psflow.worker.staging`); ``0``: plain copies, each waiting for the device."""

PSFLOW_METRICS_PORT = "PSFLOW_METRICS_PORT"
"""Port on which the task serves its Prometheus metrics (:mod:`psflow.metrics`) at
``/metrics``; ``0``: one the OS picks (logged). Unset (outside ``psflow launch``, which picks one
per task): the task records and serves no metrics."""

PSFLOW_METRICS_HOST = "PSFLOW_METRICS_HOST"
"""Address the metrics server binds (default: the host of the task's own address in the
cluster spec; never all interfaces unless this says ``0.0.0.0``)."""

LD_PRELOAD = "LD_PRELOAD"
"""The dynamic linker's list of libraries loaded first: when it names an allocator
(``jemalloc``, ``tcmalloc``: anything with ``malloc`` in it), :func:`psflow.allocator.tune`
leaves malloc alone, as the user chose it."""

XDG_RUNTIME_DIR = "XDG_RUNTIME_DIR"
"""The user's runtime directory (set by the login manager): ``psflow launch`` writes its job
file under ``$XDG_RUNTIME_DIR/psflow/jobs`` for ``psflow top`` (else ``/tmp/psflow-<uid>/jobs``)."""


_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no")


def text(
    name: str, default: str | None = None, *, environ: Mapping[str, str] | None = None
) -> str | None:
    """The value of the environment variable ``name``, else ``default`` (unset or empty).

    Args:
        name: the variable.
        default: what an unset or empty variable gives.
        environ: where to read it (a test's, or a task's about to start); default this
            process's environment.
    """
    raw = (os.environ if environ is None else environ).get(name)
    return default if raw is None or raw.strip() == "" else raw


def entries(name: str, *, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The comma-separated entries of the environment variable ``name`` (an empty value: none,
    ``[]``, which differs from unset), or ``None`` when it is unset.

    Args:
        name: the variable.
        environ: where to read it; default this process's environment.
    """
    raw = (os.environ if environ is None else environ).get(name)
    return None if raw is None else [e.strip() for e in raw.split(",") if e.strip()]


def flag(name: str, default: bool) -> bool:
    """The switch the environment variable ``name`` holds (``1/on/true/yes`` or
    ``0/off/false/no``, any case), else ``default``.

    Raises:
        ValueError: naming the variable, when it holds anything else.
    """
    raw = text(name)
    if raw is None:
        return default
    if raw.strip().lower() in _TRUE:
        return True
    if raw.strip().lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of the environment variable ``name``, one of ``choices``, else ``default``.

    Raises:
        ValueError: naming the variable and the choices, when it holds anything else.
    """
    raw = text(name)
    if raw is None:
        return default
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def port(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The port (0..65535; 0: one the OS picks) the environment variable ``name`` holds, else
    ``None`` (unset or empty).

    Raises:
        ValueError: naming the variable, when it holds anything else.
    """
    raw = (os.environ if environ is None else environ).get(name, "")
    if raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise ValueError(f"{name} must be a port in 0..65535, got {raw!r}")
    return value


def seconds(name: str, default: float, *, environ: Mapping[str, str] | None = None) -> float:
    """The positive number of seconds the environment variable ``name`` holds, else ``default``
    (``environ``: where to read it, as :func:`text`).

    Raises:
        ValueError: naming the variable, when it holds anything else.
    """
    value = _number(name, "seconds > 0", lambda v: v > 0, environ)
    return default if value is None else value


def seconds_or_none(name: str) -> float | None:
    """The positive number of seconds the environment variable ``name`` holds, else ``None``.

    Raises:
        ValueError: naming the variable, when it holds anything else.
    """
    return _number(name, "seconds > 0", lambda v: v > 0)


def micros(name: str, default: float) -> float:
    """The number of microseconds (>= 0) the environment variable ``name`` holds, in seconds,
    else ``default`` (seconds).

    Raises:
        ValueError: naming the variable, when it holds anything else.
    """
    value = _number(name, "microseconds >= 0", lambda v: v >= 0)
    return default if value is None else value / 1e6


def _number(
    name: str, what: str, ok: Callable[[float], bool], environ: Mapping[str, str] | None = None
) -> float | None:
    """The finite number the environment variable ``name`` holds (``None``: unset or empty).

    Raises:
        ValueError: naming the variable and ``what`` it must be, when ``ok`` refuses it.
    """
    raw = text(name, environ=environ)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not ok(value) or value == float("inf"):  # nan fails every comparison
        raise ValueError(f"{name} must be a number of {what}, got {raw!r}")
    return value
