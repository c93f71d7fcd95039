"""TensorFlow's hashed ids (``tf.strings.to_hash_bucket_fast``) in psflow, against what
TensorFlow computed (``tests/fixtures/make_tf_hash.py``): the C kernel and the pure-Python
transcription used where the kernels were not built."""

from __future__ import annotations

import doctest
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psflow.data.hashing as hashing
import psflow.sparse.kernels as kernels
from psflow.data.hashing import fingerprint64, hash_bucket_of_ints, to_hash_bucket_fast

pytestmark = pytest.mark.unit

EXPECTED: dict[str, Any] = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "tf_hash.json").read_text()
)
STRINGS = [bytes.fromhex(h) for h in EXPECTED["strings_hex"]]


@pytest.fixture(params=["kernel", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel":
        if kernels.KERNELS is None:
            pytest.skip("psflow.sparse._kernels is not built")
    else:
        monkeypatch.setattr(kernels, "KERNELS", None)
    return str(request.param)


def test_every_string_lands_in_tensorflows_bucket(path: str) -> None:
    assert {len(s) for s in STRINGS} >= set(range(81)) | {128, 129, 256, 300}
    for n in EXPECTED["buckets"]:
        got = to_hash_bucket_fast(STRINGS, n)
        assert got.dtype == np.int64
        assert got.tolist() == EXPECTED["hash_bucket_fast"][str(n)], n


def test_int_ids_hash_as_their_decimal_strings(path: str) -> None:
    for n in EXPECTED["buckets"]:
        got = hash_bucket_of_ints(np.array(EXPECTED["ints"], dtype=np.int64), n)
        assert got.tolist() == EXPECTED["int_hash_bucket"][str(n)], n


def test_str_and_numpy_inputs_hash_as_their_bytes() -> None:
    text = ["ünïcødé user 用户", "68fd1e64", ""]
    want = fingerprint64([t.encode() for t in text])
    assert fingerprint64(text).tolist() == want.tolist()
    assert (
        fingerprint64(np.array([t.encode() for t in text], dtype=object)).tolist() == want.tolist()
    )
    assert (
        fingerprint64(np.array([b"68fd1e64", b"ab"])).tolist()
        == fingerprint64([b"68fd1e64", b"ab"]).tolist()
    )
    assert fingerprint64([]).shape == (0,)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match="must be str or bytes, got int"):
        fingerprint64([b"a", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"num_buckets must be in \[1, 2\*\*63\), got 0"):
        to_hash_bucket_fast([b"a"], 0)
    with pytest.raises(TypeError, match="num_buckets must be an int"):
        to_hash_bucket_fast([b"a"], 2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ids must be integers"):
        hash_bucket_of_ints(np.array([1.5]), 10)


def test_the_docstring_example() -> None:
    assert doctest.testmod(hashing).failed == 0
