"""Example/SequenceExample protos and parsing specs: fast decoder against the protobuf reference."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from psflow.data import proto
from psflow.data.features import (
    FixedLenFeature,
    Ragged,
    VarLenFeature,
    _fixed_numeric,
    parse_examples,
)
from psflow.data.schema import format_schema, infer_schema
from psflow.data.tfrecord import RecordBatch, TFRecordReader, read_records
from tests.paths import TFRECORD_FIXTURES
from tests.unit.protobytes import ld as _ld
from tests.unit.protobytes import varint as _varint

pytestmark = pytest.mark.unit

FIX = TFRECORD_FIXTURES
EXPECTED = json.loads((FIX / "expected.json").read_text())["examples"]
PROTO = Path(proto.__file__).with_name("example.proto")

SPEC = {
    "label": FixedLenFeature(dtype="int64"),
    "x": FixedLenFeature(dtype="float32", shape=(2, 2)),
    "ids": VarLenFeature(dtype="int64"),
    "name": FixedLenFeature(dtype="bytes"),
    "empty_floats": VarLenFeature(dtype="float32", ragged=True),
    "absent": FixedLenFeature(dtype="float32", shape=(3,), default=[1.0, 2.0, 3.0]),
}


def _spec() -> dict[str, FixedLenFeature | VarLenFeature]:
    return dict(SPEC)


def test_runtime_descriptor_matches_the_proto_file() -> None:
    text = PROTO.read_text()
    fd = proto.file_descriptor_proto()
    for msg in fd.message_type:
        body = re.search(rf"message {msg.name} \{{(.*?)\n\}}", text, re.S)
        assert body, msg.name
        declared = dict(
            (name, int(num)) for name, num in re.findall(r"(\w+) = (\d+)", body.group(1))
        )
        assert declared == {f.name: f.number for f in msg.field}, msg.name


def test_decodes_every_fixture_example() -> None:
    for record, want in zip(read_records(FIX / "examples.tfrecord"), EXPECTED, strict=True):
        got = proto.example_to_dict(record)
        assert got["label"].tolist() == want["label"]
        np.testing.assert_array_equal(got["x"], np.asarray(want["x"], dtype=np.float32))
        assert got["ids"].tolist() == want["ids"]
        assert got["name"] == [bytes.fromhex(h) for h in want["name_hex"]]
        assert got["empty_floats"].dtype == np.float32 and got["empty_floats"].size == 0


def test_parses_fixtures_fast_and_protobuf_identically() -> None:
    with TFRecordReader(FIX / "examples.tfrecord") as r:
        (batch,) = list(r.iter_batches())
    fast = parse_examples(batch, _spec())
    ref = parse_examples(batch, _spec(), method="protobuf")
    for key in fast:
        if isinstance(fast[key], Ragged):
            np.testing.assert_array_equal(fast[key].values, ref[key].values)
            np.testing.assert_array_equal(fast[key].row_splits, ref[key].row_splits)
        else:
            np.testing.assert_array_equal(fast[key], ref[key])
    assert fast["label"].tolist() == [e["label"][0] for e in EXPECTED]
    np.testing.assert_array_equal(
        fast["x"], np.asarray([e["x"] for e in EXPECTED], dtype=np.float32).reshape(50, 2, 2)
    )
    width = max(len(e["ids"]) for e in EXPECTED)
    for row, e in zip(fast["ids"], EXPECTED, strict=True):
        assert row.tolist() == e["ids"] + [0] * (width - len(e["ids"]))
    assert fast["name"].tolist() == [bytes.fromhex(e["name_hex"][0]) for e in EXPECTED]
    assert fast["absent"].tolist() == [[1.0, 2.0, 3.0]] * 50
    ragged = parse_examples(batch, {"ids": VarLenFeature(dtype="int64", ragged=True)})["ids"]
    assert isinstance(ragged, Ragged)
    assert [ragged.row(i).tolist() for i in range(50)] == [e["ids"] for e in EXPECTED]
    empty = fast["empty_floats"]
    assert empty.values.size == 0 and empty.row_splits.tolist() == [0] * 51


def test_torch_backend_and_strings() -> None:
    records = [proto.serialize_example({"x": [1.5, 2.5], "s": "héllo"})] * 3
    out = parse_examples(
        records,
        {"x": FixedLenFeature(dtype="float32", shape=(2,)), "s": FixedLenFeature(dtype="string")},
        backend="torch",
    )
    assert isinstance(out["x"], torch.Tensor) and out["x"].dtype == torch.float32
    assert out["x"].tolist() == [[1.5, 2.5]] * 3
    assert out["s"].tolist() == ["héllo"] * 3


def _entry(key: str, feature: bytes) -> bytes:
    return _ld(1, _ld(1, key.encode()) + _ld(2, feature))


def test_irregular_encodings_agree_with_protobuf() -> None:
    """Records the vectorized walker hands to protobuf: unpacked lists, repeats, unknown fields."""
    unpacked_floats = _ld(2, b"".join(b"\x0d" + struct.pack("<f", v) for v in (1.0, 2.0)))
    unpacked_ints = _ld(3, b"".join(b"\x08" + _varint(v) for v in (5, -7)))
    weird = [
        _ld(1, _entry("x", unpacked_floats) + _entry("i", unpacked_ints)),
        # the same key twice: the last entry wins
        _ld(
            1, _entry("x", _ld(2, _ld(1, struct.pack("<2f", 9, 9)))) + _entry("x", unpacked_floats)
        ),
        # unknown fields at every level, and two `features` fields that merge
        b"\x28\x07"
        + _ld(1, _entry("i", _ld(3, _ld(1, _varint(3) + _varint(4))) + b"\x20\x01"))
        + _ld(1, _entry("x", _ld(2, _ld(1, struct.pack("<2f", 3, 4))))),
        # key and value in reverse order inside the map entry
        _ld(1, _ld(1, _ld(2, _ld(2, _ld(1, struct.pack("<2f", 5, 6)))) + _ld(1, b"x"))),
        proto.serialize_example({"x": [7.0, 8.0], "i": [1, 2**63 - 1]}),
    ]
    spec = {
        "x": FixedLenFeature(dtype="float32", shape=(2,), default=0.0),
        "i": VarLenFeature(dtype="int64", ragged=True),
    }
    fast = parse_examples(weird, spec)
    ref = parse_examples(weird, spec, method="protobuf")
    np.testing.assert_array_equal(fast["x"], ref["x"])
    np.testing.assert_array_equal(fast["i"].values, ref["i"].values)
    np.testing.assert_array_equal(fast["i"].row_splits, ref["i"].row_splits)
    assert fast["x"].tolist() == [[1, 2], [1, 2], [3, 4], [5, 6], [7, 8]]
    assert [fast["i"].row(k).tolist() for k in range(5)] == [
        [5, -7],
        [],
        [3, 4],
        [],
        [1, 2**63 - 1],
    ]


def test_random_examples_fast_equals_protobuf() -> None:
    rng = np.random.default_rng(7)
    records = []
    for _ in range(300):
        feats: dict[str, object] = {}
        if rng.random() < 0.9:
            feats["f"] = proto.float_feature(rng.standard_normal(int(rng.integers(0, 5))).tolist())
        if rng.random() < 0.9:
            big = rng.integers(-(2**62), 2**62, int(rng.integers(0, 6))).tolist()
            feats["i"] = proto.int64_feature(big)
        if rng.random() < 0.9:
            n = int(rng.integers(0, 3))
            feats["b"] = proto.bytes_feature(
                [rng.bytes(int(rng.integers(0, 40))) for _ in range(n)]
            )
        feats["noise"] = rng.bytes(int(rng.integers(0, 200)))
        records.append(proto.serialize_example(feats))
    spec = {
        "f": VarLenFeature(dtype="float32"),
        "i": VarLenFeature(dtype="int64", ragged=True),
        "b": VarLenFeature(dtype="bytes"),
    }
    fast = parse_examples(records, spec)
    ref = parse_examples(records, spec, method="protobuf")
    np.testing.assert_array_equal(fast["f"], ref["f"])
    np.testing.assert_array_equal(fast["i"].values, ref["i"].values)
    np.testing.assert_array_equal(fast["i"].row_splits, ref["i"].row_splits)
    assert fast["b"].tolist() == ref["b"].tolist()
    # the reference itself agrees with protobuf's own decoding
    for k in (0, 17, 299):
        d = proto.example_to_dict(records[k])
        if "i" in d:
            assert ref["i"].row(k).tolist() == d["i"].tolist()


def test_fixed_numeric_batches_decode_alike_on_both_paths(path: str) -> None:
    """int64 and float32 FixedLenFeatures: one C pass (``psflow/data/_example.c``) where it is
    built, the general decoder on the fallback path; protobuf's answer on each."""
    rng = np.random.default_rng(3)
    records = [
        proto.serialize_example(
            {"label": int(rng.integers(-(2**62), 2**62)), "x": rng.standard_normal(3).tolist()}
        )
        for _ in range(40)
    ]
    spec = {
        "label": FixedLenFeature(dtype="int64"),
        "x": FixedLenFeature(dtype="float32", shape=(3,)),
    }
    batch = RecordBatch.from_records(records)
    taken = _fixed_numeric(batch, spec, "numpy")
    assert (taken is not None) == (path == "native")
    for backend in ("numpy", "torch"):
        fast = parse_examples(batch, spec, backend=backend)  # type: ignore[arg-type]
        ref = parse_examples(records, spec, backend=backend, method="protobuf")  # type: ignore[arg-type]
        for key in spec:
            np.testing.assert_array_equal(np.asarray(fast[key]), np.asarray(ref[key]))
            assert fast[key].dtype == ref[key].dtype and fast[key].shape == ref[key].shape
    # A record outside the spec's plain form (a missing feature with a default) on either path.
    short = [*records, proto.serialize_example({"label": 5})]
    with_default = {**spec, "x": FixedLenFeature(dtype="float32", shape=(3,), default=0.5)}
    assert _fixed_numeric(RecordBatch.from_records(short), with_default, "numpy") is None
    got = parse_examples(short, with_default)
    assert got["x"][-1].tolist() == [0.5] * 3 and got["label"][-1] == 5


def test_features_in_another_order_in_every_record_decode_alike(path: str) -> None:
    """The C pass remembers which feature each place of the last record held (a writer keeps
    one order): records whose entries come in a new order each time, wanted ones among others
    of the same key lengths, still decode as protobuf does."""
    rng = np.random.default_rng(5)
    spec = {
        "id": FixedLenFeature(dtype="int64"),
        "ix": FixedLenFeature(dtype="int64", shape=(2,)),
        "x": FixedLenFeature(dtype="float32"),
    }
    records = []
    for _ in range(60):
        features = {
            "id": int(rng.integers(0, 2**40)),
            "ix": rng.integers(-(2**62), 2**62, 2).tolist(),
            "x": float(rng.standard_normal()),
            "i": int(rng.integers(0, 9)),  # not wanted, as long a key as "x"
            "iy": [b"a", b"bc"],  # not wanted, as long as "id"
        }
        entries = []
        for name, value in features.items():
            one = proto.serialize_example({name: value})  # b"\n" <length> <the map entry>
            entries.append(one[1 + len(_varint(len(one) - 2)) :])
        body = b"".join(entries[k] for k in rng.permutation(len(entries)))
        records.append(b"\n" + _varint(len(body)) + body)
    batch = RecordBatch.from_records(records)
    assert (_fixed_numeric(batch, spec, "numpy") is not None) == (path == "native")
    fast = parse_examples(batch, spec, backend="numpy")
    ref = parse_examples(records, spec, backend="numpy", method="protobuf")
    for key in spec:
        np.testing.assert_array_equal(fast[key], ref[key])


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("method", ["fast", "protobuf"])
def test_spec_mismatches_name_the_record_and_feature(method: str) -> None:
    records = [proto.serialize_example({"x": [1.0, 2.0]}), proto.serialize_example({"x": [1.0]})]
    with pytest.raises(
        ValueError, match=r"record 1 of the batch: feature 'x' has 1 values, the spec wants 2"
    ):
        parse_examples(records, {"x": FixedLenFeature(dtype="float32", shape=(2,))}, method=method)
    with pytest.raises(ValueError, match=r"record 0 .*required feature 'y' is missing"):
        parse_examples(records, {"y": FixedLenFeature(dtype="float32")}, method=method)
    with pytest.raises(ValueError, match=r"feature 'x' is a float_list, the spec wants int64"):
        parse_examples(records, {"x": VarLenFeature(dtype="int64")}, method=method)
    with pytest.raises(ValueError, match=r"record 0 .*not a valid tf.train.Example"):
        parse_examples([b"\x0a\x05abc"], {"x": VarLenFeature(dtype="int64")}, method=method)
    with pytest.raises(ValueError, match="pad_to=1"):
        parse_examples(records, {"x": VarLenFeature(dtype="float32", pad_to=1)}, method=method)


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="dtype"):
        FixedLenFeature(dtype="int32")
    with pytest.raises(ValueError, match="default"):
        FixedLenFeature(dtype="float32", shape=(3,), default=[1.0, 2.0])
    with pytest.raises(ValueError, match="shape"):
        FixedLenFeature(dtype="float32", shape=(-1,))
    with pytest.raises(ValueError, match="backend"):
        parse_examples([], {}, backend="jax")  # type: ignore[arg-type]


def test_padded_output_with_pad_to_and_padding_value() -> None:
    records = [proto.serialize_example({"v": [1, 2, 3]}), proto.serialize_example({"v": [4]})]
    out = parse_examples(records, {"v": VarLenFeature(dtype="int64", pad_to=4, padding_value=-1)})
    assert out["v"].tolist() == [[1, 2, 3, -1], [4, -1, -1, -1]]


def test_sequence_example_round_trip() -> None:
    seq = proto.make_sequence_example(
        {"length": 3}, {"tokens": [[1, 2], [3], [4, 5, 6]], "w": [[0.5], [1.5], [2.5]]}
    )
    data = seq.SerializeToString()
    ctx, lists = proto.sequence_example_to_dict(data)
    assert ctx["length"].tolist() == [3]
    assert [t.tolist() for t in lists["tokens"]] == [[1, 2], [3], [4, 5, 6]]
    assert [t.tolist() for t in lists["w"]] == [[0.5], [1.5], [2.5]]
    # field numbers on the wire: context = 1, feature_lists = 2
    assert data[0] == (1 << 3 | 2)


def test_make_example_types_and_errors() -> None:
    d = proto.example_to_dict(
        proto.serialize_example(
            {
                "i": np.arange(3),
                "f": np.ones((2, 2)),
                "b": [b"a", "é"],
                "t": True,
                "e": proto.float_feature([]),
            }
        )
    )
    assert d["i"].tolist() == [0, 1, 2] and d["f"].tolist() == [1.0] * 4
    assert d["b"] == [b"a", "é".encode()] and d["t"].tolist() == [1] and d["e"].size == 0
    with pytest.raises(TypeError, match="empty list"):
        proto.make_example({"z": []})
    with pytest.raises(TypeError, match="'m'"):
        proto.make_example({"m": [1, "a"]})


def test_infer_schema_from_fixture() -> None:
    spec = infer_schema(FIX / "examples.tfrecord")
    assert spec == {
        "empty_floats": VarLenFeature(dtype="float32"),
        "ids": VarLenFeature(dtype="int64"),
        "label": FixedLenFeature(dtype="int64"),
        "name": FixedLenFeature(dtype="bytes"),
        "x": FixedLenFeature(dtype="float32", shape=(4,)),
    }
    assert "x" in format_schema(spec) and "shape=(4,)" in format_schema(spec)
    out = parse_examples(list(read_records(FIX / "examples.tfrecord")), spec)
    assert out["x"].shape == (50, 4)
