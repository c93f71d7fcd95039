"""Waiting for a Kafka broker that went away (or a topic that is not there): whom, since when.

A :class:`~psflow.data.kafka.KafkaReader` tells its :class:`BrokerWait` of every request that
failed and every error the client reports; while no broker answers, the wait logs whom it is
for (every ``wait_log_s``), and past ``max_wait_s`` (if set) raises ``TimeoutError`` naming it.
The reader ends the wait when a broker answers again. Nothing here talks to a broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

# The reader's own logger: its waits are logged as the rest of what it does.
log = logging.getLogger("psflow.data.kafka")


class BrokerWait:
    """A reader's wait for a broker: logged every ``wait_log_s``, ``TimeoutError`` past
    ``max_wait_s``.

    Args:
        topic: the topic read, named in the logs and the error.
        poll_timeout_s: the reader's longest call to the client; a request that failed at once
            is retried after at most half a second, or this.
        wait_log_s: how often a wait is logged.
        max_wait_s: the longest wait before ``TimeoutError``; ``None``: as long as it takes.
        stats: the reader's counters; ``stats["broker_waits"]`` counts the waits begun.
        where: the reader's partitions and their offsets, for the log.
    """

    def __init__(
        self,
        topic: str,
        *,
        poll_timeout_s: float,
        wait_log_s: float,
        max_wait_s: float | None,
        stats: dict[str, int],
        where: Callable[[], str],
    ) -> None:
        self.topic = topic
        self.poll_timeout_s = poll_timeout_s
        self.wait_log_s = wait_log_s
        self.max_wait_s = max_wait_s
        self.stats = stats
        self.where = where
        self.waiting_for: str | None = None
        """Whom the reader is waiting for now (the client's last error), ``None`` if no one."""
        self.error: str | None = None
        """The client's last error, until a wait ends."""
        self.since: float | None = None
        """When the wait began; ``None``: the reader is not waiting."""
        self._logged_at = 0.0

    def on_error(self, err: Any) -> None:
        """The client's error callback (served inside its calls): a broker not answering."""
        self.error = err.str()

    def waiting(self, reason: str, *, sleep: bool = True) -> None:
        """Notes that the reader waits for ``reason``; logs it every ``wait_log_s``; raises
        past ``max_wait_s``."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            self._logged_at = 0.0
            self.stats["broker_waits"] += 1
        self.waiting_for = reason
        waited = now - self.since
        if now - self._logged_at >= self.wait_log_s:
            self._logged_at = now
            log.warning(
                "kafka topic %r: waiting for %s (%.1f s so far; %s)",
                self.topic, reason, waited, self.where(),
            )  # fmt: skip
        if self.max_wait_s is not None and waited > self.max_wait_s:
            raise TimeoutError(
                f"kafka topic {self.topic!r}: waited {waited:.1f} s (max_wait_s) for {reason}"
            )
        if sleep:
            time.sleep(min(self.poll_timeout_s, 0.5))  # between requests that failed at once

    def done(self) -> None:
        """Ends the wait (logged with how long it took, if there was one)."""
        if self.since is not None:
            log.warning(
                "kafka topic %r: going on after waiting %.1f s for %s",
                self.topic, time.monotonic() - self.since, self.waiting_for,
            )  # fmt: skip
        self.since = None
        self.waiting_for = None
        self.error = None
