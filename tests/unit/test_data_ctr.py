"""The Criteo-layout CTR data: the planted-model generator, its best AUC, the reader."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import psflow.cli
from psflow.data import ctr, proto, synth_ctr
from psflow.data.ctr import (
    CATEGORICAL,
    CRITEO_KAGGLE_CARDINALITIES,
    DENSE,
    META_FILE,
    PlantedCTR,
    SynthCTRConfig,
    auc,
    ctr_batches,
    expected_auc,
    write_synth_ctr,
)
from psflow.data.encode import serialize_examples
from psflow.data.tfrecord import read_records, write_records
from tests.paths import ROOT

pytestmark = pytest.mark.unit

FIXTURES = ROOT / "tests" / "fixtures"
TINY = {"train_examples": 3000, "test_examples": 1000, "scale": 1e-3, "train_shards": 3}


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name != META_FILE}


def test_cardinalities_are_criteo_kaggle_s() -> None:
    assert len(CRITEO_KAGGLE_CARDINALITIES) == len(CATEGORICAL) == 26 and len(DENSE) == 13
    assert sum(CRITEO_KAGGLE_CARDINALITIES) == 33_762_577
    assert SynthCTRConfig(scale=1e-3).cardinalities[:3] == (1, 1, 10131)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = write_synth_ctr(str(tmp_path / "a"), SynthCTRConfig(**TINY, seed=3))
    write_synth_ctr(str(tmp_path / "b"), SynthCTRConfig(**TINY, seed=3))
    write_synth_ctr(str(tmp_path / "c"), SynthCTRConfig(**TINY, seed=4))
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert _files(tmp_path / "a") != _files(tmp_path / "c")
    assert sorted(_files(tmp_path / "a")) == [
        "test-00000-of-00001.tfrecord",
        "train-00000-of-00003.tfrecord",
        "train-00001-of-00003.tfrecord",
        "train-00002-of-00003.tfrecord",
    ]
    meta = json.loads((tmp_path / "a" / META_FILE).read_text())
    assert meta["best_auc"] == a["best_auc"] and meta["config"]["seed"] == 3
    counts = [sum(1 for _ in read_records(tmp_path / "a" / f)) for f in meta["files"]["train"]]
    assert counts == [1000, 1000, 1000]


def test_serialize_examples_is_byte_identical_to_protobuf() -> None:
    rng = np.random.default_rng(0)
    n = 300
    cols = {
        "label": rng.integers(0, 2, n),
        "big": rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64),
        "small": rng.integers(0, 200, n),
        "x": rng.standard_normal(n).astype(np.float32),
        "C1": ctr.hex_strings(rng.integers(0, 2**32, n)),
    }
    data, offsets = serialize_examples(cols)
    for i in range(n):
        one = {k: (bytes(v[i]) if v.dtype.kind == "S" else v[i].item()) for k, v in cols.items()}
        assert data[offsets[i] : offsets[i + 1]] == proto.serialize_example(one), i
    with pytest.raises(ValueError, match="same number of values"):
        serialize_examples({"a": np.zeros(2, np.int64), "b": np.zeros(3, np.int64)})


@pytest.mark.parametrize("ids", ["index", "hashed"])
def test_ids_respect_the_cardinalities(ids: str) -> None:
    config = SynthCTRConfig(**TINY, ids=ids)
    model = PlantedCTR.build(config)
    s = model.sample("train", 0, 20_000)
    ks = np.asarray(config.cardinalities)
    assert (s.ranks >= 1).all() and (s.ranks <= ks).all()
    if ids == "index":
        assert (s.ids == s.ranks - 1).all()
    else:
        assert (s.ids >= 0).all() and (s.ids < 2**32).all()
    for c, k in enumerate(ks):  # one id per rank: as many distinct ids as ranks, never more
        assert len(np.unique(s.ids[:, c])) == len(np.unique(s.ranks[:, c])) <= k
    assert config.cardinalities[9] == 93 and len(np.unique(s.ranks[:, 9])) > 80  # C10, scaled


def test_ids_are_zipf_distributed() -> None:
    config = SynthCTRConfig(**TINY, zipf=1.1)
    model = PlantedCTR.build(config)
    ranks = model.sample("train", 0, 200_000).ranks
    for c in (2, 11):  # C3 and C12: 10,131 and 8,352 ids at this scale (the inverse-CDF path)
        counts = np.bincount(ranks[:, c], minlength=6)
        ratio = counts[1] / counts[2]
        assert abs(ratio - 2**1.1) < 0.1, ratio  # P(1)/P(2) = 2^s
        k = config.cardinalities[c]
        w = np.arange(1, k + 1, dtype=np.float64) ** -1.1
        assert abs(np.mean(ranks[:, c] <= 10) - w[:10].sum() / w.sum()) < 0.01
    big = _Zipf_rejection_ranks()
    assert abs(np.mean(big == 1) / np.mean(big == 2) - 2**1.1) < 0.1


def _Zipf_rejection_ranks() -> np.ndarray:
    """Ranks of a 10M-id column, drawn by rejection (the path for columns over 2^20 ids)."""
    z = synth_ctr._Zipf(10_131_227, 1.1)
    assert z.cdf is None
    out = z.draw(np.random.default_rng(0), 200_000)
    assert out.max() <= 10_131_227
    return out


def test_positive_rate_is_calibrated() -> None:
    for scale in (1e-3, 1.0):
        config = SynthCTRConfig(scale=scale, positive_rate=0.2562)
        model = PlantedCTR.build(config)
        s = model.sample("test", 0, 50_000)
        assert abs(s.prob.mean() - 0.2562) < 0.01
        assert abs(s.label.mean() - 0.2562) < 0.015


def _auc_brute(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = sum((p > q) + 0.5 * (p == q) for p, q in itertools.product(pos, neg))
    return float(wins / (len(pos) * len(neg)))


def _expected_auc_brute(p: np.ndarray) -> float:
    num = den = 0.0
    for i, j in itertools.permutations(range(len(p)), 2):
        w = p[i] * (1 - p[j])
        den += w
        num += w * ((p[i] > p[j]) + 0.5 * (p[i] == p[j]))
    return num / den


def test_auc_and_expected_auc_match_brute_force() -> None:
    rng = np.random.default_rng(1)
    p = np.round(rng.random(40), 1)  # ties on purpose
    labels = (rng.random(40) < p).astype(int)
    assert auc(p, labels) == pytest.approx(_auc_brute(p, labels), abs=1e-12)
    assert expected_auc(p) == pytest.approx(_expected_auc_brute(p), abs=1e-12)
    with pytest.raises(ValueError, match="both classes"):
        auc(p, np.zeros(40))


def test_best_auc_is_the_planted_model_s_auc_on_the_test_split(tmp_path: Path) -> None:
    config = SynthCTRConfig(**TINY, seed=5)
    meta = write_synth_ctr(str(tmp_path), config)
    s = PlantedCTR.build(config).sample("test", 0, config.test_examples)
    assert meta["best_auc"] == round(auc(s.prob, s.label), 5)
    assert meta["expected_best_auc"] == round(expected_auc(s.prob), 5)
    assert meta["test_positive_rate"] == round(s.label.mean(), 5)
    assert 0.6 < meta["expected_best_auc"] < 0.9


@pytest.mark.parametrize("categorical", ["int64", "hex"])
def test_reader_round_trip_with_sharding(tmp_path: Path, categorical: str) -> None:
    config = SynthCTRConfig(**TINY, categorical=categorical, compression="GZIP")
    write_synth_ctr(str(tmp_path), config)
    s = PlantedCTR.build(config).sample("train", 0, config.train_examples)
    pattern = str(tmp_path / "train-*")
    got = []
    for shard in range(2):
        for b in ctr_batches(pattern, batch_size=512, shard_index=shard, num_shards=2):
            assert b.dense.dtype == torch.float32 and b.dense.shape[1] == 13
            assert b.categorical.dtype == torch.int64 and b.categorical.shape[1] == 26
            assert b.label.dtype == torch.float32
            got.append(b)
    dense = torch.cat([b.dense for b in got]).numpy()
    cat = torch.cat([b.categorical for b in got]).numpy()
    label = torch.cat([b.label for b in got]).numpy()
    assert len(label) == config.train_examples
    # each worker reads whole files (3 files, 2 workers): compare the rows as sets
    counts = np.round(np.expm1(dense.astype(np.float64))).astype(np.int64)
    np.testing.assert_allclose(dense, np.log1p(counts), rtol=1e-6)
    got_rows = np.hstack([cat, counts, label[:, None].astype(np.int64)])
    want_rows = np.hstack([s.ids, s.dense, s.label[:, None]])
    np.testing.assert_array_equal(_sorted_rows(got_rows), _sorted_rows(want_rows))


def _sorted_rows(a: np.ndarray) -> np.ndarray:
    return a[np.lexsort(a.T[::-1])]


def test_a_tensorflow_written_criteo_file_reads_as_tensorflow_parses_it() -> None:
    """Written by TensorFlow 2.21 (tests/fixtures/make_criteo_tf.py): float I, hex C, gaps."""
    want = json.loads((FIXTURES / "criteo_tf.json").read_text())
    path = str(FIXTURES / "criteo_tf.tfrecord")
    layout = ctr.detect_layout(path)
    assert (layout.label, layout.dense, layout.categorical) == ("int64", "float32", "bytes")
    (b,) = list(ctr_batches(path, batch_size=100))
    np.testing.assert_array_equal(b.label.numpy(), want["label"])
    tf_dense = np.asarray(want["dense"], dtype=np.float32)
    np.testing.assert_allclose(b.dense.numpy(), np.log1p(np.maximum(tf_dense, 0)), rtol=1e-6)
    hexes = np.asarray(want["categorical_hex"])
    ids = np.vectorize(lambda h: int(h, 16) if h else 0)(hexes)
    np.testing.assert_array_equal(b.categorical.numpy(), ids)
    assert (hexes == "").any() and (tf_dense < 0).any()  # the fixture has gaps and negatives


def test_tensorflow_models_layout_reads_without_a_second_log(tmp_path: Path) -> None:
    """tensorflow/models' CriteoTFRecordReader names, written here with psflow's proto writer."""
    rng = np.random.default_rng(2)
    dense = rng.random((5, 13)).astype(np.float32) * 3
    ids = rng.integers(0, 1000, (5, 26))
    records = []
    for i in range(5):
        f: dict[str, object] = {"label": i % 2}
        f.update({n: float(dense[i, j]) for j, n in enumerate(ctr.TF_MODELS_DENSE)})
        f.update({n: int(ids[i, j]) for j, n in enumerate(ctr.TF_MODELS_CATEGORICAL)})
        records.append(proto.serialize_example(f))
    path = tmp_path / "part-0.tfrecord"
    write_records(path, records)
    assert not ctr.detect_layout(str(path)).log_dense
    (b,) = list(ctr_batches(str(path), batch_size=8))
    np.testing.assert_array_equal(b.dense.numpy(), dense)
    np.testing.assert_array_equal(b.categorical.numpy(), ids)
    np.testing.assert_array_equal(b.label.numpy(), [0, 1, 0, 1, 0])


def test_config_mistakes_name_the_value() -> None:
    with pytest.raises(ValueError, match="zipf must be > 1"):
        SynthCTRConfig(zipf=0.9)
    with pytest.raises(ValueError, match="ids must be 'hashed' or 'index', got 'rank'"):
        SynthCTRConfig(ids="rank")
    with pytest.raises(ValueError, match="compression"):
        SynthCTRConfig(compression="gz")
    with pytest.raises(ValueError, match="hex ids"):
        ctr.hex_strings(np.array([2**32]))


def test_cli_writes_the_set_and_prints_the_best_auc(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["data", "synth-ctr", str(tmp_path), "--examples", "2000", "--test-examples", "500"]
    assert psflow.cli.main([*argv, "--scale", "0.001", "--shards", "2"]) == 0
    out = capsys.readouterr().out
    meta = json.loads((tmp_path / META_FILE).read_text())
    assert f"best achievable AUC (planted model on the test split): {meta['best_auc']}" in out
    assert meta["files"]["train"] == [
        "train-00000-of-00002.tfrecord",
        "train-00001-of-00002.tfrecord",
    ]
    assert psflow.cli.main(["data", "synth-ctr", str(tmp_path), "--zipf", "1"]) == 2
    assert "zipf must be > 1" in capsys.readouterr().err


def _write_ctr(path: Path, features: list[dict[str, object]]) -> str:
    write_records(path, [proto.serialize_example(f) for f in features])
    return str(path)


GOOD: dict[str, object] = {"label": 1, "I1": 3.0, "C1": b"1f"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"label": 2}, "label 2 is not 0 or 1"),
        ({"label": -1}, "label -1 is not 0 or 1"),
        ({"I1": float("nan")}, "I1 nan is not finite"),
        ({"I1": float("inf")}, "I1 inf is not finite"),
        ({"I1": float("-inf")}, "I1 -inf is not finite"),
        ({"C1": b"-1"}, r"C1 b'-1' is not hexadecimal"),
        ({"C1": b"0x1f"}, r"C1 b'0x1f' is not hexadecimal"),
        ({"C1": b"1_0"}, r"C1 b'1_0' is not hexadecimal"),
        ({"C1": b" ff "}, r"C1 b' ff ' is not hexadecimal"),
        ({"C1": b"+ff"}, r"C1 b'\+ff' is not hexadecimal"),
        ({"C1": b"8000000000000000"}, r"C1 b'8000000000000000' does not fit int64"),
    ],
)
def test_impossible_values_are_refused_naming_file_and_record(
    tmp_path: Path, bad: dict[str, object], message: str
) -> None:
    """A label other than 0 or 1, a dense value that is not finite, an id that is not plain hex
    digits: refused by file and record (here record 3 of the second file), not read as a number."""
    first = _write_ctr(tmp_path / "a.tfrecord", [GOOD] * 5)
    second = _write_ctr(tmp_path / "b.tfrecord", [GOOD] * 3 + [{**GOOD, **bad}, GOOD])
    with pytest.raises(ValueError, match=f"^{re.escape(second)}: record 3: {message}"):
        list(ctr_batches([first, second], batch_size=4, num_epochs=1))
    with pytest.raises(ValueError, match=f"^{re.escape(second)}: record 3: {message}"):
        list(ctr_batches([first, second], batch_size=4, num_epochs=1, shuffle_buffer=8))


def test_the_checker_s_repro_is_refused(tmp_path: Path) -> None:
    path = _write_ctr(
        tmp_path / "ctr.tfrecord",
        [
            {"label": 2, "I1": float("nan"), "C1": b"-1"},
            {"label": -1, "I1": float("inf"), "C1": b"0x1f"},
            {"label": 1, "I1": -5.0, "C1": b"1_0"},
        ],
    )
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: record 0: label 2 is not 0 or 1"):
        list(ctr_batches(path, batch_size=3, num_epochs=1))


def test_possible_values_still_read(tmp_path: Path) -> None:
    """Negative counts (Criteo's I2) are 0 after log1p; hex ids of any case and length up to 16
    digits; a missing id (empty string) is 0."""
    path = _write_ctr(
        tmp_path / "ctr.tfrecord",
        [
            {"label": 0, "I1": -5.0, "C1": b"FF"},
            {"label": 1, "I1": 0.0, "C1": b""},
            {"label": 1, "I1": 1.0, "C1": b"7fffffffffffffff"},
        ],
    )
    (b,) = ctr_batches(path, batch_size=3, num_epochs=1)
    assert b.label.tolist() == [0.0, 1.0, 1.0]
    np.testing.assert_allclose(b.dense[:, 0].numpy(), [0.0, 0.0, np.log1p(1.0)])
    assert b.categorical[:, 0].tolist() == [255, 0, 2**63 - 1]


def test_ctr_arrays_and_parse_hex_name_the_row_and_value() -> None:
    layout = ctr.CTRLayout(dense="float32")
    parsed: dict[str, object] = {n: np.zeros(3, np.float32) for n in DENSE}
    parsed.update({n: np.zeros(3, np.int64) for n in CATEGORICAL})
    parsed["label"] = np.array([0, 1, 0], np.int64)
    ctr.ctr_arrays(parsed, layout)
    parsed["I3"] = np.array([0, 0, np.nan], np.float32)
    with pytest.raises(ValueError, match="row 2: I3 nan is not finite"):
        ctr.ctr_arrays(parsed, layout)
    with pytest.raises(ValueError, match=r"row 1: b'0x1f' is not hexadecimal"):
        ctr.parse_hex([b"1f", b"0x1f"])
    with pytest.raises(ValueError, match=r"row 0: b' ff ' is not hexadecimal"):
        ctr.parse_hex([b" ff ", b"00000000"])
    assert ctr.parse_hex([b"ffffffff", b"0000000A"]).tolist() == [2**32 - 1, 10]
    assert ctr.parse_hex([b"Ab", b"", b"0"]).tolist() == [0xAB, 0, 0]
