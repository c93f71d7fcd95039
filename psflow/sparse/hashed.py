"""A hashed table's rows on one shard: :class:`HashedRows`, any int64 id, rows made on demand.

A row is made the first time its id is updated (after ``min_count`` pushes, counted in a
count-min sketch), past ``max_rows`` the least recently updated rows go, and with
``ttl_seconds`` a row not updated for that long goes too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import psflow.sparse.kernels as kernels
from psflow import allocator
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse.admission import Admission
from psflow.sparse.evict import EvictionPool
from psflow.sparse.growth import Columns
from psflow.sparse.idmap import IdMap
from psflow.sparse.init import initial_rows
from psflow.sparse.mapped import MappedIds
from psflow.sparse.rows import Rows
from psflow.sparse.snapshot import STATE_PREFIX, RowSnapshot

INITIAL_CAPACITY = 1024
"""Rows a hashed shard makes room for at first; it doubles as rows come (up to ``max_rows``)."""

EVICTED_COMPACT_FROM = 1 << 16
"""Evicted ids noted for an export's tombstones are compacted from this many on
(:meth:`HashedRows._note_evicted`)."""

EXPIRY_SCANS_PER_TTL = 16
"""With ``ttl_seconds``, the rows are scanned for expired ones at most this many times per
time to live (and before every snapshot): an expired row lingers at most ``ttl / 16`` for
lookups, never into a checkpoint or export."""


class HashedRows(Rows):
    """The rows of a hashed table that one shard holds: any int64 id, rows made on demand.

    A row is created the first time its id is updated (a lookup of an unknown id returns its
    initial row without storing it). With ``min_count > 1`` an id's pushes are counted
    (:class:`~psflow.sparse.admission.Admission`, a count-min sketch) and its gradients dropped
    until it has been pushed ``min_count`` times. With ``max_rows`` the shard keeps at most that
    many rows, evicting the least recently updated (never one the same push updates): a hard
    cap, which loads (restores) keep too. With ``ttl_seconds`` a row not updated for that
    long is evicted (``expired``): the rows are scanned, in tensor operations, when the
    oldest may have expired and at most :data:`EXPIRY_SCANS_PER_TTL` times per TTL, and
    before every snapshot; the freed slots are filled with the last rows, so the rows in use
    stay the first :attr:`num_rows`. Time comes from ``clock`` (``time.monotonic``); a
    restored row's time starts at its restore. The id -> row map is an :class:`~psflow.sparse.idmap.IdMap`, asked once per request with all
    its ids; everything is tensor operations.

    Example:
        >>> spec = TableSpec(name="ids", embedding_dim=4, num_embeddings=None, max_rows=2)
        >>> rows = HashedRows(spec, shard=0, num_shards=1)
        >>> for i in (7, 8, 9):
        ...     rows.apply(torch.tensor([i]), torch.ones(1, 4))
        >>> rows.num_rows, rows.stats["evicted"]
        (2, 1)
    """

    values: torch.Tensor
    state: dict[str, torch.Tensor]
    slot_ids: torch.Tensor
    """The global id in each slot (the first :attr:`num_rows` are used)."""
    last_update: torch.Tensor
    """The update count at which each slot was last updated (least recent: evicted first)."""
    updated_at: torch.Tensor | None
    """With ``ttl_seconds``: the ``clock`` time at which each slot was last updated."""

    def __init__(
        self,
        spec: TableSpec,
        shard: int,
        num_shards: int,
        *,
        optimizer: RowOptimizerSpec | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if spec.num_embeddings is not None:
            raise ValueError(f"table {spec.name!r} has num_embeddings: use FixedRows")
        super().__init__(spec, shard, num_shards, optimizer=optimizer)
        self.max_rows = spec.max_rows
        capacity = (
            INITIAL_CAPACITY if self.max_rows is None else min(INITIAL_CAPACITY, self.max_rows)
        )
        self._n = 0
        self._index = IdMap(most=self.max_rows)
        self.mapped = MappedIds()
        self._tick = 0
        self.ttl = spec.ttl_seconds
        self._clock = clock
        self._next_expiry = -math.inf
        self._native_now: float | None = None
        """With a time to live, the time of the native request being served (expire_due)."""
        self.updated_at = None
        self.values = allocator.table_empty((capacity, self.dim), self.dtype)
        self.state = self.optimizer.new_state(capacity, self.dim, self.dtype, filled=False)
        self.slot_ids = torch.empty(capacity, dtype=torch.int64)
        self.last_update = torch.zeros(capacity, dtype=torch.int64)
        if self.ttl is not None:
            self.updated_at = torch.zeros(capacity, dtype=torch.float64)
        self._columns = Columns()
        """The tensors above grown together (:meth:`_grow`)."""
        self._evict = EvictionPool()
        """With ``max_rows``: the rows next to evict."""
        self.counts = {
            "admitted": 0,
            "not_admitted": 0,
            "evicted": 0,
            "expired": 0,
            "dropped_full": 0,
        }
        self._admission = Admission(spec.min_count, self.max_rows) if spec.min_count > 1 else None

    # -- storage -----------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        """Storage for ``capacity`` rows, the first ``self._n`` those of the current one.
        The rest is left as allocated: a slot gets its row and state as it is taken
        (:meth:`_store` writes fresh ones; :meth:`load` every state key, as its check
        requires), and the pages of slots never taken stay untouched (a table that just
        doubled its capacity does not fill the new half). A tensor past
        :data:`~psflow.allocator.RESERVE_FROM_BYTES` grows in place in a reservation
        (:class:`~psflow.sparse.growth.Columns`)."""
        columns = {
            "values": self.values,
            "slot_ids": self.slot_ids,
            "last_update": self.last_update,
        }
        columns |= {STATE_PREFIX + k: v for k, v in self.state.items()}
        if self.updated_at is not None:
            columns["updated_at"] = self.updated_at
        grown = self._columns.grown(
            columns, self._n, capacity, self.max_rows, zeroed=("last_update", "updated_at")
        )
        self.values, self.slot_ids = grown["values"], grown["slot_ids"]
        self.last_update, self.updated_at = grown["last_update"], grown.get("updated_at")
        self.state = {k: grown[STATE_PREFIX + k] for k in self.state}
        if self._changed is not None:
            changed = torch.zeros(capacity, dtype=torch.bool)
            changed[: self._n] = self._changed[: self._n]
            self._changed = changed

    @property
    def capacity(self) -> int:
        return self.values.shape[0]

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, -1 for ids not held."""
        return self._index.get(ids)

    def _take_slots(self, count: int) -> tuple[torch.Tensor, int | None]:
        """``count`` slots for new rows: free ones, by growing, or by evicting the least
        recently updated rows (the caller has marked the rows it is updating as recent); and
        the first when they are all free, one block in order (:meth:`_store` writes them so)."""
        n = self._n
        evict = 0 if self.max_rows is None else max(0, n + count - self.max_rows)
        assert evict <= n
        parts = []
        if evict:
            old = self._evict.take(evict, n, self.last_update, self.slot_ids)
            gone = self.slot_ids.index_select(0, old)
            self._index.remove(gone)
            self._note_evicted(gone)
            self.counts["evicted"] += evict
            parts.append(old)
        fresh = count - evict
        if n + fresh > self.capacity:
            capacity = self.capacity
            while capacity < n + fresh:
                capacity *= 2
            if self.max_rows is not None:
                capacity = min(capacity, self.max_rows)
            self._grow(capacity)
        parts.append(torch.arange(n, n + fresh, dtype=torch.int64))
        self._n = n + fresh
        if len(parts) > 1:
            return torch.cat(parts), None
        return parts[0], n

    def _store(self, ids: torch.Tensor, slots: torch.Tensor, first: int | None) -> None:
        """Makes ``slots`` hold the initial rows of ``ids`` and fresh state (``first``: the
        slots are the block from there, of :meth:`_take_slots`)."""
        self._preserve(slots)
        spec = self.spec
        if first is not None:
            # None evicted: the rows made in place, the state set by slices.
            block = slice(first, first + slots.numel())
            initial_rows(
                spec.seed, ids, self.dim, std=spec.init_std, dtype=self.dtype,
                padding_idx=spec.padding_idx, out=self.values[block],
            )  # fmt: skip
            self.optimizer.reset_block(self.state, block)
            self.slot_ids[block] = ids
        else:
            fresh = initial_rows(
                spec.seed, ids, self.dim, std=spec.init_std, dtype=self.dtype,
                padding_idx=spec.padding_idx,
            )  # fmt: skip
            kernels.put_rows(self.values, slots, fresh)
            self.optimizer.reset_rows(self.state, slots)
            kernels.put_rows(self.slot_ids, slots, ids)
        self._index.put(ids, slots)

    # -- time to live -------------------------------------------------------------------------

    def _note_evicted(self, ids: torch.Tensor) -> None:
        """Remembers evicted ids for the next export's tombstones (once one is tracked). Past
        twice what the last compaction kept, they are compacted (:meth:`_tombstones`): an id
        evicted again and again between exports is held once, and one held again not at all."""
        if self._changed is not None:
            self._evicted.append(ids.clone())
            noted = sum(t.numel() for t in self._evicted)
            kept = self._evicted[0].numel()  # the last compaction's
            if noted > max(EVICTED_COMPACT_FROM, 2 * kept):
                self._evicted = [self._tombstones()]

    def _expire_due(self) -> float:
        """The clock's time; the expired rows evicted first when a scan is due."""
        now = self._clock()
        if now >= self._next_expiry:
            self._expire(now)
        return now

    def _expire_now(self) -> None:
        if self.ttl is not None:
            self._expire(self._clock())

    def _expire(self, now: float) -> None:
        """Evicts every row not updated for ``ttl`` seconds; schedules the next scan."""
        ttl, at = self.ttl, self.updated_at
        assert ttl is not None and at is not None
        n = self._n
        if n:
            gone = (at[:n] <= now - ttl).nonzero().squeeze(1)
            if gone.numel():
                self._remove_slots(gone)
                self.counts["expired"] += gone.numel()
        n = self._n
        oldest = float(at[:n].min()) if n else now
        self._next_expiry = max(oldest + ttl, now + ttl / EXPIRY_SCANS_PER_TTL)

    def _remove_slots(self, gone: torch.Tensor) -> None:
        """Removes the rows at ``gone`` (ascending slots below :attr:`num_rows`), moving the
        last rows into the slots freed below the new count (rows in use stay contiguous)."""
        ids = self.slot_ids.index_select(0, gone)
        self._index.remove(ids)
        self._note_evicted(ids)
        self._evict.clear()  # rows move to other slots
        n = self._n
        m = n - gone.numel()
        tail = torch.ones(n - m, dtype=torch.bool)
        tail[gone[gone >= m] - m] = False
        movers = torch.arange(m, n, dtype=torch.int64)[tail]
        holes = gone[gone < m]
        self._tick += 1
        if holes.numel():
            self._preserve(holes)  # snapshots in progress keep the rows moved over
            self.values.index_copy_(0, holes, self.values.index_select(0, movers))
            for tensor in self.state.values():
                tensor.index_copy_(0, holes, tensor.index_select(0, movers))
            moved = self.slot_ids.index_select(0, movers)
            self.slot_ids.index_copy_(0, holes, moved)
            self.last_update.index_copy_(0, holes, self.last_update.index_select(0, movers))
            at = self.updated_at
            assert at is not None
            at.index_copy_(0, holes, at.index_select(0, movers))
            if self._changed is not None:  # a moved row is as changed as it was
                self._changed.index_copy_(0, holes, self._changed.index_select(0, movers))
            self._index.remove(moved)
            self._index.put(moved, holes)
        if self._changed is not None:
            self._changed[m:n] = False
        self._n = m

    # -- the native request path (Rows.lookup_job, Rows.apply_job) ----------------------------

    def _native_map(self) -> tuple[int, int, int, int, int] | None:
        if self.ttl is not None and self._native_now is None:
            return None  # a request's expiry first (expire_due), before its ids are mapped
        keys, vals, mask = self._index.native()
        return self._n, -1, keys, vals, mask

    @property
    def map_version(self) -> int:
        return self._index.moves

    def held_at(self, ids: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Each of ``ids``' slot (int64, unique, checked), -1 for ids not held."""
        slots: np.ndarray[Any, Any] = self._slots(torch.from_numpy(ids)).numpy()
        return slots

    def _native_stamps(self) -> tuple[int, int, int, float]:
        # The tick this update will have (applied() moves to it): the least recently updated
        # rows go first when room is needed. With a time to live, the request's time.
        at, now = self.updated_at, self._native_now
        times = (0, 0.0) if at is None or now is None else (at.data_ptr(), now)
        return self.last_update.data_ptr(), self._tick + 1, *times

    def expire_due(self) -> None:
        """A native request's start (:mod:`psflow.ps.native`), before its ids are mapped: with
        a time to live, the rows expired by now evicted when a scan is due, as :meth:`apply`
        and :meth:`lookup` begin, and the time its updated rows are stamped with; nothing
        without one. Its jobs (:meth:`lookup_job`, :meth:`apply_job`) take that time until
        the next request's."""
        if self.ttl is not None:
            self._native_now = self._expire_due()

    def applied(self) -> None:
        self._tick += 1
        self.updates += 1

    # -- the interface -----------------------------------------------------------------------

    def lookup(
        self, ids: torch.Tensor, out: torch.Tensor | None = None, *, absent_zeros: bool = False
    ) -> torch.Tensor:
        if self.ttl is not None:
            self._expire_due()
        slots = self._slots(ids)
        if bool((slots >= 0).all()):
            return kernels.gather(self.values, slots, out)
        shape = (ids.numel(), self.dim)
        if out is not None and (out.shape != shape or out.dtype != self.dtype):
            raise ValueError(
                f"lookup into {out.dtype} {list(out.shape)}: expected {self.dtype} {list(shape)}"
            )
        rows = torch.empty(shape, dtype=self.dtype) if out is None else out
        self.lookup_mapped(ids, slots, rows, absent_zeros=absent_zeros)
        return rows

    def lookup_mapped(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        out: torch.Tensor,
        *,
        absent_zeros: bool = False,
    ) -> None:
        """:meth:`lookup` into ``out`` of ``ids`` whose rows are known (``slots``, -1 for an id
        not held: the kernels' map, :mod:`psflow.ps.native`): the rows held, and the initial
        rows of the others (zeros with ``absent_zeros``)."""
        known = slots >= 0
        where = known.nonzero().squeeze(1)
        if where.numel():
            kernels.put_rows(out, where, kernels.gather(self.values, slots[where]))
        absent = (~known).nonzero().squeeze(1)
        self.initial_at(ids[absent], absent, out, zeros=absent_zeros)

    def initial_at(
        self, ids: torch.Tensor, at: torch.Tensor, out: torch.Tensor, *, zeros: bool = False
    ) -> None:
        """The rows a lookup gives ``ids``, none of them held, written to ``out``'s rows
        ``at``: their initial rows, or zeros with ``zeros`` (an evaluation's lookup). Only the
        ids not held get initial rows (a row depends on its id alone): in a stream of clicks
        most of a batch's ids are held."""
        if zeros:
            kernels.fill_rows(out, at, 0)
            return
        spec = self.spec
        fresh = initial_rows(
            spec.seed, ids, self.dim, std=spec.init_std, dtype=self.dtype,
            padding_idx=spec.padding_idx,
        )  # fmt: skip
        kernels.put_rows(out, at, fresh)

    def apply(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self._check_grads(ids, grads)
        ids, grads = self._without_padding(ids, grads)
        now = self._expire_due() if self.ttl is not None else 0.0
        self._tick += 1
        self.updates += 1
        slots = self._slots(ids)
        if self._place_new(ids, slots, self._tick):
            keep = slots >= 0
            if not bool(keep.all()):
                slots, grads = slots[keep], grads[keep]
        self._preserve(slots)
        self.optimizer.apply(self.values, self.state, slots, grads)
        kernels.fill_rows(self.last_update, slots, self._tick)
        if self.updated_at is not None:
            kernels.fill_rows(self.updated_at, slots, now)

    def make_rows(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """The new rows of a native push (:mod:`psflow.ps.native_push`), before its update:
        ``ids`` the push's (unique, checked), ``slots`` each one's row as the kernels mapped it
        (-1: not held), completed in place as :meth:`apply` does: a row made for each id not
        held that is admitted and fits, -1 left for the others (their gradients are dropped).
        The rows held are marked with the update's tick (:meth:`applied` moves to it)."""
        self._place_new(ids, slots, self._tick + 1)

    def _place_new(self, ids: torch.Tensor, slots: torch.Tensor, tick: int) -> bool:
        """Rows for the ids not held (``slots`` -1), those admitted and as room allows, their
        slots written into ``slots``; the held ones marked with ``tick`` first, so that making
        room never evicts a row this update changes. ``False`` when every id was held."""
        new_pos = (slots < 0).nonzero().squeeze(1)
        if not new_pos.numel():
            return False
        if self.max_rows is not None:
            # Marked now, so that making room for the new rows never evicts these.
            kernels.fill_rows(self.last_update, slots[slots >= 0], tick)
        held = slots.numel() - new_pos.numel()
        if self._admission is not None:
            admitted = self._admission.admit(ids[new_pos])
            self.counts["not_admitted"] += int(admitted.numel() - admitted.sum())
            new_pos = new_pos[admitted]
        if self.max_rows is not None:
            room = self.max_rows - held
            if new_pos.numel() > room:
                self.counts["dropped_full"] += new_pos.numel() - room
                new_pos = new_pos[:room]
        if new_pos.numel():
            new_slots, first = self._take_slots(new_pos.numel())
            self._store(ids[new_pos], new_slots, first)
            slots[new_pos] = new_slots
            self.counts["admitted"] += new_pos.numel()
        return True

    @property
    def num_rows(self) -> int:
        return self._n

    @property
    def version(self) -> int:
        """A count that changes whenever the rows held do (an update or a load): a copy taken
        at one version is still the rows while it stays."""
        return self._tick

    @property
    def nbytes(self) -> int:
        tensors = [self.values, self.slot_ids, self.last_update, *self.state.values()]
        tensors += [t for t in (self.updated_at, self._changed) if t is not None]
        sketch = 0 if self._admission is None else self._admission.nbytes
        return sum(t.nbytes for t in tensors) + sketch + self._index.nbytes

    @property
    def stats(self) -> dict[str, int]:
        return {"rows": self._n, "capacity": self.capacity, "updates": self.updates, **self.counts}

    def _slot_capacity(self) -> int:
        return self.capacity

    def _export_live(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        return {"ids": self.slot_ids, "values": self.values}, None

    def _tombstones(self) -> torch.Tensor:
        if not self._evicted:
            return torch.empty(0, dtype=torch.int64)
        gone = torch.cat(self._evicted).unique()
        return gone[self._slots(gone) < 0]

    def _begin_snapshot(self) -> RowSnapshot:
        live = {
            "ids": self.slot_ids,
            "values": self.values,
            **{STATE_PREFIX + k: v for k, v in self.state.items()},
        }
        return RowSnapshot(live, self._n, {})

    def give(
        self, ids: torch.Tensor, values: torch.Tensor, state: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Rows given by id (``TableModule.load_rows``): :meth:`load` with ``state``, or with
        a fresh row's state when none is given."""
        if not state:
            state = self.optimizer.new_state(ids.numel(), self.dim, self.dtype)
        self.load(ids, values, state)

    def load(self, ids: torch.Tensor, values: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        ids, values, state = self._snapshot_rows(ids, values, state)
        if ids.numel() == 0:
            return
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"table {self.spec.name!r}: snapshot ids repeat")
        now = self._expire_due() if self.ttl is not None else 0.0
        self._tick += 1
        slots = self._slots(ids)
        unknown = slots < 0
        if bool(unknown.any()):
            self.last_update.index_fill_(0, slots[~unknown], self._tick)
            new_pos = unknown.nonzero().squeeze(1)
            if self.max_rows is not None:
                room = self.max_rows - int((~unknown).sum())
                if new_pos.numel() > room:
                    self.counts["dropped_full"] += new_pos.numel() - room
                    new_pos = new_pos[:room]
            new_slots, _ = self._take_slots(new_pos.numel())
            new_ids = ids[new_pos]
            self._preserve(new_slots)
            self.slot_ids.index_copy_(0, new_slots, new_ids)
            self._index.put(new_ids, new_slots)
            slots[new_pos] = new_slots
            keep = slots >= 0
            if not bool(keep.all()):
                slots, values = slots[keep], values[keep]
                state = {k: v[keep] for k, v in state.items()}
        self._preserve(slots)
        self.values.index_copy_(0, slots, values)
        for key, tensor in state.items():
            self.state[key].index_copy_(0, slots, tensor)
        self.last_update.index_fill_(0, slots, self._tick)
        if self.updated_at is not None:
            self.updated_at.index_fill_(0, slots, now)
