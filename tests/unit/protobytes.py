"""Protocol-buffer wire bytes written by hand, for tests of the decoders' edge cases."""

from __future__ import annotations


def varint(v: int) -> bytes:
    """``v`` as a protobuf varint (negative numbers as their 64-bit two's complement)."""
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def ld(field: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return varint(field << 3 | 2) + varint(len(payload)) + payload
