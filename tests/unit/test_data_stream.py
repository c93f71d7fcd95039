"""psflow.data.stream: a glob watched for TFRecord files that land while it is read.

Files of numbered records land (written beside the glob's reach, then renamed in, as a writer
commits them) before and during the reads; readers must hand out every record once, in file
order, and a saved position (files read whole, the record reached in the current one) must
restore exactly, into one reader or several. Local paths and fsspec (``memory://``).
"""

from __future__ import annotations

import doctest
import logging
import os
import uuid
from pathlib import Path

import pytest

from psflow.data import DataLossError, FixedLenFeature, serialize_example, write_records
from psflow.data.stream import (
    FileStreamConfig,
    FileStreamReader,
    merge_file_states,
    owner,
)

pytestmark = pytest.mark.unit

PER_FILE = 10


def land(directory: Path, k: int, records: list[bytes] | None = None) -> str:
    """File k (records k*PER_FILE ...) written as a hidden name, then renamed into the glob."""
    hidden, final = directory / f".part-{k:03d}.tmp", directory / f"part-{k:03d}.tfrecord"
    numbers = range(k * PER_FILE, (k + 1) * PER_FILE)
    write_records(hidden, records if records is not None else [str(i).encode() for i in numbers])
    os.replace(hidden, final)
    return str(final)


def reader(directory: Path, **kw: object) -> FileStreamReader:
    cfg = FileStreamConfig(pattern=str(directory / "part-*.tfrecord"), poll_interval_s=0.01, **kw)  # type: ignore[arg-type]
    return FileStreamReader(cfg, parser=int)


def drain(r: FileStreamReader, max_records: int = 7) -> list[int]:
    """Everything there is now (a read that waits 0.05 s and gets nothing ends it)."""
    out: list[int] = []
    while batch := r.read(max_records, timeout_s=0.05):
        out += [rec.value for rec in batch]
    return out


def test_files_that_land_while_reading_are_read_once_each(tmp_path: Path) -> None:
    r = reader(tmp_path)
    assert r.read(timeout_s=0.05) == []  # nothing yet: waited, nothing to give
    land(tmp_path, 0)
    land(tmp_path, 1)
    got = [x.value for x in r.read(15)]  # all of file 0, half of file 1
    assert got == list(range(15))
    land(tmp_path, 2)  # lands while file 1 is being read
    got += drain(r)
    assert got == list(range(30))
    land(tmp_path, 3)
    (tmp_path / ".part-099.tmp").write_bytes(b"half written")  # hidden: never read
    got += drain(r)
    assert got == list(range(40))
    assert r.stats == {"records": 40, "bad_records": 0, "files": 4}
    assert r.state()["done"] == [str(tmp_path / f"part-{k:03d}.tfrecord") for k in range(4)]


def test_a_saved_position_restores_exactly(tmp_path: Path) -> None:
    for k in range(3):
        land(tmp_path, k)
    first = reader(tmp_path)
    seen = [x.value for x in first.read(13)]
    saved = first.state()
    assert saved["partial"] == {str(tmp_path / "part-001.tfrecord"): 3}
    assert saved["done"] == [str(tmp_path / "part-000.tfrecord")]
    first.read(4)  # read on past the save: read again after the restore
    first.close()
    land(tmp_path, 3)
    again = reader(tmp_path)
    again.restore(saved)
    assert seen + drain(again) == list(range(40))


def test_a_position_past_a_files_end_is_refused_naming_it(tmp_path: Path) -> None:
    """The file restored had fewer records than were handed out (truncated or replaced): it
    was marked done, its records after the position silently lost."""
    path = land(tmp_path, 0)
    saved = {**reader(tmp_path).state(), "partial": {path: 1000}}
    again = reader(tmp_path)
    again.restore(saved)
    with pytest.raises(ValueError, match=r"part-000.tfrecord' has 10 records, but the position "):
        again.read(5)


def test_workers_share_the_files_and_a_merged_state_restores_into_one(tmp_path: Path) -> None:
    for k in range(6):
        land(tmp_path, k)
    readers = [reader(tmp_path, worker_index=i, num_workers=2) for i in range(2)]
    got = [[x.value for x in r.read(12)] for r in readers]
    for i, mine in enumerate(got):
        assert mine and {
            owner(str(tmp_path / f"part-{v // PER_FILE:03d}.tfrecord"), 2) for v in mine
        } <= {i}
    merged = merge_file_states(r.state() for r in readers)
    for k in range(6, 8):
        land(tmp_path, k)
    one = reader(tmp_path)
    one.restore(merged)
    rest = drain(one)
    assert sorted(got[0] + got[1] + rest) == list(range(80))  # no duplicate, no gap


def test_an_fsspec_glob_is_listed_again_as_files_land() -> None:
    base = f"memory://psflow-stream-{uuid.uuid4().hex}"
    write_records(f"{base}/a-0.tfrecord", [b"0", b"1"])
    r = FileStreamReader(
        FileStreamConfig(pattern=f"{base}/a-*.tfrecord", poll_interval_s=0.01), parser=int
    )
    assert [x.value for x in r.read(10, timeout_s=0.05)] == [0, 1]
    write_records(f"{base}/a-1.tfrecord", [b"2"])
    assert drain(r) == [2]
    done = r.state()["done"]
    assert [d.rsplit("/", 1)[1] for d in done] == ["a-0.tfrecord", "a-1.tfrecord"]
    assert all(d.startswith("memory://") for d in done)


def test_examples_and_a_bad_record_skipped_or_stopping_the_reader(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = [serialize_example({"n": i}) for i in range(5)]
    records[2] = b"\xff\x01 not an Example"
    path = land(tmp_path, 0, records)
    spec = {"n": FixedLenFeature(dtype="int64")}
    strict = reader(tmp_path, on_bad_record="raise")
    with pytest.raises(ValueError, match=rf"file '{path}' record 2: the record does not parse"):
        strict.read_examples(4, spec)
    assert strict.state()["partial"] in ({}, {path: 0})  # nothing handed out
    lenient = reader(tmp_path)
    with caplog.at_level(logging.WARNING):
        batch = lenient.read_examples(8, spec, timeout_s=0.05)
    assert batch is not None and batch["n"].tolist() == [0, 1, 3, 4]
    assert lenient.stats["bad_records"] == 1 and lenient.state()["done"] == [path]
    assert f"file '{path}' record 2: skipped" in caplog.text


def test_bad_states_are_named(tmp_path: Path) -> None:
    r = reader(tmp_path)
    with pytest.raises(ValueError, match=r"pattern '/elsewhere/\*', expected"):
        r.restore({"source": "files", "pattern": "/elsewhere/*", "done": [], "partial": {}})
    with pytest.raises(ValueError, match=r"partial must map paths to record indices"):
        r.restore({**r.state(), "partial": {"x": -1}})
    with pytest.raises(ValueError, match=r"not a file stream reader's state"):
        r.restore({"source": "kafka"})


def test_the_docstring_examples_run() -> None:
    import psflow.data.kafka
    import psflow.data.stream

    for module in (psflow.data.stream, psflow.data.kafka):
        assert doctest.testmod(module).failed == 0


def test_a_corrupt_file_is_skipped_and_counted_or_stops_the_reader(tmp_path: Path) -> None:
    path = land(tmp_path, 0)
    with open(path, "r+b") as f:  # the last record cut short
        f.truncate(os.path.getsize(path) - 3)
    strict = reader(tmp_path, on_bad_record="raise")
    with pytest.raises(DataLossError, match=r"part-000.tfrecord: corrupted record .*index 9"):
        strict.read(20, timeout_s=0.05)
    assert strict.state()["partial"] == {} and strict.state()["done"] == []
    lenient = reader(tmp_path)
    assert [x.value for x in lenient.read(20, timeout_s=0.05)] == list(range(9))
    assert lenient.stats["bad_records"] == 1 and lenient.state()["done"] == [path]


def test_iter_examples_ends_after_an_idle_timeout_with_the_position_past_each_batch(
    tmp_path: Path,
) -> None:
    land(tmp_path, 0, [serialize_example({"n": i}) for i in range(5)])
    r = reader(tmp_path)
    seen, states = [], []
    for batch in r.iter_examples(2, {"n": FixedLenFeature(dtype="int64")}, idle_timeout_s=0.05):
        seen += batch["n"].tolist()
        states.append(r.state())
    assert seen == [0, 1, 2, 3, 4]
    path = str(tmp_path / "part-000.tfrecord")
    assert [s["partial"] for s in states[:2]] == [{path: 2}, {path: 4}]
    assert states[2] == {**states[2], "done": [path], "partial": {}}
