"""How a client receives: what it knows of each peer, and the wait for the replies to its
requests, on lanes and sockets at once, until a deadline that names the peers that miss it.

:class:`Receiver` is the half of :class:`~psflow.transport.client.Client` that waits for
replies; the client, which connects and sends, sets the attributes it declares.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import numpy as np
import torch
import zmq

from psflow import env as envvars
from psflow.protocol.messages import IN_REQUEST_AREA, Key, Op
from psflow.transport import wire
from psflow.transport.config import TransportConfig
from psflow.transport.errors import PeerError, PeerLostError, PeerTimeoutError
from psflow.transport.looks import Looks
from psflow.transport.monitor import Link
from psflow.transport.seal import SealError
from psflow.transport.shm import Lane, LaneError

log = logging.getLogger("psflow.transport.client")

# Bound once, as plain strings, for the per-request path (see wire/encoding.py).
_OP = Key.OP.value
_ID = Key.ID.value
_CHUNK = Key.CHUNK.value
_ERROR = Op.ERROR.value
_USE_SOCKET = Op.USE_SOCKET.value

_POLLIN = int(zmq.POLLIN)
"""A poll event as a plain int: a test against pyzmq's enum costs a microsecond per request."""

_DROP_CHECK_SECONDS = 0.2
"""A wait on one socket wakes at least this often to see whether its connection closed."""

SEAL_FROM_BYTES = 64 << 10
"""A peer's requests move to its sealed socket once one request or reply to it carried this many
tensor bytes. Sealing costs each message some Python: the linear regression's worker spent
about 57 us more CPU a step sealed (a seal and an open), and ran 2,750-2,800 steps/s through
the socket against 3,621 inside CurveZMQ; CurveZMQ's cipher costs about 1.2 ns a byte more (four
passes at 2.9 GB/s against AES's 18), so sealing pays from about 100 KB a round trip
(session 37)."""

SEAL_BREAKS = 2
"""Sessions on a peer's sealed socket that broke in a row (an answer that did not open, or a
connection refused before any) after which its client asks it for no more (its sealed port may
lead elsewhere: a host's port mapped to another process)."""

_NAP_SECONDS = 0.05
"""A wait on several peers asleep looks at the lanes' counts again at least this often (see
the doorbells in transport.shm)."""

Reply = tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]
"""A reply: its header and its tensors."""


@dataclass(eq=False, slots=True)
class _SealedLink:
    """A peer's sealed socket (:mod:`psflow.transport.seal`), as this client knows it."""

    sock: Any
    """Its :class:`~psflow.transport.seal.SealedDealer`."""
    endpoint: str | None = None
    """Where it is connected: the port the last session named (``None``: no session)."""
    began: float = 0.0
    """When that session began (``time.monotonic``)."""
    connected: bool = False
    """Its handshake with the server succeeded (the monitor's thread sets it)."""
    lost: bool = False
    """Its connection closed (the monitor's thread sets it)."""
    reported: bool = False
    """Whether its failure to connect has been logged."""
    breaks: int = 0
    """Its sessions that broke since an answer last opened (see :data:`SEAL_BREAKS`)."""


@dataclass(eq=False, slots=True)
class _Peer:
    """One peer, as this client knows it."""

    name: str
    address: str
    sock: zmq.Socket[bytes]
    """The socket its requests travel on: :attr:`own_sock`, or its sealed socket's."""
    lanes_allowed: bool
    """Whether its requests may go through a lane (shared memory is on, and no attempt failed)."""
    lane: Lane | None = None
    reply_need: int = 0
    """Lane bytes its largest reply needed: a new lane's reply area holds at least that."""
    answered: bool = False
    """Whether it has answered once (it is up: a lane may be offered to it)."""
    inflight: set[int] = field(default_factory=set)
    """Its requests in flight (a lane carries one request at a time)."""
    link: Link = field(default_factory=Link)
    """What its connection's monitor said, until it first answered."""
    drops: int = 0
    """Its connections that closed since it first answered (the monitor counts them): a
    request sent by socket before one can have no reply."""
    own_sock: Any = None
    """The socket connected to its address (through CurveZMQ, with keys)."""
    sealed: _SealedLink | None = None
    """Its sealed socket, with CurveZMQ keys and ``PSFLOW_SEALED`` on."""
    large: bool = False
    """Whether a request or reply of at least :data:`SEAL_FROM_BYTES` has gone between them."""

    def __str__(self) -> str:
        return f"{self.name} at {self.address}"


class _Wait:
    """What one :meth:`Client.wait` collects: the requests still awaited, and the replies."""

    __slots__ = ("into", "into_of", "lane_views", "replies", "request_views", "want")

    def __init__(
        self,
        rids: Iterable[int],
        into: dict[str, torch.Tensor] | None,
        lane_views: bool,
        into_of: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        request_views: bool = False,
    ) -> None:
        self.want = set(rids)
        self.replies: dict[int, Reply] = {}
        self.into = into
        self.into_of = into_of
        self.lane_views = lane_views
        self.request_views = request_views


class Receiver:
    """The receiving half of a :class:`~psflow.transport.client.Client`."""

    config: TransportConfig
    _inflight: dict[int, tuple[_Peer, bool]]
    """Each request in flight: its peer, and whether it went through the peer's lane."""
    _lane_retired: list[Callable[[np.ndarray[Any, Any]], None]]
    """Called with a lane's reply area when a late reply may still write there."""
    _sent_at_drops: dict[int, int]
    """Each request in flight by socket: its peer's :attr:`_Peer.drops` when it was sent."""
    _looks: Looks
    """Whether the waits for several replies at once have been ending within the spin time
    (a wait on one lane keeps the lane's own)."""

    def _drop_lane(self, peer: _Peer) -> None:
        if peer.lane is not None:
            peer.lane.close()
            peer.lane = None

    def wait(
        self,
        rids: Iterable[int],
        timeout: float | None = None,
        *,
        into: dict[str, torch.Tensor] | None = None,
        lane_views: bool = False,
        into_of: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        request_views: bool = False,
    ) -> dict[int, Reply]:
        """The replies to ``rids`` (header and tensors), keyed by request id.

        Large tensors named in ``into`` are received straight into those tensors
        (``into_of[rid]`` instead, for the reply to ``rid``, where given). With
        ``lane_views``, tensors that came through a lane are views of it instead: the server's
        next reply through that lane rewrites them in place (see :meth:`Server.reply`), and
        the callbacks given to :meth:`on_lane_retired` hear of a lane a late reply might still
        write into. With ``request_views``, tensors a server wrote into a lane's request area
        (a lookup's rows) are views of it, not copies: the client's next request through that
        lane overwrites them, so the caller is done with them before it sends another.

        Raises:
            PeerTimeoutError: naming each peer that has not answered by the deadline.
            PeerLostError: when a peer hung up the lane a request went through (it exited).
            PeerError: when a peer answered with an error (its :attr:`~PeerError.code` is the
                reply's) or with a malformed message.
        """
        w = _Wait(rids, into, lane_views, into_of, request_views)
        timeout = self.config.timeout if timeout is None else timeout
        begun = time.monotonic()
        deadline = begun + timeout
        several = len(w.want) > 1
        look = self._looks.worth()
        while w.want:
            left = deadline - time.monotonic()
            if left <= 0:
                self._timeout(w.want, timeout)
            arrivals = self._arrivals(w.want, left, look)
            for peer, parts in arrivals:
                self._take(peer, parts, w)
            if not arrivals:
                self._dropped(w)
        if several:  # a wait on one lane counts in that lane's odds (Lane.wait_reply)
            self._looks.waited(time.monotonic() - begun, spin=self.config.spin_seconds)
        return w.replies

    def _arrivals(
        self, want: set[int], left: float, look: bool = True
    ) -> Sequence[tuple[_Peer, list[Any] | None]]:
        """Waits up to ``left`` seconds for messages that may answer ``want``: each is its
        peer, with the message's frames when it came by socket (``None``: by lane). Several
        lanes are looked at before it sleeps with ``look`` (their whole wait's odds: the first
        reply of a step may be the late one, the others' soon after).

        Raises:
            PeerLostError: when a lane a request went through has been hung up.
        """
        spin = self.config.spin_seconds
        if len(want) == 1:
            # One request (one ps shard): a blocking wait on its lane or its socket.
            (rid,) = want
            peer, by_lane = self._inflight[rid]
            if by_lane:
                assert peer.lane is not None
                try:
                    # Awake now and then: a silent link is seen here (_dropped), not at the end.
                    rang = peer.lane.wait_reply(min(left, _DROP_CHECK_SECONDS), spin)
                except LaneError as e:
                    self._lost(peer, e)
                return ((peer, None),) if rang else ()
            sock = peer.sock
            # Awake now and then: a closed connection is seen here (_dropped), not at the end.
            sock.rcvtimeo = max(1, int(min(left, _DROP_CHECK_SECONDS) * 1000))
            try:
                parts = self._received(peer, sock, 0)
            except zmq.Again:
                return ()
            return ((peer, parts),) if parts is not None else ()
        lanes: dict[int, _Peer] = {}
        socks: dict[zmq.Socket[bytes], _Peer] = {}
        for rid in want:
            peer, by_lane = self._inflight[rid]
            if by_lane:
                assert peer.lane is not None
                lanes[peer.lane.replies_fd] = peer
            elif peer.sock not in socks:
                socks[peer.sock] = peer
        arrivals = self._arrived(lanes, socks)
        if arrivals:
            return arrivals
        # The doorbells (transport.shm): look at the lanes for a while, yielding the core, then
        # sleep. Not at sockets: their messages come through ZeroMQ's I/O threads, which need
        # the cores a look would take.
        until = time.monotonic() + (min(spin, left) if look and not socks else 0.0)
        while not arrivals and time.monotonic() < until:
            os.sched_yield()
            arrivals = self._arrived(lanes, socks)
        if arrivals:
            return arrivals
        poller = zmq.Poller()
        for fd in lanes:
            poller.register(fd, zmq.POLLIN)
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        for peer in lanes.values():
            peer.lane.sleep_for_replies(True)  # type: ignore[union-attr]
        try:
            arrivals = self._arrived(lanes, {})
            if arrivals:
                return arrivals
            for what, events in poller.poll(max(1, int(min(left, _NAP_SECONDS) * 1000))):
                if isinstance(what, int):
                    lane = lanes[what].lane
                    assert lane is not None
                    lane.drain_replies()
                    if not events & _POLLIN and not lane.has_reply():  # hung up
                        self._lost(lanes[what], LaneError("the other side hung up"))
        finally:
            for peer in lanes.values():
                if peer.lane is not None:
                    peer.lane.sleep_for_replies(False)
        return self._arrived(lanes, socks)

    def _arrived(
        self, lanes: Mapping[int, _Peer], socks: Mapping[zmq.Socket[bytes], _Peer]
    ) -> list[tuple[_Peer, list[Any] | None]]:
        """The replies that have come, without waiting: each lane's, and every message
        waiting on the sockets."""
        arrivals: list[tuple[_Peer, list[Any] | None]] = []
        for peer in lanes.values():
            lane = peer.lane
            if lane is not None and lane.has_reply():
                arrivals.append((peer, None))
        for sock, peer in socks.items():
            while True:
                try:
                    parts = self._received(peer, sock, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if parts is None:
                    break
                arrivals.append((peer, parts))
        return arrivals

    @staticmethod
    def _received(peer: _Peer, sock: Any, flags: int) -> list[Any] | None:
        """A message from ``sock``, ``peer``'s socket; ``None`` when its sealed socket got one
        that does not open: its session is given up as a closed connection is (what was sent
        on it fails as lost, :meth:`_dropped`; the next request goes inside CurveZMQ).

        Raises:
            zmq.Again: when none has come (within the socket's receive timeout).
        """
        try:
            parts: list[Any] = sock.recv_multipart(flags, copy=False)
        except SealError as e:
            sealed = peer.sealed
            assert sealed is not None
            sealed.breaks += 1
            sealed.lost = True
            peer.drops += 1
            log.warning(
                "%s: %s; %s",
                peer,
                e,
                "its sealed socket is given up"
                if sealed.breaks >= SEAL_BREAKS
                else "back inside CurveZMQ for a new session",
            )
            return None
        sealed = peer.sealed
        if sealed is not None and sealed.breaks and sock is sealed.sock:
            sealed.breaks = 0  # an answer opened: its sessions work
        return parts

    def _take(self, peer: _Peer, parts: list[Any] | None, w: _Wait) -> None:
        """Files one message from ``peer`` (``parts`` from its socket, or ``None``: the reply
        its lane rang for) as the reply to its request, dropping stale ones."""
        if not peer.answered:
            peer.answered = True
            peer.link = Link()  # it is up: from now on its monitor counts its closed connections
        lane = None if parts is not None else peer.lane
        raw: Any
        try:
            if lane is not None:
                raw, frames = lane.take_reply(), []
            else:
                assert parts is not None
                raw, frames = wire.frame_buffer(parts[0]), parts[1:]
            header = wire.decode_header(raw)
        except (wire.WireError, LaneError) as e:
            raise PeerError(peer.name, f"malformed reply: {e}") from None
        rid = header[_ID]
        op = header[_OP]
        if lane is not None:
            if rid == -1 and op == _ERROR:
                # The server could not read the request at all: it answers whatever was in flight.
                rid = next((r for r in peer.inflight if self._inflight[r][1]), -1)
            if self._inflight.get(rid) != (peer, True):
                return  # a ring for a reply already taken from the socket
        if rid not in w.want:
            return  # the reply to a request that already timed out
        self._inflight.pop(rid)[0].inflight.discard(rid)  # _landed(rid), spared a call
        self._sent_at_drops.pop(rid, None)
        if lane is not None and op == _USE_SOCKET:
            need = header.get(Key.NEED)
            if isinstance(need, int) and not isinstance(need, bool):
                peer.reply_need = max(peer.reply_need, need)
            # Too large for the lane: it comes by socket.
            self._inflight[rid] = (peer, False)
            self._sent_at_drops[rid] = peer.drops
            peer.inflight.add(rid)
            return
        w.want.discard(rid)
        if op == _ERROR:
            code = header.get(Key.CODE)
            detail = str(header.get(Key.ERROR, "unknown error"))
            raise PeerError(peer.name, detail, code=code if isinstance(code, str) else None)
        # Rows a server wrote into the request area are copied out unless the caller takes
        # views: the next request overwrites them.
        in_request = lane is not None and header.get(Key.IN_LANE) == IN_REQUEST_AREA
        area = None if lane is None else lane.request_views if in_request else lane.reply_views
        try:
            tensors = wire.decode_tensors(
                header,
                frames,
                max_bytes=self.config.max_message_bytes,
                into=w.into if w.into_of is None else w.into_of.get(rid, w.into),
                area=area,
                transient=w.request_views if in_request else w.lane_views,
                # A lookup's rows differ every time: no use keeping their views.
                keep=not in_request,
            )
        except wire.WireError as e:
            raise PeerError(peer.name, f"malformed reply: {e}") from None
        # Sized only while a lane or a seal may use it: not on every reply of a peer past both.
        if _CHUNK in header and (peer.lanes_allowed or not peer.large):
            need = wire.lane_bytes(t.nbytes for _, t in tensors)
            if peer.lanes_allowed:
                peer.reply_need = max(peer.reply_need, need)
            if need >= SEAL_FROM_BYTES:
                peer.large = True
        w.replies[rid] = (header, tensors)

    def _landed(self, rid: int) -> tuple[_Peer, bool]:
        """Forgets request ``rid`` as in flight; its peer, and whether it went by lane."""
        flight = self._inflight.pop(rid)
        flight[0].inflight.discard(rid)
        self._sent_at_drops.pop(rid, None)
        return flight

    def _dropped(self, w: _Wait) -> None:
        """Raises :class:`PeerLostError` when the connection to the peer of a request ``w``
        awaits closed after it was sent (the peer exited, was silent past the link timeout, or
        the connection was cut): its reply cannot come. What came before the close is taken
        first. A request that went through the peer's lane fails too when the socket beside
        the lane closed (a ps stopped on this host: its lane is never rung, nor hung up), and
        the lane is given up as at a timeout, since the ps may still write into it."""
        for rid in list(w.want):
            flight = self._inflight.get(rid)
            if flight is None:
                continue
            peer, by_lane = flight
            if peer.drops <= self._sent_at_drops.get(rid, peer.drops):
                continue
            if by_lane:
                if peer.lane is not None and peer.lane.has_reply():
                    continue  # it came after all: taken at the next look
            else:
                for late, parts in self._arrived({}, {peer.sock: peer}):
                    self._take(late, parts, w)
                if rid not in w.want:
                    continue
            # Every request awaited from it that was sent before the close is given up.
            gone = [r for r in w.want if r in peer.inflight and r in self._sent_at_drops]
            lane_lost = False
            for r in gone:
                if self._sent_at_drops[r] < peer.drops:
                    lane_lost |= self._landed(r)[1]
            if lane_lost:
                self._retire_lane(peer)
            raise PeerLostError(
                str(peer),
                "its connection closed with a request in flight (it exited, hung or lost its "
                "host, or the connection was cut: a link silent for "
                f"{envvars.PSFLOW_LINK_TIMEOUT}={self.config.link_timeout:g} s is closed)",
            )

    def _retire_lane(self, peer: _Peer) -> None:
        """Drops ``peer``'s lane for good after a request through it was given up: its server
        may still read or write the lane later (the callbacks of :meth:`on_lane_retired` move
        what still lies in its reply area out of it)."""
        if peer.lane is not None:
            for callback in self._lane_retired:
                callback(peer.lane.reply)
        self._drop_lane(peer)

    def _lost(self, peer: _Peer, error: LaneError) -> NoReturn:
        for rid in [r for r in peer.inflight if self._inflight[r][1]]:
            self._landed(rid)
        self._drop_lane(peer)
        raise PeerLostError(str(peer), f"{error} (it exited?)")

    def _timeout(self, want: set[int], timeout: float) -> NoReturn:
        late = set()
        for rid in want:
            peer, by_lane = self._landed(rid)
            if by_lane:
                self._retire_lane(peer)
            late.add(peer)
        ordered = sorted(late, key=lambda p: p.name)
        names = ", ".join(str(p) for p in ordered)
        # What the connection said of a peer that never answered: more than a guess.
        known = [f"{p.name}: {p.link.problem}" for p in ordered if p.link.problem]
        why = "; ".join(known) if known else "dead, hung, unreachable or not authorised?"
        raise PeerTimeoutError(names, f"no answer within {timeout:g} s ({why})")
