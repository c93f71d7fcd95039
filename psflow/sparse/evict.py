"""Which rows a full hashed table evicts: the least recently updated, from a pool of one scan.

A :class:`~psflow.sparse.hashed.HashedRows` at its ``max_rows`` makes room for a push's new
rows by evicting as many of the rows it holds, the least recently updated first (never one the
same push updates: it marks those recent before it asks). Finding them by a scan of every row
each push cost time in the rows held (a full 4M-row table: 7.4 ms of a push of 4,096 new
ids), so :class:`EvictionPool` keeps the order of one scan for the pushes after it.
"""

from __future__ import annotations

import torch

import psflow.sparse.kernels as kernels

EVICT_POOL = 64
"""A scan for the least recently updated rows keeps this many times what it was asked for, in
order, for the pushes after (:meth:`EvictionPool.take`)."""


class EvictionPool:
    """The rows next to evict from a full table, kept from its last scan as (slot, update
    count, id).

    A row left out of the pool was newer than all of it then, and every update since is newer
    still; a pooled row updated or gone since is skipped. So the pool yields what a scan each
    time would, until it runs out and is scanned anew. Rows moved to other slots (an expiry's
    compaction) empty it (:meth:`clear`).
    """

    def __init__(self) -> None:
        self._pool: torch.Tensor | None = None
        self._at = 0

    def clear(self) -> None:
        """Forgets the pool: rows moved to other slots since its scan."""
        self._pool = None

    def take(
        self, count: int, n: int, last_update: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """The slots of the ``count`` least recently updated of the first ``n`` rows (their
        update counts ``last_update``, their ids ``slot_ids``; the push that asks has marked
        its own rows recent first), taken in order from the pool, scanned anew (for
        :data:`EVICT_POOL` times ``count``) when it runs out."""
        need = count
        taken: list[torch.Tensor] = []
        while need:
            pool = self._pool
            if pool is None or self._at >= pool.shape[1]:
                k = min(n, EVICT_POOL * count)
                ticks, slots = kernels.least_recent(last_update[:n], k)
                if taken:  # those taken from the last pool are held still: not twice
                    again = torch.zeros(n, dtype=torch.bool).index_fill_(0, torch.cat(taken), True)
                    keep = again.index_select(0, slots).logical_not_()
                    ticks, slots = ticks[keep], slots[keep]
                pool = self._pool = torch.stack([slots, ticks, slot_ids.index_select(0, slots)])
                self._at = 0
            slots, ticks, ids = pool[:, self._at : self._at + need]
            self._at += slots.numel()
            ok = (slots < n).logical_and_(last_update.index_select(0, slots) == ticks)
            ok.logical_and_(slot_ids.index_select(0, slots) == ids)
            taken.append(slots[ok])
            need -= int(taken[-1].numel())
        return taken[0] if len(taken) == 1 else torch.cat(taken)
