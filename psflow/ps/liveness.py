"""Which workers a ps still hears from: liveness by silence.

A worker (or the chief) *joins* with its first request; from then on the ps expects to hear
from it at least every ``timeout`` seconds. Any request it sends counts, and while it computes
a long step, writes a checkpoint or waits, its heartbeat (:class:`~psflow.protocol.Op.HEARTBEAT`,
every fifth of the timeout, from :mod:`psflow.worker.heartbeat`) does. A worker silent for
longer is *dead*: killed, hung (SIGSTOP), or cut off. A dead worker that speaks again (its
restart, or SIGCONT) rejoins. A worker that never joined is not declared dead: it may still be
starting (importing torch on a loaded machine takes seconds), and the others wait for it as
before. A ps restored mid-job (it crashed and came back empty) *expects* every worker it has
not heard from since: the job was under way, and a worker that finished (or died) before the
crash will never speak to it again; silent for the timeout, it is dead too.
"""

from __future__ import annotations

import time
from collections.abc import Set as AbstractSet

from psflow.protocol import WORKER_TIMEOUT as DEFAULT_TIMEOUT

__all__ = ["DEFAULT_TIMEOUT", "Liveness"]


class Liveness:
    """When each worker of the job was last heard from, and which are dead.

    Example:
        >>> live = Liveness({"worker:0", "worker:1"}, timeout=10.0)
        >>> live.heard("worker:0", now=0.0), live.heard("worker:1", now=0.0)
        (False, False)
        >>> live.check(now=5.0, finished=set())
        []
        >>> live.heard("worker:0", now=9.0)
        False
        >>> live.check(now=10.5, finished=set())
        ['worker:1']
        >>> live.heard("worker:1", now=11.0)  # it came back
        True
    """

    def __init__(self, trainers: AbstractSet[str], timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"the worker timeout must be > 0 seconds, got {timeout}")
        self.trainers = frozenset(trainers)
        self.timeout = timeout
        self.last: dict[str, float] = {}
        """Each joined worker: when it was last heard from (``time.monotonic``)."""
        self.dead: set[str] = set()
        self.expected: set[str] = set()
        """Workers joined by :meth:`expect`, not by a request, and silent since."""
        self.deaths = 0
        """Workers declared dead so far (a worker that dies twice counts twice)."""

    def heard(self, name: str, now: float) -> bool:
        """Notes a request from ``name``; True when it was dead (it rejoins)."""
        if name not in self.trainers:
            return False
        self.last[name] = now
        self.expected.discard(name)
        if name in self.dead:
            self.dead.discard(name)
            return True
        return False

    def expect(self, now: float, finished: AbstractSet[str]) -> list[str]:
        """Joins, from ``now``, every unfinished worker not heard from yet: the job is under
        way (a restore mid-job). Returns them."""
        names = sorted(self.trainers - self.last.keys() - finished)
        for name in names:
            self.last[name] = now
        self.expected.update(names)
        return names

    def check(self, now: float, finished: AbstractSet[str]) -> list[str]:
        """The joined, unfinished workers silent for longer than the timeout and not yet
        declared dead: dead from now on."""
        newly = [
            name
            for name, seen in self.last.items()
            if now - seen > self.timeout and name not in self.dead and name not in finished
        ]
        newly.sort()
        self.dead.update(newly)
        self.deaths += len(newly)
        return newly

    def silence(self, name: str, now: float | None = None) -> float:
        """Seconds since ``name`` was last heard from (0 for one that never joined)."""
        seen = self.last.get(name)
        return 0.0 if seen is None else (time.monotonic() if now is None else now) - seen

    def joined(self) -> AbstractSet[str]:
        """The workers heard from at least once."""
        return self.last.keys()
