"""Prometheus metrics of a task: every metric psflow exports is defined here (``names.py``), and
only here.

Each task has its own registry (:class:`TaskMetrics`, from :func:`for_task`), served over HTTP
on ``PSFLOW_METRICS_PORT`` at the task's own address (the host of its cluster spec entry; never
all interfaces unless ``PSFLOW_METRICS_HOST`` says so). ``psflow launch`` picks a free port per
task; without the variable a task records nothing and serves nothing.

The names follow Prometheus' conventions (``_total`` counters, ``_seconds``, ``_bytes``); every
psflow metric carries the ``task`` label (``ps:0``, ``worker:1``), those of one ps shard the
``shard`` label. Besides psflow's: the ``process_*`` metrics (CPU seconds, resident memory, open
files) of prometheus-client's process collector.

- ``names.py``: every metric's name, kind, help text and labels (:data:`STEPS`, ...), and
  :data:`PATH`.
- ``registry.py``: :class:`TaskMetrics`, a task's registry, and the children bound to their
  labels that record the numbers (:class:`WorkerMetrics`, :class:`PsMetrics`).
- ``readback.py``: reading metrics back (:func:`scrape`, :func:`parse`, :class:`Sample`), for
  ``psflow top`` and the launcher's progress line.
- here: :func:`for_task`, each task's one registry in this process, served on its port.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from psflow import env as envvars
from psflow.metrics.names import _COUNTER as _COUNTER
from psflow.metrics.names import _DEFINITIONS as _DEFINITIONS
from psflow.metrics.names import _GAUGE as _GAUGE
from psflow.metrics.names import _HISTOGRAM as _HISTOGRAM
from psflow.metrics.names import (
    CHECKPOINT_SECONDS,
    CHECKPOINT_STEP,
    CHECKPOINT_TIME,
    CPU,
    EXAMPLES,
    GLOBAL_STEP,
    INFO,
    LAST_STEP,
    LOSS,
    MEMORY,
    PATH,
    PS_APPLY,
    PS_BYTES,
    PS_CKPT_PAUSE,
    PS_CKPT_WRITE,
    PS_DROPPED,
    PS_EVICTED,
    PS_EXPIRED,
    PS_EXPORT_FAILED,
    PS_EXPORT_PAUSE,
    PS_EXPORT_WRITE,
    PS_REQUESTS,
    PS_ROWS,
    PS_ROWS_PULLED,
    PS_ROWS_PUSHED,
    PS_STEP,
    PS_WAITING,
    RECEIVED_BYTES,
    REQUEST_SECONDS,
    SENT_BYTES,
    STALENESS,
    STEPS,
    SYNC_WAIT,
)
from psflow.metrics.readback import Sample, parse, scrape
from psflow.metrics.registry import _NOOP as _NOOP
from psflow.metrics.registry import PsMetrics, TaskMetrics, WorkerMetrics

# Besides these, the definitions and the no-op child keep their module-level names here
# (_DEFINITIONS, _COUNTER, _GAUGE, _HISTOGRAM, _NOOP), as before this was a package.
__all__ = [
    "CHECKPOINT_SECONDS",
    "CHECKPOINT_STEP",
    "CHECKPOINT_TIME",
    "CPU",
    "EXAMPLES",
    "GLOBAL_STEP",
    "INFO",
    "LAST_STEP",
    "LOSS",
    "MEMORY",
    "PATH",
    "PS_APPLY",
    "PS_BYTES",
    "PS_CKPT_PAUSE",
    "PS_CKPT_WRITE",
    "PS_DROPPED",
    "PS_EVICTED",
    "PS_EXPIRED",
    "PS_EXPORT_FAILED",
    "PS_EXPORT_PAUSE",
    "PS_EXPORT_WRITE",
    "PS_REQUESTS",
    "PS_ROWS",
    "PS_ROWS_PULLED",
    "PS_ROWS_PUSHED",
    "PS_STEP",
    "PS_WAITING",
    "RECEIVED_BYTES",
    "REQUEST_SECONDS",
    "SENT_BYTES",
    "STALENESS",
    "STEPS",
    "SYNC_WAIT",
    "PsMetrics",
    "Sample",
    "TaskMetrics",
    "WorkerMetrics",
    "for_task",
    "metrics_port",
    "parse",
    "scrape",
    "served_at",
]

log = logging.getLogger(__name__)

_RESOLVE_SECONDS = 30.0
"""How long a task waits for its own host name to resolve before it serves no metrics."""

_tasks: dict[str, TaskMetrics] = {}
_served: dict[str, str] = {}
_tasks_lock = threading.Lock()


def metrics_port(environ: Mapping[str, str] | None = None) -> int | None:
    """``PSFLOW_METRICS_PORT`` as a port (0: one the OS picks), or ``None`` when unset.

    Raises:
        ValueError: naming the variable when it is not a port number.
    """
    return envvars.port(envvars.PSFLOW_METRICS_PORT, environ)


def for_task(task: str, host: str | None = None) -> TaskMetrics:
    """The metrics of ``task`` in this process; serves them on ``PSFLOW_METRICS_PORT`` at
    ``host`` (the task's own address; ``PSFLOW_METRICS_HOST`` overrides it) the first time.

    Without ``PSFLOW_METRICS_PORT`` the metrics are off: no-op children, nothing served. In a
    process that runs several tasks (tests), the first to ask gets the port; the others record
    their numbers, unserved.
    """
    with _tasks_lock:
        m = _tasks.get(task)
        if m is not None:
            return m
        port = metrics_port()
        m = _tasks[task] = TaskMetrics(task, enabled=port is not None)
        if port is None or _served:
            return m
        bind = envvars.text(envvars.PSFLOW_METRICS_HOST) or host or "127.0.0.1"
        server = _serve(m.registry, bind, port)
        if server is None:
            return m
        where = f"{bind}:{server.server_address[1]}"
        _served[task] = where
        log.info("%s serves its metrics at http://%s%s", task, where, PATH)
        return m


def _serve(registry: CollectorRegistry, host: str, port: int) -> Any:
    """The HTTP server of ``registry`` on ``host:port``, or ``None`` (logged) when it cannot
    listen there: a job without its metrics still trains.

    A host name is resolved first, for up to :data:`_RESOLVE_SECONDS` (a Kubernetes pod's own
    Service name resolves only once its DNS record exists).
    """
    deadline = time.monotonic() + _RESOLVE_SECONDS
    while True:
        try:
            socket.getaddrinfo(host, port)
            break
        except socket.gaierror as e:
            if time.monotonic() > deadline:
                log.warning(
                    "cannot serve metrics: %r does not resolve (%s); going on without them", host, e
                )
                return None
            time.sleep(0.5)
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.warning(
            "cannot serve metrics on %s:%d (%s): %s; going on without them",
            host,
            port,
            envvars.PSFLOW_METRICS_PORT,
            e,
        )
        return None
    return server


def served_at(task: str) -> str | None:
    """``host:port`` where this process serves ``task``'s metrics, if it does."""
    return _served.get(task)
