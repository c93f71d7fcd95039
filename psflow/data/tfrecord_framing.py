"""TFRecord's framing of one record, and its checksum.

Each record on disk is::

    uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)

little-endian. :func:`masked_crc32c` is TensorFlow's checksum of one piece, with google-crc32c's
C code; the ``_crc32c_8`` helpers compute the checksums of many 8-byte length fields at once in
numpy, and the ``_u32``/``_u64`` helpers read the integers at many offsets of a buffer at once
(what :mod:`psflow.data.tfrecord_reader` verifies a chunk of records with).
:class:`DataLossError` is what a reader raises for a record that breaks these rules.
"""

from __future__ import annotations

import struct

import google_crc32c
import numpy as np

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_MASK_DELTA = 0xA282EAD8
_HEADER = 12
_FOOTER = 4


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC32C rotated right by 15 bits plus a constant (TF's ``Mask``)."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _mask_np(crc: np.ndarray) -> np.ndarray:
    crc = crc.astype(np.uint32)
    return ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(_MASK_DELTA)


def _crc32c_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0x82F63B78), table >> 1)
    return table.astype(np.uint32)


_TABLE = _crc32c_table()


def _crc32c_8(buf: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """CRC32C of the 8 bytes at each position, for many positions at once."""
    crc = np.full(positions.shape, 0xFFFFFFFF, dtype=np.uint32)
    for k in range(8):
        crc = _TABLE[(crc ^ buf[positions + k]) & np.uint32(0xFF)] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


def _crc32c_8_every(buf: np.ndarray, start: int, stop: int) -> np.ndarray:
    """CRC32C of the 8 bytes at every offset in ``[start, stop)``: slices, no index arrays."""
    n = stop - start
    crc = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    for k in range(8):
        crc = _TABLE[(crc ^ buf[start + k : start + k + n]) & np.uint32(0xFF)] ^ (
            crc >> np.uint32(8)
        )
    return crc ^ np.uint32(0xFFFFFFFF)


def _int_at(buf: np.ndarray, positions: np.ndarray, dtype: str) -> np.ndarray:
    """The little-endian integer at each byte offset: one gather from an unaligned view."""
    size = np.dtype(dtype).itemsize
    if len(buf) < size:
        return np.zeros(0, dtype=dtype)
    view = np.ndarray((len(buf) - size + 1,), dtype=dtype, buffer=buf, strides=(1,))
    return view[positions]


def _u32_every(buf: bytes, start: int, stop: int) -> np.ndarray:
    """The little-endian uint32 at every byte offset in ``[start, stop)``."""
    return np.ndarray((stop - start,), dtype="<u4", buffer=buf, offset=start, strides=(1,))


def _u32_at(buf: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return _int_at(buf, positions, "<u4")


def _u64_at(buf: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return _int_at(buf, positions, "<u8")


def encode_record(data: bytes | bytearray | memoryview) -> bytes:
    """One record framed as TFRecord: header, data and footer."""
    data = bytes(data)
    header = _U64.pack(len(data))
    return b"".join(
        (header, _U32.pack(masked_crc32c(header)), data, _U32.pack(masked_crc32c(data)))
    )


class DataLossError(OSError):
    """A corrupt or truncated TFRecord file (TensorFlow raises ``DataLossError`` here too).

    Attributes:
        path: the file.
        offset: byte offset of the bad record's header (in the decompressed stream if the file
            is compressed).
        index: 0-based index of the bad record in the file.
        reason: what is wrong.
    """

    def __init__(self, path: str, offset: int, index: int, reason: str, compressed: bool = False):
        where = "offset in the decompressed stream" if compressed else "byte offset"
        super().__init__(
            f"{path}: corrupted record at {where} {offset} (record index {index}): {reason}"
        )
        self.path = path
        self.offset = offset
        self.index = index
        self.reason = reason
