"""Shared-memory lanes: large tensors between a client and a server on the same host.

Over loopback TCP a 100 MB gradient is copied twice by the kernel and once more into place,
and ZeroMQ's I/O threads spend CPU on every chunk. When a worker and a ps share a host, a
*lane* moves the tensor bytes through one shared-memory segment instead, with one ``memcpy``
per side; the request and reply headers still travel over the socket, so ordering, timeouts,
validation and error replies stay exactly those of the socket path.

A lane is made by the client, for one server: a file in ``/dev/shm`` (mode 0600, created
exclusively, a random name) holding a request area and a reply area. The client writes a
random token at its start and asks the server to attach (``_lane``, handled by the transport,
never seen by the ps). The server opens it only if the name has the lane form, the file is a
regular file of this user with no access for anyone else, its size is the announced one and
the token matches: this proves both sides see the same memory. Then the client unlinks the
name, so nothing is left behind in ``/dev/shm`` when either process dies; the mappings live
until both have dropped them.

A lane carries one request at a time: the client uses it only when no other request to that
server is in flight, and retires it when a request through it times out.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import secrets
import stat
from typing import Any

import numpy as np

from psflow.transport.wire import lane_bytes

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
TOKEN_BYTES = 16
_START = 64
"""The areas start after the token, 64-byte aligned."""
_NAME = re.compile(r"psflow-[0-9a-f]{32}\Z")


def _aligned(n: int) -> int:
    return lane_bytes([n])


class LaneError(ValueError):
    """A lane could not be made or attached (the reason says why); the socket path remains."""


class Lane:
    """One shared-memory segment: ``request`` and ``reply`` areas (uint8 arrays).

    Example:
        >>> lane = Lane.create(1 << 20, 1 << 20)  # doctest: +SKIP
        >>> peer = Lane.attach(lane.name, lane.token, 1 << 20, 1 << 20)  # doctest: +SKIP
        >>> lane.unlink()  # doctest: +SKIP
    """

    def __init__(
        self, name: str, token: bytes, buf: mmap.mmap, request_bytes: int, reply_bytes: int
    ) -> None:
        self.name = name
        self.token = token
        self.request_bytes = request_bytes
        self.reply_bytes = reply_bytes
        whole = np.frombuffer(buf, dtype=np.uint8)
        start = _START
        self.request = whole[start : start + request_bytes]
        start += _aligned(request_bytes)
        self.reply = whole[start : start + reply_bytes]
        self._linked = False

    @staticmethod
    def size(request_bytes: int, reply_bytes: int) -> int:
        return _START + _aligned(request_bytes) + _aligned(reply_bytes)

    @classmethod
    def create(cls, request_bytes: int, reply_bytes: int) -> Lane:
        """A new segment, its space reserved (so a full ``/dev/shm`` fails here, not later).

        Raises:
            LaneError: when there is no ``/dev/shm`` or no room in it.
        """
        if request_bytes < 0 or reply_bytes < 0:
            raise LaneError(f"bad lane sizes {request_bytes}, {reply_bytes}")
        name = f"psflow-{secrets.token_hex(16)}"
        path = os.path.join(SHM_DIR, name)
        size = cls.size(request_bytes, reply_bytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise LaneError(f"cannot create {path}: {e.strerror}") from None
        try:
            try:
                # Reserve the pages now: a sparse file in a full tmpfs would SIGBUS on write.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)
            buf = mmap.mmap(fd, size)
        except OSError as e:
            os.close(fd)
            _unlink(path)
            raise LaneError(f"cannot make a {size}-byte lane in {SHM_DIR}: {e.strerror}") from None
        os.close(fd)
        token = secrets.token_bytes(TOKEN_BYTES)
        buf[:TOKEN_BYTES] = token
        lane = cls(name, token, buf, request_bytes, reply_bytes)
        lane._linked = True
        return lane

    @classmethod
    def attach(cls, name: Any, token: Any, request_bytes: Any, reply_bytes: Any) -> Lane:
        """Maps a client's segment after checking that it is what the client says it is.

        The arguments come from the network: each is checked before use.

        Raises:
            LaneError: naming what did not match.
        """
        if not isinstance(name, str) or not _NAME.match(name):
            raise LaneError(f"{name!r} is not a lane name")
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise LaneError("bad lane token")
        for n in (request_bytes, reply_bytes):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise LaneError(f"bad lane size {n!r}")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise LaneError(f"cannot open {path}: {e.strerror} (another host?)") from None
        try:
            st = os.fstat(fd)
            size = cls.size(request_bytes, reply_bytes)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise LaneError(f"{path} is not a private file of this user")
            if st.st_size != size:
                raise LaneError(f"{path} holds {st.st_size} bytes, not {size}")
            buf = mmap.mmap(fd, size)
        except OSError as e:
            raise LaneError(f"cannot map {path}: {e.strerror}") from None
        finally:
            os.close(fd)
        if not secrets.compare_digest(buf[:TOKEN_BYTES], token):
            raise LaneError(f"{path} does not hold the announced token (another host?)")
        return cls(name, token, buf, request_bytes, reply_bytes)

    def unlink(self) -> None:
        """Removes the name (the mappings stay valid); the creator calls it once attached."""
        if self._linked:
            self._linked = False
            _unlink(os.path.join(SHM_DIR, self.name))

    def __repr__(self) -> str:
        return f"Lane({self.name}, request={self.request_bytes}, reply={self.reply_bytes})"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
