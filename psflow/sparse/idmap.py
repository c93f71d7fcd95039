"""An int64 id -> int64 slot map in tensors: open addressing, every operation one batch.

A hashed table's shard maps each id it holds to the slot of its row. A Python dict costs about
a microsecond per id and 100 bytes per entry; this map answers a batch of ids with a few tensor
operations per probe round (linear probing at a load of at most one half, so a handful of
rounds), and costs 16 bytes per cell. With the compiled kernels (``idmap_find``,
``idmap_put`` in ``_ids.c``) each id is probed in one C loop over the same cells instead:
the same layout and hash, so either path reads what the other wrote.
"""

from __future__ import annotations

import itertools
from types import ModuleType

import torch

from psflow import allocator
from psflow.sparse.init import splitmix64


def _kernels() -> ModuleType | None:
    # Lazily: psflow.sparse.kernels imports psflow.sparse, whose __init__ imports this module.
    from psflow.sparse.kernels import KERNELS

    return KERNELS


_EMPTY = -1
_GONE = -2
"""A removed entry (a tombstone): lookups probe past it, inserts may reuse it."""
MIN_CELLS = 1024
PREPARE_FROM = 4
"""From a load of 1 / PREPARE_FROM, the cells of the coming rebuild are made ready a part at
each :meth:`IdMap.put`, in step with the load, all of them by the load that rebuilds (a half):
the rebuild then writes into memory already mapped (a 2.1M-id map's 256 MB of new cells, as
it then grew, took 17-593 ms of page faults at once, the kernel compacting memory for huge
pages)."""
_MOVES = itertools.count(1)
"""One count for every map of the process: no two maps ever share a number of :attr:`IdMap.moves`."""


class IdMap:
    """Unique int64 ids to non-negative int64 slots.

    Example:
        >>> m = IdMap()
        >>> m.put(torch.tensor([7, -3]), torch.tensor([0, 1]))
        >>> m.get(torch.tensor([-3, 5, 7])).tolist()
        [1, -1, 0]
        >>> m.remove(torch.tensor([7])); len(m)
        1
    """

    def __init__(self, cells: int = MIN_CELLS, *, most: int | None = None) -> None:
        self._most = most
        """At most this many ids at once (a table's ``max_rows``), when known: no rebuild is
        prepared for more."""
        self._next: tuple[torch.Tensor, torch.Tensor] | None = None
        """The coming rebuild's keys and values, the first :attr:`_next_ready` cells made."""
        self._next_ready = 0
        self._alloc(max(MIN_CELLS, 1 << (cells - 1).bit_length()))
        self._live = 0
        self.moves = next(_MOVES)
        """A number new whenever an id leaves the map (:meth:`remove`), unique in the process:
        while it stays, every id held at one time keeps its slot. Adding ids (:meth:`put`, which
        may rebuild the cells, never the slots) keeps it: an id not held then may be now."""

    def _alloc(self, cells: int) -> None:
        """Empty cells: the prepared ones when there are that many (:meth:`_prepare`)."""
        if self._next is not None and self._next[0].numel() == cells:
            self._make_next(cells)
            self.keys, self.vals = self._next
        else:
            # Probed at random, as a table's rows are read: in huge pages when large.
            self.keys = allocator.table_empty((cells,), torch.int64).zero_()
            self.vals = allocator.table_empty((cells,), torch.int64).fill_(_EMPTY)
        self._next, self._next_ready = None, 0
        self._claim = allocator.table_empty((cells,), torch.int64)
        self._gone = 0
        self._mask = cells - 1

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        ready = 0 if self._next is None else sum(t.nbytes for t in self._next)
        return self.keys.nbytes + self.vals.nbytes + self._claim.nbytes + ready

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return splitmix64(ids).bitwise_and_(self._mask)

    def native(self) -> tuple[int, int, int]:
        """What a kernel needs to find ids here: the keys' and values' addresses, the mask."""
        return self.keys.data_ptr(), self.vals.data_ptr(), self._mask

    def _kernel_find(self, ids: torch.Tensor, slots: bool) -> torch.Tensor | None:
        """Each id's cell (or, with ``slots``, its slot), -1 where it is absent, by the kernel;
        ``None`` without it."""
        kernels = _kernels()
        if kernels is None or ids.dtype != torch.int64 or ids.device.type != "cpu":
            return None
        ids = ids.contiguous()
        out = torch.empty_like(ids)
        kernels.idmap_find(
            self.keys.data_ptr(),
            self.vals.data_ptr(),
            self._mask,
            ids.data_ptr(),
            ids.numel(),
            out.data_ptr(),
            slots,
        )
        return out

    def _find(self, ids: torch.Tensor) -> torch.Tensor:
        """The cell holding each id, -1 where it is absent."""
        found = self._kernel_find(ids, slots=False)
        if found is not None:
            return found
        out = torch.full_like(ids, -1)
        pos = self._home(ids)
        todo = torch.arange(ids.numel())
        want = ids
        # index_select and masked_select, not t[i] and t[mask]: several times faster in torch.
        for _ in range(self._mask + 1):
            v = self.vals.index_select(0, pos)
            hit = (v >= 0).logical_and_(self.keys.index_select(0, pos) == want)
            on = (v != _EMPTY).logical_and_(hit.logical_not())  # another id's, or a tombstone
            if bool(hit.any()):
                out.index_copy_(0, todo.masked_select(hit), pos.masked_select(hit))
            if not bool(on.any()):
                break
            todo, want = todo.masked_select(on), want.masked_select(on)
            pos = pos.masked_select(on).add_(1).bitwise_and_(self._mask)
        return out

    def get(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's slot, -1 for ids not in the map."""
        slots = self._kernel_find(ids, slots=True)
        if slots is not None:
            return slots
        cells = self._find(ids)
        found = cells >= 0
        if bool(found.all()):
            return self.vals.index_select(0, cells)
        out = torch.full_like(ids, -1)
        where = found.nonzero().squeeze(1)
        out.index_copy_(0, where, self.vals.index_select(0, cells.index_select(0, where)))
        return out

    def put(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Adds ``ids`` (unique, none in the map yet) with their ``slots``."""
        n = ids.numel()
        used = self._live + self._gone + n
        if 2 * used > self._mask + 1:
            self._rebuild(self._live + n)
        elif PREPARE_FROM * used > self._mask + 1:
            self._prepare(used)
        kernels = _kernels()
        if kernels is not None and ids.dtype == slots.dtype == torch.int64 and ids.is_cpu:
            ids, slots = ids.contiguous(), slots.to("cpu").contiguous()
            reused = kernels.idmap_put(
                self.keys.data_ptr(),
                self.vals.data_ptr(),
                self._mask,
                ids.data_ptr(),
                slots.data_ptr(),
                n,
            )
            if reused < 0:  # the load is kept at a half: a full map is a bug here
                raise RuntimeError(f"id map of {self._mask + 1} cells found no room")
            self._gone -= reused
            self._live += n
            return
        pos = self._home(ids)
        todo = torch.arange(n)
        for _ in range(self._mask + 1):
            free = (self.vals.index_select(0, pos) < 0).nonzero().squeeze(1)
            if free.numel():
                # Several ids may reach one free cell in this round: one write wins, read back.
                cells, who = pos.index_select(0, free), todo.index_select(0, free)
                self._claim.index_copy_(0, cells, who)
                won = (self._claim.index_select(0, cells) == who).nonzero().squeeze(1)
                cells, who = cells.index_select(0, won), who.index_select(0, won)
                self._gone -= int((self.vals.index_select(0, cells) == _GONE).sum())
                self.keys.index_copy_(0, cells, ids.index_select(0, who))
                self.vals.index_copy_(0, cells, slots.index_select(0, who))
                left = torch.ones(todo.numel(), dtype=torch.bool)
                left.index_fill_(0, free.index_select(0, won), False)
                todo, pos = todo.masked_select(left), pos.masked_select(left)
            if not todo.numel():
                break
            pos = pos.add_(1).bitwise_and_(self._mask)
        self._live += n

    def remove(self, ids: torch.Tensor) -> None:
        """Removes ``ids`` (each in the map)."""
        self.moves = next(_MOVES)
        cells = self._find(ids)
        assert bool((cells >= 0).all()), "removing ids that are not in the map"
        self.vals.index_fill_(0, cells, _GONE)
        self._live -= ids.numel()
        self._gone += ids.numel()

    @property
    def _churns(self) -> bool:
        """Whether ids leave this map: some did since the last rebuild, or it holds at most
        :attr:`_most` (a table with ``max_rows`` evicts once full)."""
        return self._gone > 0 or self._most is not None

    def _prepare(self, used: int) -> None:
        """Makes the cells the coming rebuild takes (that of :meth:`put` when ``used`` passes
        half the cells, the tombstones of now dropped) as far as the load has come towards it;
        none where the rebuild would not grow the map (tombstones make most of its load)."""
        cells = self._mask + 1
        after = _cells_for(cells // 2 - self._gone + 1, churn=self._churns)
        if self._most is not None:
            after = min(after, _cells_for(self._most, churn=True))
        if self._next is not None and self._next[0].numel() != after:
            self._next, self._next_ready = None, 0
        if after <= cells:
            return
        if self._next is None:
            keys = allocator.table_empty((after,), torch.int64)
            self._next = (keys, allocator.table_empty((after,), torch.int64))
        start = cells // PREPARE_FROM
        share = (used - start) / max(1, cells // 2 - start)
        self._make_next(min(after, int(share * after)))

    def _make_next(self, upto: int) -> None:
        """Makes the prepared cells up to ``upto`` empty."""
        assert self._next is not None
        keys, vals = self._next
        if upto > self._next_ready:
            keys[self._next_ready : upto].zero_()
            vals[self._next_ready : upto].fill_(_EMPTY)
            self._next_ready = upto

    def _rebuild(self, live: int) -> None:
        """Room for ``live`` entries (:func:`_cells_for`); tombstones dropped."""
        kernels = _kernels()
        cells = _cells_for(live, churn=self._churns)
        if kernels is not None:
            keys, vals, mask = self.keys, self.vals, self._mask
            self._alloc(cells)
            moved = kernels.idmap_move(
                keys.data_ptr(), vals.data_ptr(), mask,
                self.keys.data_ptr(), self.vals.data_ptr(), self._mask,
            )  # fmt: skip
            if moved < 0:  # more cells than ids, always: a full map is a bug here
                raise RuntimeError(f"id map of {self._mask + 1} cells found no room")
            self._live = moved
            return
        held = (self.vals >= 0).nonzero().squeeze(1)
        keys, vals = self.keys[held], self.vals[held]
        self._alloc(cells)
        self._live = 0
        if held.numel():
            self.put(keys, vals)


def _cells_for(live: int, *, churn: bool) -> int:
    """The cells a rebuild for ``live`` entries makes. With ``churn`` (ids leave the map: a
    table that evicts), a load of at most a quarter, so that as many removals again come
    before the next; else twice as many cells as the entries and more, a load from a
    quarter to a half, so that a growing map holds 32 to 64 bytes an id (a quarter's load
    after each rebuild had it hold up to 128)."""
    if churn:
        return max(MIN_CELLS, 1 << (4 * live - 1).bit_length())
    return max(MIN_CELLS, 1 << (2 * live).bit_length())
