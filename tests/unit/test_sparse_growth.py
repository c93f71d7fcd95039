"""A hashed table's storage as it grows: in place in reserved address space past
``RESERVE_FROM_BYTES`` (nothing copied), copied where no reservation can be had, the same rows
and state either way, and snapshots keeping their moment across a growth."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from psflow import allocator
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse import HashedRows, kernels

pytestmark = pytest.mark.unit

F64 = torch.float64


def spec(optimizer: str, **kwargs: object) -> TableSpec:
    extra = {"initial_accumulator_value": 0.25} if optimizer in ("Adagrad", "Ftrl") else {}
    return TableSpec(
        name="ids", embedding_dim=3, num_embeddings=None, dtype="float64", seed=5,
        optimizer=RowOptimizerSpec.of(optimizer, **extra), **kwargs,
    )  # fmt: skip


def reserve_from_the_first_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every growth of a table reserves (``RESERVE_FROM_BYTES`` 1); the test skipped where the
    host gives no reservation (not Linux, ``vm.overcommit_memory`` 2, a finite ``ulimit -v``):
    there every table copies as it grows, which the tests of the copy path cover."""
    if allocator.reserve((1,), torch.uint8, 1) is None:
        pytest.skip("no address space to reserve here (not Linux, strict overcommit, RLIMIT_AS)")
    monkeypatch.setattr(allocator, "RESERVE_FROM_BYTES", 1)


def grow(rows: HashedRows, steps: int = 5) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Pushes of new ids and held ones, each step more than the last: the lookups on the way,
    and the storage's (capacity, address) after each step."""
    seen, storage = [], []
    made = rows.num_rows
    for step in range(steps):
        new = 700 * (step + 1)
        ids = torch.cat([torch.arange(made, made + new), torch.arange(0, made, 3)]) * 7919 - 11
        made += new
        grads = torch.linspace(-1, 1, ids.numel() * 3, dtype=F64).view(-1, 3)
        rows.apply(ids, grads)
        seen.append(rows.lookup(torch.arange(0, made + 50, 5) * 7919 - 11))
        storage.append((rows.capacity, rows.values.data_ptr()))
    return seen, storage


def same(a: HashedRows, b: HashedRows) -> None:
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.keys() == sb.keys()
    oa, ob = torch.argsort(sa["ids"]), torch.argsort(sb["ids"])
    for key in sa:
        assert torch.equal(sa[key][oa], sb[key][ob]), key
    assert a.stats == b.stats


@pytest.mark.parametrize(
    ("optimizer", "kwargs"),
    [
        ("Adagrad", {}),
        ("RowWiseAdagrad", {}),
        ("Adam", {"ttl_seconds": 1000.0}),
        ("Ftrl", {"max_rows": 6000}),
    ],
)
def test_a_table_grown_in_place_holds_what_a_copied_one_holds(
    monkeypatch: pytest.MonkeyPatch, optimizer: str, kwargs: dict[str, object]
) -> None:
    """The same pushes into a table whose growths are reserved (from its first) and one whose
    growths copy (no reservation to be had): the same lookups, rows, state, ids and counts
    (evictions with ``max_rows``, times with ``ttl_seconds``); the reserved one's rows never
    move once reserved, the copied one's do."""
    reserve_from_the_first_growth(monkeypatch)
    tables = {}
    for name in ("reserved", "copied"):
        with monkeypatch.context() as m:
            if name == "copied":
                m.setattr(allocator, "reserve", lambda *a: None)
            rows = HashedRows(spec(optimizer, **kwargs), 0, 1, clock=lambda: 7.0)
            rows.apply(torch.tensor([-11]), torch.ones(1, 3, dtype=F64))
            rows.begin_export(base=True).rows.result()  # changes tracked through the growths
            tables[name] = (rows, *grow(rows))
    reserved, seen_reserved, storage_reserved = tables["reserved"]
    copied, seen_copied, storage_copied = tables["copied"]
    for a, b in zip(seen_reserved, seen_copied, strict=True):
        assert torch.equal(a, b)
    same(reserved, copied)
    assert storage_reserved[-1][0] == storage_copied[-1][0] > 4 * 1024  # grown 3 times or more
    grown = [ptr for capacity, ptr in storage_reserved if capacity > 1024]
    assert len(grown) >= 3 and len(set(grown)) == 1
    assert len({ptr for _, ptr in storage_copied}) == len({c for c, _ in storage_copied})
    delta_r, delta_c = reserved.begin_export(base=False), copied.begin_export(base=False)
    for key in ("ids", "values"):
        got, want = delta_r.rows.result()[key], delta_c.rows.result()[key]
        assert got.shape[0] > 0 and torch.equal(got, want), key
    assert torch.equal(delta_r.tombstones, delta_c.tombstones)


def test_a_snapshot_keeps_its_moment_across_a_growth_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A snapshot begun before a push that grows the table (in place) and updates the rows the
    snapshot holds: the snapshot has the rows as they were when it began."""
    reserve_from_the_first_growth(monkeypatch)
    rows = HashedRows(spec("Adagrad"), 0, 1)
    ids = torch.arange(1000) * 13
    rows.apply(ids, torch.ones(1000, 3, dtype=F64))
    grow(rows, steps=1)  # 1,700 rows: reserved from here on
    before = rows.snapshot()
    snap = rows.begin_snapshot()
    start, ptr = rows.capacity, rows.values.data_ptr()
    more = torch.cat([ids, torch.arange(10_000, 14_000) * 13])
    rows.apply(more, torch.full((more.numel(), 3), 0.5, dtype=F64))
    assert rows.capacity > start and rows.values.data_ptr() == ptr
    after = snap.result()
    for key in before:
        assert torch.equal(after[key], before[key]), key
    assert not torch.equal(rows.snapshot()["values"][: before["values"].shape[0]], before["values"])


def test_a_table_past_its_reservation_moves_to_a_larger_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A table that outgrows its reservation (more rows than the machine's memory, made small
    here) is copied once into a new one, its rows and state kept, and grows in place again."""
    reserve_from_the_first_growth(monkeypatch)
    monkeypatch.setattr(allocator, "physical_memory", lambda: 1000 * 3 * 8)  # a few hundred rows
    rows, ref = HashedRows(spec("Adagrad"), 0, 1), HashedRows(spec("Adagrad"), 0, 1)
    _, storage = grow(rows, steps=5)  # reserved at 4,096 rows for 8,192, then past them
    with monkeypatch.context() as m:
        m.setattr(allocator, "reserve", lambda *a: None)
        grow(ref, steps=5)
    assert [c for c, _ in storage] == [1024, 4096, 8192, 8192, 16384]
    ptrs = [ptr for _, ptr in storage]
    assert ptrs[1] == ptrs[2] == ptrs[3] != ptrs[4]
    same(rows, ref)
    _, storage = grow(rows, steps=4)  # 16,384 -> 32,768 in the new reservation
    assert storage[-1] == (32768, ptrs[4])


def test_a_reservation_costs_only_the_pages_touched() -> None:
    """Half the machine's memory reserved, a few rows written: the process's resident memory
    grows by those pages only; the rows read back, the rest are zeros; rows beyond it are
    refused."""
    if allocator.reserve((1,), torch.uint8, 1) is None:
        pytest.skip("no address space to reserve here (not Linux, strict overcommit, RLIMIT_AS)")

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    rows = allocator.physical_memory() // 2 // 256
    before = resident()
    area = allocator.reserve((64,), torch.float32, rows)
    assert area is not None and area.rows == rows
    t = area.first(rows)
    t[:10] = 1.5
    t[rows // 2] = -2.0
    assert resident() - before < 64 << 20
    assert float(t[:10].sum()) == 1.5 * 640 and float(t[rows // 2].sum()) == -128.0
    assert float(t[10:20].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="rows asked of a reservation"):
        area.first(rows + 1)


def test_no_reservation_under_an_address_space_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a finite ``RLIMIT_AS`` the reserved space would count against the limit: none is
    taken, and the table copies as it grows."""
    monkeypatch.setattr(allocator.resource, "getrlimit", lambda what: (1 << 34, 1 << 34))
    assert allocator.reserve((4,), torch.float32, 1024) is None


def test_the_allocators_examples_hold() -> None:
    import doctest

    assert doctest.testmod(allocator).failed == 0


def test_reservations_stop_at_the_process_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reservations count against ``RESERVE_AT_MOST_BYTES`` while they live: one that would pass
    it is refused (the table then copies), and a reservation's bytes come back when its last
    tensor goes."""
    base = allocator.reserved_bytes()
    monkeypatch.setattr(allocator, "RESERVE_AT_MOST_BYTES", base + (16 << 20))
    first = allocator.reserve((1024,), torch.float32, 3 * 1024)  # 12 MiB
    if first is None:
        pytest.skip("no address space to reserve here (not Linux, strict overcommit, RLIMIT_AS)")
    view = first.first(8)
    assert allocator.reserved_bytes() == base + (12 << 20)
    assert allocator.reserve((1024,), torch.float32, 2 * 1024) is None  # 8 MiB more: past it
    del first
    assert allocator.reserved_bytes() == base + (12 << 20)  # its view keeps it
    del view
    assert allocator.reserved_bytes() == base
    assert allocator.reserve((1024,), torch.float32, 2 * 1024) is not None


@pytest.mark.parametrize("kernels_built", [True, False])
@pytest.mark.parametrize("min_count", [0, 2])
def test_evictions_from_the_pool_are_the_least_recently_updated(
    monkeypatch: pytest.MonkeyPatch, min_count: int, kernels_built: bool
) -> None:
    """A table at its ``max_rows`` evicting from its pool (rows updated, gone and made since its
    scan, pools running out in the middle of a push): after every push, no id is held twice,
    and every row evicted was updated no later than every row kept from before the push. With
    the compiled kernels and without (torch's operations throughout)."""
    if not kernels_built:
        monkeypatch.setattr(kernels, "KERNELS", None)
    elif kernels.KERNELS is None:
        pytest.skip("psflow.sparse._kernels is not built")
    rng = torch.Generator().manual_seed(3)
    rows = HashedRows(spec("Adagrad", max_rows=300, min_count=min_count), 0, 1)
    last: dict[int, int] = {}  # id -> the push that last updated its row
    for step in range(400):
        size = int(torch.randint(1, 120, (1,), generator=rng))
        fresh = torch.randint(0, 3000, (size,), generator=rng)
        old = torch.tensor(sorted(last), dtype=torch.int64)
        if old.numel():
            old = old[torch.randint(0, old.numel(), (size // 2,), generator=rng)]
        ids = torch.cat([fresh, old]).unique()
        before = set(last)
        rows.apply(ids, torch.ones(ids.numel(), 3, dtype=F64))
        held = rows.snapshot()["ids"].tolist()
        assert len(held) == len(set(held)) == rows.num_rows <= 300
        held_set = set(held)
        for i in ids.tolist():
            if i in held_set:
                last[i] = step
        evicted = before - held_set
        kept = (before & held_set) - set(ids.tolist())
        if evicted and kept:
            assert max(last[i] for i in evicted) <= min(last[i] for i in kept), step
        for i in evicted:
            del last[i]
        assert set(last) == held_set
    assert rows.stats["evicted"] > 1000


def test_rows_moved_by_expiry_empty_the_eviction_pool() -> None:
    """An expired row's slot is filled with the last row, which keeps its update count: a pool
    scanned before holds it under its old slot. The pool is dropped, so the moved row (older
    than the pool's next) goes before a newer one."""
    now = [0.0]
    rows = HashedRows(spec("Adagrad", max_rows=4, ttl_seconds=30.0), 0, 1, clock=lambda: now[0])

    def push(at: float, *ids: int) -> None:
        now[0] = at
        rows.apply(torch.tensor(ids), torch.ones(len(ids), 3, dtype=F64))

    # Slots 0-3: p, e (both at time 0), r, m; then r updated: p, e, m, r from least recent.
    p, e, r, m = 100, 200, 300, 400
    for at, i in ((0, p), (0, e), (5, r), (10, m), (20, r)):
        push(at, i)
    push(25, 500)  # evicts p from a pool of them all
    push(31, 600)  # e expires; m moves into its slot
    assert rows.stats["expired"] == 1 and rows.stats["evicted"] == 1
    push(32, 700)  # evicts m, the least recently updated
    assert sorted(rows.snapshot()["ids"].tolist()) == [r, 500, 600, 700]


def test_ids_evicted_between_exports_are_compacted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full table evicting the same ids again and again between two exports keeps each
    evicted id once (those held again not at all), and the delta's tombstones are the ids
    evicted and not held at its moment."""
    from psflow.sparse import hashed as hashed_module

    monkeypatch.setattr(hashed_module, "EVICTED_COMPACT_FROM", 256)
    rows = HashedRows(spec("Adagrad", max_rows=100), 0, 1)
    rows.begin_export(base=True).rows.result()
    for step in range(600):
        ids = torch.arange(step * 50, step * 50 + 50) % 1000
        rows.apply(ids, torch.ones(50, 3, dtype=F64))
        assert sum(t.numel() for t in rows._evicted) <= 2 * 1000 + 50
    assert rows.stats["evicted"] == 600 * 50 - 100
    held = set(rows.snapshot()["ids"].tolist())
    part = rows.begin_export(base=False)
    assert part.tombstones.tolist() == sorted(set(range(1000)) - held)


@pytest.mark.skipif(kernels.KERNELS is None, reason="psflow.sparse._kernels is not built")
def test_the_compiled_least_recent_is_a_stable_sorts_first() -> None:
    """The radix select gives what a stable sort's first ``k`` give, values and places, for
    counts all equal, few, many and far apart (past the 16 bits of its histogram), at every
    kind of ``k``."""
    gen = torch.Generator().manual_seed(0)
    for n in (1, 10, 1000, 300_000):
        for top in (1, 5, 70_000, 2**40, 2**62):
            ticks = torch.randint(0, top, (n,), generator=gen, dtype=torch.int64)
            order = torch.sort(ticks, stable=True)
            for k in sorted({1, min(n, 7), max(1, n // 3), n}):
                values, where = kernels.least_recent(ticks, k)
                assert torch.equal(values, order.values[:k]), (n, top, k)
                assert torch.equal(where, order.indices[:k]), (n, top, k)


def test_the_memory_a_reservation_counts_on_is_a_containers_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A table reserves for as many rows as the memory its process may have: the machine's,
    or its control group's limit where one is set lower (v2's ``max`` and v1's huge number
    mean none)."""
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(allocator, "_CGROUP_LIMITS", (str(v2), str(v1)))
    host = allocator.physical_memory()
    assert host > 0
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")
    assert allocator.physical_memory() == host
    v2.write_text(f"{1 << 30}\n")
    assert allocator.physical_memory() == 1 << 30
    v2.unlink()
    v1.write_text(f"{1 << 31}\n")
    assert allocator.physical_memory() == 1 << 31
