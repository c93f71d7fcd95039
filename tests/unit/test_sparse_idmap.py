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
