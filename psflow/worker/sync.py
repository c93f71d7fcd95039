"""Synchronous training against the ps (``mode="sync"``), with backup workers.

One synchronous step, for a job with shards 0..k: stage the gradients on shards 1..k
(acknowledged at once), push to shard 0 (answered when the step has advanced, with the chosen
workers), then pull shards 1..k passing shard 0's decisions, which they apply first. Every
shard therefore applies the same workers' gradients for each step, and the worker checks that
every shard answered with the same step. The ps side is :mod:`psflow.ps.sync`.
"""

from __future__ import annotations

import time
from typing import Any

from psflow.protocol import Key
from psflow.transport import PeerError, PeerTimeoutError
from psflow.worker.client import Replies
from psflow.worker.engine import ExchangeEngine
from psflow.worker.exchange import ParameterExchange
from psflow.worker.modes import Mode, ModeConfig, SyncTimeoutError

_CONSISTENT_PULL_TRIES = 50


class SyncEngine(ExchangeEngine):
    """Synchronous steps against the ps, with backup workers (see the module docstring)."""

    mode = Mode.SYNC

    def __init__(self, exchange: ParameterExchange, config: ModeConfig) -> None:
        super().__init__(exchange)
        trainers = exchange.ctx.cluster.trainers
        self.trainers = [str(t) for t in trainers]
        self.replicas = config.replicas(len(trainers))
        """``(replicas_to_aggregate, total_num_replicas)``."""
        self.timeout = config.timeout or self.client.config.timeout
        self.others = list(range(1, self.client.num_shards))
        self.local_steps = 0
        self.accepted = 0
        self.dropped = 0
        self.wait_seconds = 0.0

    def step(self) -> int:
        grads, _, rows = self.exchange.gradients()
        t = self.exchange.global_step
        if self.others:
            # Staged before ps:0 can count this worker, so a decision never names a worker
            # whose gradients a shard has not received.
            self.client.sync_stage(
                {s: grads.get(s, []) for s in self.others}, t, self.replicas, rows=rows
            )
        dest = self.exchange.destinations()
        start = time.monotonic()
        try:
            replies = self.client.sync_push(
                grads.get(0, []),
                t,
                self.replicas,
                timeout=self.timeout,
                into=dest,
                rows=rows.get(0),
            )
        except PeerTimeoutError as e:
            raise self._diagnose(t, e) from e
        waited = time.monotonic() - start
        self.wait_seconds += waited
        self.client.metrics.sync_wait.observe(waited)
        header = replies[0][0]
        self.local_steps += 1
        if header.get(Key.ACCEPTED):
            self.accepted += 1
        else:
            self.dropped += 1
        if self.others:
            replies.update(self._pull_others(header, dest))
            if len({int(h[Key.STEP]) for h, _ in replies.values()}) != 1:
                return self.pull()  # another step completed meanwhile: pull all again
        return self.exchange.load(replies)

    def _pull_others(self, header: dict[str, Any], dest: dict[str, Any]) -> Replies:
        return self.client.sync_pull(self.others, header.get(Key.DECISIONS, []), into=dest)

    def pull(self) -> int:
        """All shards' parameters of one and the same step."""
        steps: dict[int, int] = {}
        for attempt in range(_CONSISTENT_PULL_TRIES):
            dest = self.exchange.destinations()
            replies = self.client.sync_pull([0], None, into=dest)
            if self.others:
                replies.update(self._pull_others(replies[0][0], dest))
            steps = {s: int(h[Key.STEP]) for s, (h, _) in replies.items()}
            if len(set(steps.values())) == 1:
                return self.exchange.load(replies)
            time.sleep(0.001 * attempt)
        raise RuntimeError(f"the ps shards stayed at different steps {steps}")

    def _diagnose(self, step: int, error: PeerTimeoutError) -> PeerTimeoutError:
        """Why the step did not complete, asked of ps:0 (the original error if it is gone)."""
        try:
            status = self.client.sync_status(timeout=min(5.0, self.client.config.timeout))
        except PeerError:
            return error
        arrived = [str(w) for w in status.get(Key.ARRIVED, [])]
        finished = set(status.get(Key.FINISHED, []))
        missing = [w for w in self.trainers if w not in arrived and w not in finished]
        message = (
            f"step {step} did not complete within {self.timeout:g} s: "
            f"{len(arrived)} of {self.replicas[0]} gradients arrived"
            f" ({'from ' + ', '.join(arrived) if arrived else 'from no worker'}); "
            f"none from {', '.join(missing) or 'any unfinished worker'}"
            f" (ps:0 is at step {status.get(Key.STEP)})"
        )
        return SyncTimeoutError(error.peer, message, step=step, arrived=arrived, missing=missing)

    def stats(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "replicas_to_aggregate": self.replicas[0],
            "total_num_replicas": self.replicas[1],
            "local_steps": self.local_steps,
            "accepted": self.accepted,
            "dropped_stale": self.dropped,
            "wait_seconds": round(self.wait_seconds, 6),
        }
