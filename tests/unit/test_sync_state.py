"""The bookkeeping of synchronous steps and bounded staleness, without sockets."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from psflow.protocol import OptimizerSpec
from psflow.ps.staleness import ClockTable
from psflow.ps.store import ShardStore
from psflow.ps.sync import StepOvertakenError, SyncAggregator, worker_order
from psflow.transport import Request
from psflow.worker import ModeConfig


def _agg() -> SyncAggregator:
    store = ShardStore()
    store.initialize(
        [("w", torch.zeros(3, dtype=torch.float64))], OptimizerSpec(kwargs={"lr": 1.0})
    )
    agg = SyncAggregator(store)
    agg.configure(2, 3, "worker:0")
    return agg


def _g(v: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((3,), v, dtype=torch.float64))]


def test_first_two_of_three_are_averaged_once_and_the_late_one_dropped() -> None:
    agg = _agg()
    assert agg.stage("worker:2", 0, _g(4.0)) and agg.arrive("worker:2") is None
    assert agg.stage("worker:0", 0, _g(2.0))
    assert agg.arrive("worker:0") == ("worker:2", "worker:0")
    agg.apply(0, ("worker:2", "worker:0"))
    assert agg.store.step == 1
    assert torch.equal(agg.store.variables["w"], torch.full((3,), -3.0, dtype=torch.float64))
    assert not agg.stage("worker:1", 0, _g(100.0))  # computed against step 0: too late
    assert agg.dropped_stale == 1 and agg.dropped_by_worker == {"worker:1": 1}
    assert list(agg.decisions) == [(0, ("worker:0", "worker:2"))]  # in worker order


def test_decisions_apply_in_order_and_a_gap_is_an_error() -> None:
    agg = _agg()
    agg.stage("worker:0", 0, _g(1.0))
    agg.stage("worker:1", 0, _g(3.0))
    assert agg.catch_up([(0, ["worker:1", "worker:0"])]) == 1
    assert agg.catch_up([(0, ["worker:1", "worker:0"])]) == 0  # already applied
    with pytest.raises(ValueError, match="a decision is missing"):
        agg.catch_up([(5, ["worker:0"])])
    with pytest.raises(ValueError, match="no staged gradient from worker:2"):
        agg.catch_up([(1, ["worker:2"])])
    # A step this shard has not reached: the ps went back (a restore) under the worker.
    with pytest.raises(StepOvertakenError, match="was the ps restored") as e:
        agg.stage("worker:0", 9, _g(1.0))
    assert e.value.code == "restored"


def test_settings_must_agree() -> None:
    agg = _agg()
    with pytest.raises(ValueError, match="every worker must use the same settings"):
        agg.configure(3, 3, "worker:1")
    with pytest.raises(ValueError, match="exceeds"):
        SyncAggregator(ShardStore()).configure(4, 3, "worker:0")
    assert sorted(["worker:10", "worker:2", "chief:0"], key=worker_order) == [
        "chief:0",
        "worker:2",
        "worker:10",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "bsp"}, "unknown mode"),
        ({"mode": "sync", "replicas_to_aggregate": 0}, "replicas_to_aggregate must be"),
        ({"mode": "async", "replicas_to_aggregate": 2}, "applies to mode='sync'"),
        ({"mode": "sync", "replicas_to_aggregate": 3, "total_num_replicas": 2}, "exceeds"),
        ({"mode": "sync", "max_staleness": 2}, "applies to mode='async'"),
        ({"mode": "async", "max_staleness": -1}, "max_staleness must be"),
        ({"mode": "sync", "timeout": 0}, "timeout must be"),
    ],
)
def test_mode_config_names_the_bad_value(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModeConfig(**kwargs)


def test_mode_config_defaults_and_cluster_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSFLOW_MODE", "sync")
    assert ModeConfig().mode == "sync"
    assert ModeConfig().replicas(3) == (3, 3)
    assert ModeConfig(replicas_to_aggregate=2).replicas(3) == (2, 3)
    with pytest.raises(ValueError, match="total_num_replicas=4 but the cluster has 3"):
        ModeConfig(total_num_replicas=4).replicas(3)


def _req(i: int) -> Request:
    return Request(identity=b"x", header={"id": i}, frames=[])


def test_clock_table_holds_whoever_is_too_far_ahead() -> None:
    table = ClockTable({"worker:0", "worker:1"})
    table.wait("worker:0", 0, 1, _req(1))
    assert [r.header["id"] for r, _ in table.release()] == [1]
    table.wait("worker:0", 2, 1, _req(2))  # 2 ahead of worker:1 (clock 0)
    assert table.release() == [] and table.waits == 1
    table.wait("worker:1", 1, 1, _req(3))
    released = {r.header["id"]: h for r, h in table.release()}
    assert released[2]["held"] and not released[3]["held"]
    table.wait("worker:0", 5, 0, _req(4))
    table.finished = {"worker:1"}  # a finished worker holds no one back
    assert [r.header["id"] for r, _ in table.release()] == [4]
