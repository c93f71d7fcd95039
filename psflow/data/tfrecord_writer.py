"""Writing TFRecord files: :class:`TFRecordWriter` and :func:`write_records`.

Byte-identical to TensorFlow's ``tf.io.TFRecordWriter``, compressed or not: the framing is
:mod:`psflow.data.tfrecord_framing`'s, the compression
:mod:`psflow.data.tfrecord_compression`'s.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable
from typing import IO, Any

from psflow.data import fs
from psflow.data.tfrecord_compression import _wbits, resolve_compression
from psflow.data.tfrecord_framing import _U32, _U64, masked_crc32c


class TFRecordWriter:
    """Writes a TFRecord file byte-identical to TensorFlow's ``tf.io.TFRecordWriter``.

    Args:
        path: local path or fsspec URL (parent directories are created), or an open binary file
            (not closed by :meth:`close`).
        compression: ``""``, ``"GZIP"``, ``"ZLIB"`` or ``"auto"`` (by file suffix).
        compression_level: zlib level; TensorFlow's default is zlib's default (6).

    Example:
        >>> with TFRecordWriter("out.tfrecord") as w:  # doctest: +SKIP
        ...     w.write(serialize_example({"label": 1, "x": [0.5, 2.0]}))
    """

    _FLUSH_AT = 1 << 20

    def __init__(
        self,
        path: str | os.PathLike[str] | IO[bytes],
        *,
        compression: str | None = "auto",
        compression_level: int = zlib.Z_DEFAULT_COMPRESSION,
    ):
        if isinstance(path, str | os.PathLike):
            self.path = os.fspath(path)
            self._f: IO[bytes] = fs.open_write(self.path)
            self._owns = True
        else:
            self.path = getattr(path, "name", "<file>")
            self._f = path
            self._owns = False
        self.compression = resolve_compression(str(self.path), compression)
        # TensorFlow's ZlibCompressionOptions: mem_level 9, window bits 15 (+16 for gzip).
        self._comp: Any = (
            zlib.compressobj(compression_level, zlib.DEFLATED, _wbits(self.compression), 9)
            if self.compression
            else None
        )
        self._parts: list[bytes] = []
        self._pending = 0
        self.records = 0
        self._closed = False

    def __enter__(self) -> TFRecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, record: bytes | bytearray | memoryview) -> None:
        """Appends one record."""
        if self._closed:
            raise ValueError(f"{self.path}: write after close")
        record = bytes(record)
        header = _U64.pack(len(record))
        self._parts += (
            header,
            _U32.pack(masked_crc32c(header)),
            record,
            _U32.pack(masked_crc32c(record)),
        )
        self.records += 1
        self._pending += len(record) + 16
        if self._pending >= self._FLUSH_AT:
            self._drain()

    def write_all(self, records: Iterable[bytes | bytearray | memoryview]) -> None:
        for record in records:
            self.write(record)

    def _drain(self) -> None:
        data = b"".join(self._parts)
        self._parts.clear()
        self._pending = 0
        if self._comp is not None:
            data = self._comp.compress(data)
        if data:
            self._f.write(data)

    def flush(self) -> None:
        """Writes buffered records to the file (a compressed stream is synced, not finished)."""
        self._drain()
        if self._comp is not None:
            self._f.write(self._comp.flush(zlib.Z_SYNC_FLUSH))
        self._f.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._drain()
        if self._comp is not None:
            self._f.write(self._comp.flush(zlib.Z_FINISH))
        self._closed = True
        if self._owns:
            self._f.close()
        else:
            self._f.flush()


def write_records(
    path: str | os.PathLike[str], records: Iterable[bytes], *, compression: str | None = "auto"
) -> int:
    """Writes ``records`` to a new file; returns how many."""
    with TFRecordWriter(path, compression=compression) as w:
        w.write_all(records)
        return w.records
