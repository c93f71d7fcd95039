"""Connection events of ZeroMQ sockets, read in the background: why a peer is silent.

A request to a peer that is not up, or that refuses this task's CurveZMQ key, is simply never
answered: ZeroMQ queues it and retries the connection without telling anyone. ZeroMQ does
report each attempt to a socket *monitor*; a :class:`Monitor` reads those reports in a thread
of its own (a monitor that nobody reads fills up and stalls its socket) and hands each to a
callback. The client keeps, per peer, what the last reports say (:class:`Link`); the server
logs the clients that failed their handshake.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from psflow import env as envvars

log = logging.getLogger(__name__)

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | HANDSHAKE_FAILED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_MONITOR_STOPPED
)
"""The events watched: no per-message event, so a busy socket reports nothing."""

_endpoints = itertools.count()
"""Numbers the monitors' inproc endpoints (see :meth:`Monitor.watch`)."""

Event = dict[str, Any]
"""One report, as :func:`zmq.utils.monitor.recv_monitor_message` reads it: ``event``,
``value``, ``endpoint``."""


class Monitor:
    """Reads the monitor reports of some sockets in a daemon thread.

    Call :meth:`watch` for each socket (from the thread that owns it, before it connects or
    binds), then :meth:`start`. The thread ends once every watched socket has closed or had
    its monitor turned off (``sock.disable_monitor()``, from the socket's own thread).

    Example:
        >>> mon = Monitor("demo", lambda key, event: None)
        >>> sock = zmq.Context.instance().socket(zmq.DEALER)
        >>> mon.watch("peer", sock)
        >>> mon.start()
        >>> sock.close(linger=0)  # the monitor stops with its socket
    """

    def __init__(self, name: str, on_event: Callable[[str, Event], None]) -> None:
        self._name = name
        self._on_event = on_event
        self._pairs: dict[zmq.Socket[bytes], str] = {}
        self._thread: threading.Thread | None = None

    def watch(self, key: str, sock: zmq.Socket[bytes], events: int = EVENTS) -> None:
        """Reports of ``sock`` will reach the callback with ``key``."""
        assert self._thread is None, "watch every socket before start()"
        # A name of its own: pyzmq's default names the endpoint by the socket's file
        # descriptor, which a socket closed a moment ago may have had, its monitor's endpoint
        # still bound until the context reaps it ("Address already in use" when a worker
        # reconnects to a restarted ps).
        addr = f"inproc://psflow-monitor-{os.getpid()}-{next(_endpoints)}"
        self._pairs[sock.get_monitor_socket(events, addr)] = key

    def start(self) -> None:
        if self._thread is None and self._pairs:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for pair in self._pairs:
            poller.register(pair, zmq.POLLIN)
        live = set(self._pairs)
        try:
            while live:
                for pair, _ in poller.poll():
                    if not self._drain(pair):
                        poller.unregister(pair)
                        live.discard(pair)
                        pair.close(linger=0)
        except zmq.ContextTerminated:
            pass
        finally:
            for pair in live:
                pair.close(linger=0)

    def _drain(self, pair: zmq.Socket[bytes]) -> bool:
        """Hands on every report waiting on ``pair``; False once its monitor stopped."""
        while True:
            try:
                event = recv_monitor_message(pair, zmq.NOBLOCK)
            except zmq.Again:
                return True
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return False
            try:
                self._on_event(self._pairs[pair], dict(event))
            except Exception:  # a report must never end the thread that drains the others
                log.exception("%s: handling %s", self._name, event)


@dataclass
class Link:
    """What the monitor last said of a client's connection to one peer."""

    problem: str | None = None
    """Why the peer does not answer, for people; ``None`` while nothing is known to be wrong."""
    refused: bool = False
    """The peer refused this task's CurveZMQ key: ZeroMQ does not try again, so waiting longer
    is in vain."""

    def update(self, event: Event, address: str, *, keyed: bool = True) -> None:
        """Takes one report of the connection to the peer at ``address`` (``keyed``: this
        task speaks CurveZMQ)."""
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.problem, self.refused = None, False
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._set(
                "refused this task's CurveZMQ key: its authorised keys do not include this "
                f"task's client.key (every task needs the job's {envvars.PSFLOW_KEYS_DIR})",
                refused=True,
            )
        elif kind & HANDSHAKE_FAILED and keyed:
            self._set(
                f"the CurveZMQ handshake with {address} failed: not the same keys on both sides "
                f"({envvars.PSFLOW_KEYS_DIR} of another job?), or keys on one side only"
            )
        elif kind & HANDSHAKE_FAILED:
            self._set(
                f"the ZeroMQ handshake with {address} failed: what answers there is no psflow "
                f"task without keys (one with {envvars.PSFLOW_KEYS_DIR}'s CurveZMQ keys, or no "
                "ZeroMQ peer at all)"
            )
        elif kind == zmq.EVENT_CONNECT_RETRIED and not self._handshake_failed():
            self._set(f"nothing accepts connections at {address} (not started yet?)")
        elif kind == zmq.EVENT_CONNECTED and not self._handshake_failed():
            self._set(f"connected to {address}, no answer yet")

    def _set(self, problem: str, *, refused: bool = False) -> None:
        self.problem, self.refused = problem, refused

    def _handshake_failed(self) -> bool:
        # A failed handshake is the news; the reconnections after it say nothing new.
        return self.problem is not None and (
            "CurveZMQ" in self.problem or "handshake" in self.problem
        )


class RateLimitedLog:
    """Logs a recurring event at once, then at most once per ``interval`` seconds per key,
    saying how many were left out in between (a client retries its handshake every 100 ms)."""

    def __init__(self, logger: logging.Logger, interval: float) -> None:
        self._log = logger
        self._interval = interval
        self._last: dict[Any, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def warning(self, key: Any, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last, left_out = self._last.get(key, (float("-inf"), 0))
            if now - last < self._interval:
                self._last[key] = (last, left_out + 1)
                return
            self._last[key] = (now, 0)
        if left_out:
            message += f" ({left_out} more since the last such line)"
        self._log.warning(message, *args)
