"""How a server answers: a request's tensors, the reply (through the request's lane or the
socket, tensors sent from their own memory), error replies, and the wait until ZeroMQ has let
go of what was sent without a copy.

:class:`Replier` is the half of :class:`~psflow.transport.server.Server` that answers; the
server, which receives, sets the attributes it declares.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from psflow.protocol.messages import IN_REQUEST_AREA, Code, Key, Op
from psflow.transport import wire
from psflow.transport.config import TransportConfig
from psflow.transport.shm import Lane
from psflow.transport.wire import ZERO_COPY_ABOVE

# The server's logger: these are the server's lines, wherever its code lives.
log = logging.getLogger("psflow.transport.server")

# Bound once, as plain strings, for the per-request path (see wire/encoding.py).
_OP = Key.OP.value
_ID = Key.ID.value


@dataclass
class Request:
    """One request received by a :class:`~psflow.transport.server.Server`."""

    identity: bytes
    header: dict[str, Any]
    frames: list[Any]
    lane: Lane | None = None
    """The shared-memory lane it came through (its reply goes back the same way)."""
    sock: Any = None
    """The socket it came through, when not the server's own (its sealed socket): its reply
    goes back the same way."""


class Replier:
    """The answering half of a :class:`~psflow.transport.server.Server`."""

    config: TransportConfig
    _sock: Any
    """The ROUTER socket (``Any``, as pyzmq types a socket its context makes)."""
    _events_stale: bool
    """Whether the socket's events must be asked for (see ``Server._socket_may_have``)."""
    _pending: list[zmq.MessageTracker]
    """Trackers of the replies sent without a copy, until :meth:`flush`."""

    def tensors(
        self,
        request: Request,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        transient: bool = False,
        only: Container[str] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors of ``request``, validated (see :func:`wire.decode_tensors`).

        With ``transient``, tensors that came through a lane may be views of it: valid until
        the reply to ``request`` is sent. With ``only``, the tensors of these names alone.
        """
        lane = request.lane
        return wire.decode_tensors(
            request.header,
            request.frames,
            max_bytes=self.config.max_message_bytes,
            into=into,
            area=lane.request_views if lane is not None else None,
            transient=transient,
            only=only,
        )

    def tensor_buffers(self, request: Request) -> list[tuple[Any, int]] | None:
        """Where each tensor of ``request`` lies as it came, ``(buffer, byte offset)``, for a
        native path that reads the bytes itself; ``None`` where :meth:`tensors` must make them
        (see :func:`wire.tensor_buffers`)."""
        lane = request.lane
        return wire.tensor_buffers(
            request.header,
            request.frames,
            max_bytes=self.config.max_message_bytes,
            area=lane.request_views if lane is not None else None,
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
        Other tensors, and a set too large for the lane, go by socket, and the lane says so
        (:attr:`~psflow.protocol.Op.USE_SOCKET`).
        """
        rid = header[_ID] = request.header[_ID]
        lane = request.lane
        if lane is not None:
            if lane.closed:
                # Replaced or evicted since: its client gave up on this request.
                log.debug("dropped the reply to %s: its lane is gone", request.header[_OP])
                return
            whole_set = isinstance(tensors, wire.TensorSet)
            fixed = whole_set or wire.lane_bytes_of(tensors) <= wire.INLINE_BYTES
            if fixed:
                # Other tensors never enter the reply area: small ones travel in the header.
                frames = wire.encode(dict(header), tensors, area=lane.reply if whole_set else None)
                if len(frames) == 1 and lane.post_reply(frames[0]):
                    return
            elif not isinstance(tensors, wire.TensorSet):
                # The request's area: its tensors are done with, and the client takes these
                # before its next request. (A lookup's rows, in a lane; made there by
                # reply_tensors, they are not copied again.)
                placed = wire.placed_in(tensors, lane.request_views)
                if placed or _outside(tensors, lane.request_views):
                    frames = wire.encode(
                        dict(header),
                        tensors,
                        area=lane.request,
                        in_lane=IN_REQUEST_AREA,
                        placed=placed,
                    )
                    if len(frames) == 1 and lane.post_reply(frames[0]):
                        return
            need = wire.lane_bytes_of(tensors) if fixed else 0
            note: dict[str, Any] = {Key.OP: Op.USE_SOCKET, Key.ID: rid, Key.NEED: need}
            self._post(lane, request.identity, wire.encode(note))
        frames = wire.encode(header, tensors, chunk=self.config.chunk_bytes)
        self._send_reply(request, frames, track=True)

    def _send_reply(self, request: Request, frames: list[Any], *, track: bool) -> None:
        """Sends a reply's frames on the socket: small ones copied, large ones from their own
        memory (with ``track``, kept until :meth:`flush` says ZeroMQ is done with them)."""
        size = sum(len(f) for f in frames[1:])
        msg = [request.identity, *frames]
        sock = request.sock
        if size < ZERO_COPY_ABOVE:
            self._send(msg, sock=sock)
        elif track:
            self._pending.append(self._send(msg, copy=False, track=True, sock=sock))
        else:
            self._send(msg, copy=False, sock=sock)

    def reply_area(
        self, request: Request, sizes: Sequence[int]
    ) -> tuple[np.ndarray[Any, Any], list[int]] | None:
        """Where a reply's tensors of these byte sizes go in ``request``'s lane (its request
        area, as :meth:`reply_tensors` places them): the area and each one's offset, for a
        native path to write them there and answer with :meth:`reply_placed`. ``None`` when
        the request did not come by lane or they do not fit."""
        lane = request.lane
        if lane is None or lane.closed:
            return None
        offsets, need = wire.lane_layout(sizes)
        return (lane.request, offsets) if need <= len(lane.request) else None

    def reply_placed(
        self,
        request: Request,
        header: dict[str, Any],
        metas: list[list[Any]],
        raws: Sequence[Any] | None = None,
        *,
        live: bool = False,
    ) -> None:
        """Answers ``request`` with tensors a native path wrote itself, described by
        ``metas`` (``[name, dtype, shape]`` each): where :meth:`reply_area` placed them
        (``raws`` is ``None``), or the bytes of each in ``raws``, sent from their own memory.
        ``live``: some of those bytes may change later (a shard's variables), so
        :meth:`flush` waits until they have left; else they are fresh buffers."""
        header[_ID] = request.header[_ID]
        if raws is None:
            lane = request.lane
            assert lane is not None, "reply_placed without raws needs the request's lane"
            frames = wire.encode_raw(header, metas, in_lane=IN_REQUEST_AREA)
            if lane.closed or not lane.post_reply(frames[0]):
                log.debug("dropped the reply to %s: its lane is gone", request.header[_OP])
            return
        frames = wire.encode_raw(header, metas, raws, chunk=self.config.chunk_bytes)
        self._send_reply(request, frames, track=live)

    def reply_tensors(
        self, request: Request, specs: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> list[torch.Tensor] | None:
        """Tensors of these dtypes and shapes made where :meth:`reply` would copy a list of
        them (``request``'s lane, its request area), for a handler to fill and answer with:
        the copy is spared. ``None`` when the request did not come by lane or they do not fit
        (answer with tensors of its own). They overlay the request's own tensors: take those
        as copies first (:meth:`tensors` without ``transient``)."""
        lane = request.lane
        if lane is None or lane.closed:
            return None
        return wire.lane_tensors(lane.request_views, specs)

    def send_error(self, request: Request, message: str, code: str | None = Code.REFUSED) -> None:
        """Answers ``request`` with an error: ``message`` for people, ``code`` (a
        :class:`~psflow.protocol.Code`) for the client to act on; ``None`` sends no code."""
        frames = _error(request.header[Key.ID], message, code)
        if request.lane is not None:
            self._post(request.lane, request.identity, frames)
        else:
            self._send([request.identity, *frames], sock=request.sock)

    def _send(
        self, msg: list[Any], *, copy: bool = True, track: bool = False, sock: Any = None
    ) -> Any:
        """Sends ``msg`` on ``sock``, else the server's socket (its tracker with ``track``); the
        socket's events are stale after it (see :meth:`_socket_may_have`)."""
        if sock is None or sock is self._sock:
            self._events_stale = True
            sock = self._sock
        return sock.send_multipart(msg, copy=copy, track=track)

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
            if left <= 0 or not _sent(tracker, left):
                raise TimeoutError(f"a reply was not sent within {timeout} s")
        self._pending.clear()


def _error(rid: int, message: str, code: str | None) -> list[Any]:
    """The frames of an error reply to request ``rid``."""
    header: dict[str, Any] = {Key.OP: Op.ERROR, Key.ID: rid, Key.ERROR: message}
    if code is not None:
        header[Key.CODE] = code
    return wire.encode(header)


def _sent(tracker: zmq.MessageTracker, timeout: float) -> bool:
    """Whether ZeroMQ has let go of a message's frames within ``timeout`` seconds."""
    try:
        tracker.wait(timeout)
    except zmq.NotDone:
        return False
    return True


def _outside(tensors: Sequence[tuple[str, torch.Tensor]], area: wire.AreaViews) -> bool:
    """Whether no tensor's memory lies in ``area`` (the lane's request area): a handler may
    answer with views of what it was sent, which a copy into that area would overwrite."""
    start = area.address
    end = start + area.area.nbytes
    for _, t in tensors:
        p = t.data_ptr()
        if p < end and p + t.nbytes > start:
            return False
    return True
