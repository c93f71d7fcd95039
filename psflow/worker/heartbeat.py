"""A worker's heartbeat: tells every ps it is alive while it computes, saves or waits.

The ps declares a worker dead after ``PSFLOW_WORKER_TIMEOUT`` seconds without a word from it
(:mod:`psflow.ps.liveness`). Its requests count, but a long step, a checkpoint or a wait for
the others can be longer than that: so a thread of its own, with sockets of its own (ZeroMQ
sockets are not shared between threads), sends :attr:`~psflow.protocol.Op.HEARTBEAT` to every
ps :data:`~psflow.protocol.HEARTBEATS_PER_TIMEOUT` times per timeout. A hung process (SIGSTOP)
stops its heartbeat with everything else: that is what the ps should notice.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from psflow import env as envvars
from psflow.cluster.spec import TaskContext
from psflow.protocol import HEARTBEATS_PER_TIMEOUT, WORKER_TIMEOUT, Key, Op
from psflow.transport import Client, PeerError, TransportConfig

log = logging.getLogger(__name__)


def worker_timeout() -> float:
    """``PSFLOW_WORKER_TIMEOUT`` (seconds), or its default.

    Raises:
        ValueError: when it is set to something other than a positive number.
    """
    return envvars.seconds(envvars.PSFLOW_WORKER_TIMEOUT, WORKER_TIMEOUT)


class Heartbeat:
    """Sends a heartbeat to every ps of ``ctx``'s cluster every ``interval`` seconds.

    Example:
        >>> # beat = Heartbeat(ctx, TransportConfig.from_env()).start()
        >>> # ...  # train
        >>> # beat.stop()
    """

    def __init__(
        self, ctx: TaskContext, config: TransportConfig, *, interval: float | None = None
    ) -> None:
        if interval is None:
            interval = worker_timeout() / HEARTBEATS_PER_TIMEOUT
        if not interval > 0:
            raise ValueError(f"the heartbeat interval must be > 0 seconds, got {interval}")
        self.interval = interval
        self.me = str(ctx.task)
        self._peers = {f"ps:{i}": address for i, address in enumerate(ctx.cluster.addresses("ps"))}
        # Through the socket only, inside CurveZMQ where there are keys (a heartbeat carries
        # no tensor: no second connection pays); a reply is awaited one interval, and the
        # sends to ps that are down (a full queue) block a round no longer.
        self._config = dataclasses.replace(
            config, shared_memory=False, sealed=False, timeout=interval / (1 + len(self._peers))
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        """Starts beating (in a daemon thread); returns at once."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"psflow-heartbeat-{self.me}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops beating and closes the heartbeat's sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        client = Client(self._peers, self._config)
        try:
            while not self._stop.wait(self.interval):
                rids = []
                for peer in self._peers:
                    try:  # a ps that is down (restarting, cut off) blocks the send a while
                        rids.append(client.send(peer, {Key.OP: Op.HEARTBEAT, Key.TASK: self.me}))
                    except PeerError as e:
                        log.debug("%s: heartbeat: %s", self.me, e)
                try:
                    client.wait(rids, self.interval)
                except PeerError as e:
                    # The requests of the training loop name a dead ps; this only keeps time.
                    log.debug("%s: heartbeat: %s", self.me, e)
        except Exception:  # a heartbeat must never take the worker down
            log.exception("%s: the heartbeat stopped", self.me)
        finally:
            client.close()
