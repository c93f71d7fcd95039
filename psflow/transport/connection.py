"""Sockets: a server that answers requests, and a client with requests to many peers in flight.

The server is a ZeroMQ ROUTER bound to its own address; each client holds one DEALER per
peer. Every request carries an id, so a client can send to all ps shards at once and then
collect the replies in any order. Every wait has a deadline, and a peer that misses it is named
in the error.
"""

from __future__ import annotations

import logging
import os
import socket as pysocket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator

from psflow import allocator
from psflow import env as envvars
from psflow.cluster.spec import parse_address
from psflow.transport import wire
from psflow.transport.auth import CurveKeys, configure_client, configure_server
from psflow.transport.shm import Lane, LaneError

log = logging.getLogger(__name__)

_ZERO_COPY_ABOVE = 1 << 16
"""Messages smaller than this are copied into ZeroMQ: cheaper than tracking their frames."""


class PeerError(RuntimeError):
    """A peer failed: it answered with an error, or it did not answer in time."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"{peer}: {message}")
        self.peer = peer


class PeerTimeoutError(PeerError, TimeoutError):
    """A peer did not answer before the deadline (dead, hung, unreachable or not authorised)."""


class PeerLostError(PeerError):
    """A peer is gone (it hung up its shared-memory lane), came back without its state (a
    restarted ps that is not initialised), or had its state restored from a checkpoint since
    the request was made."""


UNINITIALIZED = "uninitialized"
"""The ``code`` of an error reply from a ps that has no variables (yet, or again)."""

RESTORED = "restored"
"""The ``code`` of an error reply to a request overtaken by a restore of the ps (its step, or
the synchronous step it waited for, is gone)."""

_LOST_CODES = (UNINITIALIZED, RESTORED)


@dataclass(kw_only=True)
class TransportConfig:
    """Settings shared by servers and clients."""

    timeout: float = field(
        default_factory=lambda: float(os.environ.get(envvars.PSFLOW_TIMEOUT, 60))
    )
    """Seconds a request may take before it fails with an error naming the peer."""
    max_message_bytes: int = 8 << 30
    """Largest message (sum of tensor bytes) a server accepts."""
    chunk_bytes: int = field(
        default_factory=lambda: (
            wire.WHOLE_TENSOR_CHUNK_BYTES if allocator.tune() else wire.DEFAULT_CHUNK_BYTES
        )
    )
    """Bytes per frame for large tensors: whole tensors with the tuned allocator."""
    keys: CurveKeys | None = None
    """CurveZMQ keys: when given, traffic is encrypted and clients must be authorised."""
    shared_memory: bool = field(
        default_factory=lambda: (
            os.environ.get(envvars.PSFLOW_SHM, "1").lower() not in ("0", "off", "false", "no")
        )
    )
    """Move large tensors through a shared-memory lane when client and server share a host
    (:mod:`psflow.transport.shm`); the socket otherwise."""

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")

    @classmethod
    def from_env(cls, **overrides: Any) -> TransportConfig:
        """Defaults, with keys from ``PSFLOW_KEYS_DIR`` when it is set."""
        keys_dir = os.environ.get(envvars.PSFLOW_KEYS_DIR)
        if keys_dir and "keys" not in overrides:
            overrides["keys"] = CurveKeys.load(keys_dir)
        return cls(**overrides)


def _endpoint(address: str, *, bind: bool, timeout: float = 0.0) -> str:
    host, port = parse_address(address)
    if bind and host not in ("*", "0.0.0.0", "::"):
        # A task's own DNS name (a Kubernetes headless Service) can appear a little after the
        # task starts: keep trying for up to ``timeout`` seconds.
        deadline = time.monotonic() + timeout
        while True:
            try:
                host = pysocket.gethostbyname(host)
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise ValueError(f"cannot resolve {host!r} to bind {address!r}: {e}") from None
                time.sleep(0.5)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass
class Request:
    """One request received by a :class:`Server`."""

    identity: bytes
    header: dict[str, Any]
    frames: list[Any]
    lane: Lane | None = None
    """The shared-memory lane it came through (its reply goes back the same way)."""


_POLLIN = int(zmq.POLLIN)
_POLLERR = int(zmq.POLLERR)
"""Poll events as plain ints: a test against pyzmq's enum costs a microsecond per request."""

_MIN_LANE_BYTES = wire.INLINE_BYTES
"""Each lane area holds at least this much: a small model's tensors never need a new lane."""

_MAX_LANES = 64
"""Lanes a server keeps (one per client); the least recently used goes first."""


class Server:
    """A ROUTER socket bound to one address, answering requests one at a time.

    Clients on the same host may also attach shared-memory lanes (:mod:`psflow.transport.shm`):
    :meth:`recv` then waits on the socket and on every lane at once.
    """

    def __init__(
        self, address: str, config: TransportConfig, *, context: zmq.Context[Any] | None = None
    ) -> None:
        self.config = config
        allocator.tune()  # before ZeroMQ's I/O thread makes its first allocation
        self._context = context or zmq.Context.instance()
        self._auth: ThreadAuthenticator | None = None
        bind_to = _endpoint(address, bind=True, timeout=config.timeout)
        sock = self._context.socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = False
        sock.maxmsgsize = config.max_message_bytes + wire.MAX_HEADER_BYTES
        if config.keys is not None:
            self._auth = ThreadAuthenticator(self._context, log=log.getChild("auth"))
            self._auth.start()
            location = str(config.keys.authorized_dir) if config.keys.authorized_dir else None
            if location is None:
                raise ValueError("keys without authorized_clients/: no client could connect")
            self._auth.configure_curve(domain="*", location=location)
            configure_server(sock, config.keys)
        try:
            sock.bind(bind_to)
        except zmq.ZMQError as e:
            sock.close()
            if self._auth is not None:
                self._auth.stop()
            raise OSError(f"cannot listen on {address} ({bind_to}): {e}") from None
        self._sock = sock
        self._pending: list[zmq.MessageTracker] = []
        self._lanes: OrderedDict[bytes, Lane] = OrderedDict()
        self._lane_of_fd: dict[int, tuple[bytes, Lane]] = {}
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._ready: deque[Request] = deque()

    def recv(self, timeout: float) -> Request | None:
        """The next request, or ``None`` after ``timeout`` seconds without one.

        Raises:
            wire.WireError: for a message whose header is malformed; the server sends the
                error reply itself when it knows whom to answer.
        """
        if self._ready:
            return self._ready.popleft()
        ms = max(1, int(timeout * 1000))
        if not self._lanes:
            # The socket alone: a blocking receive, cheaper than a poll.
            if self._sock.rcvtimeo != ms:
                self._sock.rcvtimeo = ms
            try:
                parts = self._sock.recv_multipart(copy=False)
            except zmq.Again:
                return None
            return self._from_socket(parts)
        # Events name file descriptors as they were when polled: handling one event may
        # close a lane and open another under the same numbers.
        lane_of_fd = dict(self._lane_of_fd)
        for what, events in self._poller.poll(ms):
            if what is self._sock:
                try:
                    parts = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                try:
                    request = self._from_socket(parts)
                except wire.WireError as e:
                    if not self._ready:
                        raise
                    # Answered already; the requests collected so far are served first.
                    log.warning("rejected a malformed message: %s", e)
                    continue
                if request is not None:
                    self._ready.append(request)
            else:
                identity, lane = lane_of_fd[what]
                if lane.closed:
                    continue
                if events & _POLLIN:
                    request = self._from_lane(identity, lane)
                    if request is not None:
                        self._ready.append(request)
                elif events & _POLLERR:
                    log.debug("client %r has gone: dropping %s", identity, lane)
                    self._drop_lane(identity)
        return self._ready.popleft() if self._ready else None

    def _from_socket(self, parts: list[Any]) -> Request | None:
        identity = parts[0].bytes
        if len(parts) < 2:
            raise wire.WireError("message has no header frame")
        try:
            header = wire.decode_header(parts[1].buffer)
        except wire.WireError as e:
            self._send_error(identity, -1, str(e))
            raise
        if header["op"] == "_lane":
            self._attach(identity, header)
            return None
        return Request(identity=identity, header=header, frames=parts[2:])

    def _from_lane(self, identity: bytes, lane: Lane) -> Request | None:
        self._lanes.move_to_end(identity)
        try:
            header = wire.decode_header(lane.take_request())
        except (wire.WireError, LaneError) as e:
            log.warning("rejected a malformed message on %s: %s", lane, e)
            self._post(lane, identity, wire.encode({"op": "error", "id": -1, "error": str(e)}))
            return None
        return Request(identity=identity, header=header, frames=[], lane=lane)

    def _attach(self, identity: bytes, header: dict[str, Any]) -> None:
        """Maps a client's lane (its request to attach one is answered here, not above)."""
        try:
            if not self.config.shared_memory:
                raise LaneError("shared memory is off on this server")
            lane = Lane.attach(
                header.get("name"), header.get("token"), header.get("req"), header.get("rep")
            )
        except LaneError as e:
            self._send_error(identity, header["id"], f"no shared-memory lane: {e}")
            return
        self._drop_lane(identity)
        self._lanes[identity] = lane
        self._lane_of_fd[lane.requests_fd] = (identity, lane)
        self._poller.register(lane.requests_fd, zmq.POLLIN)
        while len(self._lanes) > _MAX_LANES:
            self._drop_lane(next(iter(self._lanes)))
        self._sock.send_multipart([identity, *wire.encode({"op": "ok", "id": header["id"]})])

    def _drop_lane(self, identity: bytes) -> None:
        lane = self._lanes.pop(identity, None)
        if lane is not None:
            self._poller.unregister(lane.requests_fd)
            del self._lane_of_fd[lane.requests_fd]
            lane.close()

    def tensors(
        self,
        request: Request,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        transient: bool = False,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors of ``request``, validated (see :func:`wire.decode_tensors`).

        With ``transient``, tensors that came through a lane may be views of it: valid until
        the reply to ``request`` is sent.
        """
        lane = request.lane
        return wire.decode_tensors(
            request.header,
            request.frames,
            max_bytes=self.config.max_message_bytes,
            into=into,
            area=lane.request if lane is not None else None,
            transient=transient,
            views=lane.request_views if lane is not None else None,
        )

    def reply(
        self,
        request: Request,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] | wire.TensorSet = (),
    ) -> None:
        """Answers ``request``; tensors are sent from their own memory, without a copy.

        A request that came through a lane is answered through it, its tensors copied there,
        when they are a :class:`wire.TensorSet` (or small enough to travel inline): a lane's
        reply area only ever holds that one set, each tensor always at the same place, so a
        client may keep using them there (its model's parameters) until its next request.
        Other tensors, and a set too large for the lane, go by socket, and the lane says so.
        """
        header["id"] = request.header["id"]
        lane = request.lane
        if lane is not None:
            if lane.closed:
                # Replaced or evicted since: its client gave up on this request.
                log.debug("dropped the reply to %s: its lane is gone", request.header["op"])
                return
            whole_set = isinstance(tensors, wire.TensorSet)
            fixed = whole_set or _payload(tensors) <= wire.INLINE_BYTES
            if fixed:
                # Other tensors never enter the reply area: small ones travel in the header.
                frames = wire.encode(dict(header), tensors, area=lane.reply if whole_set else None)
                if len(frames) == 1 and lane.post_reply(frames[0]):
                    return
            note = {"op": "_socket", "id": header["id"], "need": _payload(tensors) if fixed else 0}
            self._post(lane, request.identity, wire.encode(note))
        frames = wire.encode(header, tensors, chunk=self.config.chunk_bytes)
        size = sum(len(f) for f in frames[1:])
        msg = [request.identity, *frames]
        if size < _ZERO_COPY_ABOVE:
            self._sock.send_multipart(msg, copy=True)
        else:
            self._pending.append(self._sock.send_multipart(msg, copy=False, track=True))

    def send_error(self, request: Request, message: str, code: str | None = None) -> None:
        """Answers ``request`` with an error (``code``: what kind, for the client to act on)."""
        header = {"op": "error", "id": request.header["id"], "error": message}
        if code is not None:
            header["code"] = code
        frames = wire.encode(header)
        if request.lane is not None:
            self._post(request.lane, request.identity, frames)
        else:
            self._sock.send_multipart([request.identity, *frames])

    def _send_error(self, identity: bytes, rid: int, message: str) -> None:
        frames = wire.encode({"op": "error", "id": rid, "error": message})
        self._sock.send_multipart([identity, *frames])

    def _post(self, lane: Lane, identity: bytes, frames: list[Any]) -> None:
        if not lane.post_reply(frames[0]):  # closed since: its client gave up
            log.debug("cannot answer %r on %s", identity, lane)

    def flush(self, timeout: float) -> None:
        """Waits until ZeroMQ has sent every tensor handed to :meth:`reply`.

        Call it before changing tensors that were sent without a copy.
        """
        if not self._pending:
            return
        deadline = time.monotonic() + timeout
        for tracker in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not _wait(tracker, left):
                raise TimeoutError(f"a reply was not sent within {timeout} s")
        self._pending.clear()

    def close(self, linger: float = 0.0) -> None:
        """Closes the socket, giving queued replies up to ``linger`` seconds to leave."""
        self._sock.close(linger=int(linger * 1000))
        for identity in list(self._lanes):
            self._drop_lane(identity)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def _payload(tensors: Sequence[tuple[str, torch.Tensor]] | wire.TensorSet) -> int:
    """Lane bytes that ``tensors`` need."""
    if isinstance(tensors, wire.TensorSet):
        return tensors.layout.lane_bytes
    return wire.lane_bytes(t.nbytes for _, t in tensors)


def _wait(tracker: zmq.MessageTracker, timeout: float) -> bool:
    try:
        tracker.wait(timeout)
    except zmq.NotDone:
        return False
    return True


class Client:
    """Requests to a fixed list of peers, many in flight at once.

    A peer on the same host is reached through a shared-memory lane
    (:mod:`psflow.transport.shm`) once it has answered once over the socket, when no other
    request to it is in flight; everything else goes through the socket.

    Example:
        >>> client = Client({"ps:0": "127.0.0.1:2222"}, TransportConfig(timeout=5))
        >>> # rid = client.send("ps:0", {"op": "pull"}); client.wait([rid])
        >>> client.close()
    """

    def __init__(
        self,
        peers: dict[str, str],
        config: TransportConfig,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.config = config
        allocator.tune()  # before ZeroMQ's I/O thread makes its first allocation
        self._context = context or zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._peer_of: dict[zmq.Socket[bytes], str] = {}
        self._addresses = dict(peers)
        self._next_id = 1
        self._inflight: dict[int, str] = {}  # through the socket
        self._lanes: dict[str, Lane] = {}
        self._lane_inflight: dict[int, str] = {}  # through a lane
        self._lane_need: dict[str, int] = {}  # the largest reply seen from each peer
        self._no_lane: set[str] = set() if config.shared_memory else set(peers)
        self._lane_retired: list[Callable[[np.ndarray[Any, Any]], None]] = []
        self._answered: set[str] = set()
        for name, address in peers.items():
            sock = self._context.socket(zmq.DEALER)
            sock.linger = 0
            # A DEALER with no live peer (down, or refused by CurveZMQ) blocks its sends.
            sock.sndtimeo = int(config.timeout * 1000)
            if config.keys is not None:
                configure_client(sock, config.keys)
            sock.connect(_endpoint(address, bind=False))
            self._socks[name] = sock
            self._peer_of[sock] = name

    @property
    def peers(self) -> list[str]:
        return list(self._socks)

    def on_lane_retired(self, callback: Callable[[np.ndarray[Any, Any]], None]) -> None:
        """Registers ``callback``, called with a lane's reply area when a timed-out request
        leaves it to a server that may still write there: views of it taken with
        ``lane_views`` must move out."""
        self._lane_retired.append(callback)

    def lane(self, peer: str) -> Lane | None:
        """The shared-memory lane to ``peer``, if one is attached."""
        return self._lanes.get(peer)

    def send(
        self,
        peer: str,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] | wire.TensorSet = (),
        layout: wire.Layout | None = None,
    ) -> int:
        """Sends one request to ``peer`` and returns its id, without waiting for the reply.

        The tensors must stay unchanged until the reply has arrived. ``layout``: what they
        usually look like (a step's gradients), to spare describing them again.
        """
        if peer in self._no_lane:
            lane = None
        else:
            need = layout.lane_bytes if layout is not None else _payload(tensors)
            lane = self._lane_for(peer, need)
        rid = self._next_id
        self._next_id += 1
        header["id"] = rid
        if lane is not None:
            frames = wire.encode(dict(header), tensors, area=lane.request, layout=layout)
            if len(frames) == 1 and lane.post_request(frames[0]):
                self._lane_inflight[rid] = peer
                return rid
        frames = wire.encode(header, tensors, chunk=self.config.chunk_bytes)
        self._send(peer, frames)
        self._inflight[rid] = peer
        return rid

    def _send(self, peer: str, frames: list[Any]) -> None:
        size = sum(len(f) for f in frames[1:])
        try:
            self._socks[peer].send_multipart(frames, copy=size < _ZERO_COPY_ABOVE)
        except zmq.Again:
            raise PeerTimeoutError(
                f"{peer} at {self._addresses[peer]}",
                f"could not send within {self.config.timeout:g} s (down, or not authorised?)",
            ) from None

    def _lane_for(self, peer: str, need: int) -> Lane | None:
        """The lane for a request to ``peer`` with ``need`` bytes of tensors, attached or grown
        when needed.

        None before ``peer`` has answered over the socket (it may not be up yet), and while
        another request to it is in flight (a lane carries one request at a time).
        """
        if peer not in self._answered:
            return None
        if peer in self._inflight.values() or peer in self._lane_inflight.values():
            return None
        need = max(need, _MIN_LANE_BYTES)
        lane = self._lanes.get(peer)
        reply_need = self._lane_need.get(peer, 0)
        if lane is None or lane.request_bytes < need or lane.reply_bytes < reply_need:
            old = (lane.request_bytes, lane.reply_bytes) if lane is not None else (0, 0)
            # A push is usually answered with parameters of its own size.
            lane = self._attach(peer, max(need, old[0]), max(reply_need, need, old[1]))
        return lane

    def _attach(self, peer: str, request_bytes: int, reply_bytes: int) -> Lane | None:
        self._drop_lane(peer)
        try:
            lane = Lane.create(request_bytes, reply_bytes)
        except LaneError as e:
            log.info("%s: %s; requests go through the socket", peer, e)
            self._no_lane.add(peer)
            return None
        try:
            rid = self._next_id
            self._next_id += 1
            header = {
                "op": "_lane",
                "id": rid,
                "name": lane.name,
                "token": lane.token,
                "req": request_bytes,
                "rep": reply_bytes,
            }
            self._send(peer, wire.encode(header))
            self._inflight[rid] = peer
            self.wait([rid])
        except PeerTimeoutError:
            lane.close()
            raise
        except PeerError as e:
            log.info("%s; requests go through the socket", e)
            self._no_lane.add(peer)
            lane.close()
            return None
        finally:
            lane.unlink()
        log.debug("%s: attached %s", peer, lane)
        self._lanes[peer] = lane
        return lane

    def _drop_lane(self, peer: str) -> None:
        lane = self._lanes.pop(peer, None)
        if lane is not None:
            lane.close()

    def wait(
        self,
        rids: Iterable[int],
        timeout: float | None = None,
        *,
        into: dict[str, torch.Tensor] | None = None,
        lane_views: bool = False,
    ) -> dict[int, tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]]:
        """The replies to ``rids`` (header and tensors), keyed by request id.

        Large tensors named in ``into`` are received straight into those tensors. With
        ``lane_views``, tensors that came through a lane are views of it instead: the server's
        next reply through that lane rewrites them in place (see :meth:`Server.reply`), and
        :attr:`on_lane_retired` hears of a lane a late reply might still write into.

        Raises:
            PeerTimeoutError: naming each peer that has not answered by the deadline.
            PeerError: when a peer answered with an error or with a malformed message.
        """
        want = set(rids)
        out: dict[int, tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]] = {}
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while want:
            left = deadline - time.monotonic()
            if left <= 0:
                self._timeout(want, timeout)
            on_lanes = [r for r in want if r in self._lane_inflight]
            if len(want) == 1:
                # One request (one ps shard): a blocking wait on its lane or its socket.
                (rid,) = want
                if on_lanes:
                    peer = self._lane_inflight[rid]
                    lane = self._lanes[peer]
                    try:
                        rang = lane.wait_reply(left)
                    except LaneError as e:
                        self._lost(peer, e)
                    if rang:
                        self._take_lane(peer, lane, want, out, into, lane_views)
                    continue
                sock = self._socks[self._inflight[rid]]
                sock.rcvtimeo = max(1, int(left * 1000))
                try:
                    parts = sock.recv_multipart(copy=False)
                except zmq.Again:
                    continue
                self._take(sock, parts, want, out, into)
                continue
            poller = zmq.Poller()
            lane_of_fd = {}
            for rid in on_lanes:
                peer = self._lane_inflight[rid]
                lane = self._lanes[peer]
                lane_of_fd[lane.replies_fd] = (peer, lane)
                poller.register(lane.replies_fd, zmq.POLLIN)
            for peer in {self._inflight[r] for r in want if r in self._inflight}:
                poller.register(self._socks[peer], zmq.POLLIN)
            for what, events in poller.poll(max(1, int(left * 1000))):
                if isinstance(what, int):
                    if not events & _POLLIN:  # hung up
                        self._lost(lane_of_fd[what][0], LaneError("the other side hung up"))
                    self._take_lane(*lane_of_fd[what], want, out, into, lane_views)
                    continue
                while True:
                    try:
                        parts = what.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._take(what, parts, want, out, into)
        return out

    def _lost(self, peer: str, error: LaneError) -> NoReturn:
        for rid in [r for r, p in self._lane_inflight.items() if p == peer]:
            del self._lane_inflight[rid]
        self._drop_lane(peer)
        raise PeerLostError(f"{peer} at {self._addresses[peer]}", f"{error} (it exited?)")

    def _timeout(self, want: set[int], timeout: float) -> NoReturn:
        late = set()
        for r in want:
            peer = self._inflight.pop(r, None)
            if peer is None:
                peer = self._lane_inflight.pop(r)
                # Its server may still read or write the lane later: never use it again.
                lane = self._lanes.get(peer)
                if lane is not None:
                    for callback in self._lane_retired:
                        callback(lane.reply)
                self._drop_lane(peer)
            late.add(peer)
        names = ", ".join(f"{p} at {self._addresses[p]}" for p in sorted(late))
        raise PeerTimeoutError(
            names, f"no answer within {timeout:g} s (dead, hung, unreachable or not authorised?)"
        )

    def _take(
        self,
        sock: zmq.Socket[bytes],
        parts: list[Any],
        want: set[int],
        out: dict[int, tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]],
        into: dict[str, torch.Tensor] | None,
    ) -> None:
        """Files one reply from a socket under its request id (dropping stale ones)."""
        peer = self._peer_of[sock]
        self._answered.add(peer)
        try:
            header = wire.decode_header(parts[0].buffer)
        except wire.WireError as e:
            raise PeerError(peer, f"malformed reply: {e}") from None
        rid = header["id"]
        if rid not in want:
            return  # the reply to a request that already timed out
        want.discard(rid)
        self._inflight.pop(rid, None)
        self._lane_inflight.pop(rid, None)  # moved to the socket; the lane's note comes later
        self._finish(peer, rid, header, parts[1:], None, out, into, False)

    def _take_lane(
        self,
        peer: str,
        lane: Lane,
        want: set[int],
        out: dict[int, tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]],
        into: dict[str, torch.Tensor] | None,
        lane_views: bool,
    ) -> None:
        """Files the reply that ``lane`` rang for."""
        try:
            header = wire.decode_header(lane.take_reply())
        except (wire.WireError, LaneError) as e:
            raise PeerError(peer, f"malformed reply: {e}") from None
        rid = header["id"]
        if rid == -1 and header["op"] == "error":
            # The server could not read the request at all: it answers whatever was in flight.
            rid = next((r for r, p in self._lane_inflight.items() if p == peer), -1)
        if self._lane_inflight.get(rid) != peer or rid not in want:
            return  # a ring for a reply already taken from the socket
        del self._lane_inflight[rid]
        self._answered.add(peer)
        if header["op"] == "_socket":
            need = header.get("need")
            if isinstance(need, int) and not isinstance(need, bool):
                self._lane_need[peer] = max(self._lane_need.get(peer, 0), need)
            self._inflight[rid] = peer  # too large for the lane: it comes by socket
            return
        want.discard(rid)
        self._finish(peer, rid, header, [], lane, out, into, lane_views)

    def _finish(
        self,
        peer: str,
        rid: int,
        header: dict[str, Any],
        frames: list[Any],
        lane: Lane | None,
        out: dict[int, tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]],
        into: dict[str, torch.Tensor] | None,
        lane_views: bool,
    ) -> None:
        if header["op"] == "error":
            message = str(header.get("error", "unknown error"))
            if header.get("code") in _LOST_CODES:
                raise PeerLostError(peer, message)
            raise PeerError(peer, message)
        try:
            tensors = wire.decode_tensors(
                header,
                frames,
                max_bytes=self.config.max_message_bytes,
                into=into,
                area=lane.reply if lane is not None else None,
                transient=lane_views,
                views=lane.reply_views if lane is not None else None,
            )
        except wire.WireError as e:
            raise PeerError(peer, f"malformed reply: {e}") from None
        if "c" in header and peer not in self._no_lane:
            need = wire.lane_bytes(t.nbytes for _, t in tensors)
            self._lane_need[peer] = max(self._lane_need.get(peer, 0), need)
        out[rid] = (header, tensors)

    def request(
        self,
        peer: str,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] = (),
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
        """One request and its reply."""
        rid = self.send(peer, header, tensors)
        return self.wait([rid], timeout)[rid]

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        for peer in list(self._lanes):
            self._drop_lane(peer)
