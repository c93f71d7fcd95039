"""The shuffle buffer over whole chunks (``psflow/data/shuffle.py``) against tf.data's
per-record loop, draw for draw, on both paths of the compiled module (its packing)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest

from psflow.data import shuffle
from psflow.data.shuffle import shuffle_batches
from psflow.data.tfrecord import RecordBatch

pytestmark = pytest.mark.unit


def per_record(records: list[bytes], buffer_size: int, rng: np.random.Generator) -> list[bytes]:
    """tf.data's shuffle buffer one record at a time: the order the chunks must give."""
    buf: list[bytes] = []
    out: list[bytes] = []
    draws: Iterator[int] = iter(())
    for record in records:
        if len(buf) < buffer_size:
            buf.append(record)
            continue
        j = next(draws, None)
        if j is None:
            draws = iter(rng.integers(0, buffer_size, shuffle.DRAW_BLOCK).tolist())
            j = next(draws)
        buf[j], record = record, buf[j]
        out.append(record)
    rng.shuffle(buf)  # type: ignore[arg-type]
    return out + buf


def chunks(records: list[bytes], sizes: list[int], as_slices: bool) -> Iterator[RecordBatch]:
    """``records`` in chunks of ``sizes`` (the last takes the rest), each its own buffer with
    gaps between its records, or slices of one buffer shared by every chunk."""
    framed = [b"<-" + r + b"->" for r in records]
    whole = RecordBatch.from_records(framed)
    starts, lengths = whole.starts + 2, whole.lengths - 4
    at = 0
    for size in [*sizes, len(records)]:
        size = min(size, len(records) - at)
        lo, hi = at, at + size
        at = hi
        if as_slices:
            yield RecordBatch(whole.buffer, starts[lo:hi], lengths[lo:hi], np.arange(lo, hi))
        else:
            own = RecordBatch.from_records(framed[lo:hi])
            yield RecordBatch(own.buffer, own.starts + 2, own.lengths - 4, np.arange(lo, hi))
        if at == len(records):
            return


@pytest.mark.parametrize(
    ("n", "buffer_size"),
    [(0, 5), (3, 5), (5, 5), (6, 5), (1000, 1), (5000, 7), (12_000, 100), (9000, 5000)],
)
@pytest.mark.parametrize("slack", [shuffle.SLACK_BYTES, 0])
def test_chunks_give_the_per_record_order(
    path: str, monkeypatch: pytest.MonkeyPatch, n: int, buffer_size: int, slack: int
) -> None:
    """The same records in the same order as one at a time, whatever the chunks (single
    records, empty ones, thousands, slices of one buffer), with the held records packed anew
    after every arrival (``slack`` 0) or as rarely as the default."""
    monkeypatch.setattr(shuffle, "SLACK_BYTES", slack)
    gen = np.random.default_rng(n + buffer_size)
    records = [gen.bytes(int(gen.integers(0, 40))) + i.to_bytes(4, "little") for i in range(n)]
    sizes = [int(s) for s in gen.choice([0, 1, 3, 700, 5000], size=40)]
    want = per_record(records, buffer_size, np.random.default_rng(9))
    for as_slices in (False, True):
        got = [
            r
            for b in shuffle_batches(
                chunks(records, sizes, as_slices), buffer_size, np.random.default_rng(9)
            )
            for r in b
        ]
        assert got == want


def test_buffers_are_let_go_once_none_of_their_records_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream of 30 MB through a buffer of 100 records of 1 KB holds about a megabyte of
    arrivals, what they let out and the chunks the held records live in (at most twice their
    bytes beyond ``SLACK_BYTES``), never the stream."""
    monkeypatch.setattr(shuffle, "SLACK_BYTES", 0)
    record = bytes(1000)

    def stream() -> Iterator[RecordBatch]:
        for _ in range(300):
            yield RecordBatch.from_records([record] * 100)  # 100 KB, made as it is read

    tracemalloc.start()
    try:
        count = sum(len(b) for b in shuffle_batches(stream(), 100, np.random.default_rng(0)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == 30_000
    assert peak < 8_000_000, f"peak {peak} bytes traced"


def test_a_buffer_of_no_records_is_refused() -> None:
    with pytest.raises(ValueError, match="buffer_size must be >= 1, got 0"):
        next(shuffle_batches(iter(()), 0, np.random.default_rng(0)))


def test_a_record_outside_its_buffer_is_refused() -> None:
    """The packing copies from each record's place: one that lies outside its buffer is an
    error, never a read past it."""
    bad = RecordBatch(b"0123456789", np.array([0, 8]), np.array([4, 4]), np.arange(2), "f.tfrecord")
    with pytest.raises(
        ValueError, match=r"records outside their buffer of 10 bytes \('f.tfrecord'\)"
    ):
        list(shuffle_batches(iter([bad]), 1, np.random.default_rng(0)))
