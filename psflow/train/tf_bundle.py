"""The files of a TensorFlow V2 checkpoint, as bytes: the index (a sorted table in LevelDB's
format, each block checked by a masked CRC32C) and its ``BundleEntryProto`` entries (where each
tensor, or slice of one, lies in the data files). :class:`~psflow.train.tf_reader.BundleReader`
reads tensors through them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import google_crc32c

from psflow.train.tf_proto import as_int, as_message, fields, varint

__all__ = ["Entry", "index_entries", "parse_entry", "slice_name", "slice_order", "unmask"]

_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_BYTES = 48
_BLOCK_TRAILER_BYTES = 5  # a compression type byte and a masked CRC32C
_MASK_DELTA = 0xA282EAD8


def unmask(crc: int) -> int:
    """A CRC32C as LevelDB and TensorFlow store it (rotated, plus a constant), undone."""
    rot = (crc - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


@dataclass
class Entry:
    """A ``BundleEntryProto``: where one tensor (or one slice of one) lies."""

    dtype: int = 0
    shape: tuple[int, ...] = ()
    shard: int = 0
    offset: int = 0
    size: int = 0
    crc32c: int = 0
    slices: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    """Per saved slice, ``(start, length)`` per dimension (length -1: the whole dimension)."""


def _shape(buf: bytes) -> tuple[int, ...]:
    dims = []
    for number, value in fields(buf):
        if number == 2:
            size = 0
            for n, v in fields(as_message(value)):
                if n == 1:
                    size = as_int(v)
            dims.append(size)
        elif number == 3 and value:
            raise ValueError("a tensor of unknown rank")
    if any(d < 0 for d in dims):
        raise ValueError(f"a tensor of shape {dims}")
    return tuple(dims)


def _slice(buf: bytes) -> tuple[tuple[int, int], ...]:
    extents = []
    for number, value in fields(buf):
        if number == 1:
            start, length = 0, -1
            for n, v in fields(as_message(value)):
                if n == 1:
                    start = as_int(v)
                elif n == 2:
                    length = as_int(v)
            extents.append((start, length))
    return tuple(extents)


def parse_entry(buf: bytes) -> Entry:
    """A ``BundleEntryProto`` from its bytes."""
    e = Entry()
    for number, value in fields(buf):
        if number == 1:
            e.dtype = as_int(value)
        elif number == 2:
            e.shape = _shape(as_message(value))
        elif number == 3:
            e.shard = as_int(value)
        elif number == 4:
            e.offset = as_int(value)
        elif number == 5:
            e.size = as_int(value)
        elif number == 6:
            e.crc32c = as_int(value)
        elif number == 7:
            e.slices.append(_slice(as_message(value)))
    return e


# -- LevelDB's table format ----------------------------------------------------------------


def _block(data: bytes, handle: bytes, what: str) -> bytes:
    """The contents of the block ``handle`` (offset, size) names, its CRC checked."""
    offset, pos = varint(handle, 0, len(handle))
    size, _ = varint(handle, pos, len(handle))
    end = offset + size
    if end + _BLOCK_TRAILER_BYTES > len(data):
        raise ValueError(f"{what}: a block runs past the end of the file (truncated?)")
    kind = data[end]
    (crc,) = struct.unpack_from("<I", data, end + 1)
    if google_crc32c.value(data[offset : end + 1]) != unmask(crc):
        raise ValueError(f"{what}: a block's CRC32C does not match (corrupted)")
    if kind != 0:
        raise ValueError(f"{what}: a block compressed with type {kind}; only uncompressed ones")
    return data[offset:end]


def _block_entries(block: bytes, what: str) -> Iterator[tuple[bytes, bytes]]:
    if len(block) < 4:
        raise ValueError(f"{what}: a block too short for its restart count")
    (restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    end = len(block) - 4 - 4 * restarts
    if end < 0:
        raise ValueError(f"{what}: a block's restart count ({restarts}) exceeds it")
    key = b""
    pos = 0
    while pos < end:
        shared, pos = varint(block, pos, end)
        own, pos = varint(block, pos, end)
        size, pos = varint(block, pos, end)
        if shared > len(key) or pos + own + size > end:
            raise ValueError(f"{what}: a malformed block entry")
        key = key[:shared] + block[pos : pos + own]
        pos += own
        yield key, block[pos : pos + size]
        pos += size


def index_entries(data: bytes, what: str) -> Iterator[tuple[bytes, bytes]]:
    """Every ``(key, value)`` of a table file's contents, in key order."""
    if len(data) < _FOOTER_BYTES:
        raise ValueError(f"{what}: too short for a table footer ({len(data)} bytes)")
    footer = data[-_FOOTER_BYTES:]
    (magic,) = struct.unpack_from("<Q", footer, _FOOTER_BYTES - 8)
    if magic != _TABLE_MAGIC:
        raise ValueError(f"{what}: not a TensorFlow checkpoint index (bad magic number)")
    _, pos = varint(footer, 0, 40)  # the metaindex block: none that matters here
    _, pos = varint(footer, pos, 40)
    index = _block(data, footer[pos:40], what)
    for _, handle in _block_entries(index, what):
        yield from _block_entries(_block(data, handle, what), what)


def slice_name(key: bytes) -> str:
    """The tensor a slice's key names (``OrderedCode``: a number 0, then the name with 0x00 and
    0xff escaped, ended by 0x00 0x01, then the slice)."""
    out = bytearray()
    pos = 1  # after the leading number 0
    while pos + 1 < len(key):
        byte = key[pos]
        if byte == 0x00:
            if key[pos + 1] == 0x01:
                return out.decode()
            out.append(0x00)  # 0x00 0xff
        elif byte == 0xFF:
            out.append(0xFF)  # 0xff 0x00
        else:
            out.append(byte)
            pos += 1
            continue
        pos += 2
    raise ValueError(f"a slice key {key!r} that names no tensor")


def slice_order(extents: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """A slice's place among its variable's keys: by start then length, dimension by dimension
    (the key's encoding preserves that order)."""
    return tuple(x for extent in extents for x in extent)
