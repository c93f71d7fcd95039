"""psflow.serve.delta's merge of a delta into a held table: the same table a sort of the whole
gives, for held ids, changed ids and tombstones drawn at random (edges included)."""

from __future__ import annotations

import pytest
import torch

from psflow.serve.delta import _merge

pytestmark = pytest.mark.unit


def by_sorting(
    held: torch.Tensor, held_rows: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
    gone: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The merge as a sort of the whole table (what the server did before)."""
    keep = ~torch.isin(held, torch.cat([gone, ids]))
    all_ids, all_rows = torch.cat([held[keep], ids]), torch.cat([held_rows[keep], rows])
    order = all_ids.argsort()
    return all_ids[order], all_rows[order]


def draw(g: torch.Generator, n: int, span: int) -> torch.Tensor:
    """``n`` draws of ids: small ones (they collide) or near int64's ends."""
    small = torch.randint(-span, span, (n,), generator=g)
    edge = torch.randint(0, 4, (n,), generator=g) + (2**63 - 4)
    return torch.where(torch.rand(n, generator=g) < 0.1, edge * (1 - 2 * (small % 2)), small)


@pytest.mark.parametrize("seed", range(200))
def test_a_merge_gives_what_a_sort_of_the_whole_table_gives(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 40, (3,), generator=g).tolist()
    held = draw(g, sizes[0], 30).unique()  # sorted, as a table is held
    ids = draw(g, sizes[1], 30).unique()
    ids = ids[torch.randperm(ids.numel(), generator=g)]  # a delta's ids come in any order
    gone = draw(g, sizes[2], 30).unique()
    gone = gone[~torch.isin(gone, ids)]  # an id is changed or gone, not both
    held_rows = torch.randn(held.numel(), 3, generator=g)
    rows = torch.randn(ids.numel(), 3, generator=g)
    before = held.clone()
    got = _merge(held, held_rows, ids, rows, gone)
    want = by_sorting(held, held_rows, ids, rows, gone)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(held, before)  # the held table is shared with requests: never written
