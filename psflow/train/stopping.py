"""SIGTERM (what Kubernetes sends a pod 30 s before SIGKILL), and a first Ctrl-C of a script run
by hand, as a request to stop: the part of :class:`~psflow.train.TrainingSession` that turns a
signal into flags its loop reads (:meth:`~psflow.train.TrainingSession.should_stop`)."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from psflow.train.restoring import StopWaiting

if TYPE_CHECKING:
    from psflow.worker.allreduce import AllReduceEngine


class StopOnSignals:
    """Signal handling, for :class:`~psflow.train.TrainingSession` (a mixin)."""

    _terminated: bool
    _waiting_for_ps: bool
    _allreduce: AllReduceEngine | None
    _signal_name: str = "SIGTERM"
    _previous_sigterm: Any = None
    _previous_sigint: Any = None
    _sigterm_installed: bool = False

    def _stop_on_sigterm(self) -> None:
        """In the main thread, SIGTERM asks the session to stop, as a hook would: the loop ends
        at :meth:`should_stop` and :meth:`close` saves. In all-reduce mode the request rides
        with the next step's gradients, so that every rank stops after the same step."""
        if threading.current_thread() is not threading.main_thread():
            return
        pid = os.getpid()

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            if os.getpid() != pid:  # a forked child (a DataLoader process) dies as it would have
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            if signum == signal.SIGINT and self._terminated:
                raise KeyboardInterrupt  # Ctrl-C twice: now, without the final checkpoint
            # Only flags: should_stop() says so (the main thread may be inside logging now).
            self._terminated = True
            self._signal_name = signal.Signals(signum).name
            if self._waiting_for_ps:
                # A wait of up to recovery_timeout for a lost ps: the stop must not wait for
                # it (the launcher's or Kubernetes' grace period is shorter).
                self._waiting_for_ps = False
                raise StopWaiting
            if self._allreduce is not None:
                self._allreduce.request_stop()

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            # Ctrl-C of a script run by hand (psflow launch's tasks never see it): the first
            # stops as SIGTERM does, the second raises KeyboardInterrupt as usual.
            self._previous_sigint = signal.signal(signal.SIGINT, on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if not self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        self._sigterm_installed = False
        previous = self._previous_sigterm  # None: a handler set from C, which cannot come back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None
