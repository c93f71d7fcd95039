"""A table's ids as each task last looked them up (:class:`psflow.sparse.mapped.MappedIds`),
and the id map's count of moves that says whether their rows still hold."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

import psflow.sparse.mapped as mapped
from psflow.sparse import IdMap
from psflow.sparse.mapped import MappedIds

pytestmark = pytest.mark.unit


def test_a_lookup_is_given_back_once_for_the_same_ids_at_the_same_version() -> None:
    m = MappedIds()
    ids, rows = np.array([5, 9, 1]), np.array([2, 0, 7])
    m.remember("worker:0", ids.copy(), rows, version=3)
    m.remember("worker:1", ids.copy(), rows + 1, version=3)
    assert m.recall("worker:0", ids, version=3) is rows
    assert m.recall("worker:0", ids, version=3) is None  # once
    assert m.recall("worker:1", ids, version=3).tolist() == [3, 1, 8]  # type: ignore[union-attr]
    assert len(m) == 0
    for other in [ids[::-1].copy(), ids[:2], np.array([5, 9, 2])]:  # other ids: nothing given
        m.remember("worker:0", ids.copy(), rows, version=3)
        assert m.recall("worker:0", other, version=3) is None
        assert m.recall("worker:0", ids, version=3) is rows  # still there for its own push
    m.remember("worker:0", ids.copy(), rows, version=3)
    assert m.recall("worker:0", ids, version=4) is None  # mapped since: given up all the same
    assert len(m) == 0


def test_a_push_in_flight_finds_the_lookup_before_the_last() -> None:
    """``overlap``: a push's ids were prefetched two pushes before, and the task has looked
    up the next batch's since; that push takes its own lookup and keeps the other for the next
    push, whichever came first."""
    m = MappedIds()
    batch = [np.array([4 * k, 4 * k + 1]) for k in range(5)]
    m.remember("w", batch[0].copy(), batch[0] + 100, version=1)
    m.remember("w", batch[1].copy(), batch[1] + 100, version=1)
    for k in range(3):
        rows = m.recall("w", batch[k], version=1)
        assert rows is not None and rows.tolist() == (batch[k] + 100).tolist()
        m.remember("w", batch[k + 2].copy(), batch[k + 2] + 100, version=1)
    assert m.recall("w", batch[4], version=1) is not None  # the newer first
    assert m.recall("w", batch[3], version=1) is not None and len(m) == 0
    for k in range(mapped.KEPT + 1):  # only the last KEPT of a task's lookups are kept
        m.remember("w", batch[k].copy(), batch[k], version=1)
    assert m.recall("w", batch[0], version=1) is None
    assert m.recall("w", batch[1], version=1) is not None


def test_what_a_table_keeps_is_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped, "MAX_TASKS", 3)
    monkeypatch.setattr(mapped, "MAX_IDS", 12)
    m = MappedIds()
    for i in range(4):
        m.remember(f"t{i}", np.arange(2), np.arange(2), version=0)
    assert len(m) == 3 and m.recall("t0", np.arange(2), 0) is None
    m.remember("big", np.arange(6), np.arange(6), version=0)  # 2 + 2 + 6 ids
    assert len(m) == 3 and m.recall("t1", np.arange(2), 0) is None
    m.remember("t3", np.arange(2) + 5, np.arange(2), version=0)  # t3's second: 2 + 4 + 6
    assert len(m) == 3
    m.remember("t3", np.arange(2) + 9, np.arange(2), version=0)  # its first let go: KEPT
    assert m.recall("t3", np.arange(2), 0) is None
    m.remember("huge", np.arange(13), np.arange(13), version=0)  # past the bound alone
    assert m.recall("huge", np.arange(13), 0) is None
    assert m.recall("big", np.arange(6), 0) is not None
    m.remember("big", np.arange(6), np.arange(6), version=0)
    m.remember("t9", np.arange(8), np.arange(8), version=0)  # 4 + 6 + 8 ids: the oldest go
    assert m.recall("t2", np.arange(2), 0) is None and m.recall("t3", np.arange(2) + 9, 0) is None
    assert m.recall("t9", np.arange(8), 0) is not None


def test_an_id_maps_moves_are_new_when_an_id_leaves_and_unique() -> None:
    """``IdMap.moves``: new at every removal (a held id's slot may be another's after it),
    kept by adds (which may rebuild the cells, never the slots), unique across maps."""
    a, b = IdMap(), IdMap()
    assert a.moves != b.moves
    first = a.moves
    a.put(torch.tensor([3, 4]), torch.tensor([0, 1]))
    a.get(torch.tensor([3, 5]))
    assert a.moves == first
    a.remove(torch.tensor([3]))
    assert a.moves not in (first, b.moves)
    second = a.moves
    a.put(torch.arange(10, 2000), torch.arange(2, 1992))  # grows: the cells rebuilt
    assert a.moves == second and a.get(torch.tensor([4, 1999])).tolist() == [1, 1991]


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(mapped).failed == 0
