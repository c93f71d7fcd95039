"""Prometheus metrics of a task: every metric psflow exports is defined here, and only here.

Each task has its own registry (:class:`TaskMetrics`, from :func:`for_task`), served over HTTP
on ``PSFLOW_METRICS_PORT`` at the task's own address (the host of its cluster spec entry; never
all interfaces unless ``PSFLOW_METRICS_HOST`` says so). ``psflow launch`` picks a free port per
task; without the variable a task records nothing and serves nothing.

What the code that produces numbers holds are children bound once to their labels
(:class:`WorkerMetrics`, :class:`PsMetrics`): plain objects whose ``inc``/``set``/``observe``
add to a float or a list (a tenth of a microsecond: no lock, no label lookup, no allocation);
the registry reads them only when scraped (:class:`_Recorded`). Each child is written by one
thread, the one that produces its numbers. With metrics off the children are no-ops.

The names follow Prometheus' conventions (``_total`` counters, ``_seconds``, ``_bytes``); every
psflow metric carries the ``task`` label (``ps:0``, ``worker:1``), those of one ps shard the
``shard`` label. Besides psflow's: the ``process_*`` metrics (CPU seconds, resident memory, open
files) of prometheus-client's process collector.

This module also reads metrics back (:func:`scrape`), for ``psflow top`` and the launcher's
progress line.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import urllib.request
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from psflow import env as envvars

log = logging.getLogger(__name__)

PATH = "/metrics"
"""Where a task serves its metrics."""

_RESOLVE_SECONDS = 30.0
"""How long a task waits for its own host name to resolve before it serves no metrics."""

_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_SLOW_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)

# The names, each spelled once (psflow top and the launcher read them back).
STEPS = "psflow_worker_steps_total"
EXAMPLES = "psflow_worker_examples_total"
LOSS = "psflow_worker_loss"
GLOBAL_STEP = "psflow_worker_global_step"
LAST_STEP = "psflow_worker_last_step"
SENT_BYTES = "psflow_worker_sent_bytes_total"
RECEIVED_BYTES = "psflow_worker_received_bytes_total"
REQUEST_SECONDS = "psflow_worker_request_seconds"
SYNC_WAIT = "psflow_worker_sync_wait_seconds"
STALENESS = "psflow_worker_gradient_staleness_steps"
CHECKPOINT_SECONDS = "psflow_checkpoint_save_seconds"
CHECKPOINT_STEP = "psflow_checkpoint_last_step"
CHECKPOINT_TIME = "psflow_checkpoint_last_timestamp_seconds"
PS_REQUESTS = "psflow_ps_requests_total"
PS_APPLY = "psflow_ps_apply_seconds"
PS_WAITING = "psflow_ps_requests_waiting"
PS_STEP = "psflow_ps_global_step"
PS_BYTES = "psflow_ps_variables_bytes"
PS_DROPPED = "psflow_ps_dropped_stale_gradients_total"
PS_ROWS_PULLED = "psflow_ps_rows_pulled_total"
PS_ROWS_PUSHED = "psflow_ps_rows_pushed_total"
PS_ROWS = "psflow_ps_table_rows"
PS_EVICTED = "psflow_ps_table_evicted_rows_total"
PS_CKPT_PAUSE = "psflow_ps_checkpoint_pause_seconds"
PS_CKPT_WRITE = "psflow_ps_checkpoint_write_seconds"
INFO = "psflow_task_info"
CPU = "process_cpu_seconds_total"
MEMORY = "process_resident_memory_bytes"


class _Counter:
    """A counter child: a float its one writer adds to."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class _Gauge:
    """A gauge child: the last value set, or what ``function`` returns when scraped."""

    __slots__ = ("function", "value")

    def __init__(self) -> None:
        self.value: float = 0.0
        self.function: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        self.value = value

    def set_function(self, function: Callable[[], float]) -> None:
        self.function = function

    def get(self) -> float:
        return float(self.function() if self.function is not None else self.value)


class _Histogram:
    """A histogram child: a count per bucket (the last one past every bound) and the sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # Prometheus' buckets are "less than or equal": the first bound >= amount.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def buckets(self) -> list[tuple[str, float]]:
        """The cumulative buckets of the exposition, ``+Inf`` last."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), list(self.counts), strict=True):
            total += count
            out.append((floatToGoString(bound), float(total)))
        return out


_COUNTER, _GAUGE, _HISTOGRAM = "counter", "gauge", "histogram"


class _Recorded(Collector):
    """The registry's view of a task's children: read, never locked, when scraped.

    A scrape racing a write sees the number just before or just after it (a histogram's sum
    may be one observation ahead of its buckets), as any lock-free exporter would.
    """

    def __init__(self, task: str) -> None:
        self.task = task
        self.children: dict[str, dict[tuple[tuple[str, str], ...], Any]] = {}

    def collect(self) -> Iterable[Any]:
        for name, children in list(self.children.items()):
            kind, doc, names, _ = _DEFINITIONS[name]
            labels = ["task", *names]
            family: Any
            if kind == _COUNTER:
                family = CounterMetricFamily(name, doc, labels=labels)
            elif kind == _GAUGE:
                family = GaugeMetricFamily(name, doc, labels=labels)
            else:
                family = HistogramMetricFamily(name, doc, labels=labels)
            for key, child in list(children.items()):
                values = [self.task, *(v for _, v in key)]
                if kind == _COUNTER:
                    family.add_metric(values, child.value)
                elif kind == _GAUGE:
                    family.add_metric(values, child.get())
                else:
                    family.add_metric(values, child.buckets(), child.sum)
            yield family


class _Noop:
    """A child that records nothing: the metrics of a task that serves none."""

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass


_NOOP: Any = _Noop()


class WorkerMetrics:
    """A worker's (or the chief's) children, bound to its task and ps shards."""

    def __init__(self, owner: TaskMetrics, num_shards: int) -> None:
        self.on = on = owner.enabled
        """Whether anything is recorded (callers skip work that only feeds the metrics)."""
        self.steps = owner.child(STEPS) if on else _NOOP
        self.examples = owner.child(EXAMPLES) if on else _NOOP
        self.loss = owner.child(LOSS) if on else _NOOP
        self.global_step = owner.child(GLOBAL_STEP) if on else _NOOP
        self.last_step = owner.child(LAST_STEP) if on else _NOOP
        self.sync_wait = owner.child(SYNC_WAIT) if on else _NOOP
        self.staleness = owner.child(STALENESS) if on else _NOOP
        self.checkpoint_seconds = owner.child(CHECKPOINT_SECONDS) if on else _NOOP
        self.checkpoint_step = owner.child(CHECKPOINT_STEP) if on else _NOOP
        self.checkpoint_time = owner.child(CHECKPOINT_TIME) if on else _NOOP
        shards = [str(s) for s in range(num_shards)]
        self.sent = [owner.child(SENT_BYTES, shard=s) if on else _NOOP for s in shards]
        """Bytes of tensors sent to each shard."""
        self.received = [owner.child(RECEIVED_BYTES, shard=s) if on else _NOOP for s in shards]
        self.request_seconds = [
            owner.child(REQUEST_SECONDS, shard=s) if on else _NOOP for s in shards
        ]


class PsMetrics:
    """A ps shard's children, and the gauges read from its state when scraped."""

    def __init__(self, owner: TaskMetrics, shard: int) -> None:
        self._owner = owner
        self._shard = str(shard)
        on = owner.enabled
        self.apply_seconds = owner.child(PS_APPLY, shard=self._shard) if on else _NOOP
        self.dropped_stale = owner.child(PS_DROPPED, shard=self._shard) if on else _NOOP
        self.checkpoint_pause = owner.child(PS_CKPT_PAUSE, shard=self._shard) if on else _NOOP
        self.checkpoint_write = owner.child(PS_CKPT_WRITE, shard=self._shard) if on else _NOOP
        self._bound: dict[tuple[str, str, str], Any] = {}

    def _bound_child(self, name: str, label: str, value: str) -> Any:
        """The child of ``name`` for ``label=value`` on this shard, bound on first use (ops
        and tables are small sets)."""
        key = (name, label, value)
        child = self._bound.get(key)
        if child is None:
            on = self.on
            child = self._owner.child(name, shard=self._shard, **{label: value}) if on else _NOOP
            self._bound[key] = child
        return child

    def requests(self, op: str) -> Any:
        """The request counter of ``op``."""
        return self._bound_child(PS_REQUESTS, "op", op)

    def rows_pulled(self, table: str) -> Any:
        return self._bound_child(PS_ROWS_PULLED, "table", table)

    def rows_pushed(self, table: str) -> Any:
        return self._bound_child(PS_ROWS_PUSHED, "table", table)

    @property
    def on(self) -> bool:
        return self._owner.enabled

    def watch(
        self,
        *,
        step: Callable[[], int],
        nbytes: Callable[[], int],
        waiting: Callable[[], int],
        tables: Callable[[], Mapping[str, Mapping[str, int]]],
    ) -> None:
        """Gauges computed when scraped (nothing on the hot path): the shard's step, the bytes
        of its variables, the requests received but not answered yet (queued, or parked until
        their synchronous step completes or their staleness bound allows), and per embedding
        table the rows held and evicted (from the table's own counters)."""
        if not self.on:
            return
        o, s = self._owner, self._shard
        o.child(PS_STEP, shard=s).set_function(step)
        o.child(PS_BYTES, shard=s).set_function(nbytes)
        o.child(PS_WAITING, shard=s).set_function(waiting)
        o.registry.register(_TableCollector(o.task, s, tables))


class _TableCollector(Collector):
    def __init__(
        self, task: str, shard: str, tables: Callable[[], Mapping[str, Mapping[str, int]]]
    ) -> None:
        self._task, self._shard, self._tables = task, shard, tables

    def collect(self) -> Iterable[Any]:
        labels = ["task", "shard", "table"]
        rows = GaugeMetricFamily(PS_ROWS, "Embedding rows held by the shard", labels=labels)
        evicted = CounterMetricFamily(
            PS_EVICTED, "Embedding rows evicted to make room for new ids", labels=labels
        )
        for name, stats in dict(self._tables()).items():
            key = [self._task, self._shard, name]
            rows.add_metric(key, stats.get("rows", 0))
            evicted.add_metric(key, stats.get("evicted", 0))
        return [rows, evicted]


_DEFINITIONS: dict[str, tuple[str, str, tuple[str, ...], dict[str, Any]]] = {
    STEPS: (_COUNTER, "Training steps this worker has taken", (), {}),
    EXAMPLES: (_COUNTER, "Examples this worker has trained on (as passed to step)", (), {}),
    LOSS: (_GAUGE, "Loss of this worker's last step", (), {}),
    GLOBAL_STEP: (_GAUGE, "Global step after this worker's last step", (), {}),
    LAST_STEP: (_GAUGE, "Global step at which the training stops (when the session knows)", (), {}),
    SENT_BYTES: (_COUNTER, "Bytes of tensors sent to a ps shard", ("shard",), {}),
    RECEIVED_BYTES: (_COUNTER, "Bytes of tensors received from a ps shard", ("shard",), {}),
    REQUEST_SECONDS: (
        _HISTOGRAM,
        "Round trip of requests to the ps shards, sent together, until all answered",
        ("shard",),
        {"buckets": _LATENCY_BUCKETS},
    ),
    SYNC_WAIT: (
        _HISTOGRAM,
        "Time a synchronous step waited for its step to complete on ps:0",
        (),
        {"buckets": _SLOW_BUCKETS},
    ),
    STALENESS: (
        _HISTOGRAM,
        "Updates of other workers applied between this worker's pull and its push",
        (),
        {"buckets": _STALENESS_BUCKETS},
    ),
    CHECKPOINT_SECONDS: (
        _HISTOGRAM,
        "Time a checkpoint took, from the save request to the last shard written",
        (),
        {"buckets": _SLOW_BUCKETS},
    ),
    CHECKPOINT_STEP: (_GAUGE, "Global step of the last checkpoint written", (), {}),
    CHECKPOINT_TIME: (_GAUGE, "Unix time the last checkpoint was written", (), {}),
    PS_REQUESTS: (_COUNTER, "Requests served by the shard", ("shard", "op"), {}),
    PS_APPLY: (
        _HISTOGRAM,
        "Time the shard spent applying one update",
        ("shard",),
        {"buckets": _LATENCY_BUCKETS},
    ),
    PS_WAITING: (_GAUGE, "Requests received and not answered yet", ("shard",), {}),
    PS_STEP: (_GAUGE, "The shard's step (ps:0's is the global step)", ("shard",), {}),
    PS_BYTES: (_GAUGE, "Bytes of the shard's dense variables", ("shard",), {}),
    PS_DROPPED: (
        _COUNTER,
        "Synchronous gradients dropped as stale (computed against an older step)",
        ("shard",),
        {},
    ),
    PS_ROWS_PULLED: (_COUNTER, "Embedding rows looked up", ("shard", "table"), {}),
    PS_ROWS_PUSHED: (_COUNTER, "Embedding rows updated", ("shard", "table"), {}),
    PS_CKPT_PAUSE: (
        _HISTOGRAM,
        "Time a checkpoint snapshot paused serving",
        ("shard",),
        {"buckets": _LATENCY_BUCKETS},
    ),
    PS_CKPT_WRITE: (
        _HISTOGRAM,
        "Time writing a checkpoint shard took (in the background)",
        ("shard",),
        {"buckets": _SLOW_BUCKETS},
    ),
    INFO: (_GAUGE, "Always 1: the task and its job, as labels", ("job",), {}),
}


class TaskMetrics:
    """The registry of one task and its metrics (children created on first use)."""

    def __init__(self, task: str, *, enabled: bool) -> None:
        self.task = task
        self.enabled = enabled
        self.registry = CollectorRegistry()
        self._recorded = _Recorded(task)
        self._lock = threading.Lock()
        self._worker: WorkerMetrics | None = None
        self._ps: dict[int, PsMetrics] = {}
        if enabled:
            ProcessCollector(registry=self.registry)
            self.registry.register(self._recorded)
            self.child(INFO, job=task.partition(":")[0]).set(1)

    def child(self, name: str, **labels: str) -> Any:
        """The child of metric ``name`` for this task and ``labels`` (bind it once, keep it)."""
        kind, _, names, kwargs = _DEFINITIONS[name]
        if set(labels) != set(names):
            raise ValueError(f"{name} takes the labels {names}, got {sorted(labels)}")
        key = tuple((k, labels[k]) for k in names)
        with self._lock:
            children = self._recorded.children.setdefault(name, {})
            child = children.get(key)
            if child is None:
                if kind == _COUNTER:
                    child = _Counter()
                elif kind == _GAUGE:
                    child = _Gauge()
                else:
                    child = _Histogram(tuple(float(b) for b in kwargs["buckets"]))
                children[key] = child
        return child

    def worker(self, num_shards: int) -> WorkerMetrics:
        """The worker's children (one set per task; more shards than before bind more)."""
        if self._worker is None or len(self._worker.sent) < num_shards:
            self._worker = WorkerMetrics(self, num_shards)
        return self._worker

    def ps(self, shard: int) -> PsMetrics:
        if shard not in self._ps:
            self._ps[shard] = PsMetrics(self, shard)
        return self._ps[shard]


_tasks: dict[str, TaskMetrics] = {}
_served: dict[str, str] = {}
_tasks_lock = threading.Lock()


def metrics_port(environ: Mapping[str, str] | None = None) -> int | None:
    """``PSFLOW_METRICS_PORT`` as a port (0: one the OS picks), or ``None`` when unset.

    Raises:
        ValueError: naming the variable when it is not a port number.
    """
    raw = (os.environ if environ is None else environ).get(envvars.PSFLOW_METRICS_PORT, "")
    if raw.strip() == "":
        return None
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ValueError(f"{envvars.PSFLOW_METRICS_PORT} must be a port in 0..65535, got {raw!r}")
    return port


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
        bind = os.environ.get(envvars.PSFLOW_METRICS_HOST) or host or "127.0.0.1"
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


# -- reading them back ------------------------------------------------------------------------


@dataclass
class Sample:
    """The samples of one scrape: ``{name: [(labels, value), ...]}``."""

    values: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def total(self, name: str, **match: str) -> float | None:
        """The sum of ``name``'s samples whose labels include ``match``; ``None`` if none."""
        found = [
            v
            for labels, v in self.values.get(name, [])
            if all(labels.get(k) == want for k, want in match.items())
        ]
        return sum(found) if found else None

    def by(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples summed per value of ``label``."""
        out: dict[str, float] = {}
        for labels, v in self.values.get(name, []):
            key = labels.get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
        return out


def parse(text: str) -> Sample:
    """The samples of a Prometheus text exposition."""
    out = Sample()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.values.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def scrape(address: str, timeout: float = 2.0) -> Sample:
    """The metrics a task serves at ``address`` (``host:port``).

    Raises:
        OSError: when nothing answers there within ``timeout`` seconds.
    """
    url = f"http://{address}{PATH}"
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return parse(reply.read().decode())
