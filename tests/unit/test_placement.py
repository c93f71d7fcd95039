"""Placement: round-robin, greedy by bytes, partitioning along dim 0."""

from __future__ import annotations

import pytest
import torch

from psflow.worker.placement import ParamInfo, place, shard_bytes

pytestmark = pytest.mark.unit

F32 = torch.float32


def info(name: str, *shape: int) -> ParamInfo:
    return ParamInfo(name=name, shape=shape, dtype=F32)


def test_round_robin_follows_creation_order_like_replica_device_setter() -> None:
    params = [info("a", 1000), info("b", 1), info("c", 1000), info("d", 1)]
    pieces = place(params, 2, strategy="round_robin", partition_bytes=None)
    assert [(p.var, p.shard) for p in pieces] == [("a", 0), ("b", 1), ("c", 0), ("d", 1)]
    assert shard_bytes(pieces, 2) == [8000, 8]  # TensorFlow's famous imbalance


def test_greedy_balances_bytes() -> None:
    params = [info("a", 1000), info("b", 1), info("c", 1000), info("d", 1)]
    pieces = place(params, 2, strategy="greedy", partition_bytes=None)
    assert sorted(shard_bytes(pieces, 2)) == [4004, 4004]
    assert [p.var for p in pieces] == ["a", "b", "c", "d"]  # module order kept


def test_large_tensor_is_partitioned_across_distinct_shards() -> None:
    pieces = place([info("emb", 10, 4), info("b", 4)], 3, partition_bytes=100)
    parts = [p for p in pieces if p.param == "emb"]
    assert [p.var for p in parts] == ["emb/part_0", "emb/part_1", "emb/part_2"]
    assert [p.rows for p in parts] == [(0, 4), (4, 7), (7, 10)]  # TensorFlow's split
    assert len({p.shard for p in parts}) == 3
    assert sum(p.nbytes for p in parts) == 10 * 4 * 4


def test_no_partition_with_one_shard_or_one_row() -> None:
    assert [p.var for p in place([info("w", 100, 100)], 1, partition_bytes=10)] == ["w"]
    assert [p.var for p in place([info("w", 1, 100)], 4, partition_bytes=10)] == ["w"]


def test_more_shards_than_rows() -> None:
    parts = place([info("w", 2, 100)], 5, partition_bytes=10)
    assert [p.rows for p in parts] == [(0, 1), (1, 2)]


def test_placement_is_deterministic() -> None:
    params = [info(f"p{i}", i + 1, 3) for i in range(20)]
    assert place(params, 3) == place(list(params), 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_shards": 0}, "at least one ps shard"),
        ({"num_shards": 2, "strategy": "random"}, "unknown placement strategy"),
        ({"num_shards": 2, "partition_bytes": 0}, "partition_bytes"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        place([info("w", 2)], **kwargs)  # type: ignore[arg-type]
