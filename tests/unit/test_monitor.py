"""What a client makes of its connection's monitor reports (psflow.transport.monitor)."""

from __future__ import annotations

import logging

import pytest
import zmq

from psflow.transport.monitor import Link, RateLimitedLog

pytestmark = pytest.mark.unit

ADDRESS = "10.0.0.5:2222"


def _link(*events: int, value: int = 0) -> Link:
    link = Link()
    for event in events:
        link.update({"event": event, "value": value, "endpoint": b""}, ADDRESS)
    return link


def test_nothing_listening() -> None:
    link = _link(zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_CONNECT_RETRIED)
    assert link.problem == f"nothing accepts connections at {ADDRESS} (not started yet?)"
    assert not link.refused


def test_a_refused_key_is_final_and_stays_the_news() -> None:
    link = _link(zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_FAILED_AUTH, value=400)
    assert link.refused and link.problem is not None
    assert link.problem.startswith("refused this task's CurveZMQ key")
    link.update({"event": zmq.EVENT_CONNECT_RETRIED, "value": 0, "endpoint": b""}, ADDRESS)
    assert link.refused  # a reconnection says nothing new


def test_a_failed_handshake_then_success() -> None:
    link = _link(zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_CONNECTED)
    assert (
        link.problem is not None and "CurveZMQ handshake with 10.0.0.5:2222 failed" in link.problem
    )
    assert not link.refused
    link.update({"event": zmq.EVENT_HANDSHAKE_SUCCEEDED, "value": 0, "endpoint": b""}, ADDRESS)
    assert link == Link()


def test_a_recurring_warning_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("psflow.test.ratelimit")
    limited = RateLimitedLog(logger, interval=3600)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(5):
            limited.warning("a", "client %s failed", "a")
        limited.warning("b", "client %s failed", "b")
    assert [r.getMessage() for r in caplog.records] == ["client a failed", "client b failed"]
    limited = RateLimitedLog(logger, interval=1e-9)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        limited.warning("a", "client failed")
        limited.warning("a", "client failed")
    assert len(caplog.records) == 2
