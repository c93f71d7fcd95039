"""Bounded staleness (``mode="async"`` with ``max_staleness``): asynchronous steps, each first
cleared by ps:0, so that no worker runs more than ``max_staleness`` steps ahead of the slowest.
The ps side is :mod:`psflow.ps.staleness`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from psflow.protocol import Key
from psflow.transport import PeerError, PeerTimeoutError
from psflow.worker.engine import KeepsInputPositions
from psflow.worker.exchange import ParameterExchange
from psflow.worker.modes import Mode, ModeConfig, SyncTimeoutError


class StalenessEngine(KeepsInputPositions):
    """Asynchronous steps, each first cleared by ps:0 against ``max_staleness``.

    Staleness of a gradient, as recorded here: the updates other workers applied between this
    worker's pull and the application of its gradient (``new_step - 1 - pulled_step``).
    """

    mode = Mode.ASYNC

    def __init__(self, exchange: ParameterExchange, config: ModeConfig) -> None:
        if config.max_staleness is None:
            raise ValueError("bounded staleness needs max_staleness")
        super().__init__(exchange)
        self.trainers = [str(t) for t in exchange.ctx.cluster.trainers]
        self.max_staleness = config.max_staleness
        self.timeout = config.timeout or self.client.config.timeout
        self.clock = 0
        self.histogram: Counter[int] = Counter()
        self.waited = 0
        self.wait_seconds = 0.0

    def step(self) -> int:
        grads, layouts, rows = self.exchange.gradients()
        start = time.monotonic()
        try:
            header = self.client.ssp_wait(self.clock, self.max_staleness, timeout=self.timeout)
        except PeerTimeoutError as e:
            raise self._diagnose(e) from e
        self.wait_seconds += time.monotonic() - start
        if header.get(Key.HELD):
            self.waited += 1
        pulled = self.exchange.global_step
        step = self.exchange.push_pull(grads, layouts, rows)
        self.histogram[max(0, step - 1 - pulled)] += 1
        self.clock += 1
        return step

    def _diagnose(self, error: PeerTimeoutError) -> PeerTimeoutError:
        try:
            status = self.client.sync_status(timeout=5.0)
        except PeerError:
            return error
        clocks = status.get(Key.CLOCKS, {})
        laggards = [str(w) for w in clocks.get(Key.LAGGARDS, [])]
        message = (
            f"{self.exchange.ctx.task} (clock {self.clock}) waited {self.timeout:g} s for "
            f"{', '.join(laggards) or 'the slowest worker'} (clock {clocks.get(Key.SLOWEST)}) "
            f"to come within max_staleness={self.max_staleness}: is it alive?"
        )
        return SyncTimeoutError(
            error.peer, message, step=self.exchange.global_step, arrived=[], missing=laggards
        )

    def stats(self) -> dict[str, Any]:
        n = sum(self.histogram.values())
        total = sum(k * v for k, v in self.histogram.items())
        return {
            "mode": self.mode,
            "max_staleness": self.max_staleness,
            "local_steps": self.clock,
            "staleness_mean": total / n if n else 0.0,
            "staleness_max": max(self.histogram, default=0),
            "staleness_histogram": dict(sorted(self.histogram.items())),
            "waited_steps": self.waited,
            "wait_seconds": round(self.wait_seconds, 6),
        }
