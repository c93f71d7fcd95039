"""Sealed messages (``psflow.transport.seal``): what opens is what was sealed, once, in order,
under the session's keys; everything else is refused, naming why, and changes nothing."""

from __future__ import annotations

import random
import secrets
import struct

import numpy as np
import pytest

from psflow.transport import seal
from psflow.transport.seal import Seal, SealError, Sessions, read_prefix

pytestmark = pytest.mark.skipif(not seal.available(), reason="needs the cryptography package")

MAX = 1 << 30


def _pair() -> tuple[Seal, Seal]:
    """A client's and a server's ends of one session."""
    session, up, down, _ = Sessions().new()
    return Seal(session, send=up, receive=down), Seal(session, send=down, receive=up)


def _frames(*sizes: int) -> list[bytes]:
    return [secrets.token_bytes(n) for n in sizes]


@pytest.mark.parametrize("sizes", [(0,), (1,), (100, 0, 3), (16384, 1 << 20, 7), tuple(range(40))])
def test_what_opens_is_what_was_sealed(sizes: tuple[int, ...]) -> None:
    client, server = _pair()
    for _ in range(3):
        frames = _frames(*sizes)
        prefix, body = client.seal(frames)
        assert len(body) == sum(sizes) + 16 * len(sizes)
        opened = server.open(prefix, body, max_bytes=MAX)
        assert [bytes(f) for f in opened] == frames
        # Writable, 64-byte aligned views: tensors are made on them in place.
        assert all(not f.readonly for f in opened)
        assert all(np.frombuffer(f, np.uint8).ctypes.data % 64 == 0 for f in opened if len(f))
    # And the other way, under the other key.
    prefix, body = server.seal([b"reply"])
    assert [bytes(f) for f in client.open(prefix, body, max_bytes=MAX)] == [b"reply"]


def test_nothing_is_sent_in_the_clear() -> None:
    client, _ = _pair()
    secret = b"the model's rows " * 100
    prefix, body = client.seal([b"header", secret])
    assert secret[:32] not in bytes(body) and secret[:32] not in prefix


def test_every_changed_byte_is_refused_and_the_session_goes_on() -> None:
    client, server = _pair()
    frames = _frames(40, 3, 200)
    prefix, body = client.seal(frames)
    raw = bytes(body)
    for at in range(len(prefix)):
        bad = bytearray(prefix)
        bad[at] ^= 0x01
        with pytest.raises(SealError):
            server.open(bytes(bad), raw, max_bytes=MAX)
    for at in range(0, len(raw), 7):
        bad = bytearray(raw)
        bad[at] ^= 0x80
        with pytest.raises(SealError):
            server.open(prefix, bytes(bad), max_bytes=MAX)
    # Refusals change nothing: the true message still opens, once.
    assert [bytes(f) for f in server.open(prefix, raw, max_bytes=MAX)] == frames
    with pytest.raises(SealError, match="replayed"):
        server.open(prefix, raw, max_bytes=MAX)


def test_replays_and_reordering_are_refused() -> None:
    client, server = _pair()
    first = client.seal([b"push 1"])
    second = client.seal([b"push 2"])
    assert [bytes(f) for f in server.open(*second, max_bytes=MAX)] == [b"push 2"]
    with pytest.raises(SealError, match="replayed or out of order"):
        server.open(*first, max_bytes=MAX)
    with pytest.raises(SealError, match="replayed or out of order"):
        server.open(*second, max_bytes=MAX)
    # A message lost on the way leaves a gap, which is fine: counters only have to grow.
    client.seal([b"lost"])
    assert [bytes(f) for f in server.open(*client.seal([b"push 4"]), max_bytes=MAX)] == [b"push 4"]


def test_frames_moved_dropped_or_spliced_are_refused() -> None:
    client, server = _pair()
    prefix, body = client.seal([b"a" * 10, b"b" * 10])
    raw = bytes(body)
    swapped = raw[26:] + raw[:26]
    with pytest.raises(SealError, match="failed its tag"):
        server.open(prefix, swapped, max_bytes=MAX)
    with pytest.raises(SealError, match="bytes where its frames need"):
        server.open(prefix, raw[:26], max_bytes=MAX)
    # One frame's lengths announced, the first frame's ciphertext alone: the prefix differs.
    one = prefix[:28] + struct.pack("<I", 1) + prefix[32:40]
    with pytest.raises(SealError, match="failed its tag"):
        server.open(one, raw[:26], max_bytes=MAX)
    # The second frame of another message in place of this one's.
    other_prefix, other = client.seal([b"a" * 10, b"c" * 10])
    with pytest.raises(SealError, match="failed its tag"):
        server.open(other_prefix, bytes(other)[:26] + raw[26:], max_bytes=MAX)


def test_other_sessions_keys_and_directions_are_refused() -> None:
    client, server = _pair()
    _, other_server = _pair()
    message = client.seal([b"x"])
    with pytest.raises(SealError, match="another session"):
        other_server.open(*message, max_bytes=MAX)
    # The same session id with other keys: the tags fail.
    forged = Seal(client.session, send=secrets.token_bytes(32), receive=secrets.token_bytes(32))
    with pytest.raises(SealError, match="failed its tag"):
        server.open(*forged.seal([b"x"]), max_bytes=MAX)
    # A server's own reply sent back to it (each direction has its key).
    reply = server.seal([b"rows"])
    with pytest.raises(SealError, match="failed its tag"):
        server.open(*reply, max_bytes=MAX)
    assert [bytes(f) for f in server.open(*message, max_bytes=MAX)] == [b"x"]


def test_sizes_are_checked_before_anything_is_opened() -> None:
    client, server = _pair()
    prefix, body = client.seal([b"x" * 1000])
    with pytest.raises(SealError, match="at most 999"):
        server.open(prefix, body, max_bytes=999)
    for raw in [b"", b"psS1", b"XXXX" + prefix[4:], prefix[:-1], prefix + b"\0"]:
        with pytest.raises(SealError):
            read_prefix(raw, MAX)
    huge = struct.pack("<4s16sQI", seal.MAGIC, client.session, 0, seal.MAX_FRAMES + 1)
    with pytest.raises(SealError, match="frame"):
        read_prefix(huge + bytes(8 * (seal.MAX_FRAMES + 1)), MAX)


def test_arbitrary_bytes_only_ever_raise_seal_errors() -> None:
    rng = random.Random(20261128)
    _, server = _pair()
    forms = [b"", seal.MAGIC, seal.MAGIC + server.session]
    for _ in range(2000):
        head = rng.choice(forms) + rng.randbytes(rng.randrange(0, 60))
        if rng.random() < 0.3 and len(head) >= 32:  # a count that matches the lengths given
            n = rng.randrange(1, 4)
            head = head[:28] + struct.pack("<I", n) + rng.randbytes(8 * n)
        with pytest.raises(SealError):
            server.open(head, rng.randbytes(rng.randrange(0, 80)), max_bytes=MAX)


def test_sessions_keep_the_most_recent() -> None:
    sessions = Sessions(most=3)
    ids = [sessions.new()[0] for _ in range(3)]
    assert sessions.get(ids[0]) is not None  # used: now the most recent
    ids.append(sessions.new()[0])
    assert len(sessions) == 3
    assert sessions.get(ids[1]) is None
    assert all(sessions.get(i) is not None for i in (ids[0], ids[2], ids[3]))
    assert len(set(ids)) == 4
    # A dropped session's token goes with it: its connections are refused from then on.
    assert sorted(sessions.tokens) == sorted(i.hex() for i in (ids[0], ids[2], ids[3]))


def test_a_bad_session_or_key_size_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Seal(b"short", send=bytes(32), receive=bytes(32))
    with pytest.raises(ValueError, match="32 bytes"):
        Seal(bytes(16), send=bytes(31), receive=bytes(32))
