"""Fixed-length numeric features by the compiled kernel (``parse_fixed`` in
``psflow/data/_example.c``), against the protobuf reference: the same output for every batch
it takes, and every batch it does not take handed to the general path (defaults, errors)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import pytest

from psflow.data import proto
from psflow.data.features import FixedLenFeature, _fixed_numeric, parse_examples
from psflow.data.tfrecord import RecordBatch
from psflow.sparse.kernels import KERNELS
from tests.unit.protobytes import ld as _ld
from tests.unit.protobytes import varint as _varint
from tests.unit.test_data_layout import _parse_or_none, assert_same, check_mutations

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(KERNELS is None, reason="psflow.sparse._kernels is not built"),
]

SPEC = {
    "label": FixedLenFeature(dtype="int64", default=0),
    "x": FixedLenFeature(dtype="float32", shape=(3,), default=0.0),
    "ids": FixedLenFeature(dtype="int64", shape=(2, 1), default=0),
}


def _record(i: int, rng: np.random.Generator) -> dict[str, Any]:
    return {
        "label": int(rng.integers(-(2**62), 2**62)) if i % 3 else -i,  # 10-byte varints too
        "x": rng.standard_normal(3).astype(np.float32).tolist(),
        "ids": proto.int64_feature(rng.integers(0, 1 << int(rng.integers(1, 63)), 2).tolist()),
        "name": rng.bytes(8),  # not in the spec: skipped, but checked
    }


def _kernel(records: list[bytes]) -> dict[str, Any] | None:
    return _fixed_numeric(RecordBatch.from_records(records), SPEC, "numpy")


def test_plain_records_are_decoded_by_the_kernel_as_protobuf_decodes_them() -> None:
    rng = np.random.default_rng(1)
    records = [proto.serialize_example(_record(i, rng)) for i in range(300)]
    got = _kernel(records)
    assert got is not None  # the kernel took the batch
    assert_same(got, parse_examples(records, SPEC, method="protobuf"))
    assert got["ids"].shape == (300, 2, 1) and got["label"].dtype == np.int64
    assert got["x"].flags.writeable
    # Each record's features in its own order: the same answer.
    shuffled = [proto.serialize_example(dict(reversed(_record(i, rng).items()))) for i in range(9)]
    assert_same(_kernel(shuffled), parse_examples(shuffled, SPEC, method="protobuf"))  # type: ignore[arg-type]


def _example(*entries: tuple[str, bytes]) -> bytes:
    return _ld(1, b"".join(_ld(1, _ld(1, k.encode()) + _ld(2, f)) for k, f in entries))


def _floats(values: list[float]) -> bytes:
    return _ld(2, _ld(1, struct.pack(f"<{len(values)}f", *values)))


def _ints(values: list[int], packed: bool = True) -> bytes:
    if not packed:
        return _ld(3, b"".join(b"\x08" + _varint(v) for v in values))
    return _ld(3, _ld(1, b"".join(map(_varint, values))))


GOOD = [("label", _ints([1])), ("x", _floats([1, 2, 3])), ("ids", _ints([4, 5]))]


@pytest.mark.parametrize(
    "entries",
    [
        [e for e in GOOD if e[0] != "x"],  # missing: its default
        [*GOOD, ("label", _ints([2]))],  # given twice: protobuf keeps the last
        [("label", _ints([1], packed=False)), *GOOD[1:]],  # unpacked
        [GOOD[0], ("x", _floats([1, 2])), GOOD[2]],  # a count the spec does not want
        [GOOD[0], ("x", _ints([1, 2, 3])), GOOD[2]],  # another list kind
        [("label", b""), *GOOD[1:]],  # an empty Feature
        [*GOOD, ("other", _ld(1, _ld(1, b"abc")))],  # a bytes feature outside the spec
    ],
    ids=["missing", "twice", "unpacked", "count", "kind", "empty", "other"],
)
def test_what_the_kernel_does_not_take_the_general_path_does(entries: list[Any]) -> None:
    records = [_example(*GOOD), _example(*entries)]
    ref = _parse_or_none(records, SPEC, "protobuf")
    fast = _parse_or_none(records, SPEC, "fast")
    assert (fast is None) == (ref is None)
    if ref is not None:
        assert_same(fast, ref)
    if entries[-1][0] != "other":
        assert _kernel(records) is None  # handed on, not decoded another way
    else:
        assert _kernel(records) is not None


def test_mutated_records_never_decode_differently() -> None:
    """Random byte changes: for every batch protobuf takes, the same answer; where protobuf
    rejects a record only for a feature outside the spec, the kernel, like TensorFlow's own
    parser and the general path, may take the batch, never answering differently."""
    rng = np.random.default_rng(4)
    base = [proto.serialize_example(_record(i, rng)) for i in range(16)]
    taken = []
    lenient = check_mutations(
        base, SPEC, rng, rounds=400, each=lambda records: taken.append(_kernel(records))
    )
    assert lenient < 40
    assert sum(t is not None for t in taken) > 20  # the kernel took mutated batches too
