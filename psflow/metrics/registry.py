"""A task's registry and the children that record its numbers (:class:`TaskMetrics`).

What the code that produces numbers holds are children bound once to their labels
(:class:`WorkerMetrics`, :class:`PsMetrics`): plain objects whose ``inc``/``set``/``observe``
add to a float or a list (a tenth of a microsecond: no lock, no label lookup, no allocation);
the registry reads them only when scraped (:class:`_Recorded`). Each child is written by one
thread, the one that produces its numbers. With metrics off the children are no-ops.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from psflow.metrics.names import (
    _COUNTER,
    _DEFINITIONS,
    _GAUGE,
    CHECKPOINT_SECONDS,
    CHECKPOINT_STEP,
    CHECKPOINT_TIME,
    EXAMPLES,
    GLOBAL_STEP,
    INFO,
    LAST_STEP,
    LOSS,
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
        self.export_pause = owner.child(PS_EXPORT_PAUSE, shard=self._shard) if on else _NOOP
        self.export_write = owner.child(PS_EXPORT_WRITE, shard=self._shard) if on else _NOOP
        self.exports_failed = owner.child(PS_EXPORT_FAILED, shard=self._shard) if on else _NOOP
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
        expired = CounterMetricFamily(
            PS_EXPIRED, "Embedding rows evicted as not updated for ttl_seconds", labels=labels
        )
        for name, stats in dict(self._tables()).items():
            key = [self._task, self._shard, name]
            rows.add_metric(key, stats.get("rows", 0))
            evicted.add_metric(key, stats.get("evicted", 0))
            expired.add_metric(key, stats.get("expired", 0))
        return [rows, evicted, expired]


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
