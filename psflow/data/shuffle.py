"""tf.data's shuffle buffer over whole :class:`RecordBatch` chunks: :func:`shuffle_batches`.

The buffer holds references to records (the buffer they live in, where, how long), not copies,
and takes each arriving chunk's records in one go: which record each arrival lets out, and which
it leaves in its place, are found with a sort of the chunk's draws, in numpy, with no Python
step per record. The records let out are packed into one buffer by one call of the compiled
module (:func:`psflow.data.native.pack_records`; a join where it is missing).

The order is tf.data's and the old per-record loop's, draw for draw: the buffer fills with the
first ``buffer_size`` records; each later record takes the place of the one it lets out, at a
uniform random slot; the rest leave in a random order at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from psflow.data import native
from psflow.data.tfrecord import RecordBatch

__all__ = ["shuffle_batches"]

DRAW_BLOCK = 4096
"""Slots drawn from the generator at a time (the draws, and so the order, depend on it)."""
MIN_ARRIVAL = 4096
"""Records taken in at once: smaller chunks (an interleave's blocks) wait for more, up to
:data:`MAX_WAITING_BYTES`."""
MAX_WAITING_BYTES = 1 << 20
"""Bytes of records that wait for more to arrive, at most (long records never wait)."""
SLACK_BYTES = 4 << 20
"""Bytes of buffers kept alive beyond twice what the held records take, before those records
are packed into a buffer of their own (each buffer read stays alive while one of its records is
held). Packing copies the held records only, so its cost follows the buffer's size, not the
stream's: ``examples/ctr.py``'s worker (a buffer of 5,120 records, 3.4 MB) holds about 16 MB
more than a buffer of copies did, with 16 MB here 33 MB, its reading as fast."""


class _Refs:
    """Records as where they live: each one's buffer (a key of the owner's table), the offset in
    it, its length and its address (for the compiled packing)."""

    __slots__ = ("addr", "key", "length", "start")

    def __init__(self, key: np.ndarray, start: np.ndarray, length: np.ndarray, addr: np.ndarray):
        self.key, self.start, self.length, self.addr = key, start, length, addr

    @classmethod
    def empty(cls, n: int) -> _Refs:
        return cls(*(np.zeros(n, dtype=np.int64) for _ in range(4)))

    @classmethod
    def concat(cls, parts: list[_Refs]) -> _Refs:
        if len(parts) == 1:
            return parts[0]
        return cls(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("key", "start", "length", "addr")
            )
        )

    def take(self, i: np.ndarray | slice) -> _Refs:
        return _Refs(self.key[i], self.start[i], self.length[i], self.addr[i])

    def put(self, i: np.ndarray | slice, other: _Refs) -> None:
        self.key[i], self.start[i] = other.key, other.start
        self.length[i], self.addr[i] = other.length, other.addr

    def __len__(self) -> int:
        return len(self.key)


class _Buffers:
    """The buffers records are held in, by key, each with how many held records live in it."""

    def __init__(self) -> None:
        self.objs: dict[int, bytes | bytearray | memoryview] = {}
        self.held: dict[int, int] = {}
        self.keys: dict[int, int] = {}  # id of a buffer to its key, while it is kept
        self.live = 0  # bytes of the held records
        self._next = 0

    def add(self, batch: RecordBatch) -> _Refs:
        """``batch``'s records as references (its buffer kept until none of them is held)."""
        key = self.keys.get(id(batch.buffer))
        if key is None:
            key = self._next
            self._next += 1
            self.objs[key] = batch.buffer
            self.held[key] = 0
            self.keys[id(batch.buffer)] = key
        starts = np.asarray(batch.starts, dtype=np.int64)
        lengths = np.asarray(batch.lengths, dtype=np.int64)
        size = memoryview(batch.buffer).nbytes
        if len(starts) != len(lengths) or (
            len(starts) and ((starts < 0) | (lengths < 0) | (starts + lengths > size)).any()
        ):
            # The packing copies from these addresses: a record outside its buffer is refused.
            raise ValueError(f"records outside their buffer of {size} bytes ({batch.path!r})")
        key_of = np.full(len(batch), key, dtype=np.int64)
        return _Refs(key_of, starts, lengths, starts + _address(batch.buffer))

    def count(self, refs: _Refs, sign: int) -> None:
        """``refs`` enter (``sign`` 1) or leave (-1) the shuffle buffer."""
        keys, counts = np.unique(refs.key, return_counts=True)
        for key, c in zip(keys.tolist(), counts.tolist(), strict=True):
            self.held[key] += sign * c
        self.live += sign * int(refs.length.sum())

    def release(self) -> None:
        """Forgets the buffers no held record lives in."""
        for key in [k for k, c in self.held.items() if c == 0]:
            del self.keys[id(self.objs[key])], self.held[key], self.objs[key]

    def nbytes(self) -> int:
        return sum(memoryview(b).nbytes for b in self.objs.values())

    def pack(self, refs: _Refs) -> RecordBatch:
        """The records of ``refs``, in order, in one new buffer."""
        packed: bytes | memoryview | None = native.pack_records(refs.addr, refs.length)
        if packed is None:
            views = {k: memoryview(b).cast("B") for k, b in self.objs.items()}
            packed = b"".join(
                views[k][s : s + n]
                for k, s, n in zip(
                    refs.key.tolist(), refs.start.tolist(), refs.length.tolist(), strict=True
                )
            )
        starts = np.zeros(len(refs), dtype=np.int64)
        if len(refs) > 1:
            np.cumsum(refs.length[:-1], out=starts[1:])
        return RecordBatch(packed, starts, refs.length.copy(), np.arange(len(refs), dtype=np.int64))


def _address(buffer: bytes | bytearray | memoryview) -> int:
    raw = np.frombuffer(buffer, dtype=np.uint8)
    return int(raw.ctypes.data) if len(raw) else 0


class _Draws:
    """The slots drawn, ``DRAW_BLOCK`` at a time from ``rng``, handed out in order."""

    def __init__(self, rng: np.random.Generator, buffer_size: int):
        self.rng, self.size = rng, buffer_size
        self.block = np.zeros(0, dtype=np.int64)
        self.at = 0

    def take(self, n: int) -> np.ndarray:
        parts = []
        while n:
            if self.at == len(self.block):
                self.block, self.at = self.rng.integers(0, self.size, DRAW_BLOCK), 0
            k = min(n, len(self.block) - self.at)
            parts.append(self.block[self.at : self.at + k])
            self.at += k
            n -= k
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


def shuffle_batches(
    batches: Iterator[RecordBatch], buffer_size: int, rng: np.random.Generator
) -> Iterator[RecordBatch]:
    """tf.data's shuffle buffer of ``buffer_size`` records over ``batches``, the records let out
    handed on as packed :class:`RecordBatch` chunks (their ``indices`` count within the chunk,
    their ``path`` is ``""``: the records of one chunk come from anywhere).
    """
    if buffer_size < 1:
        raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
    owners = _Buffers()
    slots = _Refs.empty(buffer_size)
    filled = 0
    draws = _Draws(rng, buffer_size)
    waiting: list[_Refs] = []
    have = waiting_bytes = 0

    def arrive(refs: _Refs) -> RecordBatch | None:
        nonlocal filled
        fill = min(len(refs), buffer_size - filled)
        if fill:
            entering = refs.take(slice(0, fill))
            slots.put(slice(filled, filled + fill), entering)
            owners.count(entering, 1)
            filled += fill
        rest = refs.take(slice(fill, None))
        out = (
            owners.pack(_let_out(slots, rest, draws.take(len(rest)), owners)) if len(rest) else None
        )
        owners.release()
        if owners.nbytes() > 2 * owners.live + SLACK_BYTES:
            held = slots.take(slice(0, filled))
            packed = owners.add(owners.pack(held))
            owners.count(held, -1)
            owners.count(packed, 1)
            owners.release()
            slots.put(slice(0, filled), packed)
        return out

    for batch in batches:
        if not len(batch):
            continue
        refs = owners.add(batch)
        waiting.append(refs)
        have += len(batch)
        waiting_bytes += int(refs.length.sum())
        if have < MIN_ARRIVAL and waiting_bytes < MAX_WAITING_BYTES:
            continue
        out = arrive(_Refs.concat(waiting))
        waiting, have, waiting_bytes = [], 0, 0
        if out is not None:
            yield out
    if waiting:
        out = arrive(_Refs.concat(waiting))
        if out is not None:
            yield out
    order = np.arange(filled)
    rng.shuffle(order)
    if filled:
        yield owners.pack(slots.take(order))


def _let_out(slots: _Refs, arriving: _Refs, drawn: np.ndarray, owners: _Buffers) -> _Refs:
    """The records that ``arriving``'s records let out of ``slots``, in order, each arrival
    taking the slot it drew; ``slots`` and the owners' counts left as after the last arrival.

    Arrival ``k`` lets out what slot ``drawn[k]`` holds then: the arrival before it that drew
    the same slot, if any, else what the slot held before them all. A stable sort of the draws
    puts each arrival just after the one before it with the same slot.
    """
    n = len(drawn)
    order = np.argsort(drawn, kind="stable")
    sorted_slots = drawn[order]
    same = sorted_slots[1:] == sorted_slots[:-1]
    before = np.full(n, -1, dtype=np.int64)  # the arrival that drew the same slot before k
    before[order[1:][same]] = order[:-1][same]
    from_arrivals = before >= 0
    out = slots.take(drawn)  # what each drawn slot held before this group arrived
    if from_arrivals.any():
        out.put(from_arrivals, arriving.take(before[from_arrivals]))
    owners.count(out.take(~from_arrivals), -1)
    last = np.ones(n, dtype=bool)  # the last arrival at each slot stays there
    last[:-1] = ~same
    stay = order[last]
    slots.put(drawn[stay], arriving.take(stay))
    owners.count(arriving.take(stay), 1)
    return out
