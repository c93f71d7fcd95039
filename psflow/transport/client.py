"""The client side: requests to many peers, many in flight at once.

A client holds one DEALER socket per peer. Every request carries an id, so a client can send to
all ps shards at once and then collect the replies in any order. Every wait has a deadline, and
a peer that misses it is named in the error. Until a peer first answers, a monitor
(:mod:`psflow.transport.monitor`) follows its connection, so that a wait can say why it is
silent (:meth:`Client.link`).

How it waits for the replies is :mod:`psflow.transport.receiver`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from psflow import allocator
from psflow.protocol.messages import Key, Op
from psflow.transport import seal, wire
from psflow.transport.auth import configure_client
from psflow.transport.config import TransportConfig, endpoint
from psflow.transport.config import context as transport_context
from psflow.transport.errors import PeerError, PeerLostError, PeerTimeoutError
from psflow.transport.looks import Looks
from psflow.transport.monitor import HANDSHAKE_FAILED, Event, Link, Monitor
from psflow.transport.receiver import (
    SEAL_BREAKS,
    SEAL_FROM_BYTES,
    Receiver,
    Reply,
    _Peer,
    _SealedLink,
)
from psflow.transport.shm import Lane, LaneError
from psflow.transport.wire import ZERO_COPY_ABOVE

log = logging.getLogger(__name__)

# Bound once, as plain strings, for the per-request path (see wire/encoding.py).
_ID = Key.ID.value

_MIN_LANE_BYTES = wire.INLINE_BYTES
"""Each lane area holds at least this much: a small model's tensors never need a new lane."""

_SEALED = "/sealed"
"""Appended to a peer's name: its sealed socket's reports from the monitor."""

_SEALED_WAIT_SECONDS = 10.0
"""A sealed socket not connected this long after its session began is reported (once): its port
may be closed to this client (a deployment that lets only the task's own port through)."""


class Client(Receiver):
    """Requests to a fixed list of peers, many in flight at once.

    A peer on the same host is reached through a shared-memory lane
    (:mod:`psflow.transport.shm`) once it has answered once over the socket, when no other
    request to it is in flight; everything else goes through the socket. With CurveZMQ keys, a
    peer reached only by socket whose messages have been large (:data:`SEAL_FROM_BYTES`) is
    asked for a session on its sealed socket (:mod:`psflow.transport.seal`) in the same way,
    and its requests move there once that connects.

    Example:
        >>> client = Client({"ps:0": "127.0.0.1:2222"}, TransportConfig(timeout=5))
        >>> # rid = client.send("ps:0", {Key.OP: Op.PULL}); client.wait([rid])
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
        self._context = context or transport_context(config)
        self._peers: dict[str, _Peer] = {}
        # Each request in flight: its peer, and whether it went through the peer's lane.
        self._inflight: dict[int, tuple[_Peer, bool]] = {}
        self._sent_at_drops: dict[int, int] = {}
        self._looks = Looks()
        self._next_id = 1
        self._lane_retired: list[Callable[[np.ndarray[Any, Any]], None]] = []
        self._monitor = Monitor("psflow-client-monitor", self._on_event)
        endpoints = {name: endpoint(address, bind=False) for name, address in peers.items()}
        sealing = config.keys is not None and config.sealed and seal.available()
        for name, address in peers.items():
            sock = self._dealer(name)
            if config.keys is not None:
                configure_client(sock, config.keys)
            peer = _Peer(name, address, sock, lanes_allowed=config.shared_memory, own_sock=sock)
            self._peers[name] = peer
            self._monitor.watch(name, sock)
            if sealing:
                # Made and watched now (the monitor watches no socket added later); connected
                # to the port a session names.
                peer.sealed = _SealedLink(self._dealer(name, seal.SealedDealer))
                peer.sealed.sock.setup(name, config.max_message_bytes + wire.MAX_HEADER_BYTES)
                self._monitor.watch(name + _SEALED, peer.sealed.sock)
            sock.connect(endpoints[name])
        self._monitor.start()

    def _dealer(self, name: str, socket_class: Any = None) -> Any:
        sock = self._context.socket(zmq.DEALER, socket_class=socket_class)
        sock.linger = 0
        # A DEALER with no live peer (down, or refused by CurveZMQ) blocks its sends.
        sock.sndtimeo = int(self.config.timeout * 1000)
        # A connection silent past link_timeout is closed: a request on it is lost then
        # (_dropped), not at its timeout. The peer's I/O thread answers, whatever its Python.
        sock.heartbeat_timeout = max(1, int(self.config.link_timeout * 1000))
        sock.heartbeat_ivl = max(1, int(self.config.link_timeout * 250))
        return sock

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    def on_lane_retired(self, callback: Callable[[np.ndarray[Any, Any]], None]) -> None:
        """Registers ``callback``, called with a lane's reply area when a timed-out request
        leaves it to a server that may still write there: views of it taken with
        ``lane_views`` must move out."""
        self._lane_retired.append(callback)

    def link(self, peer: str) -> Link:
        """What is known of the connection to ``peer`` before it first answered: why it is
        silent (nothing listening, its key refused), if anything is known."""
        return self._peers[peer].link

    def _on_event(self, name: str, event: Event) -> None:
        # The monitor's thread: only the links (a few attributes) and the count change here.
        # A closed connection counts when requests travel on it.
        if name.endswith(_SEALED):
            peer = self._peers.get(name[: -len(_SEALED)])
            if peer is None or peer.sealed is None:
                return
            sealed = peer.sealed
            what = event["event"]
            if what == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                sealed.connected = True
            elif what & HANDSHAKE_FAILED:
                # Refused. A session that never connected (its port leads to another process)
                # counts, as an answer that does not open does, so that a client does not ask
                # for sessions for ever; one that had (its ps restarted on the same port) not.
                if not sealed.connected:
                    sealed.breaks += 1
                sealed.lost = True
            elif what == zmq.EVENT_DISCONNECTED:
                sealed.lost = True
                if peer.sock is sealed.sock:
                    peer.drops += 1
            return
        peer = self._peers.get(name)
        if peer is None:
            return
        if not peer.answered:
            peer.link.update(event, peer.address, keyed=self.config.keys is not None)
        elif event["event"] == zmq.EVENT_DISCONNECTED and peer.sock is peer.own_sock:
            peer.drops += 1

    def lane(self, peer: str) -> Lane | None:
        """The shared-memory lane to ``peer``, if one is attached."""
        p = self._peers.get(peer)
        return p.lane if p is not None else None

    # -- sending ----------------------------------------------------------------------------

    def send(
        self,
        peer: str,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] | wire.TensorSet = (),
        layout: wire.Layout | None = None,
        *,
        block: float | None = None,
    ) -> int:
        """Sends one request to ``peer`` and returns its id, without waiting for the reply.

        The tensors must stay unchanged until the reply has arrived. ``layout``: what they
        usually look like (a step's gradients), to spare describing them again. ``block``:
        how long the send may wait for a connection that can take it (the peer down, or its
        handshake failing) before :class:`PeerTimeoutError`; the transport's timeout when
        ``None``.
        """
        p = self._peers[peer]
        lane = None
        if p.lanes_allowed:
            need = layout.lane_bytes if layout is not None else wire.lane_bytes_of(tensors)
            lane = self._lane_for(p, need)
        rid = self._next_id
        self._next_id += 1
        header[_ID] = rid
        if lane is not None:
            frames = wire.encode(dict(header), tensors, area=lane.request, layout=layout)
            if len(frames) == 1 and lane.post_request(frames[0]):
                self._inflight[rid] = (p, True)
                # A lane's reply comes through shared memory, but a hung ps is noticed by the
                # socket beside it going silent (Receiver._dropped).
                self._sent_at_drops[rid] = p.drops
                p.inflight.add(rid)
                return rid
        if p.sealed is not None:
            self._seal(p)
        frames = wire.encode(header, tensors, chunk=self.config.chunk_bytes)
        self._send(p, frames, block)
        self._inflight[rid] = (p, False)
        drops = p.drops
        if p.sealed is not None and p.sock is p.sealed.sock and p.sealed.lost:
            # Sent on a connection known to have closed (another request in flight kept it
            # from moving back): its server may be gone with its port, so it fails as lost at
            # once (_dropped), not at its timeout.
            drops -= 1
        self._sent_at_drops[rid] = drops
        p.inflight.add(rid)
        return rid

    def _send(self, peer: _Peer, frames: list[Any], block: float | None = None) -> None:
        size = sum(len(f) for f in frames[1:])
        if size >= SEAL_FROM_BYTES:
            peer.large = True
        sock = peer.sock
        if block is not None:
            sock.sndtimeo = max(1, int(block * 1000))
        try:
            sock.send_multipart(frames, copy=size < ZERO_COPY_ABOVE)
        except zmq.Again:
            waited = self.config.timeout if block is None else block
            raise PeerTimeoutError(
                str(peer), f"could not send within {waited:g} s (down, or not authorised?)"
            ) from None
        finally:
            if block is not None:
                sock.sndtimeo = int(self.config.timeout * 1000)

    def _lane_for(self, peer: _Peer, need: int) -> Lane | None:
        """The lane for a request to ``peer`` with ``need`` bytes of tensors, attached or grown
        when needed.

        None before ``peer`` has answered over the socket (it may not be up yet), and while
        another request to it is in flight (a lane carries one request at a time).
        """
        if not peer.answered or peer.inflight:
            return None
        need = max(need, _MIN_LANE_BYTES)
        lane = peer.lane
        if lane is None or lane.request_bytes < need or lane.reply_bytes < peer.reply_need:
            old = (lane.request_bytes, lane.reply_bytes) if lane is not None else (0, 0)
            # A push is usually answered with parameters of its own size.
            lane = self._attach(peer, max(need, old[0]), max(peer.reply_need, need, old[1]))
        return lane

    def _attach(self, peer: _Peer, request_bytes: int, reply_bytes: int) -> Lane | None:
        self._drop_lane(peer)
        try:
            lane = Lane.create(request_bytes, reply_bytes)
        except LaneError as e:
            log.info("%s: %s; requests go through the socket", peer.name, e)
            peer.lanes_allowed = False
            return None
        try:
            header: dict[str, Any] = {
                Key.OP: Op.ATTACH_LANE,
                Key.LANE_NAME: lane.name,
                Key.LANE_TOKEN: lane.token,
                Key.LANE_REQUEST_BYTES: request_bytes,
                Key.LANE_REPLY_BYTES: reply_bytes,
            }
            self._ask(peer, header)
        except PeerTimeoutError:
            lane.close()
            raise
        except PeerError as e:
            log.info("%s; requests go through the socket", e)
            peer.lanes_allowed = False
            lane.close()
            return None
        finally:
            lane.unlink()
        log.debug("%s: attached %s", peer.name, lane)
        peer.lane = lane
        return lane

    def _ask(self, peer: _Peer, header: dict[str, Any]) -> dict[str, Any]:
        """Sends one of the transport's own requests to ``peer`` by socket and waits for its
        reply's header."""
        rid = self._next_id
        self._next_id += 1
        header[_ID] = rid
        self._send(peer, wire.encode(header))
        self._inflight[rid] = (peer, False)
        self._sent_at_drops[rid] = peer.drops
        peer.inflight.add(rid)
        return self.wait([rid])[rid][0]

    def _seal(self, peer: _Peer) -> None:
        """Moves ``peer``'s requests to its sealed socket or back, while none is in flight:
        a session is asked for once it has answered and no lane can reach it; they move once the
        sealed socket has connected, and back inside CurveZMQ when that connection closes (the
        server restarted, or the link was cut), a new session asked for at the next request."""
        sealed = peer.sealed
        assert sealed is not None
        if peer.inflight or peer.lanes_allowed or not peer.answered or not peer.large:
            return
        if sealed.lost:
            sealed.lost = sealed.connected = False
            if sealed.endpoint is not None:
                sealed.sock.disconnect(sealed.endpoint)
                sealed.endpoint = None
            if peer.sock is sealed.sock:
                log.info("%s: its sealed socket's connection closed; back inside CurveZMQ", peer)
                peer.sock = peer.own_sock
            if sealed.breaks >= SEAL_BREAKS:
                self._no_seal(peer)
            return
        if peer.sock is sealed.sock:
            return
        if sealed.endpoint is None:
            self._open_session(peer, sealed)
        elif sealed.connected:
            log.debug("%s: requests move to its sealed socket %s", peer, sealed.endpoint)
            peer.sock = sealed.sock
        elif not sealed.reported and time.monotonic() - sealed.began > _SEALED_WAIT_SECONDS:
            sealed.reported = True
            log.info(
                "%s: its sealed socket %s has not connected in %g s (a port closed to this "
                "host?); requests stay inside CurveZMQ",
                peer,
                sealed.endpoint,
                _SEALED_WAIT_SECONDS,
            )

    def _open_session(self, peer: _Peer, sealed: _SealedLink) -> None:
        try:
            reply = self._ask(peer, {Key.OP: Op.SEAL})
        except (PeerTimeoutError, PeerLostError):
            raise  # as any request's would: the next request asks again
        except PeerError as e:  # a server that does not seal: CurveZMQ for good
            log.info("%s; requests stay inside CurveZMQ", e)
            self._no_seal(peer)
            return
        session = reply.get(Key.SEAL_SESSION)
        keys = reply.get(Key.SEAL_KEYS)
        port = reply.get(Key.SEAL_PORT)
        token = reply.get(Key.SEAL_TOKEN)
        if not (
            isinstance(session, bytes)
            and len(session) == seal.SESSION_BYTES
            and isinstance(keys, bytes)
            and len(keys) == 2 * seal.KEY_BYTES
            and isinstance(token, bytes)
            and len(token) == seal.TOKEN_BYTES
            and isinstance(port, int)
            and not isinstance(port, bool)
            and 0 < port < 65536
        ):
            # Its fields' types and sizes only: the values are keys, never logged.
            shapes = {
                str(k): f"{type(v).__name__}[{len(v)}]"
                if isinstance(v, bytes | str)
                else type(v).__name__
                for k, v in (
                    (Key.SEAL_SESSION, session),
                    (Key.SEAL_KEYS, keys),
                    (Key.SEAL_TOKEN, token),
                    (Key.SEAL_PORT, port),
                )
            }
            log.warning(
                "%s answered a session with %s; requests stay inside CurveZMQ",
                peer,
                wire.brief(shapes),
            )
            self._no_seal(peer)
            return
        to_server, to_client = keys[: seal.KEY_BYTES], keys[seal.KEY_BYTES :]
        sealed.sock.begin(seal.Seal(session, send=to_server, receive=to_client), token)
        own = endpoint(peer.address, bind=False)
        sealed.endpoint = f"{own.rsplit(':', 1)[0]}:{port}"
        sealed.began = time.monotonic()
        sealed.sock.connect(sealed.endpoint)

    def _no_seal(self, peer: _Peer) -> None:
        if peer.sealed is not None:
            peer.sealed.sock.close(linger=0)
            peer.sealed = None

    def request(
        self,
        peer: str,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] = (),
        timeout: float | None = None,
    ) -> Reply:
        """One request and its reply."""
        rid = self.send(peer, header, tensors)
        return self.wait([rid], timeout)[rid]

    def close(self) -> None:
        for peer in self._peers.values():
            peer.own_sock.close(linger=0)
            self._no_seal(peer)
            self._drop_lane(peer)
        self._peers.clear()
