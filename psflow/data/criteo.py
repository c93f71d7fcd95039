"""Criteo's click logs as text, into the TFRecord layout of :mod:`psflow.data.ctr`.

Criteo Kaggle's ``train.txt`` (45,840,617 lines over 7 days) and the Terabyte set's
``day_0`` .. ``day_23`` (also gzipped) hold one impression per line, tab-separated: the label
(0 or 1), 13 integer features (mostly counts; I2 goes negative), then 26 categorical
features, each a 32-bit hash as 8 hex digits. A missing value is an empty field. The lines are
in time order.

:func:`convert_criteo` writes them in :mod:`psflow.data.ctr`'s layout: ``label``,
``I1``..``I13`` int64 (a missing one 0), ``C1``..``C26`` int64 (the hash as an integer, a
missing one 0). The files have the names ``psflow data synth-ctr`` gives its own
(``train-0000i-of-0000N.tfrecord``, ``test-00000-of-00001.tfrecord``), so ``examples/ctr.py
--data OUT`` trains on real Criteo data as on the synthetic set. The held-out split is the
last ``test_fraction`` of the lines: the latest impressions, as DLRM holds out Kaggle's last
day. Or it is the files given as ``test`` (the Terabyte set's ``day_23``, say). Kaggle's
``test.txt`` has no labels, and it is refused.

The text is parsed a block of lines at a time with numpy, with no Python per line. A line
that is not Criteo's stops the conversion, naming its file and line:
- another number of fields;
- a label other than 0 or 1;
- a count that is not an integer;
- a categorical value that is not 8 hex digits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from psflow.data import fs
from psflow.data.ctr import CATEGORICAL, DENSE, HEX_DIGIT, serialize_ctr, shard_name
from psflow.data.line_input import line_blocks
from psflow.data.tfrecord import TFRecordWriter

META_FILE = "_criteo.json"
"""What :func:`convert_criteo` wrote: sources, examples and positive rate per split, missing
values per column, files. The ``_`` keeps it out of directory reads."""

FIELDS = 1 + len(DENSE) + len(CATEGORICAL)
"""Fields of a line: the label, 13 integer features, 26 categorical ones."""

BLOCK_BYTES = 8 << 20
"""Text parsed at a time (about 35,000 of Criteo's lines)."""

MAX_LINE_BYTES = 1 << 20
"""The longest line read by default (Criteo's are under 1 KB): a file that is not Criteo's
text, or a decompression bomb, stops at it (``--max-line-bytes`` raises it)."""

_TAB, _NL, _MINUS = 9, 10, 45
_MAX_DIGITS = 18
"""Digits an integer feature may have (int64 holds them all)."""


@dataclass(frozen=True)
class CriteoRows:
    """Parsed lines: ``label`` ``[n]``, ``dense`` ``[n, 13]`` and ``categorical`` ``[n, 26]``
    int64, and ``empty`` ``[n, 39]``, which feature fields were empty (missing values)."""

    label: np.ndarray
    dense: np.ndarray
    categorical: np.ndarray
    empty: np.ndarray

    def __len__(self) -> int:
        return len(self.label)

    def rows(self, at: slice) -> CriteoRows:
        return CriteoRows(self.label[at], self.dense[at], self.categorical[at], self.empty[at])

    def encode(self) -> tuple[bytes, np.ndarray]:
        """The rows as serialized Examples: ``(data, offsets)``."""
        return serialize_ctr(self.label, self.dense, self.categorical)


class BadLine(ValueError):
    """A line that is not Criteo's; ``line`` counts from 0 within the parsed text."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(problem)
        self.line = line
        self.problem = problem


def parse_lines(text: bytes) -> CriteoRows:
    """Criteo's lines (complete, each ending in ``\\n``) as arrays.

    Raises:
        BadLine: for the first line that is not Criteo's, with what is wrong.
    """
    buf = np.frombuffer(text, dtype=np.uint8)
    seps = np.flatnonzero((buf == _TAB) | (buf == _NL))
    is_nl = buf[seps] == _NL
    lines = int(is_nl.sum())
    if len(seps) != lines * FIELDS or not is_nl[FIELDS - 1 :: FIELDS].all():
        _bad_field_count(is_nl)
    ends = seps.reshape(lines, FIELDS)
    starts = np.empty_like(ends)
    starts[:, 1:] = ends[:, :-1] + 1
    if lines:
        starts[0, 0] = 0
        starts[1:, 0] = ends[:-1, -1] + 1
    lengths = ends - starts
    first = buf[starts[:, 0]]
    bad = (lengths[:, 0] != 1) | ((first != ord("0")) & (first != ord("1")))
    if bad.any():
        raise BadLine(int(bad.argmax()), "the label is not 0 or 1")
    label = (first - ord("0")).astype(np.int64)
    dense = _integers(buf, starts[:, 1:14], lengths[:, 1:14])
    categorical = _hashes(buf, starts[:, 14:], lengths[:, 14:])
    return CriteoRows(label, dense, categorical, lengths[:, 1:] == 0)


def _bad_field_count(is_nl: np.ndarray) -> None:
    nl_at = np.flatnonzero(is_nl)
    fields = np.diff(nl_at, prepend=-1)
    line = int((fields != FIELDS).argmax())
    count = int(fields[line])
    hint = (
        " (Criteo Kaggle's test.txt has no label column: convert train.txt, whose last lines "
        "are held out)"
        if count == FIELDS - 1
        else ""
    )
    raise BadLine(
        line,
        f"{count} tab-separated fields, expected {FIELDS} (the label, 13 integer and 26 "
        f"categorical features){hint}",
    )


def _first(bad: np.ndarray) -> int:
    """The first line (row) with a ``True`` in ``bad`` ``[n, k]``."""
    return int(bad.any(axis=1).argmax())


def _integers(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The integer features (``[n, 13]``; an empty field is 0), digit by digit."""
    neg = (lengths > 0) & (buf[starts] == _MINUS)
    digits_at = starts + neg
    digits = lengths - neg
    bad = (neg & (digits == 0)) | (digits > _MAX_DIGITS)
    if bad.any():
        raise BadLine(_first(bad), "an integer feature is not an integer")
    value = np.zeros(starts.shape, dtype=np.int64)
    for k in range(int(digits.max(initial=0))):
        has = digits > k
        d = buf[np.where(has, digits_at + k, 0)].astype(np.int64) - ord("0")
        bad = has & ((d < 0) | (d > 9))
        if bad.any():
            raise BadLine(_first(bad), "an integer feature is not an integer")
        value = np.where(has, value * 10 + d, value)
    return np.where(neg, -value, value)


def _hashes(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The categorical features (``[n, 26]``; an empty field is 0) from 8 hex digits each."""
    has = lengths == 8
    bad = ~has & (lengths != 0)
    value = np.zeros(starts.shape, dtype=np.int64)
    for k in range(8):
        nibble = HEX_DIGIT[buf[np.where(has, starts + k, 0)]]
        bad |= has & (nibble > 15)
        value = (value << 4) | np.where(has, nibble, 0)
    if bad.any():
        raise BadLine(_first(bad), "a categorical feature is not 8 hex digits")
    return value


def blocks(
    path: str, block_bytes: int | None = None, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[bytes]:
    """``path``'s text (gzipped when its name ends in ``.gz``, zlib's for ``.zlib``) in pieces of
    whole lines, each ending in ``\\n``; ``\\r\\n`` is taken as ``\\n``, and blank lines at the
    end are dropped. Read by :func:`~psflow.data.line_input.line_blocks`: a regular file only,
    each line at most ``max_line_bytes``, damaged compressed data named with its offset.

    Raises:
        ValueError: naming the file (and its line, or compressed byte offset).
    """
    blank = b""  # blank lines held back: dropped at the end, else a bad line
    for _, text in line_blocks(
        path, max_line_bytes=max_line_bytes, block_bytes=block_bytes or BLOCK_BYTES
    ):
        piece = _unix(text)
        body = piece.rstrip(b"\n")
        if body:
            yield blank + body + b"\n"
            blank = b"\n" * (len(piece) - len(body) - 1)
        else:
            blank += piece


def _unix(text: bytes) -> bytes:
    return text.replace(b"\r\n", b"\n") if b"\r" in text else text


def count_lines(paths: Sequence[str], max_line_bytes: int = MAX_LINE_BYTES) -> int:
    """Lines in ``paths`` (what :func:`blocks` gives)."""
    return sum(block.count(b"\n") for path in paths for block in blocks(path, None, max_line_bytes))


def read_criteo(paths: Sequence[str], max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[CriteoRows]:
    """Each file's lines, parsed a block at a time.

    Raises:
        ValueError: for a line that is not Criteo's, naming its file and line (from 1); a line
            over ``max_line_bytes``; a file that is not a regular file; damaged compressed data.
    """
    for path in paths:
        line = 0
        for block in blocks(path, None, max_line_bytes):
            try:
                rows = parse_lines(block)
            except BadLine as e:
                raise ValueError(
                    f"{path}, line {line + e.line + 1}: not a line of Criteo's click logs: "
                    f"{e.problem}"
                ) from None
            line += len(rows)
            yield rows


class _Split:
    """One split's files, rows dealt out evenly over them, and its counts."""

    def __init__(self, out_dir: str, name: str, shards: int, compression: str) -> None:
        self.names = [shard_name(name, i, shards, compression) for i in range(shards)]
        self.writers = [
            TFRecordWriter(fs.join(out_dir, n), compression=compression) for n in self.names
        ]
        self.examples = 0
        self.positives = 0
        self.missing = np.zeros(FIELDS - 1, dtype=np.int64)

    def write(self, rows: CriteoRows) -> None:
        if not len(rows):
            return
        data, offsets = rows.encode()
        view = memoryview(data)
        count = len(self.writers)
        for i in range(len(rows)):  # row after row, the files in turn
            w = self.writers[(self.examples + i) % count]
            w.write(view[offsets[i] : offsets[i + 1]])
        self.examples += len(rows)
        self.positives += int(rows.label.sum())
        self.missing += rows.empty.sum(axis=0)

    def close(self) -> None:
        for w in self.writers:
            w.close()

    def summary(self) -> dict[str, Any]:
        n = max(self.examples, 1)
        return {
            "examples": self.examples,
            "positive_rate": round(self.positives / n, 5),
            "missing": {
                name: round(int(m) / n, 5)
                for name, m in zip((*DENSE, *CATEGORICAL), self.missing, strict=True)
            },
        }


def convert_criteo(
    inputs: Sequence[str],
    out_dir: str,
    *,
    test: Sequence[str] = (),
    test_fraction: float = 0.1,
    shards: int = 4,
    compression: str = "",
    max_line_bytes: int = MAX_LINE_BYTES,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Writes Criteo's text files ``inputs`` as TFRecord splits in ``out_dir``, with
    :data:`META_FILE`.

    Args:
        inputs: Criteo text files (``train.txt``, ``day_N`` or ``day_N.gz``), in time order.
        out_dir: a directory (local or fsspec URL), created if missing.
        test: files for the held-out split; when none, the last ``test_fraction`` of the
            lines of ``inputs`` (they are counted first: a gzipped file is read twice).
        shards: training files; the rows are dealt out over them in turn.
        compression: ``""``, ``"GZIP"`` or ``"ZLIB"``.
        max_line_bytes: the longest line read (a longer one stops the conversion, named: a
            decompression bomb or a file that is not Criteo's text stops there).
        log: a callable taking one line of progress (e.g. ``print``), or None.

    Returns:
        What :data:`META_FILE` holds.

    Raises:
        ValueError: for bad arguments, or a line that is not Criteo's (its file and line).
    """
    start = time.perf_counter()
    if not inputs:
        raise ValueError("no input files")
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if max_line_bytes < 1:
        raise ValueError(f"max_line_bytes must be at least 1, got {max_line_bytes}")
    if not test and not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    compression = compression.upper()
    if compression not in ("", "GZIP", "ZLIB"):
        raise ValueError(f"compression must be '', GZIP or ZLIB, got {compression!r}")
    held_from = None
    if not test:
        total = count_lines(inputs, max_line_bytes)
        held_from = total - round(total * test_fraction)
        if log is not None:
            log(f"{total:,} lines; the last {total - held_from:,} are held out")
    train = _Split(out_dir, "train", shards, compression)
    held = _Split(out_dir, "test", 1, compression)
    try:
        seen = 0
        for rows in read_criteo(inputs, max_line_bytes):
            cut = len(rows) if held_from is None else min(max(held_from - seen, 0), len(rows))
            train.write(rows.rows(slice(0, cut)))
            held.write(rows.rows(slice(cut, None)))
            seen += len(rows)
            if log is not None and seen // 1_000_000 != (seen - len(rows)) // 1_000_000:
                log(f"{seen:,} lines")
        for rows in read_criteo(test, max_line_bytes):
            held.write(rows)
    finally:
        train.close()
        held.close()
    result: dict[str, Any] = {
        "source": {
            "train": list(inputs),
            "test": list(test) if test else f"the last {test_fraction} of the lines",
        },
        "layout": {
            "label": "int64",
            "dense": {"names": list(DENSE), "dtype": "int64", "transform": "log1p"},
            "categorical": {"names": list(CATEGORICAL), "dtype": "int64"},
        },
        "train": train.summary(),
        "test": held.summary(),
        "files": {"train": train.names, "test": held.names},
        "seconds": round(time.perf_counter() - start, 2),
    }
    with fs.open_write(fs.join(out_dir, META_FILE)) as f:
        f.write((json.dumps(result, indent=2) + "\n").encode())
    if log is not None:
        for split in ("train", "test"):
            s = result[split]
            log(f"{split}: {s['examples']:,} examples, {s['positive_rate']:.2%} positive")
    return result
