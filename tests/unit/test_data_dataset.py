"""Sharding, shuffling, epochs and DataLoader integration of TFRecordDataset."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch.utils.data

from psflow.data import pipeline, proto
from psflow.data.dataset import DatasetConfig, TFRecordDataset
from psflow.data.features import FixedLenFeature
from psflow.data.tfrecord import DataLossError, encode_record, write_records

pytestmark = pytest.mark.unit

SPEC = {"id": FixedLenFeature(dtype="int64")}


def make_files(root: Path, n_files: int, per_file: list[int] | int) -> list[int]:
    """Files of Examples with a unique int64 ``id`` each; returns every id."""
    sizes = per_file if isinstance(per_file, list) else [per_file] * n_files
    ids, nxt = [], 0
    for f, size in enumerate(sizes):
        recs = [proto.serialize_example({"id": nxt + k}) for k in range(size)]
        suffix = ".gz" if f % 2 else ""
        write_records(root / f"part-{f:03d}.tfrecord{suffix}", recs)
        ids += range(nxt, nxt + size)
        nxt += size
    return ids


def read_all(ds: TFRecordDataset, loaders: int) -> list[int]:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=loaders)
    return [i for batch in loader for i in batch["id"].tolist()]


@pytest.mark.parametrize(
    ("n_files", "per_file"),
    [(8, 25), (3, [40, 7, 1]), (1, 61)],
    ids=["by-file", "by-record", "one-file"],
)
def test_every_record_exactly_once_across_tasks_and_loader_processes(
    tmp_path: Path, n_files: int, per_file: list[int] | int
) -> None:
    ids = make_files(tmp_path, n_files, per_file)
    for epoch in (0, 1):
        seen: list[int] = []
        for task in range(2):
            ds = TFRecordDataset(
                str(tmp_path / "*.tfrecord*"),
                SPEC,
                batch_size=5,
                shard_index=task,
                num_shards=2,
                shuffle_buffer=16,
                seed=3,
                cycle_length=2,
                block_length=3,
                backend="torch",
            )
            ds.set_epoch(epoch)
            seen += read_all(ds, loaders=2)
        assert sorted(seen) == sorted(ids), collections.Counter(seen).most_common(3)


def test_shuffle_is_seeded_and_changes_per_epoch(tmp_path: Path) -> None:
    make_files(tmp_path, 4, 30)

    def order(seed: int, epoch: int) -> list[int]:
        ds = TFRecordDataset(
            tmp_path, SPEC, batch_size=8, shuffle_buffer=20, seed=seed, backend="numpy"
        )
        ds.set_epoch(epoch)
        return [i for b in ds for i in b["id"].tolist()]

    a0, a1 = order(1, 0), order(1, 1)
    assert a0 == order(1, 0) and sorted(a0) == sorted(a1) == list(range(120))
    assert a0 != a1 and a0 != order(2, 0) and a0 != sorted(a0)


def test_several_epochs_in_one_iteration_and_unbatched(tmp_path: Path) -> None:
    make_files(tmp_path, 2, 10)
    ds = TFRecordDataset(tmp_path, SPEC, num_epochs=3, shuffle_buffer=4, backend="numpy")
    got = [int(r["id"]) for r in ds]
    assert len(got) == 60 and collections.Counter(got) == {i: 3 for i in range(20)}
    assert got[:20] != got[20:40]  # each epoch reshuffles
    raw = list(TFRecordDataset(tmp_path))
    assert len(raw) == 20 and isinstance(raw[0], bytes)
    forever = iter(TFRecordDataset(tmp_path, num_epochs=None, prefetch=0))
    assert len([next(forever) for _ in range(50)]) == 50


def test_batches_without_shuffle_keep_file_order_and_drop_remainder(tmp_path: Path) -> None:
    make_files(tmp_path, 3, 10)
    ds = TFRecordDataset(tmp_path, SPEC, batch_size=7, backend="numpy")
    batches = [b["id"].tolist() for b in ds]
    assert [len(b) for b in batches] == [7, 7, 7, 7, 2]
    assert [i for b in batches for i in b] == list(range(30))
    ds = TFRecordDataset(tmp_path, SPEC, batch_size=7, drop_remainder=True, backend="numpy")
    assert [len(b["id"]) for b in ds] == [7, 7, 7, 7]
    raw = list(TFRecordDataset(tmp_path, batch_size=4))
    assert isinstance(raw[0], list) and sum(map(len, raw)) == 30


def test_interleave_round_robins_blocks() -> None:
    files = [(f"f{i}", i, None) for i in range(3)]

    class FakeReader:
        def __init__(self, path: str) -> None:
            self.path = path

        def iter_batches(self):  # type: ignore[no-untyped-def]
            from psflow.data.tfrecord import RecordBatch

            yield RecordBatch.from_records([f"{self.path}-{k}".encode() for k in range(4)])

    out = pipeline.interleave(
        files,
        lambda p, _k: FakeReader(p),
        cycle_length=2,
        block_length=3,  # type: ignore[arg-type,return-value]
    )
    got = [r.decode() for b in out for r in b]
    assert got == [
        "f0-0",
        "f0-1",
        "f0-2",
        "f1-0",
        "f1-1",
        "f1-2",
        "f0-3",
        "f1-3",
        "f2-0",
        "f2-1",
        "f2-2",
        "f2-3",
    ]


def test_prefetch_reraises_and_stops() -> None:
    def boom():  # type: ignore[no-untyped-def]
        yield 1
        raise RuntimeError("source failed")

    it = pipeline.prefetch(boom(), 2)
    assert next(it) == 1
    with pytest.raises(RuntimeError, match="source failed"):
        next(it)
    slow = pipeline.prefetch(iter(range(10**9)), 2)
    assert next(slow) == 0
    slow.close()  # the thread notices and ends


def test_corrupt_file_raises_through_the_dataset_or_is_counted(tmp_path: Path) -> None:
    recs = [proto.serialize_example({"id": i}) for i in range(5)]
    data = bytearray(b"".join(map(encode_record, recs)))
    data[20] ^= 1
    (tmp_path / "bad.tfrecord").write_bytes(bytes(data))
    with pytest.raises(DataLossError, match=r"bad.tfrecord.*record index 0"):
        list(TFRecordDataset(tmp_path, SPEC, batch_size=2))
    ds = TFRecordDataset(tmp_path, SPEC, batch_size=2, skip_corrupt=True, backend="numpy")
    assert [i for b in ds for i in b["id"].tolist()] == [1, 2, 3, 4] and ds.skipped == 1


def test_config_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match=r"shard_index.*got 2"):
        DatasetConfig(shard_index=2, num_shards=2)
    with pytest.raises(ValueError, match=r"batch_size.*got 0"):
        DatasetConfig(batch_size=0)
    with pytest.raises(ValueError, match="compression"):
        DatasetConfig(compression="snappy")
    with pytest.raises(ValueError, match="shard_index"):
        pipeline.assign_files(["a"], 3, 2, seed=0, epoch=0, shuffle=False)


def test_assign_files_is_a_partition_each_epoch() -> None:
    files = [f"f{i}" for i in range(10)]
    for epoch in range(3):
        got = [
            f
            for i in range(4)
            for f, _, _ in pipeline.assign_files(files, i, 4, seed=5, epoch=epoch, shuffle=True)
        ]
        assert sorted(got) == files
    orders = {
        tuple(f for f, _, _ in pipeline.assign_files(files, 0, 1, seed=5, epoch=e, shuffle=True))
        for e in range(3)
    }
    assert len(orders) == 3
