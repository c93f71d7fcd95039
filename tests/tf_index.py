"""TensorFlow checkpoint indexes built by hand, for hostile-file tests and the fuzzer: an index
of any entries, with valid block CRCs (a LevelDB table of one data block, no key sharing),
and the protobuf wire format of its ``BundleEntryProto`` values."""

from __future__ import annotations

import google_crc32c


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, value: int | bytes) -> bytes:
    """One protobuf field: a varint, or length-delimited bytes."""
    if isinstance(value, bytes):
        return varint(number << 3 | 2) + varint(len(value)) + value
    return varint(number << 3) + varint(value)


def masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A LevelDB table block, no key sharing, with its trailer (type 0, masked CRC32C)."""
    body = b"".join(varint(0) + varint(len(k)) + varint(len(v)) + k + v for k, v in entries)
    body += (0).to_bytes(4, "little") + (1).to_bytes(4, "little")  # one restart, at 0
    return body + b"\0" + masked_crc32c(body + b"\0").to_bytes(4, "little")


def index_file(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A whole ``.index`` file holding ``entries`` (sorted by key), every CRC valid."""
    data = block(entries)
    handle = varint(0) + varint(len(data) - 5)
    index = block([(entries[-1][0], handle)])
    footer = varint(0) + varint(0) + varint(len(data)) + varint(len(index) - 5)
    footer = footer.ljust(40, b"\0") + (0xDB4775248B80FB57).to_bytes(8, "little")
    return data + index + footer


def entry(
    dtype: int,
    shape: list[int],
    *,
    offset: int = 0,
    size: int = 0,
    crc: int | None = None,
    shard: int = 0,
    slices: list[list[tuple[int, int]]] | None = None,
) -> bytes:
    """A ``BundleEntryProto``: ``slices`` as ``(start, length)`` per dimension (-1 whole)."""
    dims = b"".join(field(2, field(1, d)) for d in shape)
    out = field(1, dtype) + field(2, dims)
    if shard:
        out += field(3, shard)
    out += field(4, offset) + field(5, size)
    if crc is not None:
        out += b"\x35" + crc.to_bytes(4, "little")
    for extents in slices or []:
        ext = b""
        for start, length in extents:
            inner = field(1, start) + (field(2, length) if length >= 0 else b"")
            ext += field(1, inner)
        out += field(7, ext)
    return out


def slice_key(name: str, n: int) -> bytes:
    """A key that sorts among ``name``'s slices (the reader takes them in key order)."""
    return b"\x00" + name.encode() + b"\x00\x01" + n.to_bytes(4, "big")
