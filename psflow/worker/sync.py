"""Training modes on the worker side: synchronous (with backup workers) and bounded staleness.

:class:`DistributedOptimizer` hands its :meth:`~DistributedOptimizer.step` and
:meth:`~DistributedOptimizer.pull` to an engine chosen by ``mode``:

- ``"async"``: the optimizer's own path (no engine), or :class:`StalenessEngine` with
  ``max_staleness``.
- ``"sync"``: :class:`SyncEngine`; the ps side is :mod:`psflow.ps.sync`.
- ``"allreduce"``: :class:`psflow.worker.allreduce.AllReduceEngine`, no ps at all.

One synchronous step, for a job with shards 0..k: stage the gradients on shards 1..k
(acknowledged at once), push to shard 0 (answered when the step has advanced, with the chosen
workers), then pull shards 1..k passing shard 0's decisions, which they apply first. Every
shard therefore applies the same workers' gradients for each step, and the worker checks that
every shard answered with the same step.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from psflow import env as envvars
from psflow.transport import PeerError, PeerTimeoutError
from psflow.worker.client import Tensors

if TYPE_CHECKING:
    from psflow.worker.optimizer import DistributedOptimizer

MODES = ("async", "sync", "allreduce")

_CONSISTENT_PULL_TRIES = 50


def _default_mode() -> str:
    return os.environ.get(envvars.PSFLOW_MODE) or "async"


def _default_timeout() -> float | None:
    raw = os.environ.get(envvars.PSFLOW_SYNC_TIMEOUT)
    return float(raw) if raw else None


@dataclass(kw_only=True)
class ModeConfig:
    """How the workers combine their gradients.

    Example:
        >>> ModeConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3).mode
        'sync'
    """

    mode: str = field(default_factory=_default_mode)
    """``"async"``, ``"sync"`` or ``"allreduce"`` (default: ``PSFLOW_MODE``, else async)."""
    replicas_to_aggregate: int | None = None
    """Sync: gradients averaged per step (default: every worker)."""
    total_num_replicas: int | None = None
    """Sync: workers in the job (default and required: the cluster's workers, chief included);
    more than ``replicas_to_aggregate`` makes backup workers."""
    max_staleness: int | None = None
    """Async: a worker may push its gradient number ``c + 1`` only once every unfinished
    worker has pushed at least ``c - max_staleness`` (it waits otherwise; nothing is dropped)."""
    timeout: float | None = field(default_factory=_default_timeout)
    """Seconds a worker waits for its step (sync) or for the slowest worker (bounded
    staleness), and for the all-reduce group; default: the transport timeout."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: expected one of {MODES}")
        for name in ("replicas_to_aggregate", "total_num_replicas"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if v is not None and self.mode != "sync":
                raise ValueError(f"{name}={v} applies to mode='sync', not {self.mode!r}")
        r, n = self.replicas_to_aggregate, self.total_num_replicas
        if r is not None and n is not None and r > n:
            raise ValueError(f"replicas_to_aggregate={r} exceeds total_num_replicas={n}")
        s = self.max_staleness
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"max_staleness must be an integer >= 0, got {s!r}")
            if self.mode != "async":
                raise ValueError(f"max_staleness={s} applies to mode='async', not {self.mode!r}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")

    def replicas(self, num_trainers: int) -> tuple[int, int]:
        """``(replicas_to_aggregate, total_num_replicas)`` for a job of ``num_trainers``."""
        n = self.total_num_replicas or num_trainers
        if n != num_trainers:
            raise ValueError(
                f"total_num_replicas={n} but the cluster has {num_trainers} worker task(s) "
                "(chief included): give every replica a task"
            )
        r = self.replicas_to_aggregate or n
        if r > n:
            raise ValueError(f"replicas_to_aggregate={r} exceeds the {n} workers of the cluster")
        return r, n


class SyncTimeoutError(PeerTimeoutError):
    """A synchronous step (or a bounded-staleness wait) did not complete in time.

    ``arrived`` names the workers whose gradients reached ps:0 for ``step``, ``missing`` the
    unfinished workers that sent none.
    """

    def __init__(
        self, peer: str, message: str, *, step: int, arrived: list[str], missing: list[str]
    ) -> None:
        super().__init__(peer, message)
        self.step = step
        self.arrived = arrived
        self.missing = missing


def gather_grads(opt: DistributedOptimizer) -> dict[int, Tensors]:
    """Each shard's slice of the model's gradients (parameters without one are left out)."""
    grads: dict[int, Tensors] = {}
    for shard, pieces in opt._by_shard.items():
        out = []
        for p in pieces:
            g = opt.params[p.param].grad
            if g is not None:
                out.append((p.var, opt._slice(g, p)))
        if out:
            grads[shard] = out
    if not grads:
        raise ValueError("no gradients to push: call loss.backward() before step()")
    return grads


class Engine:
    """What a training mode provides to :class:`DistributedOptimizer`."""

    global_step = 0

    def step(self) -> int:
        raise NotImplementedError

    def pull(self) -> int:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        """Releases what the engine holds (the optimizer closes its ps connections itself)."""


class SyncEngine(Engine):
    """Synchronous steps against the ps, with backup workers (see the module docstring)."""

    def __init__(self, opt: DistributedOptimizer, config: ModeConfig) -> None:
        self.opt = opt
        self.client = opt._client
        trainers = opt.ctx.cluster.trainers
        self.trainers = [str(t) for t in trainers]
        self.replicas_to_aggregate, self.total_num_replicas = config.replicas(len(trainers))
        self.timeout = config.timeout or self.client.config.timeout
        self.others = list(range(1, self.client.num_shards))
        self.local_steps = 0
        self.accepted = 0
        self.dropped = 0
        self.wait_seconds = 0.0

    def step(self) -> int:
        opt = self.opt
        grads = gather_grads(opt)
        t = opt.global_step
        base = {"step": t, "r": self.replicas_to_aggregate, "n": self.total_num_replicas}
        if self.others:
            # Staged before ps:0 can count this worker, so a decision never names a worker
            # whose gradients a shard has not received.
            self.client.call(
                {s: {"op": "sync_stage", **base} for s in self.others},
                {s: grads.get(s, []) for s in self.others},
            )
        dest = opt._destinations()
        start = time.monotonic()
        try:
            replies = self.client.call(
                {0: {"op": "sync_push", **base}},
                {0: grads.get(0, [])},
                timeout=self.timeout,
                into=dest,
                lane_views=True,
            )
        except PeerTimeoutError as e:
            raise self._diagnose(t, e) from e
        self.wait_seconds += time.monotonic() - start
        header = replies[0][0]
        self.local_steps += 1
        if header.get("accepted"):
            self.accepted += 1
        else:
            self.dropped += 1
        if self.others:
            replies.update(self._pull_others(header.get("decisions", []), dest))
            if len({int(h["step"]) for h, _ in replies.values()}) != 1:
                return self.pull()  # another step completed meanwhile: pull all again
        opt._load(replies)
        return opt.global_step

    def _pull_others(
        self, decisions: Any, dest: dict[str, Any]
    ) -> dict[int, tuple[dict[str, Any], Tensors]]:
        return self.client.call(
            {s: {"op": "sync_pull", "decisions": decisions} for s in self.others},
            into=dest,
            lane_views=True,
        )

    def pull(self) -> int:
        """All shards' parameters of one and the same step."""
        steps: dict[int, int] = {}
        for attempt in range(_CONSISTENT_PULL_TRIES):
            dest = self.opt._destinations()
            replies = self.client.call({0: {"op": "sync_pull"}}, into=dest, lane_views=True)
            if self.others:
                replies.update(self._pull_others(replies[0][0].get("decisions", []), dest))
            steps = {s: int(h["step"]) for s, (h, _) in replies.items()}
            if len(set(steps.values())) == 1:
                self.opt._load(replies)
                return self.opt.global_step
            time.sleep(0.001 * attempt)
        raise RuntimeError(f"the ps shards stayed at different steps {steps}")

    def _diagnose(self, step: int, error: PeerTimeoutError) -> PeerTimeoutError:
        """Why the step did not complete, asked of ps:0 (the original error if it is gone)."""
        try:
            status = self.status(timeout=min(5.0, self.client.config.timeout))
        except PeerError:
            return error
        arrived = [str(w) for w in status.get("arrived", [])]
        finished = set(status.get("finished", []))
        missing = [w for w in self.trainers if w not in arrived and w not in finished]
        message = (
            f"step {step} did not complete within {self.timeout:g} s: "
            f"{len(arrived)} of {self.replicas_to_aggregate} gradients arrived"
            f" ({'from ' + ', '.join(arrived) if arrived else 'from no worker'}); "
            f"none from {', '.join(missing) or 'any unfinished worker'}"
            f" (ps:0 is at step {status.get('step')})"
        )
        return SyncTimeoutError(error.peer, message, step=step, arrived=arrived, missing=missing)

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        """ps:0's view: step, arrivals, dropped gradients per worker, recent decisions."""
        return self.client.call({0: {"op": "sync_status"}}, timeout=timeout)[0][0]

    def stats(self) -> dict[str, Any]:
        return {
            "mode": "sync",
            "replicas_to_aggregate": self.replicas_to_aggregate,
            "total_num_replicas": self.total_num_replicas,
            "local_steps": self.local_steps,
            "accepted": self.accepted,
            "dropped_stale": self.dropped,
            "wait_seconds": round(self.wait_seconds, 6),
        }


class StalenessEngine(Engine):
    """Asynchronous steps, each first cleared by ps:0 against ``max_staleness``.

    Staleness of a gradient, as recorded here: the updates other workers applied between this
    worker's pull and the application of its gradient (``new_step - 1 - pulled_step``).
    """

    def __init__(self, opt: DistributedOptimizer, config: ModeConfig) -> None:
        assert config.max_staleness is not None
        self.opt = opt
        self.client = opt._client
        self.trainers = [str(t) for t in opt.ctx.cluster.trainers]
        self.max_staleness = config.max_staleness
        self.timeout = config.timeout or self.client.config.timeout
        self.clock = 0
        self.histogram: Counter[int] = Counter()
        self.waited = 0
        self.wait_seconds = 0.0

    def step(self) -> int:
        opt = self.opt
        grads = gather_grads(opt)
        start = time.monotonic()
        try:
            header, _ = self.client.call(
                {0: {"op": "ssp_wait", "clock": self.clock, "max_staleness": self.max_staleness}},
                timeout=self.timeout,
            )[0]
        except PeerTimeoutError as e:
            raise self._diagnose(e) from e
        waited = time.monotonic() - start
        self.wait_seconds += waited
        if header.get("held"):
            self.waited += 1
        pulled = opt.global_step
        opt._load(self.client.push(grads, pull=True, into=opt._destinations(), lane_views=True))
        self.histogram[max(0, opt.global_step - 1 - pulled)] += 1
        self.clock += 1
        return opt.global_step

    def pull(self) -> int:
        opt = self.opt
        opt._load(opt._client.pull(into=opt._destinations(), lane_views=True))
        return opt.global_step

    def _diagnose(self, error: PeerTimeoutError) -> PeerTimeoutError:
        try:
            h = self.client.call({0: {"op": "sync_status"}}, timeout=5.0)[0][0]
        except PeerError:
            return error
        clocks = h.get("clocks", {})
        laggards = [str(w) for w in clocks.get("laggards", [])]
        message = (
            f"{self.opt.ctx.task} (clock {self.clock}) waited {self.timeout:g} s for "
            f"{', '.join(laggards) or 'the slowest worker'} (clock {clocks.get('slowest')}) to "
            f"come within max_staleness={self.max_staleness}: is it alive?"
        )
        return SyncTimeoutError(
            error.peer, message, step=self.opt.global_step, arrived=[], missing=laggards
        )

    def stats(self) -> dict[str, Any]:
        n = sum(self.histogram.values())
        total = sum(k * v for k, v in self.histogram.items())
        return {
            "mode": "async",
            "max_staleness": self.max_staleness,
            "local_steps": self.clock,
            "staleness_mean": total / n if n else 0.0,
            "staleness_max": max(self.histogram, default=0),
            "staleness_histogram": dict(sorted(self.histogram.items())),
            "waited_steps": self.waited,
            "wait_seconds": round(self.wait_seconds, 6),
        }
