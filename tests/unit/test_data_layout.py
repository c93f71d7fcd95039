"""The shared-layout batch decoder (``layout.py``) against the protobuf reference.

Every test parses the same records both ways (``method="fast"`` and ``method="protobuf"``) and
wants identical output, or the same kind of error; some also check that the layout path, not a
fallback, decoded the records.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psflow.data import fastparse, layout, pipeline, proto
from psflow.data.dataset import TFRecordDataset
from psflow.data.features import FixedLenFeature, Ragged, VarLenFeature, parse_examples
from psflow.data.tfrecord import DataLossError, RecordBatch, TFRecordReader, encode_record
from tests.unit.protobytes import ld as _ld
from tests.unit.protobytes import varint as _varint

pytestmark = pytest.mark.unit


def _example(*entries: tuple[str, bytes]) -> bytes:
    """An Example with the map entries in the order given (feature bytes as encoded)."""
    return _ld(1, b"".join(_ld(1, _ld(1, k.encode()) + _ld(2, f)) for k, f in entries))


def _floats(values: list[float]) -> bytes:
    return _ld(2, _ld(1, struct.pack(f"<{len(values)}f", *values)) if values else b"")


def _ints(values: list[int]) -> bytes:
    return _ld(3, _ld(1, b"".join(map(_varint, values))) if values else b"")


def _bytes(values: list[bytes]) -> bytes:
    return _ld(1, b"".join(_ld(1, v) for v in values))


def assert_same(fast: dict[str, Any], ref: dict[str, Any]) -> None:
    assert fast.keys() == ref.keys()
    for key in fast:
        a, b = fast[key], ref[key]
        if isinstance(a, Ragged):
            assert isinstance(b, Ragged)
            assert a.values.dtype == b.values.dtype, key
            assert a.values.tolist() == b.values.tolist(), key
            assert a.row_splits.tolist() == b.row_splits.tolist(), key
        else:
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert a.tolist() == b.tolist(), key


def parse_both(records: list[bytes], spec: dict[str, Any]) -> dict[str, Any]:
    fast = parse_examples(records, spec)
    assert_same(fast, parse_examples(records, spec, method="protobuf"))
    return fast


@pytest.fixture
def general_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many records each call of the general walker got (the layout path's leftovers)."""
    calls: list[int] = []
    real = fastparse.decode_batch

    def counting(buffer: Any, starts: np.ndarray, lengths: np.ndarray, names: Any) -> Any:
        calls.append(len(starts))
        return real(buffer, starts, lengths, names)

    monkeypatch.setattr(fastparse, "decode_batch", counting)
    return calls


SPEC = {
    "label": FixedLenFeature(dtype="int64"),
    "x": FixedLenFeature(dtype="float32", shape=(3,)),
    "ids": VarLenFeature(dtype="int64", ragged=True),
    "name": FixedLenFeature(dtype="bytes"),
}


def _record(i: int, rng: np.random.Generator) -> dict[str, Any]:
    return {
        "label": int(rng.integers(-(2**62), 2**62)) if i % 3 else i,
        "x": rng.standard_normal(3).astype(np.float32).tolist(),
        "ids": proto.int64_feature(
            rng.integers(0, 1 << int(rng.integers(1, 40)), int(rng.integers(0, 6))).tolist()
        ),
        "name": rng.bytes(8),
    }


def test_one_layout_is_decoded_by_the_layout_path(general_rows: list[int]) -> None:
    rng = np.random.default_rng(1)
    recs = [_record(i, rng) for i in range(200)]
    records = [proto.serialize_example(r) for r in recs]
    out = parse_both(records, SPEC)
    assert general_rows == []
    assert out["label"].tolist() == [r["label"] for r in recs]
    assert [out["ids"].row(i).tolist() for i in range(200)] == [
        list(r["ids"].int64_list.value) for r in recs
    ]
    assert out["name"].tolist() == [r["name"] for r in recs]


def test_records_with_differing_layouts_in_one_batch(general_rows: list[int]) -> None:
    rng = np.random.default_rng(2)
    records = []
    for i in range(120):
        r = _record(i, rng)
        entries = [
            ("label", _ints([r["label"]])),
            ("x", _floats(r["x"])),
            ("ids", _ints(list(r["ids"].int64_list.value))),
            ("name", _bytes([r["name"]])),
        ]
        if i % 4 == 1:
            entries.reverse()  # another key order
        if i % 4 == 2:
            entries.append(("extra", _floats([1.0] * (i % 5))))  # a feature outside the spec
        if i % 4 == 3:
            entries = entries[:2] + entries[3:]  # `ids` missing
        if i % 10 == 9:
            entries.insert(1, ("label2", b""))  # a Feature with no list at all
        records.append(_example(*entries))
    parse_both(records, SPEC)
    assert sum(general_rows) <= 12  # four layouts per batch; the fifth and later go general


def test_missing_features_take_defaults_and_empty_lists() -> None:
    spec = {
        "a": FixedLenFeature(dtype="float32", shape=(2,), default=[7.0, 8.0]),
        "b": FixedLenFeature(dtype="int64", default=-1),
        "c": VarLenFeature(dtype="float32"),
        "d": VarLenFeature(dtype="bytes", ragged=True),
        "s": FixedLenFeature(dtype="string", default="none"),
    }
    records = [
        _example(("a", _floats([1.0, 2.0])), ("b", _ints([5])), ("c", _floats([1.0]))),
        _example(("a", _floats([])), ("b", _ints([])), ("c", _floats([])), ("d", _bytes([]))),
        _example(("s", _bytes(["é".encode()])), ("d", _bytes([b"", b"\x00\x00", b"z"]))),
        _example(),
        b"",
    ]
    out = parse_both(records, spec)
    assert out["a"].tolist() == [[1, 2], [7, 8], [7, 8], [7, 8], [7, 8]]
    assert out["b"].tolist() == [5, -1, -1, -1, -1]
    assert out["c"].tolist() == [[1.0], [0.0], [0.0], [0.0], [0.0]]
    assert out["d"].row(2).tolist() == [b"", b"\x00\x00", b"z"]
    assert out["s"].tolist() == ["none", "none", "é", "none", "none"]


def test_varlen_counts_and_padding_differ_per_record() -> None:
    rng = np.random.default_rng(3)
    records = []
    for i in range(64):
        n = int(rng.integers(0, 9))
        records.append(
            _example(
                ("f", _floats(rng.standard_normal(n).astype(np.float32).tolist())),
                ("i", _ints(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64).tolist())),
                ("b", _bytes([rng.bytes(int(rng.integers(0, 20))) for _ in range(i % 4)])),
            )
        )
    spec = {
        "f": VarLenFeature(dtype="float32", padding_value=-1.0),
        "i": VarLenFeature(dtype="int64", ragged=True),
        "b": VarLenFeature(dtype="bytes"),
        "b2": VarLenFeature(dtype="bytes", ragged=True),
    }
    parse_both(records, spec)
    parse_both(records, {"i": VarLenFeature(dtype="int64", pad_to=8)})


def test_unpacked_and_packed_encodings_agree() -> None:
    unpacked_f = _ld(2, b"".join(b"\x0d" + struct.pack("<f", v) for v in (1.5, 2.5)))
    unpacked_i = _ld(3, b"".join(b"\x08" + _varint(v) for v in (3, -4)))
    packed = [_example(("x", _floats([1.0, 2.0])), ("i", _ints([1, 2]))) for _ in range(6)]
    records = [*packed[:2], _example(("x", unpacked_f), ("i", unpacked_i)), *packed[2:]]
    # A packed list split in two fields, and one with both a packed and an unpacked part.
    records.append(_example(("x", _ld(2, _ld(1, struct.pack("<f", 5)) * 2)), ("i", _ints([9]))))
    records.append(_example(("x", _floats([6.0])), ("i", _ld(3, _ld(1, b"\x07") + b"\x08\x08"))))
    spec = {
        "x": VarLenFeature(dtype="float32", ragged=True),
        "i": VarLenFeature(dtype="int64", ragged=True),
    }
    out = parse_both(records, spec)
    assert out["x"].row(2).tolist() == [1.5, 2.5] and out["i"].row(2).tolist() == [3, -4]
    assert out["x"].row(7).tolist() == [5.0, 5.0]
    assert out["i"].row(8).tolist() == [7, 8]


def test_bytes_of_one_length_and_of_many() -> None:
    same = [_example(("n", _bytes([bytes([i]) * 4 + b"\x00"]))) for i in range(10)]
    mixed = [_example(("n", _bytes([b"ab"[: i % 3] + b"\x00" * (i % 2)]))) for i in range(10)]
    spec = {"n": FixedLenFeature(dtype="bytes")}
    out = parse_both(same, spec)
    assert out["n"].dtype == object and out["n"][3] == b"\x03\x03\x03\x03\x00"
    assert parse_both(mixed, spec)["n"].tolist() == [
        b"ab"[: i % 3] + b"\x00" * (i % 2) for i in range(10)
    ]


def test_a_list_of_another_kind_names_the_record() -> None:
    records = [_example(("x", _floats([1.0])))] * 3 + [_example(("x", _ints([1])))]
    for method in ("fast", "protobuf"):
        with pytest.raises(ValueError, match=r"record 3 .*'x' is a int64_list"):
            parse_examples(records, {"x": FixedLenFeature(dtype="float32")}, method=method)  # type: ignore[arg-type]


def test_a_malformed_record_raises_as_protobuf_does() -> None:
    good = _example(("x", _floats([1.0, 2.0])), ("i", _ints([5])))
    spec = {
        "x": FixedLenFeature(dtype="float32", shape=(2,)),
        "i": VarLenFeature(dtype="int64", ragged=True),
    }
    bad = [
        good[:-1],  # cut short
        good[:5] + b"\xff" + good[6:],  # a length made huge
        good + b"\x0a",  # a trailing tag with no length
        _example(("x", _ld(2, _ld(1, b"\x00\x00\x80")))),  # floats not a multiple of 4 bytes
        _example(("x", _floats([1.0, 2.0])), ("i", _ld(3, _ld(1, b"\x80" * 11 + b"\x01")))),
    ]
    for k, record in enumerate(bad):
        records = [good] * 5 + [record] + [good] * 5
        outcomes = []
        for method in ("fast", "protobuf"):
            try:
                outcomes.append(parse_examples(records, spec, method=method)["x"].tolist())  # type: ignore[arg-type]
            except ValueError as e:
                assert "record 5" in str(e), (k, method, e)
                outcomes.append("error")
        assert outcomes[0] == outcomes[1], k


def _row(out: dict[str, Any], k: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for key, v in out.items():
        if isinstance(v, Ragged):
            lo, hi = int(v.row_splits[k]), int(v.row_splits[k + 1])
            row[key] = Ragged(v.values[lo:hi], np.asarray([0, hi - lo]))
        else:
            row[key] = v[k : k + 1]
    return row


def _parse_or_none(records: list[bytes], spec: dict[str, Any], method: str) -> Any:
    try:
        return parse_examples(records, spec, method=method)  # type: ignore[arg-type]
    except ValueError:
        return None


def test_mutated_records_never_decode_differently() -> None:
    """Random byte changes: the fast path gives protobuf's answer for every record protobuf takes.

    Where protobuf rejects a record only for a feature outside the spec (a key no longer valid
    UTF-8, a broken list under another key), the fast path, like TensorFlow's own parser, does
    not look there: it may then decode the batch where protobuf raises, never differently.
    """
    rng = np.random.default_rng(4)
    spec = {
        "label": FixedLenFeature(dtype="int64", default=0),
        "x": VarLenFeature(dtype="float32", ragged=True),
        "ids": VarLenFeature(dtype="int64", ragged=True),
        "name": VarLenFeature(dtype="bytes", ragged=True),
    }
    base = [proto.serialize_example(_record(i, rng)) for i in range(16)]
    assert check_mutations(base, spec, rng, rounds=300) < 30


def check_mutations(
    base: list[bytes],
    spec: dict[str, Any],
    rng: np.random.Generator,
    *,
    rounds: int,
    each: Any = None,
) -> int:
    """``rounds`` batches of ``base`` with one to three random bytes changed, each parsed both
    ways: protobuf's answer wherever it gives one; where it rejects the batch and the fast path
    does not (a feature outside the spec), each record protobuf takes alone decodes the same.
    ``each(records)`` is called on every batch. Returns how many batches were taken so."""
    lenient = 0
    for _ in range(rounds):
        records = list(base)
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(0, len(records)))
            r = bytearray(records[k])
            r[int(rng.integers(0, len(r)))] = int(rng.integers(0, 256))
            records[k] = bytes(r)
        if each is not None:
            each(records)
        ref = _parse_or_none(records, spec, "protobuf")
        fast = _parse_or_none(records, spec, "fast")
        if ref is not None:
            assert fast is not None
            assert_same(fast, ref)
        elif fast is not None:
            lenient += 1
            for k, record in enumerate(records):
                one = _parse_or_none([record], spec, "protobuf")
                if one is not None:
                    assert_same(_row(fast, k), one)
    return lenient


def test_learn_takes_only_plain_layouts() -> None:
    good = _example(("a", _floats([1.0])), ("b", _ints([2])))
    assert layout.learn(good, 0, len(good)) == [b"a", b"b"]
    assert layout.learn(b"", 0, 0) is None
    assert layout.learn(good + b"\x28\x01", 0, len(good) + 2) is None  # an unknown field
    twice = _example(("a", _floats([1.0])), ("a", _floats([2.0])))
    assert layout.learn(twice, 0, len(twice)) is None
    not_utf8 = _ld(1, _ld(1, _ld(1, b"\xff") + _ld(2, b"")))
    assert layout.learn(not_utf8, 0, len(not_utf8)) is None


def test_records_at_the_very_end_of_the_buffer() -> None:
    """Keys compared 8 bytes at a time near the end of the buffer, and tiny buffers."""
    for n in range(1, 4):
        records = [_example(("k", _floats([float(i)] * n))) for i in range(3)]
        out = parse_both(records, {"k": FixedLenFeature(dtype="float32", shape=(n,))})
        assert out["k"][:, 0].tolist() == [0.0, 1.0, 2.0]
    for tiny in ([_example(("", b""))], [_ld(1, b"")], [_ld(1, b""), b""]):
        parse_both(tiny, {"": VarLenFeature(dtype="int64")})


def _write(path: Path, records: list[bytes]) -> None:
    path.write_bytes(b"".join(map(encode_record, records)))


def test_dataset_batches_equal_per_batch_parsing(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    records = [proto.serialize_example(_record(i, rng)) for i in range(500)]
    _write(tmp_path / "a.tfrecord", records)
    spec = dict(SPEC)
    for chunk_size, bs, drop in ((1 << 20, 64, False), (700, 7, True), (4096, 50, False)):
        ds = TFRecordDataset(tmp_path, spec, batch_size=bs, drop_remainder=drop, backend="numpy")
        ds._open = lambda p, k, ds=ds, c=chunk_size: TFRecordReader(p, chunk_size=c, shard=k)  # type: ignore[method-assign]
        got = list(ds)
        with TFRecordReader(tmp_path / "a.tfrecord") as r:
            want = [
                parse_examples(b, spec)
                for b in pipeline.rebatch(r.iter_batches(), bs, drop_remainder=drop)
            ]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


def test_dataset_error_comes_with_the_batch_of_the_bad_record(tmp_path: Path) -> None:
    records = [proto.serialize_example({"v": [float(i), 0.0]}) for i in range(40)]
    records[23] = proto.serialize_example({"v": [1.0]})
    _write(tmp_path / "a.tfrecord", records)
    ds = TFRecordDataset(
        tmp_path, {"v": FixedLenFeature(dtype="float32", shape=(2,))}, batch_size=8, prefetch=0
    )
    seen = []
    with pytest.raises(ValueError, match=r"a\.tfrecord record 23: feature 'v' has 1 values"):
        for b in ds:
            seen.append(b["v"][:, 0].tolist())
    assert seen == [list(map(float, range(k, k + 8))) for k in (0, 8)]


def test_dataset_corrupted_record_raises_or_is_skipped(tmp_path: Path) -> None:
    records = [proto.serialize_example({"v": [float(i), 0.0]}) for i in range(300)]
    data = bytearray(b"".join(map(encode_record, records)))
    offset = sum(len(r) + 16 for r in records[:150])
    data[offset + 20] ^= 0x10  # inside record 150's data
    (tmp_path / "c.tfrecord").write_bytes(bytes(data))
    spec = {"v": FixedLenFeature(dtype="float32", shape=(2,))}
    with pytest.raises(DataLossError, match=rf"c\.tfrecord.*offset {offset} \(record index 150\)"):
        list(TFRecordDataset(tmp_path, spec, batch_size=64))
    ds = TFRecordDataset(tmp_path, spec, batch_size=64, skip_corrupt=True, backend="numpy")
    got = [v for b in ds for v in b["v"][:, 0].tolist()]
    assert got == [float(i) for i in range(300) if i != 150] and ds.skipped == 1


def test_batch_units_cut_into_rebatch_batches() -> None:
    chunks = [
        RecordBatch.from_records([bytes([i, j]) for j in range(n)])
        for i, n in enumerate([5, 1, 17, 3, 30])
    ]
    for bs in (1, 4, 7, 100):
        for most in (1, 8, 64):
            units = list(pipeline.batch_units(iter(chunks), bs, max_records=most))
            assert all(len(u) % bs == 0 for u in units[:-1])
            flat = [r for u in units for r in u]
            assert flat == [r for c in chunks for r in c]
            want = [b.tolist() for b in pipeline.rebatch(iter(chunks), bs, drop_remainder=False)]
            cut = [u.tolist()[k : k + bs] for u in units for k in range(0, len(u), bs)]
            assert cut == want


def test_an_empty_batch() -> None:
    spec = {
        "f": FixedLenFeature(dtype="float32", shape=(2,)),
        "b": VarLenFeature(dtype="bytes", ragged=True),
        "i": VarLenFeature(dtype="int64"),
    }
    out = parse_both([], spec)
    assert out["f"].shape == (0, 2) and out["i"].shape == (0, 0)
    assert out["b"].values.dtype == object and out["b"].row_splits.tolist() == [0]


def test_outputs_are_writable_arrays() -> None:
    """Values gathered out of the record buffer come out as arrays of their own."""
    long_lists = [_example(("f", _floats([float(i)] * (1 + 40 * (i % 2))))) for i in range(9)]
    for backend in ("numpy", "torch"):
        out = parse_examples(
            long_lists, {"f": VarLenFeature(dtype="float32", ragged=True)}, backend=backend
        )
        values = out["f"].values
        assert values.numpy().flags.writeable if backend == "torch" else values.flags.writeable
