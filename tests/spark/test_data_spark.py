"""Spark DataFrames to TFRecord and back, against a real local Spark (local[2])."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psflow.data import proto
from psflow.data.features import FixedLenFeature, VarLenFeature, parse_examples
from psflow.data.spark import read_dataframe, spark_schema, write_dataframe
from psflow.data.tfrecord import read_records, write_records

pytestmark = pytest.mark.spark


def _schema() -> Any:
    from pyspark.sql import types as T

    return T.StructType(
        [
            T.StructField("id", T.LongType(), False),
            T.StructField("small", T.IntegerType(), True),
            T.StructField("f", T.FloatType(), True),
            T.StructField("d", T.DoubleType(), True),
            T.StructField("s", T.StringType(), True),
            T.StructField("b", T.BinaryType(), True),
            T.StructField("v", T.ArrayType(T.FloatType(), False), True),
            T.StructField("tags", T.ArrayType(T.StringType(), False), True),
        ]
    )


def _rows() -> list[tuple[Any, ...]]:
    rows = []
    for i in range(40):
        null = i % 7 == 3  # some rows have nulls in every nullable column
        rows.append(
            (
                i,
                None if null else -i * 1000,
                None if null else i / 4,
                None if null else i * 0.5,
                None if null else f"row-{i}-é",
                None if null else bytes([i, 0, 255]),
                None if null else [float(i), i + 0.5][: i % 3],
                None if null else [f"t{k}" for k in range(i % 4)],
            )
        )
    return rows


def test_round_trip_with_schema_and_plain_reader(spark: Any, tmp_path: Path) -> None:
    df = spark.createDataFrame(_rows(), _schema()).repartition(3)
    out = tmp_path / "out"
    written = write_dataframe(df, out, compression="GZIP")
    assert len(written) == 3 and sum(n for _, n in written) == 40
    assert (out / "_SUCCESS").exists()

    back = read_dataframe(spark, str(out), _schema())
    got = sorted(tuple(r) for r in back.collect())
    want = sorted(_rows())
    assert [g[0] for g in got] == list(range(40))
    for g, w in zip(got, want, strict=True):
        assert (g[0], g[1], g[4], g[6], g[7]) == (w[0], w[1], w[4], w[6], w[7])
        assert (g[5] and bytes(g[5])) == w[5]
        if w[2] is None:
            assert g[2] is None and g[3] is None
        else:
            assert math.isclose(g[2], w[2]) and math.isclose(g[3], w[3])
    assert sum(g[6] == [] for g in got) > 0  # empty arrays stay empty arrays, not nulls

    # Files written by Spark read back through the plain reader and parser.
    records = [r for f, _ in written for r in read_records(f)]
    parsed = parse_examples(
        records,
        {
            "id": FixedLenFeature(dtype="int64"),
            "s": FixedLenFeature(dtype="string", default=""),
            "v": VarLenFeature(dtype="float32", ragged=True),
        },
    )
    order = np.argsort(parsed["id"])
    assert parsed["id"][order].tolist() == list(range(40))
    assert parsed["s"][order][5] == "row-5-é" and parsed["s"][order][3] == ""
    assert parsed["v"].row(int(order[5])).tolist() == [5.0, 5.5]


def test_read_tensorflow_style_files_with_inferred_schema(spark: Any, tmp_path: Path) -> None:
    recs = [
        proto.serialize_example(
            {"label": i, "x": [i * 1.0, 2.0], "ids": proto.int64_feature(range(i % 3))}
        )
        for i in range(20)
    ]
    write_records(tmp_path / "a.tfrecord", recs[:10])
    write_records(tmp_path / "b.tfrecord", recs[10:])
    df = read_dataframe(spark, str(tmp_path / "*.tfrecord"))
    assert df.schema == spark_schema(
        {
            "ids": VarLenFeature(dtype="int64"),
            "label": FixedLenFeature(dtype="int64"),
            "x": FixedLenFeature(dtype="float32", shape=(2,)),
        }
    )
    rows = sorted(df.collect(), key=lambda r: r["label"])
    assert [r["label"] for r in rows] == list(range(20))
    assert rows[4]["x"] == [4.0, 2.0] and rows[4]["ids"] == [0]


def test_unsupported_types_and_null_elements_are_errors(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import types as T

    dec = spark.createDataFrame([(1,)], "n int").selectExpr("cast(n as decimal(10,2)) as price")
    with pytest.raises(ValueError, match="column 'price'"):
        write_dataframe(dec, tmp_path / "dec")
    schema = T.StructType([T.StructField("a", T.ArrayType(T.LongType(), True))])
    nulls = spark.createDataFrame([([1, None],)], schema).coalesce(1)
    with pytest.raises(Exception, match="null element"):
        write_dataframe(nulls, tmp_path / "nulls")
    ok = spark.createDataFrame([([1, 2],)], schema).coalesce(1)
    write_dataframe(ok, tmp_path / "ok")
    with pytest.raises(ValueError, match="overwrite"):
        write_dataframe(ok, tmp_path / "ok")
    assert write_dataframe(ok, tmp_path / "ok", overwrite=True)[0][1] == 1


def test_duplicate_column_names_are_refused(spark: Any, tmp_path: Path) -> None:
    dup = spark.createDataFrame([(1, 2)], "x long, y long").toDF("a", "a")
    with pytest.raises(ValueError, match="column 'a' appears 2 times"):
        write_dataframe(dup, tmp_path / "dup")


def test_doubles_beyond_float32_are_refused(spark: Any, tmp_path: Path) -> None:
    big = spark.createDataFrame([(1.5,), (1e300,)], "d double").coalesce(1)
    with pytest.raises(Exception, match=r"column 'd': value 1e\+300 is beyond float32"):
        write_dataframe(big, tmp_path / "big")


def test_boolean_column_refuses_ints_other_than_0_and_1(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql import types as T

    write_records(
        tmp_path / "b.tfrecord", [proto.serialize_example({"flag": v}) for v in (0, 1, 2)]
    )
    schema = T.StructType([T.StructField("flag", T.BooleanType(), True)])
    with pytest.raises(Exception, match=r"record 2: feature 'flag': 2 in a boolean column"):
        read_dataframe(spark, tmp_path / "b.tfrecord", schema).collect()
    write_records(tmp_path / "ok.tfrecord", [proto.serialize_example({"flag": 1})])
    assert read_dataframe(spark, tmp_path / "ok.tfrecord", schema).collect()[0]["flag"] is True
