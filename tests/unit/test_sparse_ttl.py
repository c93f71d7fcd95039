"""Hashed tables bounded over time (ttl_seconds, max_rows as a hard cap) and the rows an export
takes (a base, then deltas: rows changed and ids evicted since the last export).

Time is an injected clock moved by hand: no test waits.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest

from psflow import metrics
from psflow.nn import TableConfig
from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse import FixedRows, HashedRows, initial_rows, make_rows

pytestmark = pytest.mark.unit

DIM = 3
SGD = RowOptimizerSpec.of("SGD", lr=1.0)


class Clock:
    """Seconds, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def hashed(clock: Clock, **spec: object) -> HashedRows:
    table = make_rows(
        TableSpec(name="t", embedding_dim=DIM, num_embeddings=None, optimizer=SGD, **spec),  # type: ignore[arg-type]
        0,
        1,
        clock=clock,
    )
    assert isinstance(table, HashedRows)
    return table


def push(table: HashedRows | FixedRows, ids: list[int], value: float = 1.0) -> None:
    table.apply(torch.tensor(ids), torch.full((len(ids), DIM), value))


def held(table: HashedRows | FixedRows) -> dict[int, list[float]]:
    snap = table.snapshot()
    return dict(zip(snap["ids"].tolist(), snap["values"].tolist(), strict=True))


def test_rows_expire_after_ttl_seconds_without_an_update() -> None:
    clock = Clock()
    table = hashed(clock, ttl_seconds=10.0)
    push(table, [1, 2, 3])
    clock.now += 6
    push(table, [2])  # 2 is fresh again
    clock.now += 4  # 1 and 3: 10 s without an update
    push(table, [4])
    assert sorted(held(table)) == [2, 4]
    assert table.stats["expired"] == 2 and table.stats["rows"] == 2
    # An expired id reads its initial row again, and comes back as a new row when pushed.
    first = initial_rows(0, torch.tensor([1]), DIM, std=1.0, dtype=torch.float32)
    assert torch.equal(table.lookup(torch.tensor([1])), first)
    clock.now += 6  # 2: 10 s since its update at 106
    push(table, [1])
    assert sorted(held(table)) == [1, 4]
    assert table.stats["expired"] == 3


def test_a_snapshot_never_holds_an_expired_row_even_between_scans() -> None:
    clock = Clock()
    table = hashed(clock, ttl_seconds=16.0)
    push(table, [1])
    clock.now += 8
    push(table, [2])
    clock.now += 8.5  # 1 expired 0.5 s ago; no scan is due before 1 s (ttl / 16) has passed
    push(table, [3])
    clock.now += 0.1
    assert sorted(held(table)) == [2, 3]  # the snapshot scanned first


def test_expiry_moves_rows_and_keeps_every_value_and_state() -> None:
    clock = Clock()
    spec = {"ttl_seconds": 5.0}
    table = hashed(clock, **spec)
    adagrad = make_rows(
        TableSpec(name="t", embedding_dim=DIM, num_embeddings=None, ttl_seconds=5.0,
                  optimizer=RowOptimizerSpec.of("Adagrad")),
        0, 1, clock=clock,
    )  # fmt: skip
    for t in (table, adagrad):
        push(t, list(range(10)))
        clock.now += 3
        push(t, [2, 5, 9], 2.0)
        before = t.snapshot()
        clock.now += 3  # 0, 1, 3, 4, 6, 7, 8 expire; 9 is moved into a freed slot
        t.apply(torch.tensor([11]), torch.ones(1, DIM))
        after = t.snapshot()
        keep = torch.isin(before["ids"], torch.tensor([2, 5, 9]))
        order = after["ids"][:-1].argsort()
        assert after["ids"][:-1][order].tolist() == [2, 5, 9]
        want = before["ids"][keep].argsort()
        for key in before:
            assert torch.equal(after[key][:-1][order], before[key][keep][want]), key
        got = t.lookup(torch.tensor([9, 2, 5]))
        assert torch.equal(
            got, torch.stack([before["values"][before["ids"] == i][0] for i in (9, 2, 5)])
        )


def test_max_rows_is_a_hard_cap_with_ttl_and_when_loading() -> None:
    clock = Clock()
    table = hashed(clock, max_rows=4, ttl_seconds=100.0)
    for step in range(10):
        push(table, [step * 3, step * 3 + 1, step * 3 + 2])
        assert table.num_rows <= 4
        clock.now += 1
    assert table.stats["evicted"] == 26 and table.stats["expired"] == 0
    ids = torch.arange(100, 110)
    table.load(ids, torch.zeros(10, DIM), {})
    assert table.num_rows == 4 and len(table.snapshot()["ids"]) == 4
    clock.now += 100
    assert table.snapshot()["ids"].numel() == 0
    assert table.stats["expired"] == 4


def test_ttl_is_checked_where_the_table_is_described() -> None:
    with pytest.raises(ValueError, match="ttl_seconds must be a number > 0"):
        TableSpec(name="t", embedding_dim=2, num_embeddings=None, ttl_seconds=0)
    with pytest.raises(ValueError, match="ttl_seconds is for hashed tables"):
        TableConfig(num_embeddings=10, embedding_dim=2, ttl_seconds=5.0)
    config = TableConfig(num_embeddings=None, embedding_dim=2, ttl_seconds=5.0, max_rows=9)
    spec = config.spec("users")
    assert spec.ttl_seconds == 5.0
    assert TableSpec.from_wire(spec.to_wire()) == spec
    assert TableConfig.from_spec(spec) == config


def apply_export(held_rows: dict[int, list[float]], part: object) -> None:
    """What a loader does with one shard's part of one table."""
    rows, tombstones = part  # type: ignore[misc]
    got = rows.result()
    for i in tombstones.tolist():
        held_rows.pop(i, None)  # evicted since the last export, maybe made after it too
    held_rows.update(zip(got["ids"].tolist(), got["values"].tolist(), strict=True))


def test_a_base_and_its_deltas_give_the_rows_held_with_eviction_on() -> None:
    clock = Clock()
    table = hashed(clock, max_rows=6, ttl_seconds=10.0)
    assert not table.tracking
    with pytest.raises(ValueError, match="no export was taken on this shard"):
        table.begin_export(base=False)
    push(table, [1, 2, 3, 4])
    served: dict[int, list[float]] = {}
    apply_export(served, table.begin_export(base=True))
    assert served == held(table)
    sizes = []
    for step in range(12):
        # Bursts overflow max_rows (evictions); quiet spells let rows expire.
        clock.now += 3 if step % 4 < 2 else 7
        burst = [step % 5, 10 + step, 20 + step % 3] if step % 4 < 2 else [step % 5]
        push(table, burst, float(step))
        if step % 3 == 2:
            part = table.begin_export(base=False)
            sizes.append((part.rows.result()["ids"].numel(), part.tombstones.numel()))
            apply_export(served, part)  # its result again: the same tensors
            assert served == held(table)
    assert table.stats["evicted"] > 0 and table.stats["expired"] > 0
    assert all(n <= 9 for n, _ in sizes) and any(t for _, t in sizes)


def test_a_delta_holds_each_row_as_it_was_at_the_export() -> None:
    clock = Clock()
    table = hashed(clock, ttl_seconds=10.0)
    push(table, list(range(8)))
    table.begin_export(base=True).rows.result()
    clock.now += 6
    push(table, [1, 6], 5.0)
    want = held(table)
    part = table.begin_export(base=False)
    # Before the delta is read: the rows change, rows expire and others move into their slots.
    clock.now += 5
    push(table, [6, 30], 7.0)
    got = part.rows.result()
    assert sorted(got["ids"].tolist()) == [1, 6]
    for i, row in zip(got["ids"].tolist(), got["values"].tolist(), strict=True):
        assert row == want[i]
    assert sorted(held(table)) == [1, 6, 30]  # the others expired, 6 moved to a freed slot


def test_a_re_admitted_id_is_no_tombstone_and_a_fixed_table_exports_its_changed_rows() -> None:
    clock = Clock()
    table = hashed(clock, max_rows=2)
    push(table, [1, 2])
    table.begin_export(base=True)
    push(table, [3])  # evicts 1 (or 2)
    push(table, [1, 2])  # back; 3 goes
    part = table.begin_export(base=False)
    assert part.tombstones.tolist() == [3]
    fixed = make_rows(
        TableSpec(name="f", embedding_dim=DIM, num_embeddings=10, optimizer=SGD), 1, 2
    )
    assert isinstance(fixed, FixedRows)
    fixed.begin_export(base=True)
    fixed.apply(torch.tensor([3, 7]), torch.ones(2, DIM))
    rows = fixed.begin_export(base=False).rows.result()
    assert rows["ids"].tolist() == [3, 7]
    assert torch.equal(rows["values"], fixed.lookup(torch.tensor([3, 7])))
    assert fixed.begin_export(base=False).rows.result()["ids"].numel() == 0


def test_expired_rows_are_counted_in_the_metrics() -> None:
    clock = Clock()
    table = hashed(clock, ttl_seconds=1.0)
    push(table, [1, 2])
    clock.now += 2
    push(table, [3])
    m = metrics.TaskMetrics("ps:0", enabled=True)
    m.ps(0).watch(
        step=lambda: 0, nbytes=lambda: 0, waiting=lambda: 0, tables=lambda: {"t": table.stats}
    )
    got = metrics.parse(generate_latest(m.registry).decode())
    assert got.total(metrics.PS_EXPIRED, table="t") == 2
    assert got.total(metrics.PS_ROWS, table="t") == 1
