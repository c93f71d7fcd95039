"""Serializing many ``tf.train.Example`` records of one layout at once, in numpy.

Building one protobuf message per record costs tens of microseconds in Python; a generator that
writes a million records of 40 features would spend minutes there. Records whose features each
hold exactly one value (an int64, a float32 or a fixed-width bytes string) differ only in their
varint lengths, so they can be laid out side by side: each record is written into one row of a
``(records, widest record)`` byte matrix, field by field (one numpy assignment per field for all
records), and a mask of the bytes each row really uses compacts the matrix into the records.

The bytes are exactly those of :func:`psflow.data.proto.serialize_example` (map keys sorted,
packed lists), which the tests check.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from psflow.data.proto import check_float32, check_int64

_MAX_KEY = 64
_MAX_VALUE = 48  # with _MAX_KEY: every length inside a map entry fits a one-byte varint


def varints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Varint encodings of int64 values (negative ones as 10 bytes, as protobuf writes them).

    Returns:
        ``(bytes, lengths)``: a ``(widest, n)`` uint8 matrix whose column ``i`` starts with the
        ``lengths[i]`` bytes of value ``i`` (the rest is zero).
    """
    v = np.asarray(values).astype(np.int64).view(np.uint64)
    lengths = np.ones(len(v), dtype=np.int64)
    for k in range(1, 10):
        lengths += v >= np.uint64(1 << (7 * k))
    width = int(lengths.max()) if len(v) else 1
    out = np.empty((width, len(v)), dtype=np.uint8)
    for j in range(width):
        group = ((v >> np.uint64(7 * j)) & np.uint64(0x7F)).astype(np.uint8)
        group[lengths - 1 > j] |= 0x80
        group[lengths <= j] = 0
        out[j] = group
    return out, lengths


class _Rows:
    """Records side by side, filled field by field: each field owns fixed byte positions.

    The matrix is ``(position, record)`` so that each field's write is contiguous. A field
    shorter in some records leaves unused bytes there, marked in ``keep``; compacting by ``keep``
    closes those gaps, so no record ever needs its own write position.
    """

    def __init__(self, n: int, width: int):
        self.buf = np.zeros((width, n), dtype=np.uint8)
        self.keep = np.ones((width, n), dtype=bool)
        self.col = 0

    def const(self, data: bytes) -> None:
        """The same bytes in every record."""
        end = self.col + len(data)
        self.buf[self.col : end] = np.frombuffer(data, dtype=np.uint8)[:, None]
        self.col = end

    def put(self, data: np.ndarray, lengths: np.ndarray | None = None) -> None:
        """Record ``i`` gets ``data[:lengths[i], i]`` (all of ``data[:, i]`` without lengths)."""
        end = self.col + data.shape[0]
        self.buf[self.col : end] = data
        if lengths is not None:
            self.keep[self.col : end] = np.arange(data.shape[0])[:, None] < lengths[None, :]
        self.col = end

    def records(self) -> tuple[bytes, np.ndarray]:
        n = self.buf.shape[1]
        self.keep[self.col :] = False
        keep = np.ascontiguousarray(self.keep.T)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(keep.sum(axis=1), out=offsets[1:])
        return np.ascontiguousarray(self.buf.T)[keep].tobytes(), offsets


def _payload(name: str, values: np.ndarray) -> tuple[int, np.ndarray, np.ndarray | None]:
    """(Feature's list tag, list bodies as a (bytes, n) matrix, their lengths if they vary)."""
    kind = values.dtype.kind
    n = len(values)
    if kind in "iub":
        data, lengths = varints(check_int64(values, f"feature {name!r}"))
        return 0x1A, data, lengths  # int64_list, packed: its body is the varints
    if kind == "f":
        narrow = check_float32(values, f"feature {name!r}")
        data = np.ascontiguousarray(narrow.astype("<f4")).view(np.uint8).reshape(n, 4)
        return 0x12, np.ascontiguousarray(data.T), None
    if kind == "S":
        width = values.dtype.itemsize
        data = np.frombuffer(values.tobytes(), dtype=np.uint8).reshape(n, width)
        if width and (data[:, -1] == 0).any():
            raise ValueError(
                f"feature {name!r}: bytes values must all have the same length ({width}); "
                "numpy pads shorter ones with zeros"
            )
        return 0x0A, np.ascontiguousarray(data.T), None
    raise TypeError(f"feature {name!r}: cannot encode numpy dtype {values.dtype}")


def serialize_examples(features: Mapping[str, np.ndarray]) -> tuple[bytes, np.ndarray]:
    """Serializes ``n`` Examples that each hold one value per feature.

    Args:
        features: feature name to a 1-D array of ``n`` values: integers (``int64_list``;
            unsigned ones of 2**63 and above raise ``ValueError``), floats (``float_list``,
            float32 on the wire; a finite value beyond float32's range raises ``ValueError``) or
            fixed-width bytes (``numpy.bytes_`` of one length, ``bytes_list``).

    Returns:
        ``(data, offsets)``: record ``i`` is ``data[offsets[i]:offsets[i + 1]]``, byte-identical
        to ``serialize_example({name: values[i] ...})``.

    Example:
        >>> data, offsets = serialize_examples({"label": np.array([0, 1]),
        ...                                     "x": np.array([0.5, 2.0], dtype=np.float32)})
        >>> data[offsets[1]:offsets[2]] == serialize_example({"label": 1, "x": 2.0})  # doctest: +SKIP
        True
    """
    if not features:
        raise ValueError("serialize_examples needs at least one feature")
    sizes = {len(np.asarray(v)) for v in features.values()}
    if len(sizes) != 1:
        raise ValueError(f"every feature needs the same number of values, got sizes {sizes}")
    n = sizes.pop()
    pieces = []
    width = 0
    for name in sorted(features):
        key = name.encode()
        if not 0 < len(key) <= _MAX_KEY:
            raise ValueError(f"feature name {name!r}: 1 to {_MAX_KEY} bytes")
        values = np.asarray(features[name]).reshape(-1)
        tag, data, lengths = _payload(name, values)
        if data.shape[0] > _MAX_VALUE:
            raise ValueError(
                f"feature {name!r}: values over {_MAX_VALUE} bytes are not supported here"
            )
        if lengths is None:
            lengths = np.full(n, data.shape[0], dtype=np.int64)
            pieces.append((key, tag, data, lengths, False))
        else:
            pieces.append((key, tag, data, lengths, True))
        width += 10 + len(key) + data.shape[0]
    body = np.zeros(n, dtype=np.int64)
    for key, _, _, lengths, _ in pieces:
        body += 10 + len(key) + lengths
    head, head_len = varints(body)
    out = _Rows(n, 1 + head.shape[0] + width)
    out.const(b"\x0a")  # Example.features
    out.put(head, head_len)
    for key, tag, data, lengths, varies in pieces:
        # map entry {key, value: Feature {<tag>: List {value: <packed varints or one bytes>}}};
        # every length inside it is a one-byte varint (_MAX_KEY + _MAX_VALUE see to that)
        if varies:
            out.const(b"\x0a")
            out.put((8 + len(key) + lengths).astype(np.uint8)[None])
            out.const(b"\x0a" + bytes([len(key)]) + key + b"\x12")
            out.put((4 + lengths).astype(np.uint8)[None])
            out.const(bytes([tag]))
            out.put((2 + lengths).astype(np.uint8)[None])
            out.const(b"\x0a")
            out.put(lengths.astype(np.uint8)[None])
            out.put(data, lengths)
        else:
            size = data.shape[0]
            out.const(bytes([0x0A, 8 + len(key) + size, 0x0A, len(key)]) + key)
            out.const(bytes([0x12, 4 + size, tag, 2 + size, 0x0A, size]))
            out.put(data)
    return out.records()
