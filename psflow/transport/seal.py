"""Sealed sockets: the bytes a job's keys protect, under a cipher the CPU runs six times faster.

With CurveZMQ keys every byte through a socket is encrypted by libzmq, always with libsodium's
XSalsa20-Poly1305: about 2.9 GB/s a core on this project's 2-core AMD EPYC host, a tenth of a
CTR job's two cores through the socket (``benchmarks/results/profile.md``). AES-256-GCM with
the CPU's AES instructions (OpenSSL, through the ``cryptography`` package) seals 18.7 GB/s on
the same core. So a client that reaches a server only by socket, once a message between them
has been large (64 KiB: ``psflow.transport.receiver.SEAL_FROM_BYTES``; small ones do not repay
the Python a seal costs), asks it, through the CurveZMQ connection (both ends authenticated by
their keys, encrypted, forward secret), for a session (:attr:`~psflow.protocol.Op.SEAL`). The
server answers there with a random session id, two random 256-bit keys (one a direction), a
random token and the port of its *sealed socket*, a second ROUTER without CurveZMQ. The client
connects to it with ZeroMQ's PLAIN mechanism, the session id and token as user name and
password, which the server's authenticator checks: a peer that holds no session's token cannot
even send it a message (nor make it hold one of gigabytes), and a connection speaks only in the
session its token named. From then on that client's requests and their replies travel through
the sealed socket, each message sealed (:class:`Seal`)::

    frame 0, in the clear: MAGIC, the session id (16 bytes), the first frame's counter (8),
             the number of frames (4), each frame's length (8 each)
    frame 1: each frame's ciphertext and 16-byte tag, one after another

Frame ``i`` is sealed with its direction's key, the 96-bit nonce ``counter + i`` and the whole
first frame as associated data: a frame changed, moved, dropped, added or taken from another
message fails its tag, and so does a first frame changed in any byte. A receiver opens nothing
before the session id is one it handed out (or was given), and takes a message only when its
counter is past the last one it took: a replay fails. Each key has one sender, whose counter
only grows: a nonce never repeats under a key. What an eavesdropper learns is what it learns
from CurveZMQ's frames, their sizes, and the token, which lets it connect and no more: it
opens nothing and seals nothing.

A client whose sealed socket cannot connect (a port a deployment does not let through) stays
with CurveZMQ; without ``cryptography``, or with ``PSFLOW_SEALED=0``, so does everything.
"""

from __future__ import annotations

import logging
import secrets
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import zmq

from psflow.protocol.messages import Code, Key
from psflow.transport.auth import SEALED_DOMAIN
from psflow.transport.replier import _error
from psflow.transport.wire import ZERO_COPY_ABOVE, WireError, brief, decode_header

_aead: Any
_errors: Any
try:
    import cryptography.exceptions as _errors
    import cryptography.hazmat.primitives.ciphers.aead as _aead
except ImportError:  # pragma: no cover - a dependency, but a bare machine may lack it
    _aead = _errors = None

log = logging.getLogger(__name__)

__all__ = [
    "KEY_BYTES",
    "MAGIC",
    "SESSION_BYTES",
    "Seal",
    "SealError",
    "SealedDealer",
    "SealedRouter",
    "Sessions",
    "available",
    "read_prefix",
]

MAGIC = b"psS1"
"""The first bytes of a sealed message (and its version)."""
SESSION_BYTES = 16
KEY_BYTES = 32
TOKEN_BYTES = 32
TAG_BYTES = 16
MAX_FRAMES = 1 << 17
"""The most frames a sealed message may carry (a message's header and its tensors' chunks)."""
MAX_SESSIONS = 4096
"""Sessions a server keeps (one a client that reaches it by socket); the least recently used
goes first, and its client's next message is refused."""
_ALIGN = 64
"""Each opened frame starts at a multiple of this in its buffer: tensors are viewed in place."""

_HEAD = struct.Struct("<4s16sQI")
_COUNTERS = 1 << 64


class SealError(WireError):
    """A message on a sealed socket that is not sealed under a session held here: malformed,
    tampered with, replayed, or of a session that is gone."""


def available() -> bool:
    """Whether messages can be sealed here: the ``cryptography`` package, 47 or later (which
    seals into a buffer given, ``encrypt_into``), is installed."""
    return _aead is not None and hasattr(_aead.AESGCM, "encrypt_into")


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "little")


def read_prefix(raw: Any, max_bytes: int) -> tuple[bytes, int, tuple[int, ...]]:
    """The session id, first counter and frame lengths of a sealed message's first frame,
    checked for form and size only (nothing in it is trusted before a frame opens).

    Raises:
        SealError: when it is not the first frame of a sealed message, or announces frames past
            :data:`MAX_FRAMES` or more than ``max_bytes`` bytes.
    """
    raw = memoryview(raw)
    if len(raw) < _HEAD.size:
        raise SealError(f"not a sealed message: a first frame of {len(raw)} bytes")
    magic, session, counter, n = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise SealError(f"not a sealed message: it begins {brief(bytes(magic))}")
    if not 0 < n <= MAX_FRAMES or len(raw) != _HEAD.size + 8 * n:
        raise SealError(f"a sealed message announcing {n} frame(s) in {len(raw)} bytes")
    lengths = struct.unpack_from(f"<{n}Q", raw, _HEAD.size)
    total = sum(lengths)
    if total > max_bytes:
        raise SealError(f"a sealed message of {total} bytes (at most {max_bytes})")
    return session, counter, lengths


class Seal:
    """One end of a session: seals what it sends under one key, opens what it receives under
    the other, each with its own counter.

    Example:
        >>> session, a, b = secrets.token_bytes(16), secrets.token_bytes(32), secrets.token_bytes(32)
        >>> client, server = Seal(session, send=a, receive=b), Seal(session, send=b, receive=a)
        >>> prefix, body = client.seal([b"header", b"tensor bytes"])
        >>> [bytes(f) for f in server.open(prefix, body, max_bytes=1 << 20)]
        [b'header', b'tensor bytes']
    """

    __slots__ = ("_open", "_seal", "_sent", "_taken", "session")

    def __init__(self, session: bytes, *, send: bytes, receive: bytes) -> None:
        if not available():
            raise RuntimeError("sealing needs cryptography>=47 (pip install -U cryptography)")
        if len(session) != SESSION_BYTES or len(send) != KEY_BYTES or len(receive) != KEY_BYTES:
            raise ValueError(
                f"a session id of {SESSION_BYTES} bytes and keys of {KEY_BYTES} bytes, got "
                f"{len(session)}, {len(send)}, {len(receive)}"
            )
        self.session = bytes(session)
        self._seal = _aead.AESGCM(send)
        self._open = _aead.AESGCM(receive)
        self._sent = 0
        """The counter of the next frame sealed."""
        self._taken = 0
        """Counters below this have been opened (or skipped): the next message starts here or
        later."""

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """The two frames of a sealed message holding ``frames`` (buffers): the first frame's
        bytes, and an array of the ciphertexts (sent without a copy when large)."""
        views = [memoryview(f).cast("B") for f in frames]
        n = len(views)
        counter = self._sent
        if not 0 < n <= MAX_FRAMES or counter + n >= _COUNTERS:
            raise ValueError(f"cannot seal {n} frame(s) at counter {counter}")
        lengths = [len(v) for v in views]
        prefix = _HEAD.pack(MAGIC, self.session, counter, n) + struct.pack(f"<{n}Q", *lengths)
        body = np.empty(sum(lengths) + TAG_BYTES * n, np.uint8)
        out = body.data
        start = 0
        for i, v in enumerate(views):
            end = start + len(v) + TAG_BYTES
            self._seal.encrypt_into(_nonce(counter + i), v, prefix, out[start:end])
            start = end
        self._sent = counter + n
        return [prefix, body]

    def open(
        self,
        prefix: Any,
        body: Any,
        *,
        max_bytes: int,
        read: tuple[bytes, int, tuple[int, ...]] | None = None,
    ) -> list[memoryview]:
        """The frames of a sealed message (writable views of one new buffer, each 64-byte
        aligned), after every one has passed its tag. ``read``: the prefix's
        :func:`read_prefix`, when the caller has it already.

        Raises:
            SealError: naming what is wrong; nothing of the message is returned then, and the
                counter is unchanged.
        """
        session, counter, lengths = read if read is not None else read_prefix(prefix, max_bytes)
        if session != self.session:
            raise SealError("a sealed message of another session")
        n = len(lengths)
        if counter < self._taken or counter + n >= _COUNTERS:
            raise SealError(
                f"a sealed message replayed or out of order (counter {counter}, expected at "
                f"least {self._taken})"
            )
        body = memoryview(body).cast("B")
        if len(body) != sum(lengths) + TAG_BYTES * n:
            raise SealError(
                f"a sealed message of {len(body)} bytes where its frames need "
                f"{sum(lengths) + TAG_BYTES * n}"
            )
        offsets = []
        size = 0
        for length in lengths:
            offsets.append(size)
            size += -(-length // _ALIGN) * _ALIGN
        whole = np.empty(size + _ALIGN, np.uint8)
        shift = -whole.ctypes.data % _ALIGN
        plain = whole[shift : shift + size].data
        aad = bytes(prefix)
        frames = []
        start = 0
        for i, (length, at) in enumerate(zip(lengths, offsets, strict=True)):
            end = start + length + TAG_BYTES
            into = plain[at : at + length]
            try:
                self._open.decrypt_into(_nonce(counter + i), body[start:end], aad, into)
            except _errors.InvalidTag:
                raise SealError(
                    f"frame {i} of a sealed message failed its tag (changed on the way, or "
                    "sealed under other keys)"
                ) from None
            frames.append(into)
            start = end
        self._taken = counter + n
        return frames


class Sessions:
    """A server's sessions by id, the least recently used dropped past :data:`MAX_SESSIONS`,
    with the tokens a connection to its sealed socket must present (:attr:`tokens`)."""

    def __init__(self, most: int = MAX_SESSIONS) -> None:
        self._most = most
        self._by_id: OrderedDict[bytes, Seal] = OrderedDict()
        self.tokens: dict[str, str] = {}
        """PLAIN user name (a session id in hex) to password (its token in hex), read by the
        authenticator's thread: entries are only added and removed whole."""
        self.opened = 0
        """Sessions handed out so far: before the first, nobody can connect."""

    def __len__(self) -> int:
        return len(self._by_id)

    def new(self) -> tuple[bytes, bytes, bytes, bytes]:
        """A new session: its id, the client's sending key, the server's and the token, all
        random."""
        session = secrets.token_bytes(SESSION_BYTES)
        to_server = secrets.token_bytes(KEY_BYTES)
        to_client = secrets.token_bytes(KEY_BYTES)
        token = secrets.token_bytes(TOKEN_BYTES)
        self._by_id[session] = Seal(session, send=to_client, receive=to_server)
        self.tokens[session.hex()] = token.hex()
        self.opened += 1
        while len(self._by_id) > self._most:
            gone, _ = self._by_id.popitem(last=False)
            self.tokens.pop(gone.hex(), None)
        return session, to_server, to_client, token

    def get(self, session: bytes) -> Seal | None:
        seal = self._by_id.get(session)
        if seal is not None:
            self._by_id.move_to_end(session)
        return seal


class SealedRouter(zmq.Socket):  # type: ignore[type-arg]
    """A server's sealed socket: a ROUTER whose messages are opened as they are received and
    sealed as they are sent, each reply under the session of its client's last request."""

    sessions: Sessions
    max_bytes: int
    _of_peer: OrderedDict[bytes, Seal]

    def setup(self, max_bytes: int) -> None:
        """Sets what a socket made by ``context.socket(zmq.ROUTER, socket_class=...)`` needs:
        connections by PLAIN, each checked by the authenticator against :attr:`Sessions.tokens`
        (:class:`~psflow.transport.auth.Gatekeeper`)."""
        self.sessions = Sessions()
        self.max_bytes = max_bytes
        self._of_peer = OrderedDict()
        self.plain_server = True
        self.zap_domain = SEALED_DOMAIN.encode()

    def recv_multipart(  # type: ignore[override]
        self, flags: int = 0, copy: bool = True, track: bool = False
    ) -> list[Any]:
        """``[routing id, frame, ...]``, opened.

        Raises:
            SealError: for a message that does not open; its sender is told so in the clear
                (it has no session to read a sealed answer in).
        """
        parts = super().recv_multipart(flags, copy=False)
        identity = parts[0]
        try:
            if len(parts) != 3:
                raise SealError(f"a sealed message has 2 frames, not {len(parts) - 1}")
            read = read_prefix(parts[1].buffer, self.max_bytes)
            # The user name its connection presented (checked with its token by the
            # authenticator) names the one session it may speak in.
            if parts[1].get("User-Id") != read[0].hex():
                raise SealError("a message in a session other than its connection's")
            seal = self.sessions.get(read[0])
            if seal is None:
                raise SealError("a message of a session this server does not hold")
            frames = seal.open(
                parts[1].buffer, parts[2].buffer, max_bytes=self.max_bytes, read=read
            )
        except SealError as e:
            self._refuse(identity.bytes, str(e))
            raise
        self._of_peer[identity.bytes] = seal
        self._of_peer.move_to_end(identity.bytes)
        while len(self._of_peer) > MAX_SESSIONS:
            self._of_peer.popitem(last=False)
        return [identity, *frames]

    def _refuse(self, identity: bytes, why: str) -> None:
        super().send_multipart([identity, *_error(-1, why, Code.MALFORMED)])

    def send_multipart(  # type: ignore[override]
        self, msg_parts: Sequence[Any], flags: int = 0, copy: bool = True, track: bool = False
    ) -> Any:
        """Sends ``[routing id, frame, ...]`` sealed under that peer's session; a peer without
        one (gone from :data:`MAX_SESSIONS`) is not answered. Returns a finished tracker: what
        was sent is a sealed copy, so the frames may change at once."""
        identity = msg_parts[0]
        key = identity if isinstance(identity, bytes) else bytes(identity)
        seal = self._of_peer.get(key)
        if seal is None:
            log.debug("no session for %r: its reply is dropped", key)
            return zmq.MessageTracker()
        prefix, body = seal.seal(msg_parts[1:])
        super().send_multipart([key, prefix, body], flags, copy=len(body) < ZERO_COPY_ABOVE)
        return zmq.MessageTracker()


class SealedDealer(zmq.Socket):  # type: ignore[type-arg]
    """A client's sealed socket to one server: what it sends is sealed, what it receives opened.
    It holds no session until :meth:`begin`."""

    peer: str
    max_bytes: int
    seal: Seal | None

    def setup(self, peer: str, max_bytes: int) -> None:
        self.peer = peer
        self.max_bytes = max_bytes
        self.seal = None

    def begin(self, seal: Seal, token: bytes) -> None:
        """A new session, presented with ``token`` by the connections made from now on: what
        waits from an earlier one is dropped."""
        self.seal = seal
        self.plain_username = seal.session.hex().encode()
        self.plain_password = token.hex().encode()
        while True:
            try:
                super().recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return

    def send_multipart(  # type: ignore[override]
        self, msg_parts: Sequence[Any], flags: int = 0, copy: bool = True, track: bool = False
    ) -> Any:
        assert self.seal is not None, "a sealed socket sends only in a session"
        prefix, body = self.seal.seal(msg_parts)
        return super().send_multipart([prefix, body], flags, copy=len(body) < ZERO_COPY_ABOVE)

    def recv_multipart(  # type: ignore[override]
        self, flags: int = 0, copy: bool = True, track: bool = False
    ) -> list[Any]:
        """The frames of a reply, opened.

        Raises:
            SealError: when a message does not open, quoting what it says when it is a
                refusal in the clear (the server refused the request's seal; or someone else
                wrote it: untrusted words, bounded).
        """
        parts = super().recv_multipart(flags, copy=False)
        seal = self.seal
        try:
            if seal is None:
                raise SealError("a message before any session")
            if len(parts) != 2:
                raise SealError(f"a sealed message has 2 frames, not {len(parts)}")
            return seal.open(parts[0].buffer, parts[1].buffer, max_bytes=self.max_bytes)
        except SealError as e:
            raise SealError(
                f"an answer on its sealed socket that does not open: {e}{_said(parts)}"
            ) from None


def _said(parts: list[Any]) -> str:
    """What an unsealed message says, for the error that quotes it: the server's refusal of a
    request's seal is sent in the clear (untrusted words, bounded)."""
    try:
        header = decode_header(parts[0].buffer)
    except WireError:
        return ""
    return f" (in the clear: {brief(header.get(Key.ERROR))})"
