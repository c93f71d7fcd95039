"""psflow data text: tab-separated (label, text) files to TFRecord shards of token ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from psflow.cli import main
from psflow.data import fs
from psflow.data.text import (
    OOV,
    PAD,
    TextConfig,
    corpus_files,
    prepare_text,
    read_labels,
    read_tsv,
    read_vocab,
    text_batches,
    tokenize,
)

TRAIN = [
    ("sport", "The match ended 3-1: a great match!"),
    ("space", "The rocket reached orbit; the crew is safe."),
    ("sport", "Another match, another goal."),
    ("space", "Orbit and orbit again"),
    ("sport", "goal goal GOAL"),
]
TEST = [("space", "a rocket and a comet"), ("sport", "")]


def _write(path: Path, rows: list[tuple[str, str]], header: str = "") -> str:
    path.write_text(header + "".join(f"{label}\t{text}\n" for label, text in rows))
    return str(path)


def test_tokenize_lowercases_runs_of_letters_and_digits() -> None:
    assert tokenize("It's 3 p.m. -- Zürich_Bern") == ["it", "s", "3", "p", "m", "zürich", "bern"]


def test_plain_and_orange_files_read_alike(tmp_path: Path) -> None:
    plain = _write(tmp_path / "plain.tsv", TRAIN)
    # Orange's header rows: names, types, flags (the class column need not come first).
    orange = tmp_path / "orange.tab"
    orange.write_text(
        "Text\tCategory\nstring\td\n\tclass\n\n"
        + "".join(f"{text}\t{label}\n" for label, text in TRAIN)
    )
    assert list(read_tsv(plain)) == TRAIN
    assert list(read_tsv(str(orange))) == TRAIN


def test_bad_lines_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("sport\tfine\nno tab here\n")
    with pytest.raises(ValueError, match=r"bad.tsv:2: expected 'label<TAB>text'"):
        list(read_tsv(str(bad)))
    bad.write_text("\tno label\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1: empty label"):
        list(read_tsv(str(bad)))


def test_vocabulary_and_labels_come_from_the_training_split(tmp_path: Path) -> None:
    train, test = _write(tmp_path / "train.tsv", TRAIN), _write(tmp_path / "test.tsv", TEST)
    out = tmp_path / "out"
    figures = prepare_text(train, test, str(out), TextConfig(min_count=2, shards=2, seed=3))
    vocab = read_vocab(str(out))
    # Words seen at least twice in training, by falling count then by the word.
    assert vocab == ["<pad>", "<unk>", "goal", "match", "orbit", "the", "another"]
    assert "comet" not in vocab and "rocket" not in vocab  # test-only, or seen once
    assert read_labels(str(out)) == ["space", "sport"]
    assert figures["train"]["documents"] == 5 and figures["test"]["documents"] == 2
    assert json.loads((out / "_text.json").read_text())["vocab_size"] == len(vocab)
    # The side files stay out of directory reads; the shards are what is read.
    assert [Path(f).name for f in fs.expand_paths(str(out))] == [
        "test-00000-of-00001.tfrecord",
        "train-00000-of-00002.tfrecord",
        "train-00001-of-00002.tfrecord",
    ]

    (batch,) = text_batches(str(out / "test-*"), batch_size=8)
    index = {w: i for i, w in enumerate(vocab)}
    # "a rocket and a comet": no known word but padding-free OOVs; the empty one: one OOV.
    assert batch.ids.tolist() == [[OOV] * 5, [OOV, PAD, PAD, PAD, PAD]]
    assert batch.lengths.tolist() == [5, 1]
    assert batch.label.tolist() == [0, 1]
    docs = [
        (b.label.tolist(), b.ids.tolist()) for b in text_batches(str(out / "train-*"), batch_size=1)
    ]
    assert len(docs) == 5
    assert sorted(label for (label,), _ in docs) == [0, 0, 1, 1, 1]
    goals = [ids[0] for _, ids in docs if ids[0][0] == index["goal"]]
    assert goals == [[index["goal"]] * 3]


def test_each_worker_reads_its_share_and_documents_are_cut(tmp_path: Path) -> None:
    train, test = _write(tmp_path / "train.tsv", TRAIN), _write(tmp_path / "test.tsv", TEST)
    out = tmp_path / "out"
    prepare_text(train, test, str(out), TextConfig(min_count=1, max_length=3, shards=2))
    shares = [
        [tuple(r) for b in text_batches(str(out / "train-*"), batch_size=2, shard_index=i,
                                        num_shards=2) for r in b.ids.tolist()]
        for i in range(2)
    ]  # fmt: skip
    assert sum(len(s) for s in shares) == 5 and not set(shares[0]) & set(shares[1])
    assert all(len(ids) <= 3 for s in shares for ids in s)
    (b,) = text_batches(str(out / "train-*"), batch_size=8, max_length=2)
    assert b.ids.shape == (5, 2) and b.lengths.max() == 2


def test_a_test_label_unknown_to_training_is_an_error(tmp_path: Path) -> None:
    train = _write(tmp_path / "train.tsv", TRAIN)
    test = _write(tmp_path / "test.tsv", [("cooking", "a recipe")])
    with pytest.raises(ValueError, match=r"labels the training split lacks: \['cooking'\]"):
        prepare_text(train, test, str(tmp_path / "out"))
    with pytest.raises(ValueError, match="min_count must be >= 1"):
        TextConfig(min_count=0)


def test_the_cli_writes_the_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train, test = _write(tmp_path / "train.tsv", TRAIN), _write(tmp_path / "test.tsv", TEST)
    out = tmp_path / "out"
    args = ["data", "text", str(out), "--train", train, "--test", test, "--max-size", "3"]
    assert main([*args, "--shards", "1", "--min-count", "1"]) == 0
    assert "vocabulary: 5 words; labels: 2" in capsys.readouterr().out
    assert read_vocab(str(out))[2:] == ["goal", "match", "orbit"]
    assert main(["data", "text", str(out), "--train", train]) == 2
    assert "give --train and --test" in capsys.readouterr().err


def test_the_shipped_20_newsgroups_files_are_found_and_read() -> None:
    train, test = corpus_files("20newsgroups")
    first = next(read_tsv(train))
    assert first[0] == "alt.atheism" and first[1].startswith("alt atheism")
    assert sum(1 for _ in read_tsv(test)) == 7528
    with pytest.raises(ValueError, match="unknown corpus 'imdb'"):
        corpus_files("imdb")


def test_integer_labels_sort_as_numbers(tmp_path: Path) -> None:
    """Labels that are all integers are numbered by their rank as numbers, not as strings."""
    rows = [("1", "a b"), ("2", "c d"), ("10", "e f"), ("-3", "g h")]
    train, test = _write(tmp_path / "train.tsv", rows), _write(tmp_path / "test.tsv", rows)
    out = tmp_path / "out"
    prepare_text(train, test, str(out), TextConfig(min_count=1, shards=1))
    assert read_labels(str(out)) == ["-3", "1", "2", "10"]
    (batch,) = text_batches(str(out / "test-*"), batch_size=8)
    assert batch.label.tolist() == [1, 2, 3, 0]
    # One label that is not an integer: all sort as strings, as before.
    mixed = _write(tmp_path / "mixed.tsv", [*rows, ("x", "i j")])
    prepare_text(mixed, test, str(tmp_path / "out2"), TextConfig(min_count=1, shards=1))
    assert read_labels(str(tmp_path / "out2")) == ["-3", "1", "10", "2", "x"]
