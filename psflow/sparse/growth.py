"""A hashed table's tensors (a row each slot: values, optimizer state, ids, update counts) grown
together as rows come.

Past :data:`~psflow.allocator.RESERVE_FROM_BYTES` a tensor grows in place in a
:class:`~psflow.allocator.Reservation`: nothing is copied, and the new rows are fresh pages
(zeros), taken only when first touched. Below it, or where no reservation is to be had, a
growth copies the rows to new storage.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from psflow import allocator


class Columns:
    """Grows a table's tensors together (:meth:`grown`), each in its reservation once it has one."""

    def __init__(self) -> None:
        self._areas: dict[str, allocator.Reservation] = {}
        """Each tensor's reservation, by name, once it has one."""

    def grown(
        self,
        columns: Mapping[str, torch.Tensor],
        n: int,
        capacity: int,
        most: int | None,
        *,
        zeroed: Collection[str] = (),
    ) -> dict[str, torch.Tensor]:
        """``columns`` grown to ``capacity`` rows, by name, the first ``n`` of each kept. The
        rest is left as allocated (the pages of slots never taken stay untouched), but for the
        tensors named in ``zeroed``, whose new rows are zeros. Every tensor reserves the same
        rows, or none does: as many as the host's memory could hold, or ``most`` (a table's
        ``max_rows``)."""
        row_bytes = sum(t[:1].nbytes for t in columns.values())
        reserve = 0
        if capacity * row_bytes >= allocator.RESERVE_FROM_BYTES:
            # Each table then reserves about the memory there is, and no more.
            reserve = max(2 * capacity, allocator.physical_memory() // row_bytes)
            if most is not None:
                reserve = min(reserve, most)
        return {
            name: self._grown(name, t, n, capacity, reserve, zero=name in zeroed)
            for name, t in columns.items()
        }

    def _grown(
        self, name: str, old: torch.Tensor, n: int, capacity: int, reserve: int, *, zero: bool
    ) -> torch.Tensor:
        """``old`` (the tensor ``name``) grown to ``capacity`` rows, its first ``n`` kept. In
        its reservation when it has one, or can take one of ``reserve`` rows (0: none), nothing
        moves: the new rows are fresh pages, zeros. Otherwise it is copied to new storage, as a
        growth always was (the new rows zeroed with ``zero``)."""
        area = self._areas.get(name)
        if area is not None and capacity > area.rows:  # past the host's memory
            del self._areas[name]
            area = None
        if area is None and reserve >= capacity:
            area = allocator.reserve(tuple(old.shape[1:]), old.dtype, reserve)
            if area is not None:
                self._areas[name] = area
        if area is not None:
            out = area.first(capacity)
            if not area.holds(old):
                out[:n] = old[:n]
            return out
        out = allocator.table_empty((capacity, *old.shape[1:]), old.dtype)
        out[:n] = old[:n]
        if zero:
            out[n:].zero_()
        return out
