"""Shared-memory lanes: requests between a client and a server on the same host.

Over loopback a ZeroMQ round trip costs tens of microseconds of CPU on each side (two I/O
threads, the kernel's TCP stack), and a 100 MB gradient is copied twice by the kernel and
once more into place. When a worker and a ps share a host, a *lane* carries their requests
instead: the message (the same msgpack header and raw tensor bytes as on the socket) is
written into one shared-memory segment, and a byte written to a FIFO wakes the other side. A
round trip then costs a few microseconds, and a tensor one ``memcpy`` per side.

A lane is made by the client, for one server: a segment in ``/dev/shm`` and two FIFOs beside
it (``<name>.q`` rings for requests, ``<name>.r`` for replies), all mode 0600, created
exclusively under a name that says whose they are and cannot be guessed
(``psflow-<pid>-<pidns>-<random>``, :mod:`psflow.cluster.shmfiles`). The client writes a random
token at the segment's start and asks the server, over the socket, to attach
(:attr:`~psflow.protocol.Op.ATTACH_LANE`, handled by the transport, never seen by the ps). The
server opens the three only if the name has the lane form, each is a private file of this user
of the right kind, the segment has the announced size and holds the token: this proves that
both sides see the same memory. Then the names go: the server removes them as soon as it has
mapped them, and the client on every way out of the attach (answered, refused, timed out,
interrupted); the mappings and open FIFOs live until both sides have dropped them. A client
killed before either could (SIGKILL while the server is busy or down) leaves names that say
whose they were: the launcher removes a task's once it has exited, and the next process to
make a lane removes those of dead processes. Any failure leaves the socket path, which always
works.

Segment layout: the token (16 bytes) and the doorbells (four 8-byte words, see below) in the
first 64 bytes, the request header area and the reply header area (:data:`HEADER_BYTES` each: a
4-byte length, then the packed header), then the request data area and the reply data area,
each tensor 64-byte aligned (see ``wire.lane_bytes``).

**Doorbells.** A message is posted by writing it, then counting it in the segment (a request
count that the client raises, a reply count that the server raises): a side knows a message
has come when the count differs from the last one it took. A side that waits looks at the
count for a short while first (``spin``: at most :data:`SPIN_SECONDS` after its last message,
yielding its core to any other runnable task at every look, and only while its last waits ended
that soon: :mod:`psflow.transport.looks`), then says it sleeps (a flag in the
segment) and blocks on its FIFO; the poster writes the FIFO's byte only to a sleeper. On these
virtual machines a FIFO's wake-up costs each side tens of microseconds (a pipe round trip took
55-76 us, a look at shared memory 1.2 us), and a step of a sparse job makes four round trips.
The flag and the count are each written before the other side's is read, with a full memory
barrier between (:func:`_fence`); a sleeper also looks again every :data:`_NAP_SECONDS`, so
that even a wake-up lost on a platform with weaker barriers costs a nap, never a timeout.

A lane carries one request at a time: the client uses it only when no other request to that
server is in flight, and retires it when a request through it times out. The server drops a
lane when its client has gone (the requests FIFO hangs up), so dead workers leave nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import select
import stat
import threading
import time
import weakref
from typing import Any

import numpy as np

from psflow.cluster import shmfiles
from psflow.cluster.shmfiles import SHM_DIR
from psflow.transport.looks import Looks
from psflow.transport.wire import AreaViews, lane_bytes

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
HEADER_BYTES = 1 << 16
"""Room for one packed header (with up to 16 KB of inline tensor data) in each direction."""
_START = 64
_SUFFIXES = ("", ".q", ".r")
# The doorbells: four 8-byte words after the token.
_REQUESTS, _REPLIES, _SERVER_ASLEEP, _CLIENT_ASLEEP = range(4)
SPIN_SECONDS = 0.002
"""Default of ``PSFLOW_SPIN_US``: how long after its last message a side looks at the counts
before it sleeps. A sparse step's ps waits about 0.1-0.8 ms for its next request."""
_NAP_SECONDS = 0.05
"""A sleeper's longest nap before it looks at the count again (see the module docstring)."""
_fence_lock = threading.Lock()
_swept = False
"""Whether this process has removed the lane files of dead processes (once, at its first lane)."""


def _aligned(n: int) -> int:
    return lane_bytes([n])


class LaneError(ValueError):
    """A lane could not be made or attached (the reason says why); the socket path remains."""


class Lane:
    """One shared-memory segment and its two FIFOs, seen from either side.

    ``request`` and ``reply`` are the data areas (uint8 arrays); :meth:`post_request`,
    :meth:`take_request`, :meth:`post_reply` and :meth:`take_reply` move packed headers.

    Example:
        >>> lane = Lane.create(1 << 20, 1 << 20)  # doctest: +SKIP
        >>> peer = Lane.attach(lane.name, lane.token, 1 << 20, 1 << 20)  # doctest: +SKIP
        >>> lane.unlink()  # doctest: +SKIP
    """

    def __init__(
        self,
        name: str,
        token: bytes,
        buf: mmap.mmap,
        fds: tuple[int, int],
        request_bytes: int,
        reply_bytes: int,
    ) -> None:
        self.name = name
        self.token = token
        self.request_bytes = request_bytes
        self.reply_bytes = reply_bytes
        self.requests_fd, self.replies_fd = fds
        """FIFOs (both ends open, non-blocking): one byte rings for each message."""
        whole = np.frombuffer(buf, dtype=np.uint8)
        self._bells = memoryview(buf)[TOKEN_BYTES : TOKEN_BYTES + 32].cast("Q")
        self._requests_seen = self._bells[_REQUESTS]
        self._replies_seen = self._bells[_REPLIES]
        self._looks = Looks()
        """Whether the client's waits for replies have been ending within the spin time."""
        start = _START
        # Headers through memoryviews: for a small step, numpy's per-call cost would show.
        self._request_header = memoryview(buf)[start : start + HEADER_BYTES]
        start += HEADER_BYTES
        self._reply_header = memoryview(buf)[start : start + HEADER_BYTES]
        start += HEADER_BYTES
        self.request = whole[start : start + request_bytes]
        start += _aligned(request_bytes)
        self.reply = whole[start : start + reply_bytes]
        self._linked = False
        self._reply_poller: select.poll | None = None
        self.request_views = AreaViews(self.request)
        self.reply_views = AreaViews(self.reply)
        """Tensors laid out in the areas (``wire.decode_tensors``, ``wire.lane_tensors``)."""
        self.closed = False
        """Closed lanes carry nothing (their FIFO numbers may belong to new files by now)."""
        self._finalizer = weakref.finalize(self, _close, fds)
        _live.add(self)

    @staticmethod
    def size(request_bytes: int, reply_bytes: int) -> int:
        return _START + 2 * HEADER_BYTES + _aligned(request_bytes) + _aligned(reply_bytes)

    # -- making and attaching ---------------------------------------------------------------

    @classmethod
    def create(cls, request_bytes: int, reply_bytes: int) -> Lane:
        """A new lane, its space reserved (so a full ``/dev/shm`` fails here, not later).

        Raises:
            LaneError: when there is no ``/dev/shm`` or no room in it.
        """
        if request_bytes < 0 or reply_bytes < 0:
            raise LaneError(f"bad lane sizes {request_bytes}, {reply_bytes}")
        global _swept
        if not _swept:
            _swept = True
            shmfiles.remove_stale(SHM_DIR)
        name = shmfiles.new_name()
        path = os.path.join(SHM_DIR, name)
        size = cls.size(request_bytes, reply_bytes)
        fds: list[int] = []
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                try:
                    # Reserve the pages now: a sparse file in a full tmpfs would SIGBUS later.
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(fd, size)
                buf = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            # Requests: read and write, as no reader is there yet. Replies: read only, so that
            # the FIFO hangs up when the server's end closes (it exited).
            for suffix, mode in zip(_SUFFIXES[1:], (os.O_RDWR, os.O_RDONLY), strict=True):
                os.mkfifo(path + suffix, 0o600)
                fds.append(os.open(path + suffix, mode | os.O_NONBLOCK | os.O_NOFOLLOW))
        except OSError as e:
            _close(tuple(fds))
            for suffix in _SUFFIXES:
                _unlink(path + suffix)
            raise LaneError(f"cannot make a {size}-byte lane in {SHM_DIR}: {e.strerror}") from None
        token = secrets.token_bytes(TOKEN_BYTES)
        buf[:TOKEN_BYTES] = token
        lane = cls(name, token, buf, (fds[0], fds[1]), request_bytes, reply_bytes)
        lane._linked = True
        return lane

    @classmethod
    def attach(
        cls,
        name: Any,
        token: Any,
        request_bytes: Any,
        reply_bytes: Any,
        *,
        max_bytes: int | None = None,
    ) -> Lane:
        """Maps a client's lane after checking that it is what the client says it is, then
        removes its names (the client may die before it could).

        The arguments come from the network: each is checked before use. Nothing is mapped
        before the file is known to be the lane: of the announced size, each area at most
        ``max_bytes`` (the server's largest message), its space reserved (:meth:`create`
        reserves it: a sparse file would fault later, when tmpfs fills), and holding the token.

        Raises:
            LaneError: naming what did not match.
        """
        if not isinstance(name, str) or not shmfiles.NAME.match(name):
            raise LaneError(f"{name!r} is not a lane name"[:200])
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise LaneError("bad lane token")
        for n in (request_bytes, reply_bytes):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise LaneError(f"bad lane size {n!r}"[:200])
            if max_bytes is not None and n > max_bytes:
                raise LaneError(f"a lane area of {n} bytes exceeds this server's {max_bytes}")
        path = os.path.join(SHM_DIR, name)
        size = cls.size(request_bytes, reply_bytes)
        fds: list[int] = []
        try:
            fd = _open_private(path, os.O_RDWR, "file")
            try:
                st = os.fstat(fd)
                if st.st_size != size:
                    raise LaneError(f"{path} holds {st.st_size} bytes, not {size}")
                if st.st_blocks * 512 < size:
                    raise LaneError(f"{path} is sparse: its space is not reserved")
                if not secrets.compare_digest(os.pread(fd, TOKEN_BYTES, 0), token):
                    raise LaneError(f"{path} does not hold the announced token (another host?)")
                buf = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            # Read-only and write-only ends: when the client goes away (exits, dies, or retires
            # the lane) the requests FIFO has no writer left and polls as hung up.
            for suffix, flags in ((".q", os.O_RDONLY), (".r", os.O_WRONLY)):
                fds.append(_open_private(path + suffix, flags | os.O_NONBLOCK, "fifo"))
        except OSError as e:
            _close(tuple(fds))
            raise LaneError(f"cannot open {path}: {e.strerror} (another host?)") from None
        except LaneError:
            _close(tuple(fds))
            raise
        if not secrets.compare_digest(buf[:TOKEN_BYTES], token):  # as read before mapping
            _close(tuple(fds))
            buf.close()
            raise LaneError(f"{path} does not hold the announced token (another host?)")
        # Mapped and open: the names have served. Its client may be killed before its answer
        # comes (it unlinks them too), and a name of a dead process stays until someone sweeps.
        for suffix in _SUFFIXES:
            _unlink(path + suffix)
        return cls(name, token, buf, (fds[0], fds[1]), request_bytes, reply_bytes)

    def unlink(self) -> None:
        """Removes the names (the mappings stay valid); the creator calls it on every way out of
        an attach (the server removes them too, once it has mapped them)."""
        if self._linked:
            self._linked = False
            for suffix in _SUFFIXES:
                _unlink(os.path.join(SHM_DIR, self.name + suffix))

    def close(self) -> None:
        """Closes the FIFOs; the memory goes when the last view of it does."""
        self.closed = True
        self._finalizer()

    # -- messages ---------------------------------------------------------------------------

    def post_request(self, header: bytes) -> bool:
        """Writes a packed request header and rings; False when it does not fit or closed."""
        if self.closed or not _write(self._request_header, header):
            return False
        return self._ring(_REQUESTS, _SERVER_ASLEEP, self.requests_fd)

    def has_request(self) -> bool:
        """Whether a request has come that :meth:`take_request` has not taken."""
        return self._bells[_REQUESTS] != self._requests_seen

    def take_request(self) -> bytes:
        """The packed request header (after :meth:`has_request`, or the FIFO rang)."""
        self._requests_seen = self._bells[_REQUESTS]
        _fence()
        return _read(self._request_header)

    def post_reply(self, header: bytes) -> bool:
        """Writes a packed reply header and rings; False when it does not fit or closed."""
        if self.closed or not _write(self._reply_header, header):
            return False
        return self._ring(_REPLIES, _CLIENT_ASLEEP, self.replies_fd)

    def has_reply(self) -> bool:
        """Whether a reply has come that :meth:`take_reply` has not taken."""
        return self._bells[_REPLIES] != self._replies_seen

    def take_reply(self) -> bytes:
        self._replies_seen = self._bells[_REPLIES]
        _fence()
        return _read(self._reply_header)

    def _ring(self, count: int, asleep: int, fd: int) -> bool:
        bells = self._bells
        _fence()  # the message before its count
        bells[count] = (bells[count] + 1) & 0xFFFFFFFFFFFFFFFF
        _fence()  # the count before the sleeper's flag is read (the sleeper fences the other way)
        if not bells[asleep]:
            return True  # it is looking: no wake-up to pay
        try:
            os.write(fd, b"\x01")
        except BlockingIOError:
            pass  # a full FIFO already rings
        except BrokenPipeError:
            return False  # the other side has gone
        return True

    def sleep_for_requests(self, asleep: bool) -> None:
        """The server says whether it sleeps on the requests FIFO (then a request rings it);
        call :meth:`has_request` after saying so, before blocking."""
        self._bells[_SERVER_ASLEEP] = int(asleep)
        if asleep:
            _fence()

    def drain_requests(self) -> None:
        """Empties the requests FIFO after it polled readable."""
        _drain(self.requests_fd)

    def wait_reply(self, timeout: float, spin: float = 0.0) -> bool:
        """Waits up to ``timeout`` seconds for a reply: looking at the count for up to ``spin``
        seconds (see the module docstring) while the last replies came that soon
        (:class:`~psflow.transport.looks.Looks`), then asleep on the replies FIFO.

        Raises:
            LaneError: when the other side has closed its end (it exited) with nothing to read.
        """
        if self.has_reply():
            self._looks.waited(0.0, spin=spin)
            return True
        begun = time.monotonic()
        deadline = begun + timeout
        if spin > 0 and self._looks.worth():
            until = min(deadline, begun + spin)
            while time.monotonic() < until:
                os.sched_yield()
                if self.has_reply():
                    self._looks.waited(time.monotonic() - begun, spin=spin)
                    return True
        if self._reply_poller is None:
            self._reply_poller = select.poll()
            self._reply_poller.register(self.replies_fd, select.POLLIN)
        bells = self._bells
        bells[_CLIENT_ASLEEP] = 1
        try:
            while True:
                _fence()
                if self.has_reply():
                    self._looks.waited(time.monotonic() - begun, spin=spin)
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                events = self._reply_poller.poll(max(1, int(min(left, _NAP_SECONDS) * 1000)))
                if events:
                    _drain(self.replies_fd)
                    if not events[0][1] & select.POLLIN and not self.has_reply():
                        raise LaneError("the other side hung up")
        finally:
            bells[_CLIENT_ASLEEP] = 0

    def sleep_for_replies(self, asleep: bool) -> None:
        """The client says whether it sleeps on the replies FIFO (for a wait on several peers
        at once; :meth:`wait_reply` says so itself)."""
        self._bells[_CLIENT_ASLEEP] = int(asleep)
        if asleep:
            _fence()

    def drain_replies(self) -> None:
        _drain(self.replies_fd)

    def __repr__(self) -> str:
        return f"Lane({self.name}, request={self.request_bytes}, reply={self.reply_bytes})"


_live: weakref.WeakSet[Lane] = weakref.WeakSet()


def _close_in_child() -> None:
    # A forked child (a DataLoader process) must not hold its parent's FIFOs open: a ps would
    # not see the lane hang up when the parent dies.
    for lane in list(_live):
        lane.close()


os.register_at_fork(after_in_child=_close_in_child)


def _fence() -> None:
    """A full memory barrier: an uncontended lock is taken with an atomic read-modify-write
    (``lock cmpxchg`` on x86), which no load or store crosses. Python has no other."""
    _fence_lock.acquire()
    _fence_lock.release()


def _write(area: memoryview, header: bytes) -> bool:
    n = len(header)
    if n + 4 > len(area):
        return False
    area[:4] = n.to_bytes(4, "little")
    area[4 : 4 + n] = header
    return True


def _read(area: memoryview) -> bytes:
    n = int.from_bytes(area[:4], "little")
    if n > len(area) - 4:
        raise LaneError(f"a lane message claims {n} bytes")
    return area[4 : 4 + n].tobytes()


def _drain(fd: int) -> None:
    # Not contextlib.suppress: three calls more per message, on the path of every small step.
    try:  # noqa: SIM105
        os.read(fd, 4096)
    except BlockingIOError:
        pass  # the ring was drained already


def _open_private(path: str, flags: int, kind: str) -> int:
    fd = os.open(path, flags | os.O_NOFOLLOW)
    st = os.fstat(fd)
    is_kind = stat.S_ISFIFO if kind == "fifo" else stat.S_ISREG
    if not is_kind(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise LaneError(f"{path} is not a private {kind} of this user")
    return fd


def _close(fds: tuple[int, ...]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
