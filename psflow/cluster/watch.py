"""A running job seen through its tasks' metrics: ``psflow top`` and the launcher's progress line.

:class:`JobView` scrapes every task (:func:`psflow.metrics.scrape`) and turns two successive
scrapes into rates: one :class:`TaskRow` per task (up or down, step rate, loss, bytes/s, ps
load, staleness, last checkpoint, CPU and memory) and a :class:`JobSummary` (global step,
rate, loss, ETA, tasks up, the slowest worker). :func:`top_table` and :func:`progress_line`
render them with rich.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from psflow import metrics as m
from psflow.cluster.spec import TaskSpec

_RATE_WINDOW = 10.0
"""Seconds over which the job's step rate (and so its ETA) is averaged."""


@dataclass
class TaskRow:
    """What one task looks like between the last two scrapes."""

    task: str
    up: bool
    error: str = ""
    global_step: float | None = None
    step_rate: float | None = None
    loss: float | None = None
    bytes_rate: float | None = None
    """Tensor bytes per second: a worker's to and from all shards; a ps's, from all workers."""
    busy: float | None = None
    """A ps: the fraction of the time it spent applying updates."""
    waiting: float | None = None
    """A ps: requests received and not answered yet."""
    staleness: float | None = None
    """A worker: mean staleness (steps) of its last pushes; a ps: stale gradients dropped."""
    latency: float | None = None
    """A worker: mean round trip of its requests to the ps (seconds)."""
    checkpoint_step: float | None = None
    checkpoint_age: float | None = None
    cpu: float | None = None
    """CPU use, in cores."""
    memory: float | None = None
    """Resident memory, bytes."""


@dataclass
class JobSummary:
    global_step: float | None
    last_step: float | None
    rate: float | None
    loss: float | None
    up: int
    total: int
    slowest: str | None = None

    @property
    def eta(self) -> float | None:
        """Seconds until ``last_step`` at the current rate."""
        if self.last_step is None or self.global_step is None:
            return None
        if self.global_step >= self.last_step:
            return 0.0
        return (self.last_step - self.global_step) / self.rate if self.rate else None


def _rate(cur: m.Sample, prev: m.Sample | None, dt: float, name: str, **match: str) -> float | None:
    now = cur.total(name, **match)
    if now is None or prev is None or dt <= 0:
        return None
    before = prev.total(name, **match)
    if before is None:
        return None
    return max(0.0, now - before) / dt


def _mean_delta(cur: m.Sample, prev: m.Sample | None, histogram: str) -> float | None:
    """A histogram's mean over the observations made since ``prev``."""
    if prev is None:
        return None
    count = (cur.total(histogram + "_count") or 0) - (prev.total(histogram + "_count") or 0)
    if count <= 0:
        return None
    return ((cur.total(histogram + "_sum") or 0) - (prev.total(histogram + "_sum") or 0)) / count


class JobView:
    """Scrapes the tasks of a job; each :meth:`poll` gives the rows and summary since the last.

    Args:
        targets: task (``worker:0``) to the ``host:port`` of its metrics.
        alive: optionally, whether each task's process runs (the launcher knows): a task that
            runs but does not answer yet shows as starting, not down.
        timeout: seconds one scrape may take.
    """

    def __init__(
        self,
        targets: Mapping[str, str],
        *,
        alive: Callable[[str], bool] | None = None,
        timeout: float = 1.0,
    ) -> None:
        self.targets = dict(sorted(targets.items(), key=lambda kv: _order(kv[0])))
        self.alive = alive
        self.timeout = timeout
        self._prev: dict[str, tuple[float, m.Sample]] = {}
        self._steps: deque[tuple[float, float]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=min(8, max(1, len(self.targets))))

    def close(self) -> None:
        self._pool.shutdown(wait=False)

    def _scrape(self, address: str) -> m.Sample | str:
        try:
            return m.scrape(address, self.timeout)
        except OSError as e:
            return str(getattr(e, "reason", e))
        except ValueError as e:
            return f"bad metrics: {e}"

    def poll(self) -> tuple[list[TaskRow], JobSummary]:
        now = time.monotonic()
        scraped = dict(
            zip(self.targets, self._pool.map(self._scrape, self.targets.values()), strict=True)
        )
        samples = {t: s for t, s in scraped.items() if isinstance(s, m.Sample)}
        rows = []
        for task, got in scraped.items():
            if isinstance(got, m.Sample):
                rows.append(self._row(task, got, now, samples))
            else:
                starting = self.alive is not None and self.alive(task)
                rows.append(TaskRow(task=task, up=False, error="starting" if starting else got))
        for task, got in samples.items():
            self._prev[task] = (now, got)
        return rows, self._summary(rows, samples, now)

    def _row(self, task: str, cur: m.Sample, now: float, all_: dict[str, m.Sample]) -> TaskRow:
        prev_t, prev = self._prev.get(task, (now, None))
        dt = now - prev_t
        row = TaskRow(task=task, up=True)
        row.cpu = _rate(cur, prev, dt, m.CPU)
        row.memory = cur.total(m.MEMORY)
        job = task.partition(":")[0]
        if job == "ps":
            shard = task.partition(":")[2]
            row.global_step = cur.total(m.PS_STEP)
            busy = _rate(cur, prev, dt, m.PS_APPLY + "_sum")
            row.busy = None if busy is None else min(1.0, busy)
            row.waiting = cur.total(m.PS_WAITING)
            row.staleness = cur.total(m.PS_DROPPED)
            # What the workers sent to and received from this shard.
            rates = []
            for other, sample in all_.items():
                p = self._prev.get(other)
                if p is None or other == task:
                    continue
                for name in (m.SENT_BYTES, m.RECEIVED_BYTES):
                    r = _rate(sample, p[1], now - p[0], name, shard=shard)
                    if r is not None:
                        rates.append(r)
            row.bytes_rate = sum(rates) if rates else None
        else:
            row.global_step = cur.total(m.GLOBAL_STEP)
            row.step_rate = _rate(cur, prev, dt, m.STEPS)
            row.loss = cur.total(m.LOSS)
            sent = _rate(cur, prev, dt, m.SENT_BYTES)
            got = _rate(cur, prev, dt, m.RECEIVED_BYTES)
            row.bytes_rate = None if sent is None or got is None else sent + got
            row.staleness = _mean_delta(cur, prev, m.STALENESS)
            row.latency = _mean_delta(cur, prev, m.REQUEST_SECONDS)
            row.checkpoint_step = cur.total(m.CHECKPOINT_STEP)
            at = cur.total(m.CHECKPOINT_TIME)
            row.checkpoint_age = None if not at else max(0.0, time.time() - at)
        return row

    def _summary(self, rows: list[TaskRow], samples: dict[str, m.Sample], now: float) -> JobSummary:
        steps = [r.global_step for r in rows if r.global_step is not None]
        step = max(steps) if steps else None
        if step is not None:
            self._steps.append((now, step))
        while len(self._steps) > 2 and now - self._steps[0][0] > _RATE_WINDOW:
            self._steps.popleft()
        rate = None
        if len(self._steps) >= 2 and self._steps[-1][0] > self._steps[0][0]:
            (t0, s0), (t1, s1) = self._steps[0], self._steps[-1]
            rate = max(0.0, s1 - s0) / (t1 - t0)
        trainers = [r for r in rows if r.task.partition(":")[0] in ("chief", "worker")]
        chief = next((r for r in trainers if r.task == self._chief()), None)
        losses = [r.loss for r in trainers if r.loss is not None]
        loss = chief.loss if chief is not None and chief.loss is not None else None
        if loss is None and losses:
            loss = sum(losses) / len(losses)
        last = [s.total(m.LAST_STEP) for s in samples.values()]
        known = [x for x in last if x is not None]
        rated = [r for r in trainers if r.up and r.step_rate is not None]
        slowest = None
        if len(rated) > 1 and any(r.step_rate for r in rated):
            low = min(rated, key=lambda r: r.step_rate or 0.0)
            slowest = f"{low.task} ({low.step_rate:.1f} steps/s)"
        return JobSummary(
            global_step=step,
            last_step=max(known) if known else None,
            rate=rate,
            loss=loss,
            up=sum(r.up for r in rows),
            total=len(rows),
            slowest=slowest,
        )

    def _chief(self) -> str:
        return "chief:0" if "chief:0" in self.targets else "worker:0"


def _order(task: str) -> tuple[int, int]:
    job, _, index = task.partition(":")
    rank = {"chief": 0, "worker": 1, "ps": 2, "evaluator": 3}.get(job, 4)
    return rank, int(index) if index.isdigit() else 0


# -- rendering ------------------------------------------------------------------------------


def _num(x: float | None, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if x < 1000 or unit == "GB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return "-"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return (
        f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
    )


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def summary_text(s: JobSummary) -> str:
    """The job in one line: step, rate, loss, ETA, tasks up."""
    step = "-" if s.global_step is None else f"{s.global_step:.0f}"
    if s.last_step is not None:
        step += f"/{s.last_step:.0f}"
    parts = [
        f"step {step}",
        f"{_num(s.rate)} steps/s",
        f"loss {_num(s.loss, '{:.4g}')}",
        f"ETA {_duration(s.eta)}",
        f"tasks up {s.up}/{s.total}",
    ]
    return " · ".join(parts)


def progress_line(s: JobSummary) -> Table:
    """The launcher's line: a bar (when the last step is known) and :func:`summary_text`."""
    grid = Table.grid(padding=(0, 1))
    if s.last_step and s.global_step is not None:
        grid.add_row(
            ProgressBar(total=s.last_step, completed=min(s.global_step, s.last_step), width=30),
            Text(summary_text(s)),
        )
    else:
        grid.add_row(Text(summary_text(s)))
    return grid


def top_table(rows: list[TaskRow], summary: JobSummary, title: str) -> Group:
    """``psflow top``'s screen: the job's line, then one row per task.

    Columns: STEP (the global step the task last saw), STEP/S (its own steps), LOSS, NET/S
    (tensor bytes a worker moved, or a ps served to all workers), LOAD (a ps: share of time
    applying updates, requests waiting), STALE (a worker: mean steps of other workers applied
    between its pull and its push; a ps: synchronous gradients dropped as stale), RTT (a
    worker's mean round trip to the ps), CKPT (the chief's last checkpoint), CPU, MEM.
    """
    table = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("TASK", "UP", "STEP", "STEP/S", "LOSS", "NET/S", "LOAD", "STALE", "RTT"):
        table.add_column(col, justify="left" if col in ("TASK", "UP") else "right", no_wrap=True)
    table.add_column("CKPT", no_wrap=True)
    table.add_column("CPU", justify="right", no_wrap=True)
    table.add_column("MEM", justify="right", no_wrap=True)
    for r in rows:
        job = r.task.partition(":")[0]
        if not r.up:
            state = Text("wait" if r.error == "starting" else "DOWN", style="yellow")
            table.add_row(r.task, state, *[""] * 7, Text(r.error[:30], style="dim"), "", "")
            continue
        if job == "ps":
            busy = _num(None if r.busy is None else 100 * r.busy, "{:.0f}%")
            load = f"{busy} q{_num(r.waiting, '{:.0f}')}"
            stale = f"{_num(r.staleness, '{:.0f}')} drop"
        else:
            load = ""
            stale = _num(r.staleness, "{:.2f}")
        ckpt = ""
        if r.checkpoint_age is not None and r.checkpoint_step is not None:
            ckpt = f"{r.checkpoint_step:.0f} {_ago(r.checkpoint_age)}"
        table.add_row(
            r.task,
            Text("up", style="green"),
            _num(r.global_step, "{:.0f}"),
            "" if job == "ps" else _num(r.step_rate),
            "" if job == "ps" else _num(r.loss, "{:.4g}"),
            _bytes(r.bytes_rate),
            load,
            stale,
            "" if r.latency is None else f"{r.latency * 1e3:.1f}ms",
            ckpt,
            _num(None if r.cpu is None else 100 * r.cpu, "{:.0f}%"),
            _bytes(r.memory),
        )
    head = Text(title, style="bold")
    head.append("\n" + summary_text(summary), style="")
    if summary.slowest:
        head.append(f" · slowest {summary.slowest}", style="")
    return Group(head, table)


def task_names(cluster: Mapping[str, Sequence[str]]) -> list[str]:
    """``job:index`` for every task of a cluster spec's jobs."""
    return [
        str(TaskSpec(job=j, index=i)) for j, addrs in cluster.items() for i in range(len(addrs))
    ]
