"""A table's ids as each task last looked them up, with the rows they were found at.

A training step looks a batch's rows up (or has them prefetched by the step before) and then
pushes their gradients: the same ids, in the same order, from the same task. Mapping them to
their rows again (checked, then found in a hashed table's id map: 40-50 ns an id in a job,
where the map's cells are no longer cached) is a fifth of a shard's work on a CTR push
(``benchmarks/results/profile.md``). :class:`MappedIds` keeps what the kernels found for each
task's last lookup, and gives it back once to a push of the same ids (byte for byte) while no
id the table held then has lost its row (:attr:`Rows.map_version
<psflow.sparse.rows.Rows.map_version>` unchanged): the rows of the ids held then are theirs
still, their checks passed (a lookup's are a push's); an id not held then (-1) may have been
given a row since (by another task's push), so the caller finds those few again. Anything else
maps again. A task's last two lookups are kept: with a push in flight while the next step
computes (``overlap``), a push's ids are those of the lookup before the last.
"""

from __future__ import annotations

from typing import Any

import numpy as np

MAX_TASKS = 1024
"""The most tasks whose lookups a table keeps (the oldest go first)."""
MAX_IDS = 1 << 20
"""The most ids a table keeps in all (16 bytes each with their rows: 16 MB)."""
KEPT = 2
"""Lookups kept a task: a push's ids are those of the task's last lookup, or, with a push in
flight while the next step computes (``overlap``: the prefetch two batches ahead), of the one
before it."""


class MappedIds:
    """The ids each task last looked up in one table (its last :data:`KEPT` lookups), their
    rows, and the table's :attr:`~psflow.sparse.rows.Rows.map_version` then.

    Example:
        >>> m = MappedIds()
        >>> ids, rows = np.array([7, 3]), np.array([0, 5])
        >>> m.remember("worker:0", ids, rows, version=4)
        >>> m.recall("worker:0", np.array([7, 3]), version=4).tolist()
        [0, 5]
        >>> m.recall("worker:0", np.array([7, 3]), version=4) is None  # given back once
        True
    """

    def __init__(self) -> None:
        self._by: dict[str, list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]]] = {}
        self._ids = 0

    def __len__(self) -> int:
        return len(self._by)

    def remember(
        self, task: str, ids: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], version: int
    ) -> None:
        """Keeps ``ids`` (a copy the caller gives up) and the ``rows`` the kernels mapped them
        to at ``version``, after what ``task`` looked up before (the oldest past
        :data:`KEPT` let go)."""
        kept = self._by.pop(task, [])  # back in as the newest task
        if len(ids) > MAX_IDS:
            self._let_go(kept)
            return
        kept.append((ids, rows, version))
        self._ids += len(ids)
        if len(kept) > KEPT:
            self._let_go(kept[:-KEPT])
            del kept[:-KEPT]
        self._by[task] = kept
        while len(self._by) > MAX_TASKS or self._ids > MAX_IDS:
            self._let_go(self._by.pop(next(iter(self._by))))

    def recall(
        self, task: str, ids: np.ndarray[Any, Any], version: int
    ) -> np.ndarray[Any, Any] | None:
        """The rows of ``ids`` when ``task`` looked up exactly these (byte for byte) at
        ``version`` (-1 where not held then: the caller's to find again), else ``None``. A
        lookup of these ids is given up either way (a push uses it once, and may complete the
        rows in place); the task's other lookup stays (a prefetch made after it may be for an
        earlier push: a lookup at a step's start settles the push in flight first)."""
        kept = self._by.get(task)
        if not kept:
            return None
        for i, (known, rows, at) in enumerate(kept):
            if len(known) == len(ids) and np.array_equal(known, ids):
                self._let_go(kept[i : i + 1])
                del kept[i]
                if not kept:
                    del self._by[task]
                return rows if at == version else None
        return None

    def _let_go(
        self, entries: list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]]
    ) -> None:
        self._ids -= sum(len(ids) for ids, _, _ in entries)
