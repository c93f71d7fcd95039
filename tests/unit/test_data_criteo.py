"""``psflow data criteo``: Criteo's click logs as text into the CTR layout, checked against what
TensorFlow parses from the same lines (tests/fixtures/make_criteo_text.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import psflow.cli
from psflow.data import criteo, proto
from psflow.data.ctr import CATEGORICAL, DENSE, LABEL, ctr_batches
from psflow.data.tfrecord import read_records
from tests.paths import ROOT

pytestmark = pytest.mark.unit

TEXT = ROOT / "tests" / "fixtures" / "criteo_text.txt"
TF = json.loads((ROOT / "tests" / "fixtures" / "criteo_text_tf.json").read_text())


def _tf_rows() -> np.ndarray:
    """TensorFlow's parse of the fixture, one row per line: label, I1..I13, C1..C26 as ids."""
    ids = np.vectorize(lambda h: int(h, 16) if h else 0)(np.asarray(TF["categorical_hex"]))
    return np.hstack([np.asarray(TF["label"])[:, None], np.asarray(TF["dense"]), ids])


def _rows(path: Path) -> np.ndarray:
    out = []
    for record in read_records(str(path)):
        ex = proto.example_to_dict(record)
        out.append([int(ex[name][0]) for name in (LABEL, *DENSE, *CATEGORICAL)])
    return np.asarray(out, dtype=np.int64).reshape(-1, 40)


def test_converted_lines_hold_what_tensorflow_parses(tmp_path: Path) -> None:
    """Each line's label, counts (negative ones, missing ones as 0) and hashes (missing ones 0)
    are what ``tf.io.decode_csv`` gives; the last tenth of the lines is the test split, in
    order, and the rest is dealt out over the training files in turn."""
    result = criteo.convert_criteo([str(TEXT)], str(tmp_path), shards=3, test_fraction=0.1)
    want = _tf_rows()
    assert (want[:, 2] < 0).any() and (want[:, 14:] == 0).any()  # negatives, missing hashes
    files = [tmp_path / f"train-0000{i}-of-00003.tfrecord" for i in range(3)]
    got = [_rows(f) for f in files]
    assert [len(g) for g in got] == [30, 30, 30]
    for i, g in enumerate(got):
        np.testing.assert_array_equal(g, want[:90][i::3])
    np.testing.assert_array_equal(_rows(tmp_path / "test-00000-of-00001.tfrecord"), want[90:])
    meta = json.loads((tmp_path / criteo.META_FILE).read_text())
    assert meta == result
    assert meta["train"]["examples"] == 90 and meta["test"]["examples"] == 10
    assert meta["test"]["positive_rate"] == round(want[90:, 0].mean(), 5)
    text = [line.split("\t") for line in TEXT.read_text().splitlines()]
    empty_i5 = sum(fields[5] == "" for fields in text[:90]) / 90
    assert meta["train"]["missing"]["I5"] == round(empty_i5, 5)
    # examples/ctr.py reads them as it reads synth-ctr's
    (batch,) = ctr_batches(str(tmp_path / "test-*"), batch_size=10)
    np.testing.assert_array_equal(batch.categorical.numpy(), want[90:, 14:])
    np.testing.assert_allclose(
        batch.dense.numpy(), np.log1p(np.maximum(want[90:, 1:14], 0)), rtol=1e-6
    )


def test_gzip_crlf_small_blocks_and_test_files_give_the_same_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gzipped file with Windows line ends, no newline at its end, parsed in blocks smaller
    than a line; the held-out split from files of its own."""
    text = TEXT.read_bytes()
    lines = text.splitlines()
    day0 = tmp_path / "day_0.gz"
    day0.write_bytes(gzip.compress(b"\r\n".join(lines[:70])))
    day1 = tmp_path / "day_1"
    day1.write_bytes(b"\n".join(lines[70:]) + b"\n\n")
    monkeypatch.setattr(criteo, "BLOCK_BYTES", 100)
    out = tmp_path / "out"
    criteo.convert_criteo([str(day0)], str(out), test=[str(day1)], shards=1, compression="GZIP")
    want = _tf_rows()
    np.testing.assert_array_equal(_rows(out / "train-00000-of-00001.tfrecord.gz"), want[:70])
    np.testing.assert_array_equal(_rows(out / "test-00000-of-00001.tfrecord.gz"), want[70:])


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda f: f[:-1], "39 tab-separated fields, expected 40.*test.txt has no label"),
        (lambda f: [*f, "x"], "41 tab-separated fields"),
        (lambda f: ["2", *f[1:]], "the label is not 0 or 1"),
        (lambda f: [f[0], "1.5", *f[2:]], "an integer feature is not an integer"),
        (lambda f: [f[0], "-", *f[2:]], "an integer feature is not an integer"),
        (lambda f: [*f[:20], "abc", *f[21:]], "a categorical feature is not 8 hex digits"),
        (lambda f: [*f[:20], "0000000g", *f[21:]], "a categorical feature is not 8 hex digits"),
        (lambda f: [""], "1 tab-separated fields"),  # a blank line (only trailing ones go)
    ],
)
@pytest.mark.parametrize("block_bytes", [100, criteo.BLOCK_BYTES])
def test_a_line_that_is_not_criteo_s_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change, problem: str, block_bytes: int
) -> None:
    monkeypatch.setattr(criteo, "BLOCK_BYTES", block_bytes)
    lines = TEXT.read_text().splitlines()
    lines[41] = "\t".join(change(lines[41].split("\t")))
    bad = tmp_path / "train.txt"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        ValueError, match=rf"train.txt, line 42: not a line of Criteo's .*{problem}"
    ):
        criteo.convert_criteo([str(bad)], str(tmp_path / "out"))


def test_the_cli_converts_and_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert psflow.cli.main(["data", "criteo", str(TEXT), str(out), "--shards", "2"]) == 0
    said = capsys.readouterr().out
    assert "100 lines; the last 10 are held out" in said
    assert "train: 90 examples" in said and "test: 10 examples" in said
    assert sorted(p.name for p in out.iterdir()) == [
        criteo.META_FILE,
        "test-00000-of-00001.tfrecord",
        "train-00000-of-00002.tfrecord",
        "train-00001-of-00002.tfrecord",
    ]
    argv = ["data", "criteo", str(TEXT), str(out)]
    assert psflow.cli.main([*argv, "--test-fraction", "1"]) == 2
    assert "test_fraction must be in (0, 1), got 1.0" in capsys.readouterr().err
    assert psflow.cli.main(["data", "criteo", str(tmp_path / "none.txt"), str(out)]) == 2
    assert "none.txt" in capsys.readouterr().err
