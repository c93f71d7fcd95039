"""What a client makes of its connection's monitor reports (psflow.transport.monitor)."""

from __future__ import annotations

import logging

import pytest
import zmq

from psflow.transport.monitor import Link, Monitor, RateLimitedLog

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


def test_a_failed_handshake_without_keys_does_not_blame_keys() -> None:
    # A task without keys: what answers is no psflow task of a job without keys.
    link = Link()
    for kind in (zmq.EVENT_CONNECTED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_CONNECTED):
        link.update({"event": kind, "value": 0, "endpoint": b""}, ADDRESS, keyed=False)
    assert link.problem is not None and link.problem.startswith(
        f"the ZeroMQ handshake with {ADDRESS} failed: what answers there is no psflow task "
        "without keys"
    )  # and a reconnection after it says nothing new
    assert not link.refused


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


def test_a_socket_is_watched_whatever_endpoint_its_file_descriptor_named_before() -> None:
    """A socket closed a moment ago may leave its monitor's inproc endpoint bound, named (by
    pyzmq's default) after its file descriptor; a new socket with that descriptor must still
    be watched (a worker reconnecting to a restarted ps hit "Address already in use")."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    squatter = ctx.socket(zmq.PAIR)
    try:
        squatter.bind(f"inproc://monitor.s-{sock.FD}")  # what the old socket's monitor left
        events: list[tuple[str, dict]] = []
        mon = Monitor("test", lambda key, event: events.append((key, event)))
        mon.watch("peer", sock)
        mon.start()
        sock.connect("tcp://127.0.0.1:1")  # nothing listens there: reports come
        sock.close(linger=0)
        assert mon._thread is not None
        mon._thread.join(30)
        assert not mon._thread.is_alive()  # stopped with its socket
    finally:
        sock.close(linger=0)
        squatter.close(linger=0)
        ctx.term()
