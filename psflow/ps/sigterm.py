"""SIGTERM on a ps: serve on while the workers still ask, then stop.

A ps stopped by SIGTERM (Kubernetes deleting the pod, ``psflow launch`` stopping the job)
serves on while its workers still ask, so that a chief stopped by the same SIGTERM saves a last
checkpoint through it, and stops once none has asked for :data:`TERM_IDLE_SECONDS`, after
:data:`TERM_SECONDS` at most, or at a second SIGTERM.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from collections.abc import Set as AbstractSet

log = logging.getLogger(__name__)

TERM_SECONDS = 20.0
"""At most this long a ps serves on after SIGTERM: the chief's final checkpoint goes through it,
within Kubernetes' default grace period of 30 s (and ``psflow launch``'s)."""
TERM_IDLE_SECONDS = 5.0
"""After SIGTERM, a ps stops once no request has come for this long (its workers are gone, or
stopped without saying ``done``): longer than a slow step, so a worker still finishing its
last step finds its ps."""


class Termination:
    """SIGTERM to the task while a :class:`~psflow.ps.server.ParameterServer` serves.

    Args:
        name: the ps task, for the log.
        stop: set at a second SIGTERM: the serving loop stops at once.
        trainers: the workers of the job; ``finished``: those that have said ``done`` (both
            read when the log says whom the ps still serves).
    """

    def __init__(
        self,
        name: str,
        stop: threading.Event,
        trainers: AbstractSet[str],
        finished: AbstractSet[str],
    ) -> None:
        self.name = name
        self._stop = stop
        self._trainers = trainers
        self._finished = finished
        self.at: float | None = None
        """When SIGTERM came (while :meth:`handled`), if it did."""
        self._logged = False

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Takes SIGTERM while inside, unless this is not the main thread or the script
        handles it."""
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        ):
            yield  # the script's own handler stands
            return

        def on_term(_signum: int, _frame: object) -> None:
            # Nothing that takes a lock here: the serving thread logs what happens.
            if self.at is None:
                self.at = time.monotonic()
            else:
                self._stop.set()

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def over(self, last_seen: float) -> bool:
        """After SIGTERM: whether to stop now (nobody asks any more, or time is up)."""
        assert self.at is not None
        now = time.monotonic()
        if not self._logged:
            self._logged = True
            waiting = ", ".join(sorted(self._trainers - self._finished)) or "nobody"
            log.info(
                "%s received SIGTERM: serving on while its workers ask (for %s), at most %g s",
                self.name,
                waiting,
                TERM_SECONDS,
            )
        if now - last_seen >= TERM_IDLE_SECONDS or now - self.at >= TERM_SECONDS:
            log.info("%s: stopping on SIGTERM", self.name)
            return True
        return False
