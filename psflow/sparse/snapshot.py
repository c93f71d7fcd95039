"""A shard's rows of one table at one moment, for a checkpoint or an export, taken without a
pause.

:class:`RowSnapshot` keeps references to the live tensors and copies a row only before it
changes (:meth:`RowSnapshot.preserve`, called by :class:`~psflow.sparse.rows.Rows`), or when the
thread that writes the checkpoint asks for the result. It holds every row in use, or (an
incremental export's) the rows of chosen slots.
"""

from __future__ import annotations

import threading

import torch

STATE_PREFIX = "opt/"
"""Snapshot keys of the optimizer state: ``opt/<state name>``."""


class RowSnapshot:
    """A shard's rows of one table as they were at one moment, taken without a pause.

    Taking it copies nothing: it keeps references to the live tensors. Before the shard writes
    rows it has not copied yet, :meth:`preserve` copies those rows (what one update touches,
    a few thousand rows); :meth:`result`, in the thread that writes the checkpoint, copies the
    rest chunk by chunk. Each row's value and optimizer state are copied together, so they
    belong to the same moment (DeepRec-AI/DeepRec#1023 is what happens otherwise). A hashed
    table that grows keeps its first rows where they are (in a reservation) or leaves the old
    tensors unchanged (when copied): either way, what the snapshot holds is what it took.
    """

    CHUNK_ROWS = 1 << 16
    """Rows copied at a time by :meth:`result`: how long the serving thread may wait on it."""

    def __init__(
        self,
        live: dict[str, torch.Tensor],
        rows: int,
        fixed: dict[str, torch.Tensor],
        *,
        slots: torch.Tensor | None = None,
    ):
        """``live``'s first ``rows`` rows, or with ``slots`` (unique, each below ``rows``) the
        rows at those slots, in that order; ``fixed`` is added to the result as it is."""
        self._live = live
        self._where = slots
        """The storage slot of each row of the result (``None``: row ``i`` is slot ``i``)."""
        self._pos: torch.Tensor | None = None
        """The row of the result that each slot is (-1: none), for :meth:`preserve`."""
        if slots is not None:
            self._pos = torch.full((rows,), -1, dtype=torch.int64)
            self._pos[slots] = torch.arange(slots.numel())
            rows = slots.numel()
        self._rows = rows
        self._out = {k: torch.empty((rows, *t.shape[1:]), dtype=t.dtype) for k, t in live.items()}
        self._copied = torch.zeros(rows, dtype=torch.bool)
        self._fixed = fixed
        self._lock = threading.Lock()
        self.done = False

    def preserve(self, slots: torch.Tensor) -> None:
        """Copies the rows at ``slots`` that are not copied yet (call before writing them)."""
        if self.done:
            return
        with self._lock:
            if self.done:
                return
            if self._pos is None:
                slots = slots[slots < self._rows]
                fresh = slots[~self._copied[slots]]
                where = fresh
            else:
                pos = self._pos[slots[slots < self._pos.numel()]]
                pos = pos[pos >= 0]
                fresh = pos[~self._copied[pos]]
                assert self._where is not None
                where = self._where[fresh]
            if fresh.numel():
                for key, live in self._live.items():
                    self._out[key][fresh] = live.index_select(0, where)
                self._copied[fresh] = True

    def result(self) -> dict[str, torch.Tensor]:
        """The snapshot, complete: copies the rows not copied yet (any thread)."""
        for start in range(0, self._rows, self.CHUNK_ROWS):
            stop = min(start + self.CHUNK_ROWS, self._rows)
            with self._lock:
                todo = ~self._copied[start:stop]
                if self._where is None and bool(todo.all()):
                    for key, live in self._live.items():
                        self._out[key][start:stop] = live[start:stop]
                elif bool(todo.any()):
                    rows = todo.nonzero().squeeze(1).add_(start)
                    where = rows if self._where is None else self._where[rows]
                    for key, live in self._live.items():
                        self._out[key][rows] = live.index_select(0, where)
                self._copied[start:stop] = True
        with self._lock:
            self.done = True
            self._live = {}
        return {**self._fixed, **self._out}
