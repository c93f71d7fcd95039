"""Conversions that would return a wrong number refuse loudly instead (ValueError naming it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from psflow.data import proto
from psflow.data.convert import convert_table
from psflow.data.encode import serialize_examples
from psflow.data.features import FixedLenFeature, VarLenFeature
from psflow.data.tfrecord import read_records

pytestmark = pytest.mark.unit


def _convert(tmp_path: Path, name: str) -> list[dict[str, object]]:
    convert_table(str(tmp_path / name), str(tmp_path / "out.tfrecord"), progress=False)
    return [proto.example_to_dict(r) for r in read_records(tmp_path / "out.tfrecord")]


def test_csv_integers_in_a_float_column_that_float32_rounds_are_refused(tmp_path: Path) -> None:
    (tmp_path / "m.csv").write_text("id,label\n16777217,1\n123456789,0\n1.5,1\n")
    with pytest.raises(ValueError, match=r"m\.csv row 0: column 'id'.*16777217.*float32"):
        _convert(tmp_path, "m.csv")
    (tmp_path / "b.csv").write_text("id\n16777217\n9223372036854775808\n")
    with pytest.raises(ValueError, match=r"column 'id'.*16777217"):
        _convert(tmp_path, "b.csv")
    # integers float32 holds exactly, and fractions (float32 precision, as documented), pass
    (tmp_path / "ok.csv").write_text("id\n16777216\n1.5\n0.1\n")
    rows = _convert(tmp_path, "ok.csv")
    assert [r["id"].tolist() for r in rows] == [[16777216.0], [1.5], [np.float32(0.1)]]


def test_duplicate_column_names_are_refused(tmp_path: Path) -> None:
    (tmp_path / "d.csv").write_text("a,a\n1,2\n")
    with pytest.raises(ValueError, match=r"d\.csv: column 'a' appears 2 times"):
        _convert(tmp_path, "d.csv")
    table = pa.table({"x": [1.0], "y": [2]}).rename_columns(["a", "a"])
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(ValueError, match=r"d\.parquet: column 'a' appears 2 times"):
        _convert(tmp_path, "d.parquet")


def test_finite_values_beyond_float32_are_refused(tmp_path: Path) -> None:
    pq.write_table(pa.table({"d": pa.array([0.5, 1e300], pa.float64())}), tmp_path / "f.parquet")
    with pytest.raises(ValueError, match=r"f\.parquet row 1: column 'd'.*1e\+300.*float32"):
        _convert(tmp_path, "f.parquet")
    (tmp_path / "f.csv").write_text("d\n1.5\n3.4e39\n")
    with pytest.raises(ValueError, match=r"column 'd'.*3\.4e\+39"):
        _convert(tmp_path, "f.csv")
    lst = pa.array([[1.0, -1e300]], pa.list_(pa.float64()))
    pq.write_table(pa.table({"v": lst}), tmp_path / "l.parquet")
    with pytest.raises(ValueError, match=r"column 'v'.*-1e\+300"):
        _convert(tmp_path, "l.parquet")
    for value in (1e300, [1.0, -1e300], np.array([1e300]), np.float64(1e39)):
        with pytest.raises(ValueError, match=r"feature 'a'.*float32"):
            proto.serialize_example({"a": value})
    with pytest.raises(ValueError, match=r"feature 'a'.*float32"):
        serialize_examples({"a": np.array([1.0, 1e300])})
    # inf, nan and the largest float32 itself stay as they are
    big = float(np.finfo(np.float32).max)
    got = proto.example_to_dict(proto.serialize_example({"a": [np.inf, -np.inf, big]}))["a"]
    assert got.tolist() == [np.inf, -np.inf, big]
    assert np.isnan(proto.example_to_dict(proto.serialize_example({"a": np.nan}))["a"][0])
    data, offsets = serialize_examples({"a": np.array([np.inf, big])})
    assert data[offsets[1] : offsets[2]] == proto.serialize_example({"a": big})


def test_uint64_beyond_int64_is_refused_by_serialize_examples() -> None:
    with pytest.raises(ValueError, match=r"feature 'u'.*9223372036854775808.*int64"):
        serialize_examples({"u": np.array([1, 2**63], dtype=np.uint64)})
    with pytest.raises(ValueError, match=r"feature 'u'.*int64"):
        proto.serialize_example({"u": np.array([2**64 - 1], dtype=np.uint64)})
    data, offsets = serialize_examples({"u": np.array([0, 2**63 - 1], dtype=np.uint64)})
    assert data[offsets[1] : offsets[2]] == proto.serialize_example({"u": 2**63 - 1})


def test_mixed_int_float_list_refuses_ints_float32_cannot_hold() -> None:
    with pytest.raises(ValueError, match=r"feature 'a'.*9223372036854775807.*float32"):
        proto.serialize_example({"a": [2**63 - 1, 1.0]})
    with pytest.raises(ValueError, match=r"feature 'a'.*16777217"):
        proto.serialize_example({"a": [16777217, 0.5]})
    got = proto.example_to_dict(proto.serialize_example({"a": [3, 0.5]}))["a"]
    assert got.dtype == np.float32 and got.tolist() == [3.0, 0.5]


@pytest.mark.parametrize(
    ("dtype", "default"),
    [
        ("int64", 1.7),
        ("int64", "7"),
        ("int64", [1, 2.5]),
        ("int64", 2.0**70),
        ("float32", 1e300),
        ("float32", 16777217),
        ("float32", "1.5"),
    ],
)
def test_fixed_len_default_that_the_cast_changes_is_refused(dtype: str, default: object) -> None:
    shape = (2,) if isinstance(default, list) else ()
    with pytest.raises(ValueError, match="default"):
        FixedLenFeature(dtype=dtype, shape=shape, default=default)
    if not shape:  # a VarLenFeature's padding fills the same way
        with pytest.raises(ValueError, match="default"):
            VarLenFeature(dtype=dtype, padding_value=default)
    VarLenFeature(dtype=dtype, padding_value=0)


def test_fixed_len_defaults_that_survive_the_cast_are_kept() -> None:
    FixedLenFeature(dtype="int64", default=True)  # bools are ints here, as in make_feature
    FixedLenFeature(dtype="int64", default=np.int32(3))
    FixedLenFeature(dtype="int64", default=2.0)
    FixedLenFeature(dtype="float32", default=0.5)
    FixedLenFeature(dtype="float32", default=float("nan"))
    FixedLenFeature(dtype="float32", default=[1, -np.inf], shape=(2,))
    FixedLenFeature(dtype="string", default="none")


def test_fixed_len_float32_default_rounds_fractions_as_float_lists_do() -> None:
    spec = FixedLenFeature(dtype="float32", default=0.1)
    assert np.asarray(spec.default, dtype=np.float32) == np.float32(0.1)
    with pytest.raises(ValueError, match=r"default .*2\.5.* int64"):
        FixedLenFeature(dtype="int64", default=[1, 2.5], shape=(2,))


def test_csv_nan_stays_nan_and_empty_or_na_cells_are_absent(tmp_path: Path) -> None:
    (tmp_path / "n.csv").write_text("a,b,s\n1.5,1,x\nnan,,nan\nNaN,NA,\n-nan,null,NA\n")
    rows = _convert(tmp_path, "n.csv")
    assert rows[0]["a"].tolist() == [1.5] and rows[0]["b"].tolist() == [1]
    assert all(np.isnan(r["a"][0]) for r in rows[1:])  # a literal nan is NaN, as in Parquet
    assert all("b" not in r for r in rows[1:])  # an empty, NA or null number cell: absent
    assert [r["s"] for r in rows] == [[b"x"], [b"nan"], [b""], [b"NA"]]  # strings as written


def test_parquet_uint64_beyond_int64_is_refused_naming_the_column(tmp_path: Path) -> None:
    table = pa.table({"u": pa.array([1, 2**63], pa.uint64())})
    pq.write_table(table, tmp_path / "u.parquet")
    with pytest.raises(ValueError, match=r"u\.parquet row 1: column 'u'.*9223372036854775808"):
        _convert(tmp_path, "u.parquet")
