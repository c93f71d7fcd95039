"""TFRecord files, byte-compatible with TensorFlow's ``TFRecordWriter`` and ``TFRecordDataset``.

Each record on disk is::

    uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)

little-endian, the whole stream optionally GZIP- or ZLIB-compressed. This module is the one
place to import them from; each role has a module of its own:

- ``tfrecord_framing.py``: one record's framing (:func:`encode_record`), its checksum
  (:func:`masked_crc32c`, also vectorized over many headers), :class:`DataLossError`
- ``tfrecord_compression.py``: :func:`resolve_compression`, and the inflated stream a reader
  reads (bounded, so a "zip bomb" costs time, never memory)
- ``tfrecord_reader.py``: :class:`TFRecordReader`, :class:`RecordBatch`, :func:`read_records`
  (chunked reads, checksums verified per chunk, hostile lengths refused, resynchronisation)
- ``tfrecord_writer.py``: :class:`TFRecordWriter`, :func:`write_records`
"""

from __future__ import annotations

from psflow.data.tfrecord_compression import COMPRESSIONS, resolve_compression
from psflow.data.tfrecord_framing import DataLossError, encode_record, masked_crc32c
from psflow.data.tfrecord_reader import (
    DEFAULT_CHUNK_SIZE,
    MAX_RECORD_BYTES,
    RecordBatch,
    TFRecordReader,
    read_records,
)
from psflow.data.tfrecord_writer import TFRecordWriter, write_records

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_CHUNK_SIZE",
    "MAX_RECORD_BYTES",
    "DataLossError",
    "RecordBatch",
    "TFRecordReader",
    "TFRecordWriter",
    "encode_record",
    "masked_crc32c",
    "read_records",
    "resolve_compression",
    "write_records",
]
