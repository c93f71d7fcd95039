"""The Criteo layout of click-through-rate data: its features, and how their values are written.

One ``tf.train.Example`` per impression with Criteo Kaggle's column names, each feature one
value:

- ``label``: int64, 1 for a click;
- ``I1`` .. ``I13``: int64, the raw integer counts of Criteo's text files (the reader applies
  ``log1p``, as every published Criteo pipeline does before the bottom MLP);
- ``C1`` .. ``C26``: int64 ids. Criteo's text files hold 32-bit hashes as 8 hex digits; here the
  same 32-bit value is an integer (``int("68fd1e64", 16)``), so it goes to a hashed embedding
  table as is. ``--categorical hex`` writes the 8-digit strings instead (``bytes_list``), as
  converters that copy Criteo's text column by column do; the reader takes either, and also float
  ``I`` columns, finding out from the first record.

What :func:`~psflow.data.synth_ctr.write_synth_ctr` and :func:`~psflow.data.criteo.convert_criteo`
write (:func:`serialize_ctr`, :func:`shard_name`), and what
:func:`~psflow.data.ctr_reader.ctr_batches` reads (:func:`parse_hex`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from psflow.data.encode import serialize_examples

LABEL = "label"
DENSE = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))


def serialize_ctr(
    label: np.ndarray,
    dense: np.ndarray,
    ids: np.ndarray,
    *,
    categorical: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[bytes, np.ndarray]:
    """Examples in this module's layout, serialized: ``(data, offsets)`` as
    :func:`~psflow.data.encode.serialize_examples` gives them. ``label`` ``[n]``, ``dense``
    ``[n, 13]``, ``ids`` ``[n, 26]``; ``categorical`` turns a column of ids into what its
    feature holds (:func:`hex_strings`), the ids as they are when ``None``."""
    cols: dict[str, np.ndarray] = {LABEL: label}
    for j, name in enumerate(DENSE):
        cols[name] = dense[:, j]
    for c, name in enumerate(CATEGORICAL):
        cols[name] = ids[:, c] if categorical is None else categorical(ids[:, c])
    return serialize_examples(cols)


def hex_strings(ids: np.ndarray) -> np.ndarray:
    """32-bit ids as Criteo's 8 lowercase hex digits (``numpy.bytes_`` of width 8)."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
        raise ValueError("hex ids must be in [0, 2**32)")
    digits = (ids[:, None] >> (4 * np.arange(7, -1, -1))[None, :]) & 0xF
    chars = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)[digits]
    return np.ascontiguousarray(chars).view("S8").reshape(-1)


HEX_DIGIT = np.full(256, 16, dtype=np.int64)
"""Each byte's value as a hex digit (either case); 16 for a byte that is none."""
HEX_DIGIT[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)
HEX_DIGIT[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


class BadValue(ValueError):
    """A value that no CTR example can hold (a label other than 0 or 1, a dense value that is
    not finite, an id that is not hexadecimal), at ``row`` of the values checked."""

    def __init__(self, row: int, what: str):
        super().__init__(f"row {row}: {what}")
        self.row = row
        self.what = what


HEX_SHIFTS = 4 * np.arange(7, -1, -1)


def parse_hex(values: Any) -> np.ndarray:
    """Criteo's hex strings (bytes) as int64 ids; an empty string (a missing value) is 0.

    Each must be hex digits only (``[0-9a-fA-F]+``: no sign, ``0x``, ``_`` or spaces, which
    Python's ``int(v, 16)`` would take) and fit int64; else :class:`BadValue` names the first
    that does not, and its row.
    """
    arr = np.asarray(values, dtype=object).reshape(-1)
    if not len(arr):
        return np.zeros(0, dtype=np.int64)
    lengths = np.fromiter(map(len, arr), dtype=np.int64, count=len(arr))
    raw = np.frombuffer(b"".join(arr), dtype=np.uint8)
    nib = HEX_DIGIT[raw]
    if not (nib < 16).all():
        row = int(np.searchsorted(np.cumsum(lengths), int(np.argmax(nib == 16)), side="right"))
        raise BadValue(row, f"{arr[row]!r} is not hexadecimal (digits 0-9, a-f, A-F only)")
    if (lengths == 8).all():
        return (nib.reshape(-1, 8) << HEX_SHIFTS[None, :]).sum(axis=1)
    ids = [int(v, 16) if len(v) else 0 for v in arr]
    too_big = next((i for i, v in enumerate(ids) if v >= 1 << 63), None)
    if too_big is not None:
        raise BadValue(too_big, f"{arr[too_big]!r} does not fit int64")
    return np.asarray(ids, dtype=np.int64)


def shard_name(split: str, i: int, count: int, compression: str) -> str:
    """``<split>-0000i-of-0000N.tfrecord``, with ``.gz`` or ``.zlib`` for ``compression``."""
    suffix = {"": "", "GZIP": ".gz", "ZLIB": ".zlib"}[compression]
    return f"{split}-{i:05d}-of-{count:05d}.tfrecord{suffix}"
