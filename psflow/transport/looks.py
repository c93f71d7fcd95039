"""Whether a side of a lane should look for its next message before it sleeps.

A side that waits looks at its lane's count for up to the spin time (``PSFLOW_SPIN_US``,
:data:`~psflow.transport.shm.SPIN_SECONDS`), yielding its core at every look, then sleeps on
its FIFO (the doorbells in :mod:`psflow.transport.shm`). Looking pays where messages come
within the spin time: a small model's step (the linear regression's, four round trips a step)
is then 1.2x faster than with every wait asleep. It wastes a core's time where they come later:
a CTR worker waits 2-3 ms for a shard's reply to its push and a shard 10 ms or more between two
workers' pushes on 2 cores, so each wait first spent the whole spin time looking, on a core the
other processes needed. :class:`Looks` keeps the odds that a message comes within the spin time,
from the last waits (each measured whether it looked or slept), and says to look only while
they are even or better.
"""

from __future__ import annotations

WEIGHT = 0.125
"""How much the last wait moves the odds: about the last eight count."""
EVEN = 0.5
"""The odds at and above which a side looks."""


class Looks:
    """The odds that a wait ends within the spin time, and so whether to look first.

    Example:
        >>> looks = Looks()
        >>> looks.worth()  # a new lane looks
        True
        >>> for _ in range(6):
        ...     looks.waited(0.010, spin=0.002)  # the replies came 10 ms after
        >>> looks.worth()
        False
        >>> for _ in range(6):
        ...     looks.waited(0.0001, spin=0.002)
        >>> looks.worth()
        True
    """

    __slots__ = ("odds",)

    def __init__(self) -> None:
        self.odds = 1.0

    def worth(self) -> bool:
        """Whether to look before sleeping."""
        return self.odds >= EVEN

    def waited(self, seconds: float, *, spin: float) -> None:
        """A wait that ended ``seconds`` after it began (looking or asleep)."""
        self.odds += WEIGHT * (float(seconds <= spin) - self.odds)
