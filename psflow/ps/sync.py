"""Synchronous aggregation on a ps shard (``mode="sync"``), with backup workers.

Shard 0 is the step authority. For global step ``t`` it waits for the gradients of the first
``replicas_to_aggregate`` distinct workers computed against ``t``, averages them, applies the
optimizer once and advances to ``t + 1``; that set of workers is the step's *decision*. A
gradient computed against an older step (a backup worker's, a straggler's) is dropped and
counted. A worker's push to shard 0 is answered only once ``t + 1`` exists: the request is kept
pending (the ROUTER identity and request id) while the serving loop goes on.

The other shards never decide. A worker first *stages* its gradients on them (acknowledged at
once), then pushes to shard 0, then forwards shard 0's decisions to them with its pull: a shard
applies a decision only when it names the step the shard is at, averaging exactly the staged
gradients of the workers it names. So every shard applies the same set of workers' gradients
for every step, and a worker pulls all shards at the same step (it checks, and retries).

Staged gradients are summed in worker order, not arrival order, so a step's result does not
depend on timing. A shard keeps one gradient buffer per worker (a worker has at most one push
in flight): ``total_num_replicas`` copies of the shard's variables at most.

Ops (:class:`SyncService`): ``sync_push`` (shard 0), ``sync_stage`` (other shards),
``sync_pull`` (any shard; with ``decisions`` it applies them first), ``sync_status``; and
``ssp_wait`` for bounded staleness (:mod:`psflow.ps.staleness`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from psflow.protocol import Code, Key, Op
from psflow.ps.errors import RequestError
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.staleness import ClockTable
from psflow.ps.store import GradBuffers, RowGrads, ShardStore
from psflow.ps.tables import split_rows, sum_rows
from psflow.transport import Request

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

DECISIONS_KEPT = 64
"""Recent decisions shard 0 hands out, so that a shard that missed some can catch up."""


def worker_order(name: str) -> tuple[int, int, str]:
    """Sort key of a task name: the chief first, then workers by index (``worker:10`` last)."""
    job, _, index = name.partition(":")
    return (0 if job == "chief" else 1, int(index) if index.isdigit() else 0, name)


class StepOvertakenError(RequestError):
    """A gradient computed against a step this shard has not reached: the ps went back to an
    older step (a restore after a crash) while the worker was computing it."""

    code = Code.RESTORED


@dataclass
class _Pending:
    request: Request
    worker: str
    step: int


class SyncAggregator:
    """The synchronous state of one shard: staged gradients, arrivals, decisions, counters.

    Pure bookkeeping over a :class:`ShardStore`; :class:`SyncService` does the messaging.
    """

    def __init__(self, store: ShardStore) -> None:
        self.store = store
        self.replicas_to_aggregate: int | None = None
        self.total_num_replicas: int | None = None
        self.staged: dict[str, tuple[int, Tensors]] = {}
        """Worker name to the step its staged gradients were computed against, and them."""
        self.staged_rows: dict[str, RowGrads] = {}
        """Worker name to its staged row gradients per embedding table (for the same step)."""
        self.arrived: list[str] = []
        """Shard 0: the workers counted for the current step, in arrival order."""
        self.decisions: deque[tuple[int, tuple[str, ...]]] = deque(maxlen=DECISIONS_KEPT)
        self.dropped_stale = 0
        self.dropped_by_worker: dict[str, int] = {}
        self.accepted_by_worker: dict[str, int] = {}
        self._buffers: dict[str, GradBuffers] = {}
        self._sums: dict[str, torch.Tensor] = {}

    def configure(self, replicas_to_aggregate: Any, total_num_replicas: Any, sender: str) -> None:
        """Fixes the aggregation on the first push; later pushes must agree."""
        r, n = replicas_to_aggregate, total_num_replicas
        for what, v in ((Key.REPLICAS_TO_AGGREGATE, r), (Key.TOTAL_NUM_REPLICAS, n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r} from {sender}")
        if r > n:
            raise ValueError(f"replicas_to_aggregate={r} exceeds total_num_replicas={n}")
        if self.replicas_to_aggregate is None:
            self.replicas_to_aggregate, self.total_num_replicas = r, n
        elif (r, n) != (self.replicas_to_aggregate, self.total_num_replicas):
            raise ValueError(
                f"{sender} aggregates replicas_to_aggregate={r}, total_num_replicas={n}; this "
                f"job uses {self.replicas_to_aggregate} of {self.total_num_replicas}: every "
                "worker must use the same settings"
            )

    def buffers(self, worker: str) -> GradBuffers:
        """Where ``worker``'s gradients that arrive in pieces are assembled (kept per worker)."""
        buf = self._buffers.get(worker)
        if buf is None:
            buf = self._buffers[worker] = GradBuffers(self.store.variables)
        return buf

    def stage(self, worker: str, step: int, grads: Tensors, rows: RowGrads | None = None) -> bool:
        """Keeps ``worker``'s gradients for ``step``; False (and counted) when ``step`` is past."""
        if step > self.store.step:
            raise StepOvertakenError(
                f"{worker} pushed a gradient for step {step}, but this shard is at step "
                f"{self.store.step}: was the ps restored from a checkpoint since?"
            )
        if step < self.store.step:
            self.dropped_stale += 1
            self.dropped_by_worker[worker] = self.dropped_by_worker.get(worker, 0) + 1
            return False
        self.store.check(grads)
        if rows:
            self.store.check_rows(rows)
            # Kept past this request: copies, not views of a network buffer.
            self.staged_rows[worker] = {n: (i.clone(), g.clone()) for n, (i, g) in rows.items()}
        else:
            self.staged_rows.pop(worker, None)
        self.staged[worker] = (step, grads)
        return True

    def arrive(self, worker: str) -> tuple[str, ...] | None:
        """Shard 0: counts ``worker`` for the current step; the decision once enough arrived."""
        assert self.replicas_to_aggregate is not None
        if worker not in self.arrived:
            self.arrived.append(worker)
        if len(self.arrived) < self.replicas_to_aggregate:
            return None
        return tuple(self.arrived[: self.replicas_to_aggregate])

    def apply(self, step: int, workers: Sequence[str]) -> None:
        """Averages the staged gradients of ``workers`` for ``step`` and applies them once."""
        assert step == self.store.step, (step, self.store.step)
        chosen = sorted(workers, key=worker_order)
        missing = [w for w in chosen if self.staged.get(w, (-1, []))[0] != step]
        if missing:
            raise ValueError(
                f"cannot apply step {step}: no staged gradient from {', '.join(missing)} "
                "(did the worker stage before pushing to ps:0?)"
            )
        per_var: dict[str, list[torch.Tensor]] = {}
        for w in chosen:
            for name, g in self.staged[w][1]:
                per_var.setdefault(name, []).append(g)
        averaged: Tensors = []
        for name, gs in per_var.items():
            if len(gs) == 1 and len(chosen) == 1:
                averaged.append((name, gs[0]))
                continue
            acc = self._sums.get(name)
            if acc is None or acc.shape != gs[0].shape or acc.dtype != gs[0].dtype:
                acc = self._sums[name] = torch.empty_like(gs[0])
            torch.add(gs[0], gs[1], out=acc) if len(gs) > 1 else acc.copy_(gs[0])
            for g in gs[2:]:
                acc.add_(g)
            # Averaged over the chosen workers, as one process's gradient of their joint batch:
            # a worker whose loss did not touch this variable sends no gradient for it, and
            # contributed zero (as DDP averages an unused parameter's over every rank).
            acc.div_(len(chosen))
            averaged.append((name, acc))
        # A table's row gradients: summed per id over the chosen workers, divided by their
        # number (a worker whose batch missed a row contributed zero to it).
        staged_rows = [self.staged_rows[w] for w in chosen if w in self.staged_rows]
        rows = sum_rows(staged_rows, 1.0 / len(chosen)) if staged_rows else None
        if averaged or rows:
            self.store.apply(averaged, rows=rows)
        else:
            self.store.step += 1
        for w in chosen:
            self.accepted_by_worker[w] = self.accepted_by_worker.get(w, 0) + 1
        self.decisions.append((step, tuple(chosen)))
        self.arrived.clear()
        for w in [w for w, (s, _) in self.staged.items() if s <= step]:
            del self.staged[w]
            self.staged_rows.pop(w, None)

    def catch_up(self, decisions: Sequence[tuple[int, Sequence[str]]]) -> int:
        """Applies, in order, the decisions for this shard's current step onwards."""
        applied = 0
        for step, workers in sorted(decisions, key=lambda d: d[0]):
            if step < self.store.step:
                continue
            if step > self.store.step:
                raise ValueError(
                    f"decision for step {step} but this shard is at step {self.store.step}: "
                    "a decision is missing (the shards have diverged)"
                )
            self.apply(step, workers)
            applied += 1
        return applied

    def reset(self) -> None:
        """Forgets the steps in progress (after the chief replaced the variables); the
        aggregation settings and the counters stay."""
        self.staged.clear()
        self.staged_rows.clear()
        self.arrived.clear()
        self.decisions.clear()
        self._buffers.clear()  # they were shaped after the variables just replaced
        self._sums.clear()

    def stats(self) -> dict[str, Any]:
        return {
            Key.STEP: self.store.step,
            Key.REPLICAS_TO_AGGREGATE: self.replicas_to_aggregate,
            Key.TOTAL_NUM_REPLICAS: self.total_num_replicas,
            Key.ARRIVED: list(self.arrived),
            Key.DROPPED_STALE: self.dropped_stale,
            Key.DROPPED_BY_WORKER: dict(self.dropped_by_worker),
            Key.ACCEPTED_BY_WORKER: dict(self.accepted_by_worker),
            Key.DECISIONS: [[s, list(ws)] for s, ws in self.decisions],
        }


def _decisions(raw: Any) -> list[tuple[int, list[str]]]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > 4 * DECISIONS_KEPT:
        raise ValueError("'decisions' must be a list of [step, [worker, ...]]")
    out = []
    for entry in raw:
        ok = (
            isinstance(entry, list)
            and len(entry) == 2
            and isinstance(entry[0], int)
            and not isinstance(entry[0], bool)
            and isinstance(entry[1], list)
            and all(isinstance(w, str) for w in entry[1])
        )
        if not ok:
            raise ValueError(f"bad decision {entry!r}: expected [step, [worker, ...]]")
        out.append((entry[0], entry[1]))
    return out


def _int(header: dict[str, Any], key: Key) -> int:
    v = header.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"'{key}' must be a non-negative integer, got {v!r}")
    return v


class SyncService(Service):
    """The sync and bounded-staleness ops of one ps server.

    The server's loop stays single-threaded and never blocks: a push waiting for its step is a
    pending request, answered when the step advances.
    """

    def __init__(self, host: ServiceHost) -> None:
        self.host = host
        self.agg = SyncAggregator(host.store)
        self.clocks = ClockTable(host.trainers)
        self._pending: list[_Pending] = []
        self._why_dead: dict[str, str] = {}
        """Each dead worker: why the ps thinks so (for the errors that name it)."""

    def handlers(self) -> Mapping[Op, Handler]:
        return {
            Op.SYNC_PUSH: self._push,
            Op.SYNC_STAGE: self._stage,
            Op.SYNC_PULL: self._pull,
            Op.SYNC_STATUS: self._status,
            Op.SSP_WAIT: self._ssp_wait,
        }

    # -- helpers ----------------------------------------------------------------------------

    def _worker(self, request: Request) -> str:
        name = request.header.get(Key.TASK)
        if not isinstance(name, str) or name not in self.host.trainers:
            raise ValueError(f"sync requests must name a worker of this job, got {name!r}")
        return name

    def _configure(self, request: Request, worker: str) -> None:
        header = request.header
        self.agg.configure(
            header.get(Key.REPLICAS_TO_AGGREGATE), header.get(Key.TOTAL_NUM_REPLICAS), worker
        )

    def _reply_params(self, request: Request, header: dict[str, Any]) -> None:
        header.setdefault(Key.STEP, self.agg.store.step)
        header[Key.DECISIONS] = [[s, list(ws)] for s, ws in self.agg.decisions]
        self.host.reply(request, header, self.agg.store.wire_set)

    # -- handlers ---------------------------------------------------------------------------

    def _stage(self, request: Request) -> None:
        self.host.require_initialized()
        worker = self._worker(request)
        step = _int(request.header, Key.STEP)
        self._configure(request, worker)
        grads, rows = split_rows(
            request.header, self.host.tensors(request, into=self.agg.buffers(worker))
        )
        staged = self.agg.stage(worker, step, grads, rows)
        if not staged:
            self.host.metrics.dropped_stale.inc()
        self.host.reply(request, {Key.STAGED: staged})

    def _push(self, request: Request) -> None:
        self.host.require_initialized()
        if self.host.shard != 0:
            raise ValueError(f"sync_push goes to ps:0 (the step authority), not {self.host.name}")
        worker = self._worker(request)
        step = _int(request.header, Key.STEP)
        self._configure(request, worker)
        grads, rows = split_rows(
            request.header, self.host.tensors(request, into=self.agg.buffers(worker))
        )
        if not self.agg.stage(worker, step, grads, rows):
            # Too late for its step: the worker moves on to the current one.
            self.host.metrics.dropped_stale.inc()
            self._reply_params(request, {Key.ACCEPTED: False})
            return
        self._pending = [p for p in self._pending if p.worker != worker]  # a restarted worker
        self._pending.append(_Pending(request=request, worker=worker, step=step))
        chosen = self.agg.arrive(worker)
        if chosen is None:
            self._fail_if_stuck()
            return
        self.host.flush()
        start = time.perf_counter()
        self.agg.apply(step, chosen)
        self.host.metrics.apply_seconds.observe(time.perf_counter() - start)
        pending, self._pending = self._pending, []
        for p in pending:
            self._reply_params(p.request, {Key.ACCEPTED: p.worker in chosen})

    def _pull(self, request: Request) -> None:
        self.host.require_initialized()
        decisions = _decisions(request.header.get(Key.DECISIONS))
        if decisions and any(s >= self.agg.store.step for s, _ in decisions):
            self.host.flush()
            self.agg.catch_up(decisions)
        self._reply_params(request, {})

    def _status(self, request: Request) -> None:
        out = self.agg.stats()
        out[Key.PENDING] = [p.worker for p in self._pending]
        out[Key.FINISHED] = sorted(self.host.finished)
        out[Key.CLOCKS] = self.clocks.stats()
        self.host.reply(request, out)

    def _ssp_wait(self, request: Request) -> None:
        worker = self._worker(request)
        clock = _int(request.header, Key.CLOCK)
        bound = _int(request.header, Key.MAX_STALENESS)
        self.clocks.wait(worker, clock, bound, request)
        self._release()

    @property
    def waiting(self) -> int:
        """Pushes parked until their step completes, and bounded-staleness waits."""
        return len(self._pending) + self.clocks.num_waiting

    def _release(self) -> None:
        for request, header in self.clocks.release():
            self.host.reply(request, header)

    # -- the server's life ------------------------------------------------------------------

    def on_worker_finished(self, worker: str) -> None:
        self.clocks.finished = set(self.host.finished)
        self._release()
        self._fail_if_stuck()

    def on_worker_dead(self, worker: str, reason: str) -> None:
        """Bounded staleness stops holding the others back for it; a synchronous step that
        needs its gradient fails its waiting workers, naming it (with backup workers enough
        are left, and the step goes on without it)."""
        self._why_dead[worker] = reason
        self.clocks.dead = set(self.host.dead)
        self._release()
        self._fail_if_stuck()

    def on_worker_back(self, worker: str) -> None:
        self._why_dead.pop(worker, None)
        self.clocks.dead = set(self.host.dead)
        self.clocks.finished = set(self.host.finished)  # restarted after it said done
        self.clocks.rejoin(worker)

    def _fail_if_stuck(self) -> None:
        """Fails the waiting pushes when fewer workers than a step needs are left to push."""
        r = self.agg.replicas_to_aggregate
        if r is None or not self._pending:
            return
        live = self.host.trainers - self.host.finished - self.host.dead
        if len(live) >= r:
            return
        dead = sorted(self.host.dead - self.host.finished)
        self.fail_pending(
            f"step {self.agg.store.step} cannot complete: it needs {r} gradients but only "
            f"{len(live)} worker(s) are alive and unfinished ({', '.join(sorted(live)) or 'none'})"
            + "".join(f"; {self._why_dead.get(w, w + ' is dead')}" for w in dead)
        )

    def on_restored(self, reason: str) -> None:
        """The waiting requests fail as overtaken (their workers recover and start again from
        the restored step), and the steps in progress are forgotten."""
        self.fail_pending(reason, Code.RESTORED)
        self.agg.reset()

    def on_stopping(self, reason: str) -> None:
        self.fail_pending(reason)

    def fail_pending(self, message: str, code: Code = Code.STOPPING) -> None:
        """Answers every waiting request with an error (the server is stopping, or stuck)."""
        for p in self._pending:
            self.host.refuse(p.request, message, code)
        self._pending.clear()
        for request in self.clocks.drop_waiting():
            self.host.refuse(request, message, code)
