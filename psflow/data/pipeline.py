"""The record pipeline of one shard: file assignment, interleave, batching, prefetch (the
shuffle buffer is :mod:`psflow.data.shuffle`).

Every function here is a plain generator over :class:`RecordBatch` objects, so that the pipeline
moves whole buffers and never touches records one by one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from psflow.data.tfrecord import RecordBatch, TFRecordReader

T = TypeVar("T")

FileShard = tuple[str, int, tuple[int, int, int] | None]
"""(path, position in the epoch's file order, record filter for :class:`TFRecordReader`)."""


def assign_files(
    files: Sequence[str], shard_index: int, num_shards: int, *, seed: int, epoch: int, shuffle: bool
) -> list[FileShard]:
    """The files (and, with fewer files than shards, the records) one shard reads in one epoch.

    With at least as many files as shards, shard ``i`` reads files ``i::num_shards`` of the
    epoch's file order (shuffled with ``(seed, epoch)`` when ``shuffle``, identically in every
    shard, so the assignment stays a partition). With fewer files, every shard reads every file
    and keeps record ``j`` of file ``f`` when ``(j + f) % num_shards == i``; the ``+ f`` spreads
    the remainders of short files over the shards.
    """
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}")
    order = list(files)
    if shuffle:
        perm = np.random.default_rng([seed, epoch]).permutation(len(order))
        order = [order[i] for i in perm]
    if len(order) >= num_shards:
        whole: list[FileShard] = [(f, i, None) for i, f in enumerate(order)]
        return whole[shard_index::num_shards]
    return [(f, i, (shard_index, num_shards, i)) for i, f in enumerate(order)]


def interleave(
    shards: Sequence[FileShard],
    open_reader: Callable[[str, tuple[int, int, int] | None], TFRecordReader],
    *,
    cycle_length: int,
    block_length: int,
) -> Iterator[RecordBatch]:
    """Reads ``cycle_length`` files at a time, ``block_length`` records from each in turn.

    ``cycle_length == 1`` reads the files one after another, whole chunks at a time.
    """
    pending = list(shards)
    active: list[tuple[Iterator[RecordBatch], list[RecordBatch]]] = []

    def refill() -> None:
        while pending and len(active) < cycle_length:
            path, _, keep = pending.pop(0)
            active.append((open_reader(path, keep).iter_batches(), []))

    refill()
    if cycle_length == 1:
        while active:
            yield from active.pop()[0]
            refill()
        return
    i = 0
    while active:
        i %= len(active)
        it, carry = active[i]
        need = block_length
        while need > 0:
            if not carry:
                nxt = next(it, None)
                if nxt is None:
                    break
                carry.append(nxt)
            head = carry[0]
            take = min(need, len(head))
            yield slice_batch(head, 0, take)
            need -= take
            if take == len(head):
                carry.pop(0)
            else:
                carry[0] = slice_batch(head, take, len(head))
        if need > 0:  # this file is done
            active.pop(i)
            refill()
        else:
            i += 1


def slice_batch(b: RecordBatch, lo: int, hi: int) -> RecordBatch:
    """Records ``lo:hi`` of a batch, sharing its buffer."""
    return RecordBatch(b.buffer, b.starts[lo:hi], b.lengths[lo:hi], b.indices[lo:hi], b.path)


def rebatch(
    batches: Iterator[RecordBatch], batch_size: int, *, drop_remainder: bool
) -> Iterator[RecordBatch]:
    """Batches of exactly ``batch_size`` records (the last may be smaller unless dropped).

    A batch inside one chunk is a zero-copy slice; one spanning chunks is packed into one buffer.
    """
    parts: list[RecordBatch] = []
    have = 0
    for b in batches:
        lo = 0
        while lo < len(b):
            take = min(batch_size - have, len(b) - lo)
            part = slice_batch(b, lo, lo + take)
            lo += take
            if not parts and take == batch_size:
                yield part
                continue
            parts.append(part)
            have += take
            if have == batch_size:
                yield _concat(parts)
                parts, have = [], 0
    if parts and not drop_remainder:
        yield _concat(parts)


def batch_units(
    batches: Iterator[RecordBatch], batch_size: int, *, max_records: int
) -> Iterator[RecordBatch]:
    """:func:`rebatch`'s batches, grouped into runs of whole batches for one parse call each.

    Every unit but the last holds a multiple of ``batch_size`` records (at most ``max_records``,
    and at least one batch), so that cutting the units in ``batch_size`` rows gives exactly the
    batches of :func:`rebatch`. A unit is a zero-copy slice of one chunk unless it completes a
    batch that spans chunks. Parsing a few thousand records at once costs much less per record
    than parsing them a batch at a time.
    """
    per_unit = max(max_records // batch_size, 1) * batch_size
    parts: list[RecordBatch] = []
    have = 0
    for b in batches:
        lo = 0
        if have:  # first complete the batch that spans from the chunks before
            take = min(batch_size - have, len(b))
            parts.append(slice_batch(b, 0, take))
            have += take
            lo = take
            if have < batch_size:
                continue
            yield _concat(parts)
            parts, have = [], 0
        while len(b) - lo >= batch_size:
            hi = lo + min(per_unit, (len(b) - lo) // batch_size * batch_size)
            yield slice_batch(b, lo, hi)
            lo = hi
        if lo < len(b):
            parts, have = [slice_batch(b, lo, len(b))], len(b) - lo
    if parts:
        yield _concat(parts)


def _concat(parts: list[RecordBatch]) -> RecordBatch:
    """One batch of the records of ``parts``, in one new buffer.

    Each part's records usually lie in ascending order in one stretch of its buffer (only
    framing bytes between them), so that stretch is copied whole and the offsets moved: one
    copy per part, none per record. Parts that are scattered are packed record by record.
    """
    if len(parts) == 1:
        return parts[0]
    pieces: list[bytes | bytearray | memoryview] = []
    starts, lengths = [], []
    at = 0
    for p in parts:
        if not len(p):
            continue
        lo = int(p.starts[0])
        hi = int(p.starts[-1] + p.lengths[-1])
        if (np.diff(p.starts) >= p.lengths[:-1]).all() and hi - lo <= 2 * p.nbytes + 64 * len(p):
            pieces.append(memoryview(p.buffer)[lo:hi])  # copied once, by the join below
            starts.append(p.starts - lo + at)
            at += hi - lo
        else:
            packed = RecordBatch.from_records(p)
            pieces.append(packed.buffer)
            starts.append(packed.starts + at)
            at += len(packed.buffer)
        lengths.append(p.lengths)
    path = parts[0].path
    if all(p.path == path for p in parts):
        indices = np.concatenate([p.indices for p in parts])
    else:  # from several files: errors can only name the position in the batch
        path, indices = "", np.arange(sum(map(len, parts)), dtype=np.int64)
    if not pieces:
        z = np.zeros(0, dtype=np.int64)
        return RecordBatch(b"", z, z, z, path)
    return RecordBatch(
        b"".join(pieces), np.concatenate(starts), np.concatenate(lengths), indices, path
    )


_DONE = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def prefetch(source: Iterator[T], depth: int) -> Iterator[T]:
    """Runs ``source`` in a background thread, ``depth`` items ahead of the consumer.

    Reading and decompression release the GIL, so the thread overlaps I/O with the consumer's
    work. Errors are re-raised in the consumer; closing the generator stops the thread.
    """
    if depth <= 0:
        yield from source
        return
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in source:
                if not put(item):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, who re-raises it
            put(_Failure(e))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name="psflow-data-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join(timeout=5)
