"""Bounded staleness for asynchronous training: no worker runs more than ``s`` steps ahead.

Stale synchronous parallel (SSP): each worker reports its clock (the steps it has completed)
to shard 0 before it pushes; shard 0 answers at once when the worker is at most
``max_staleness`` steps ahead of the slowest unfinished worker, and otherwise keeps the request
pending until the slowest catches up (or finishes). Nothing is dropped: every gradient is
applied on arrival, as in plain asynchronous mode, and is at most ``max_staleness`` clock
ticks of any other worker old.

A dead worker (:mod:`psflow.ps.liveness`) holds nobody back. One that rejoins (restarted, its
clock back at 0; or resumed after SIGSTOP, far behind) starts again level with the slowest of
the others: its clock is rebased, not waited for.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from psflow.protocol import Key
from psflow.transport import Request


@dataclass
class _Waiting:
    request: Request
    worker: str
    clock: int
    bound: int
    counted: bool = False


class ClockTable:
    """Each worker's clock, and the ``ssp_wait`` requests held until the slowest catches up."""

    def __init__(self, trainers: AbstractSet[str]) -> None:
        self.trainers = set(trainers)
        self.clocks: dict[str, int] = {}
        self.finished: set[str] = set()
        self.dead: set[str] = set()
        """Workers the ps no longer hears from: they hold nobody back."""
        self.waits = 0
        """Requests that had to wait for a slower worker."""
        self._waiting: list[_Waiting] = []
        self._offsets: dict[str, int] = {}
        """Added to a rejoined worker's own clock: where it stands among the others."""
        self._rebase: set[str] = set()
        """Workers that rejoined: their next clock is rebased."""

    def rejoin(self, worker: str) -> None:
        """``worker`` was dead and speaks again: its next clock starts level with the slowest
        of the others (or stays, when it is ahead of them)."""
        self._rebase.add(worker)

    def slowest(self) -> tuple[int, list[str]]:
        """The lowest clock among unfinished workers (0 for one not seen yet), and who has it."""
        live = sorted(self.trainers - self.finished - self.dead)
        if not live:
            return 0, []
        low = min(self.clocks.get(w, 0) for w in live)
        return low, [w for w in live if self.clocks.get(w, 0) == low]

    def wait(self, worker: str, clock: int, bound: int, request: Request) -> None:
        known = self.clocks.get(worker)
        own = clock + self._offsets.get(worker, 0)
        if worker in self._rebase or (known is not None and own < known):
            # Rejoined, or restarted before it was declared dead (its clock went back).
            self._rebase.discard(worker)
            others = [
                self.clocks.get(w, 0) for w in self.trainers - self.finished - self.dead - {worker}
            ]
            level = min(others, default=own)
            self._offsets[worker] = max(0, level - clock)
            own = clock + self._offsets[worker]
        clock = own
        self.clocks[worker] = clock
        self._waiting = [w for w in self._waiting if w.worker != worker]
        self._waiting.append(_Waiting(request=request, worker=worker, clock=clock, bound=bound))

    def release(self) -> list[tuple[Request, dict[str, Any]]]:
        """The waiting requests that may go on now, with their reply headers."""
        low, laggards = self.slowest()
        out: list[tuple[Request, dict[str, Any]]] = []
        keep = []
        for w in self._waiting:
            if not laggards or w.clock - low <= w.bound:
                out.append(
                    (w.request, {Key.SLOWEST: low, Key.AHEAD: w.clock - low, Key.HELD: w.counted})
                )
            else:
                if not w.counted:
                    w.counted = True
                    self.waits += 1
                keep.append(w)
        self._waiting = keep
        return out

    @property
    def num_waiting(self) -> int:
        """Workers held back (for their bound) right now."""
        return len(self._waiting)

    def drop_waiting(self) -> list[Request]:
        out = [w.request for w in self._waiting]
        self._waiting.clear()
        return out

    def stats(self) -> dict[str, Any]:
        low, laggards = self.slowest()
        return {
            Key.CLOCKS: dict(self.clocks),
            Key.SLOWEST: low,
            Key.LAGGARDS: laggards,
            Key.WAITING: [w.worker for w in self._waiting],
            Key.WAITS: self.waits,
        }
