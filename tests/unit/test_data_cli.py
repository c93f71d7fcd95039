"""``psflow data inspect`` and ``psflow data convert``."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import psflow.cli
from psflow.data import proto
from psflow.data.features import FixedLenFeature, VarLenFeature, parse_examples
from psflow.data.tfrecord import read_records
from tests.paths import TFRECORD_FIXTURES

pytestmark = pytest.mark.unit

FIX = TFRECORD_FIXTURES


def run(*argv: str) -> int:
    return psflow.cli.main(["data", *argv])


def test_inspect_prints_count_schema_and_first_records(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("inspect", str(FIX / "examples.tfrecord.zlib"), "-n", "2") == 0
    out = capsys.readouterr().out
    assert "records: 50" in out and "compression: ZLIB" in out
    assert "x             fixed   float32  shape=(4,)" in out
    assert "record 1:" in out and "record 2:" not in out
    assert "ids: [869025, 423326, 273169]" in out


def test_inspect_reports_corruption_and_non_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("inspect", str(FIX / "corrupt_crc.tfrecord")) == 2
    assert "record index 0" in capsys.readouterr().err
    assert run("inspect", str(FIX / "raw.tfrecord")) == 2
    assert "--raw" in capsys.readouterr().err
    assert run("inspect", str(FIX / "raw.tfrecord"), "--raw") == 0
    assert "records: 5" in capsys.readouterr().out


def test_convert_parquet_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = pa.table(
        {
            "id": pa.array(range(1000), pa.int32()),
            "score": pa.array([i / 8 if i % 5 else None for i in range(1000)], pa.float64()),
            "name": [f"n{i}" for i in range(1000)],
            "vec": pa.array(
                [[float(i), 1.0][: i % 3] for i in range(1000)], pa.list_(pa.float32())
            ),
        }
    )
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=300)
    assert run("convert", str(tmp_path / "t.parquet"), str(tmp_path / "t.tfrecord.gz")) == 0
    captured = capsys.readouterr()
    assert "wrote 1,000 records" in captured.out and "100.0%" in captured.err
    recs = list(read_records(tmp_path / "t.tfrecord.gz"))
    out = parse_examples(
        recs,
        {
            "id": FixedLenFeature(dtype="int64"),
            "score": FixedLenFeature(dtype="float32", default=-1.0),
            "name": FixedLenFeature(dtype="string"),
            "vec": VarLenFeature(dtype="float32", ragged=True),
        },
    )
    assert out["id"].tolist() == list(range(1000))
    assert out["score"][5] == -1.0 and out["score"][6] == 0.75
    assert out["name"][7] == "n7" and out["vec"].row(7).tolist() == [7.0]
    assert "vec" in proto.example_to_dict(recs[0])  # an empty list stays a typed empty list

    (tmp_path / "t.csv").write_text("a,b,c\n1,2.5,x\n2,,y\n")
    assert run("convert", str(tmp_path / "t.csv"), str(tmp_path / "c.tfrecord"), "--quiet") == 0
    rows = [proto.example_to_dict(r) for r in read_records(tmp_path / "c.tfrecord")]
    assert rows[0]["a"].tolist() == [1] and rows[0]["b"].tolist() == [2.5]
    assert rows[1]["c"] == [b"y"] and "b" not in rows[1]


def test_convert_rejects_unsupported_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pq.write_table(pa.table({"m": pa.array([{"k": 1}])}), tmp_path / "s.parquet")
    assert run("convert", str(tmp_path / "s.parquet"), str(tmp_path / "s.tfrecord"), "--quiet") == 2
    assert "s.parquet: column 'm'" in capsys.readouterr().err
