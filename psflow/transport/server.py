"""The server side: a ROUTER socket that receives requests and answers them one at a time.

Clients on the same host may attach shared-memory lanes (:mod:`psflow.transport.shm`); with
CurveZMQ keys, clients that reach it only by socket may move to its sealed socket
(:mod:`psflow.transport.seal`). The server answers those requests itself
(:attr:`~psflow.protocol.Op.ATTACH_LANE`, :attr:`~psflow.protocol.Op.SEAL`), so what it hands up
is only ever a request for the service above it.

A client that cannot connect is never seen by a request, so the server logs it (WARNING, once,
then at most once per ``wait_log_seconds`` for the same client): one whose CurveZMQ key is not
authorised (with its address and key, from the ZAP authenticator), and one whose handshake
fails (another job's keys, or keys on one side only; from the socket's monitor).

How it answers (a request's tensors, its reply, an error) is :mod:`psflow.transport.replier`'s.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import select
import time
from collections import OrderedDict, deque
from typing import Any

import zmq

from psflow import allocator
from psflow import env as envvars
from psflow.protocol.messages import Code, Key, Op
from psflow.transport import seal, wire
from psflow.transport.auth import Gatekeeper, configure_server
from psflow.transport.config import TransportConfig, endpoint
from psflow.transport.config import context as transport_context
from psflow.transport.looks import Looks
from psflow.transport.monitor import Event, Monitor, RateLimitedLog
from psflow.transport.replier import Replier, Request, _error
from psflow.transport.shm import Lane, LaneError

log = logging.getLogger(__name__)

# Bound once, as plain strings, for the per-request path (see wire/encoding.py).
_OP = Key.OP.value
_ATTACH_LANE = Op.ATTACH_LANE.value
_SEAL = Op.SEAL.value

_POLLIN = int(zmq.POLLIN)
_POLLERR = int(zmq.POLLERR)
"""Poll events as plain ints: a test against pyzmq's enum costs a microsecond per request."""

_MAX_LANES = 64
"""Lanes a server keeps (one per client); the least recently used goes first."""

_EVENTS_EVERY = 0.001
"""Seconds between full looks at the socket's events when its file descriptor says nothing
(a net under the bookkeeping of :meth:`Server._socket_may_have`)."""

_BIND_RETRY_SECONDS = 2.0
"""How long a server tries again to bind a port that is in use: another process may hold it
for a moment (a launcher on the same machine trying ports as it picks free ones)."""


def _bind(sock: zmq.Socket[bytes], endpoint_: str) -> None:
    """Binds ``sock``, trying again for :data:`_BIND_RETRY_SECONDS` while the port is in use.

    Raises:
        zmq.ZMQError: when it is still in use then, or for any other reason at once.
    """
    deadline = time.monotonic() + _BIND_RETRY_SECONDS
    while True:
        try:
            sock.bind(endpoint_)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            log.debug("%s is in use; trying again", endpoint_)
            time.sleep(0.02)


class Server(Replier):
    """A ROUTER socket bound to one address, answering requests one at a time.

    Clients on the same host may also attach shared-memory lanes (:mod:`psflow.transport.shm`):
    :meth:`recv` then waits on the socket and on every lane at once.

    Example:
        >>> server = Server("127.0.0.1:2222", TransportConfig(timeout=5))  # doctest: +SKIP
        >>> request = server.recv(timeout=1.0)  # doctest: +SKIP
        >>> if request is not None:  # doctest: +SKIP
        ...     server.reply(request, {Key.OP: Op.OK}, server.tensors(request))
        >>> server.close()  # doctest: +SKIP
    """

    def __init__(
        self, address: str, config: TransportConfig, *, context: zmq.Context[Any] | None = None
    ) -> None:
        self.config = config
        allocator.tune()  # before ZeroMQ's I/O thread makes its first allocation
        self._context = context or transport_context(config)
        self._auth: Gatekeeper | None = None
        self.address = address
        self._refusals = RateLimitedLog(log, config.wait_log_seconds)
        bind_to = endpoint(address, bind=True, timeout=config.timeout)
        _unpredictable_routing_ids()
        sock = self._context.socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = False
        sock.maxmsgsize = config.max_message_bytes + wire.MAX_HEADER_BYTES
        if config.keys is not None:
            if config.keys.authorized_dir is None:
                sock.close()
                raise ValueError("keys without authorized_clients/: no client could connect")
            self._auth = Gatekeeper(
                self._context,
                config.keys.authorized_dir,
                refusals=self._refusals.warning,
                log=log.getChild("auth"),
            )
            self._auth.start()
            configure_server(sock, config.keys)
        try:
            _bind(sock, bind_to)
        except zmq.ZMQError as e:
            sock.close()
            if self._auth is not None:
                self._auth.stop()
            raise OSError(f"cannot listen on {address} ({bind_to}): {e}") from None
        # Handshakes that fail before the authenticator is asked (no address is known there).
        # Not the connections that close before a word (a TCP health check): no news there.
        self._monitor = Monitor("psflow-server-monitor", self._on_event)
        self._monitor.watch(
            address, sock, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_MONITOR_STOPPED
        )
        self._monitor.start()
        self._sock = sock
        self._sealed = self._sealed_socket(bind_to) if self._auth is not None else None
        if self._sealed is not None and self._auth is not None:
            self._auth.sealed_tokens = self._sealed.sessions.tokens
        # ZeroMQ's descriptor for the socket: readable when its events may have changed.
        self._events_fd = select.poll()
        self._events_fd.register(sock.getsockopt(zmq.FD), select.POLLIN)
        self._events_stale = True
        self._events_seen = 0.0
        self._pending: list[zmq.MessageTracker] = []
        self._lanes: OrderedDict[bytes, Lane] = OrderedDict()
        self._lane_of_fd: dict[int, tuple[bytes, Lane]] = {}
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._sockets_poller = zmq.Poller()
        self._sockets_poller.register(sock, zmq.POLLIN)
        if self._sealed is not None:
            self._poller.register(self._sealed, zmq.POLLIN)
            self._sockets_poller.register(self._sealed, zmq.POLLIN)
        self._ready: deque[Request] = deque()
        self._last_request = 0.0
        """When the last request was handed out (the doorbells' spin counts from it)."""
        self._looks = Looks()
        """Whether the next request has been coming within the spin time of the last."""

    def _sealed_socket(self, bind_to: str) -> seal.SealedRouter | None:
        """The sealed socket, bound to a port of the OS's choosing on the same interface, when
        this server seals (:mod:`psflow.transport.seal`)."""
        if not self.config.sealed:
            return None
        if not seal.available():
            log.warning(
                "no cryptography>=47: every byte stays inside CurveZMQ (pip install -U "
                "cryptography for the sealed socket)"
            )
            return None
        sock = self._context.socket(zmq.ROUTER, socket_class=seal.SealedRouter)
        sock.setup(self.config.max_message_bytes + wire.MAX_HEADER_BYTES)
        sock.linger = 0
        sock.router_mandatory = False
        sock.maxmsgsize = self.config.max_message_bytes + 2 * wire.MAX_HEADER_BYTES
        try:
            sock.bind(bind_to.rsplit(":", 1)[0] + ":*")
        except zmq.ZMQError as e:
            sock.close()
            log.warning("no sealed socket (%s): every byte stays inside CurveZMQ", e)
            return None
        return sock

    @property
    def sealed_port(self) -> int | None:
        """The port of the sealed socket, if this server has one."""
        if self._sealed is None:
            return None
        return int(self._sealed.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def _on_event(self, address: str, event: Event) -> None:
        # The monitor's thread.
        value = event["value"]
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            why = "it does not hold this server's public key (another job's keys?)"
        elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            why = (
                f"it connects without CurveZMQ keys ({envvars.PSFLOW_KEYS_DIR} unset on it?)"
                if self._auth is not None
                else f"it has CurveZMQ keys and this server none ({envvars.PSFLOW_KEYS_DIR} "
                "unset here?)"
            )
        else:
            try:
                name = zmq.Event(value).name
            except ValueError:
                name = str(value)
            why = f"ZeroMQ protocol error {name} (not a psflow task?)"
        self._refusals.warning(
            ("handshake", value), "a client failed its handshake on %s: %s", address, why
        )

    @property
    def queued(self) -> int:
        """Requests received and not yet handed out by :meth:`recv`."""
        return len(self._ready)

    def waiting(self) -> list[Request]:
        """The requests that have come and wait to be taken by :meth:`recv` (collected from
        the lanes and the socket now, without waiting), in the order it hands them out.

        Raises:
            wire.WireError: as :meth:`recv`, for a malformed message on the socket.
        """
        self._collect()
        return list(self._ready)

    def recv(self, timeout: float) -> Request | None:
        """The next request, or ``None`` after ``timeout`` seconds without one.

        Raises:
            wire.WireError: for a message whose header is malformed; the server sends the
                error reply (:attr:`~psflow.protocol.Code.MALFORMED`) itself when it knows
                whom to answer.
        """
        if self._ready:
            return self._ready.popleft()
        ms = max(1, int(timeout * 1000))
        if not self._lanes:
            self._events_stale = True
            if self._sealed is None or not self._sealed.sessions.opened:
                # The socket alone (no session yet, so no connection to the sealed socket): a
                # blocking receive, cheaper than a poll.
                if self._sock.rcvtimeo != ms:
                    self._sock.rcvtimeo = ms
                try:
                    parts = self._sock.recv_multipart(copy=False)
                except zmq.Again:
                    return None
                return self._from_socket(parts, self._sock)
            # The socket and the sealed socket.
            self._collect_sealed()
            if not self._ready and self._sockets_poller.poll(ms):
                self._collect_socket()
                self._collect_sealed()
            return self._ready.popleft() if self._ready else None
        if self._collect() or self._spin(timeout):
            return self._ready.popleft()
        # Asleep: each lane's client rings its FIFO (see the doorbells in transport.shm).
        lanes = list(self._lanes.values())
        for lane in lanes:
            lane.sleep_for_requests(True)
        try:
            if self._collect_lanes():
                return self._ready.popleft()
            # Events name file descriptors as they were when polled: handling one event may
            # close a lane and open another under the same numbers.
            lane_of_fd = dict(self._lane_of_fd)
            hung_up = []
            polled = self._poller.poll(ms)
            self._events_stale = True
            for what, events in polled:
                if what is self._sock:
                    self._collect_socket()
                    continue
                if what is self._sealed:
                    self._collect_sealed()
                    continue
                identity, lane = lane_of_fd[what]
                if lane.closed:
                    continue
                if events & _POLLIN:
                    lane.drain_requests()
                elif events & _POLLERR and not lane.has_request():
                    hung_up.append(identity)
            for identity in hung_up:
                log.debug("client %r has gone: dropping its lane", identity)
                self._drop_lane(identity)
            self._collect_lanes()
        finally:
            for lane in lanes:
                lane.sleep_for_requests(False)
        if self._ready:
            self._came()
            return self._ready.popleft()
        return None

    def _spin(self, timeout: float) -> bool:
        """Looks for requests for at most the spin time after the last one (and ``timeout``),
        yielding the core at every look; whether one came."""
        spin = self.config.spin_seconds
        if spin <= 0 or not self._looks.worth():
            return False
        now = time.monotonic()
        until = min(self._last_request + spin, now + timeout)
        while now < until:
            os.sched_yield()
            if self._collect():
                return True
            now = time.monotonic()
        return False

    def _collect(self) -> bool:
        """Queues every request that has come (lanes, then the socket), without waiting;
        whether any is queued."""
        self._collect_lanes()
        if self._socket_may_have() and self._sock.getsockopt(zmq.EVENTS) & _POLLIN:
            self._collect_socket()
        self._collect_sealed()
        if self._ready:
            self._came()
            return True
        return False

    def _came(self) -> None:
        """Requests have come: the time the next spin counts from, and whether this one came
        within the spin time of the last."""
        now = time.monotonic()
        self._looks.waited(now - self._last_request, spin=self.config.spin_seconds)
        self._last_request = now

    def _socket_may_have(self) -> bool:
        """Whether a message may wait on the socket, without asking ZeroMQ when its
        descriptor says nothing changed: asking (``ZMQ_EVENTS``) costs a system call and
        ZeroMQ's bookkeeping, about 15 us in a busy job, at every look of a spinning server.
        The descriptor is edge-triggered and any send or receive on the socket may take its
        signal, so each of those marks the events stale (the next look asks); a full look at
        least every :data:`_EVENTS_EVERY` seconds besides."""
        now = time.monotonic()
        if self._events_stale or self._events_fd.poll(0) or now - self._events_seen > _EVENTS_EVERY:
            self._events_stale = False
            self._events_seen = now
            return True
        return False

    def _collect_lanes(self) -> bool:
        for identity, lane in list(self._lanes.items()):
            if not lane.closed and lane.has_request():
                request = self._from_lane(identity, lane)
                if request is not None:
                    self._ready.append(request)
        return bool(self._ready)

    def _collect_socket(self) -> None:
        self._events_stale = True
        self._collect_from(self._sock)

    def _collect_sealed(self) -> None:
        # Before its first session nobody can connect to it: a look would cost a spinning
        # server a failed receive each time. (The socket's descriptor is the other socket's:
        # nothing here marks its events stale.)
        if self._sealed is not None and self._sealed.sessions.opened:
            self._collect_from(self._sealed)

    def _collect_from(self, sock: Any) -> None:
        while True:
            try:
                try:
                    parts = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                request = self._from_socket(parts, sock)
            except wire.WireError as e:
                if not self._ready:
                    raise
                # Answered already; the requests collected so far are served first.
                self._refusals.warning("malformed", "rejected a malformed message: %s", e)
                continue
            if request is not None:
                self._ready.append(request)

    def _from_socket(self, parts: list[Any], sock: Any) -> Request | None:
        identity = parts[0].bytes
        if len(parts) < 2:
            raise wire.WireError("message has no header frame")
        try:
            header = wire.decode_header(wire.frame_buffer(parts[1]))
        except Exception as e:  # WireError; anything else is a bug, still the sender's alone
            error = e if isinstance(e, wire.WireError) else wire.WireError(f"unreadable: {e!r}")
            self._send([identity, *_error(-1, str(error), Code.MALFORMED)], sock=sock)
            raise error from None
        op = header[_OP]
        if op == _ATTACH_LANE:
            self._attach(identity, header, sock)
            return None
        if op == _SEAL:
            self._open_session(identity, header, sock)
            return None
        return Request(identity=identity, header=header, frames=parts[2:], sock=sock)

    def _from_lane(self, identity: bytes, lane: Lane) -> Request | None:
        self._lanes.move_to_end(identity)
        try:
            header = wire.decode_header(lane.take_request())
        except Exception as e:  # WireError, LaneError; anything else is this client's alone too
            self._refusals.warning(
                "malformed-lane", "rejected a malformed message on %s: %s", lane, e
            )
            self._post(lane, identity, _error(-1, str(e), Code.MALFORMED))
            return None
        return Request(identity=identity, header=header, frames=[], lane=lane)

    def _open_session(self, identity: bytes, header: dict[str, Any], sock: Any) -> None:
        """Answers a client's request for a session on the sealed socket, through CurveZMQ
        only (its keys travel in the reply)."""
        rid = header[Key.ID]
        if sock is not self._sock or self._sealed is None:
            why = (
                "no sealed socket on this server"
                if self._sealed is None
                else "a session is asked for through the server's own socket"
            )
            self._send([identity, *_error(rid, why, Code.REFUSED)], sock=sock)
            return
        session, to_server, to_client, token = self._sealed.sessions.new()
        reply: dict[str, Any] = {
            Key.OP: Op.OK,
            Key.ID: rid,
            Key.SEAL_SESSION: session,
            Key.SEAL_KEYS: to_server + to_client,
            Key.SEAL_TOKEN: token,
            Key.SEAL_PORT: self.sealed_port,
        }
        self._send([identity, *wire.encode(reply)])

    def _attach(self, identity: bytes, header: dict[str, Any], sock: Any) -> None:
        """Maps a client's lane (its request to attach one is answered here, not above)."""
        rid = header[Key.ID]
        try:
            if not self.config.shared_memory:
                raise LaneError("shared memory is off on this server")
            if sock is not self._sock:
                raise LaneError("lanes are offered through the server's own socket")
            lane = Lane.attach(
                header.get(Key.LANE_NAME),
                header.get(Key.LANE_TOKEN),
                header.get(Key.LANE_REQUEST_BYTES),
                header.get(Key.LANE_REPLY_BYTES),
                max_bytes=self.config.max_message_bytes,
            )
        except Exception as e:  # LaneError, or an OS error no check foresaw: refused all the same
            message = f"no shared-memory lane: {e}"
            if not isinstance(e, LaneError):
                self._refusals.warning("attach", "refused a lane attach from %r: %r", identity, e)
            self._send([identity, *_error(rid, message, Code.REFUSED)], sock=sock)
            return
        self._drop_lane(identity)
        self._lanes[identity] = lane
        self._lane_of_fd[lane.requests_fd] = (identity, lane)
        self._poller.register(lane.requests_fd, zmq.POLLIN)
        while len(self._lanes) > _MAX_LANES:
            self._drop_lane(next(iter(self._lanes)))
        self._send([identity, *wire.encode({Key.OP: Op.OK, Key.ID: rid})], sock=sock)

    def _drop_lane(self, identity: bytes) -> None:
        lane = self._lanes.pop(identity, None)
        if lane is not None:
            self._poller.unregister(lane.requests_fd)
            del self._lane_of_fd[lane.requests_fd]
            lane.close()

    def close(self, linger: float = 0.0) -> None:
        """Closes the socket, giving queued replies up to ``linger`` seconds to leave."""
        self._sock.close(linger=int(linger * 1000))
        if self._sealed is not None:
            self._sealed.close(linger=int(linger * 1000))
        for identity in list(self._lanes):
            self._drop_lane(identity)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def _unpredictable_routing_ids() -> None:
    """Makes the routing ids a ROUTER made after this call hands out unpredictable.

    A ROUTER names each peer that does not choose its own routing id ``0x00`` + a 32-bit
    counter, and accepts a peer that chooses one of that form. When the counter reaches an id
    a peer claimed, libzmq aborts the whole process (``Assertion failed: ok
    (src/socket_base.cpp:2113)``; ``ZMQ_ROUTER_HANDOVER`` does not cover it). The counter
    starts at ``rand()``, which libzmq never seeds: every process's first ROUTER hands out
    ``0x006b8b4567`` then the next, so any peer could claim those and kill the server. Seeded
    from the OS's randomness, the counter's start is a secret 32-bit number: claiming the id
    the server will hand out next means guessing it (a wrong claim of an id in use is ignored
    by libzmq; one not in use is a client like any other).
    """
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError):  # no C library to reach: the counter stays predictable
        log.warning("cannot seed libzmq's routing ids: a peer could guess them")
