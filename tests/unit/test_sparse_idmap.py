"""IdMap, the id -> slot map of hashed tables, against a dict on random operations."""

from __future__ import annotations

import doctest
import random

import pytest
import torch

import psflow.sparse.idmap as idmap_module
from psflow.sparse.idmap import MIN_CELLS, IdMap

pytestmark = pytest.mark.unit


def _ids(rng: random.Random, n: int, pool: list[int]) -> list[int]:
    return rng.sample(pool, n)


@pytest.fixture(params=["kernel", "torch", "mixed"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The compiled kernel's probes, torch's, or either at random per call (the two must read
    what the other wrote: a map made with one is asked with the other)."""
    from psflow.sparse.kernels import KERNELS

    if request.param != "torch" and KERNELS is None:
        pytest.skip("psflow.sparse._kernels is not built")
    pick = random.Random(9)
    choose = {
        "kernel": lambda: KERNELS,
        "torch": lambda: None,
        "mixed": lambda: KERNELS if pick.random() < 0.5 else None,
    }[request.param]
    monkeypatch.setattr(idmap_module, "_kernels", choose)
    return str(request.param)


@pytest.mark.parametrize("seed", range(2))
def test_an_idmap_answers_as_a_dict_does_through_puts_removals_and_rebuilds(
    seed: int, path: str
) -> None:
    rng = random.Random(seed)
    # Extremes, negatives and a narrow range (neighbouring homes, long probe runs) together.
    pool = list({rng.randrange(-(2**63), 2**63) for _ in range(3000)} | set(range(-50, 3000)))
    pool += [-(2**63), 2**63 - 1]
    m, d = IdMap(), {}
    next_slot = 0
    for _ in range(200):
        absent = [i for i in _ids(rng, 60, pool) if i not in d]
        if absent and rng.random() < 0.6:
            slots = list(range(next_slot, next_slot + len(absent)))
            next_slot += len(absent)
            m.put(torch.tensor(absent), torch.tensor(slots))
            d.update(zip(absent, slots, strict=True))
        elif d:
            gone = rng.sample(sorted(d), min(len(d), rng.randrange(1, 80)))
            m.remove(torch.tensor(gone))
            for i in gone:
                del d[i]
        asked = _ids(rng, 200, pool)
        got = m.get(torch.tensor(asked)).tolist()
        assert got == [d.get(i, -1) for i in asked]
        assert len(m) == len(d)
    assert m.keys.numel() > MIN_CELLS  # it grew: rebuilds were exercised


def test_an_idmap_keeps_its_load_at_most_one_half_with_tombstones_counted(path: str) -> None:
    m = IdMap()
    for round_ in range(50):
        ids = torch.arange(round_ * 400, round_ * 400 + 400)
        m.put(ids, ids)
        m.remove(ids[:300])
        used = int((m.vals != -1).sum())  # live entries and tombstones
        assert 2 * used <= m.keys.numel()
    assert len(m) == 50 * 100


def test_the_docstring_example_runs() -> None:
    assert doctest.testmod(idmap_module).failed == 0


def test_a_growing_map_rebuilds_into_cells_made_ready_as_it_filled(path: str) -> None:
    """From a quarter's load the cells of the coming rebuild (twice as many) are made a
    part at each put, all of them by the put that rebuilds, which then takes them: the map
    still answers as before, and its bytes count the prepared cells."""
    m = IdMap()
    cells = MIN_CELLS
    ids = torch.arange(cells // 2) * 7919 - 3
    m.put(ids[: cells // 4], torch.arange(cells // 4))
    assert m.nbytes == 3 * 8 * cells  # keys, values and the claims of the torch path
    made = []
    for start in range(cells // 4, cells // 2, 32):
        m.put(ids[start : start + 32], torch.arange(start, start + 32))
        assert m._next is not None and m._next[0].numel() == 2 * cells
        made.append(m._next_ready)
    assert made == sorted(made) and made[-1] == 2 * cells and made[0] < cells
    assert m.nbytes == 3 * 8 * cells + 2 * 8 * 2 * cells
    ready = m._next[0].data_ptr()
    m.put(torch.tensor([-1]), torch.tensor([cells // 2]))  # past a half: the rebuild
    assert m.keys.data_ptr() == ready and m._next is None and m.nbytes == 3 * 8 * 2 * cells
    everything = torch.cat([ids, torch.tensor([-1, 5])])
    assert m.get(everything).tolist() == [*range(cells // 2 + 1), -1]


def test_nothing_is_prepared_for_a_rebuild_that_would_not_grow_the_map(path: str) -> None:
    """A load made mostly of tombstones (removed ids), or a map told it holds at most a few
    ids (a table's ``max_rows``), rebuilds at its own size: no cells are prepared for it."""
    cells = MIN_CELLS
    ids = torch.arange(cells) * 31 + 1
    m = IdMap()
    m.put(ids[:500], torch.arange(500))
    m.remove(ids[:490])
    m.put(ids[500:510], torch.arange(500, 510))  # a load of 510 / 1,024, 490 of it removed
    assert m._next is None and m.nbytes == 3 * 8 * cells
    m.put(ids[510:520], torch.arange(510, 520))  # the rebuild, at the same size
    assert m.nbytes == 3 * 8 * cells and m.get(ids[488:520]).tolist() == [-1, -1, *range(490, 520)]
    capped = IdMap(most=100)
    capped.put(ids[: cells // 2], torch.arange(cells // 2))
    assert capped._next is None
    assert capped.get(ids[: cells // 2]).tolist() == list(range(cells // 2))


def test_a_growing_map_holds_a_quarter_to_a_half_of_its_cells(path: str) -> None:
    """A map that only grows rebuilds at twice the cells (32-64 bytes an id, not up to 128);
    one whose ids are removed too rebuilds with room for as many removals again."""
    m = IdMap()
    for start in range(0, 20_000, 100):
        m.put(torch.arange(start, start + 100) * 3, torch.arange(start, start + 100))
        cells = m.keys.numel()
        assert 2 * len(m) <= cells and (cells == MIN_CELLS or 4 * len(m) > cells)
    assert m.keys.numel() == 65536
    churned = IdMap()
    for start in range(0, 20_000, 100):
        churned.put(torch.arange(start, start + 100), torch.arange(100))
        churned.remove(torch.arange(start, start + 100))
    assert len(churned) == 0 and churned.keys.numel() == MIN_CELLS
