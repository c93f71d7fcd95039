"""Protobuf's wire format, read without protobuf: the few messages of TensorFlow's checkpoints
(a bundle's header and entries, the object graph of a ``tf.train.Checkpoint``).

Each message is walked field by field (:func:`fields`); a field past its message's end, or of a
wire type proto3 has no use for, raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["as_int", "as_message", "fields", "varint"]


def varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``buf[pos:end]`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("a varint runs past its message")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """``(field number, value)`` of a message: an int, or the bytes of a length-delimited one."""
    pos, end = 0, len(buf)
    while pos < end:
        tag, pos = varint(buf, pos, end)
        number, kind = tag >> 3, tag & 7
        if kind == 0:
            value, pos = varint(buf, pos, end)
            yield number, value
        elif kind in (1, 5):
            size = 8 if kind == 1 else 4
            if pos + size > end:
                raise ValueError("a fixed-size field runs past its message")
            yield number, int.from_bytes(buf[pos : pos + size], "little")
            pos += size
        elif kind == 2:
            size, pos = varint(buf, pos, end)
            if pos + size > end:
                raise ValueError("a length-delimited field runs past its message")
            yield number, buf[pos : pos + size]
            pos += size
        else:
            raise ValueError(f"unexpected wire type {kind} in field {number}")


def as_int(value: int | bytes) -> int:
    """An int64 field's value (a varint read as two's complement)."""
    if not isinstance(value, int):
        raise ValueError("a number field holds bytes")
    return value - (1 << 64) if value >= 1 << 63 else value  # int64 as two's complement


def as_message(value: int | bytes) -> bytes:
    """A length-delimited field's bytes (a message, a string)."""
    if not isinstance(value, bytes):
        raise ValueError("a message field holds a number")
    return value
