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

Ops: ``sync_push`` (shard 0), ``sync_stage`` (other shards), ``sync_pull`` (any shard; with
``decisions`` it applies them first), ``sync_status``; and ``ssp_wait`` for bounded staleness
(:mod:`psflow.ps.staleness`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from psflow.protocol import Code
from psflow.ps.staleness import ClockTable
from psflow.ps.store import GradBuffers, ShardStore
from psflow.transport import Request

if TYPE_CHECKING:
    from psflow.ps.server import ParameterServer

log = logging.getLogger(__name__)

Tensors = list[tuple[str, torch.Tensor]]

DECISIONS_KEPT = 64
"""Recent decisions shard 0 hands out, so that a shard that missed some can catch up."""


def worker_order(name: str) -> tuple[int, int, str]:
    """Sort key of a task name: the chief first, then workers by index (``worker:10`` last)."""
    job, _, index = name.partition(":")
    return (0 if job == "chief" else 1, int(index) if index.isdigit() else 0, name)


class StepOvertakenError(ValueError):
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
        for what, v in (("replicas_to_aggregate", r), ("total_num_replicas", n)):
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

    def stage(self, worker: str, step: int, grads: Tensors) -> bool:
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
            # Averaged over the workers that sent this variable (a worker may send no
            # gradient for a variable its loss did not touch).
            acc.div_(len(gs))
            averaged.append((name, acc))
        if averaged:
            self.store.apply(averaged)
        else:
            self.store.step += 1
        for w in chosen:
            self.accepted_by_worker[w] = self.accepted_by_worker.get(w, 0) + 1
        self.decisions.append((step, tuple(chosen)))
        self.arrived.clear()
        for w in [w for w, (s, _) in self.staged.items() if s <= step]:
            del self.staged[w]

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
        self.arrived.clear()
        self.decisions.clear()
        self._buffers.clear()  # they were shaped after the variables just replaced
        self._sums.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "step": self.store.step,
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "total_num_replicas": self.total_num_replicas,
            "arrived": list(self.arrived),
            "dropped_stale": self.dropped_stale,
            "dropped_by_worker": dict(self.dropped_by_worker),
            "accepted_by_worker": dict(self.accepted_by_worker),
            "decisions": [[s, list(ws)] for s, ws in self.decisions],
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


def _int(header: dict[str, Any], key: str) -> int:
    v = header.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{key!r} must be a non-negative integer, got {v!r}")
    return v


class SyncService:
    """The sync and bounded-staleness ops of one :class:`ParameterServer`.

    Registers its handlers on the server; the server's loop stays single-threaded and never
    blocks: a push waiting for its step is a pending request, answered when the step advances.
    """

    def __init__(self, ps: ParameterServer) -> None:
        self.ps = ps
        self.shard = ps.ctx.task.index
        self.agg = SyncAggregator(ps.store)
        self.clocks = ClockTable(ps.trainers)
        self._pending: list[_Pending] = []
        handlers: dict[str, Callable[[Request], None]] = {
            "sync_push": self._push,
            "sync_stage": self._stage,
            "sync_pull": self._pull,
            "sync_status": self._status,
            "ssp_wait": self._ssp_wait,
        }
        ps._handlers.update(handlers)
        done = ps._handlers["done"]

        def done_then_check(request: Request) -> None:
            done(request)
            self._after_done()

        ps._handlers["done"] = done_then_check

    # -- helpers ----------------------------------------------------------------------------

    def _worker(self, request: Request) -> str:
        name = request.header.get("task")
        if not isinstance(name, str) or name not in self.ps.trainers:
            raise ValueError(f"sync requests must name a worker of this job, got {name!r}")
        return name

    def _reply_params(self, request: Request, header: dict[str, Any]) -> None:
        header.setdefault("step", self.agg.store.step)
        header["decisions"] = [[s, list(ws)] for s, ws in self.agg.decisions]
        self.ps._reply(request, header, self.agg.store.wire_set)

    # -- handlers ---------------------------------------------------------------------------

    def _stage(self, request: Request) -> None:
        self.ps._require_initialized()
        worker = self._worker(request)
        step = _int(request.header, "step")
        self.agg.configure(request.header.get("r"), request.header.get("n"), worker)
        grads = self.ps._tensors(request, into=self.agg.buffers(worker))
        staged = self.agg.stage(worker, step, grads)
        self.ps._reply(request, {"staged": staged})

    def _push(self, request: Request) -> None:
        self.ps._require_initialized()
        if self.shard != 0:
            raise ValueError(f"sync_push goes to ps:0 (the step authority), not {self.ps.name}")
        worker = self._worker(request)
        step = _int(request.header, "step")
        self.agg.configure(request.header.get("r"), request.header.get("n"), worker)
        grads = self.ps._tensors(request, into=self.agg.buffers(worker))
        if not self.agg.stage(worker, step, grads):
            # Too late for its step: the worker moves on to the current one.
            self._reply_params(request, {"accepted": False})
            return
        self._pending = [p for p in self._pending if p.worker != worker]  # a restarted worker
        self._pending.append(_Pending(request=request, worker=worker, step=step))
        chosen = self.agg.arrive(worker)
        if chosen is None:
            return
        self.ps._server_flush()
        self.agg.apply(step, chosen)
        pending, self._pending = self._pending, []
        for p in pending:
            self._reply_params(p.request, {"accepted": p.worker in chosen})

    def _pull(self, request: Request) -> None:
        self.ps._require_initialized()
        decisions = _decisions(request.header.get("decisions"))
        if decisions and any(s >= self.agg.store.step for s, _ in decisions):
            self.ps._server_flush()
            self.agg.catch_up(decisions)
        self._reply_params(request, {})

    def _status(self, request: Request) -> None:
        out = self.agg.stats()
        out["pending"] = [p.worker for p in self._pending]
        out["finished"] = sorted(self.ps.finished)
        out["clocks"] = self.clocks.stats()
        self.ps._reply(request, out)

    def _ssp_wait(self, request: Request) -> None:
        worker = self._worker(request)
        clock = _int(request.header, "clock")
        bound = _int(request.header, "max_staleness")
        self.clocks.wait(worker, clock, bound, request)
        self._release()

    def _release(self) -> None:
        for request, header in self.clocks.release():
            self.ps._reply(request, header)

    # -- ends -------------------------------------------------------------------------------

    def _after_done(self) -> None:
        self.clocks.finished = set(self.ps.finished)
        self._release()
        r = self.agg.replicas_to_aggregate
        live = self.ps.trainers - self.ps.finished
        if r is not None and self._pending and len(live) < r:
            self.fail_pending(
                f"step {self.agg.store.step} cannot complete: it needs {r} gradients but only "
                f"{len(live)} worker(s) have not finished ({', '.join(sorted(live)) or 'none'})"
            )

    def fail_pending(self, message: str, code: str | None = None) -> None:
        """Answers every waiting request with an error (the server is stopping, or stuck)."""
        assert self.ps._server is not None
        for p in self._pending:
            self.ps._server.send_error(p.request, message, code)
        self._pending.clear()
        for request in self.clocks.drop_waiting():
            self.ps._server.send_error(request, message, code)

    def reset(self, reason: str) -> None:
        """After a restore: the waiting requests fail as overtaken (their workers recover and
        start again from the restored step), and the steps in progress are forgotten."""
        self.fail_pending(reason, Code.RESTORED)
        self.agg.reset()
