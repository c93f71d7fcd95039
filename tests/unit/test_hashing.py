"""TensorFlow's hashed ids (``tf.strings.to_hash_bucket_fast``) in psflow, against what
TensorFlow computed (``tests/fixtures/make_tf_hash.py``): the C hash (``psflow/data/_farmhash.c``)
and the pure-Python transcription used where it was not built (the ``path`` fixture runs each);
and neither, nor the Example parser beside it, loads torch."""

from __future__ import annotations

import doctest
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import psflow.data.hashing as hashing
from psflow import env as envvars
from psflow.data import native
from psflow.data.hashing import fingerprint64, hash_bucket_of_ints, to_hash_bucket_fast
from tests.kernels import need_kernels

pytestmark = pytest.mark.unit

EXPECTED: dict[str, Any] = json.loads(
    (Path(__file__).parent.parent / "fixtures" / "tf_hash.json").read_text()
)
STRINGS = [bytes.fromhex(h) for h in EXPECTED["strings_hex"]]


def test_the_native_module_is_built() -> None:
    need_kernels()
    assert native.NATIVE is native._load()


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


def test_str_and_numpy_inputs_hash_as_their_bytes(path: str) -> None:
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


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_hashing_and_parsing_load_no_torch(kernels: str) -> None:
    """A data reader hashes and parses without the tensor library, on either path."""
    code = (
        "import sys, numpy as np, psflow.data.hashing as h, psflow.data.features as f\n"
        "from psflow.data import native, proto\n"
        "records = [proto.serialize_example({'x': [1.0, 2.0], 'i': [7]})] * 3\n"
        "spec = {'x': f.FixedLenFeature(dtype='float32', shape=(2,)),\n"
        "        'i': f.FixedLenFeature(dtype='int64')}\n"
        "out = f.parse_examples(records, spec)\n"
        "assert out['x'].tolist() == [[1.0, 2.0]] * 3 and out['i'].tolist() == [7] * 3\n"
        "assert h.to_hash_bucket_fast(['user_17'], 1000).tolist() == [627]\n"
        "print(native.NATIVE is not None, 'torch' in sys.modules)\n"
    )
    env = {**os.environ, envvars.PSFLOW_KERNELS: kernels}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    built = kernels == "1" and importlib.util.find_spec("psflow.data._native") is not None
    assert proc.stdout.split() == [str(built), "False"]
