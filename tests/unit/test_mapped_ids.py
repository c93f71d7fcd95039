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
    for other, version in [(ids, 4), (ids[::-1].copy(), 3), (ids[:2], 3), (np.array([5, 9, 2]), 3)]:
        m.remember("worker:0", ids.copy(), rows, version=3)
        assert m.recall("worker:0", other, version=version) is None
        assert len(m) == 0  # given up either way


def test_what_a_table_keeps_is_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped, "MAX_TASKS", 3)
    monkeypatch.setattr(mapped, "MAX_IDS", 10)
    m = MappedIds()
    for i in range(4):
        m.remember(f"t{i}", np.arange(2), np.arange(2), version=0)
    assert len(m) == 3 and m.recall("t0", np.arange(2), 0) is None
    m.remember("big", np.arange(6), np.arange(6), version=0)  # 2 + 2 + 6 ids
    assert len(m) == 3 and m.recall("t1", np.arange(2), 0) is None
    m.remember("t3", np.arange(2), np.arange(2), version=0)  # t3's replaced, not added
    assert len(m) == 3
    m.remember("huge", np.arange(11), np.arange(11), version=0)  # past the bound alone
    assert m.recall("huge", np.arange(11), 0) is None
    assert m.recall("big", np.arange(6), 0) is not None


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
