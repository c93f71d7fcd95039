"""``psflow data inspect``, ``convert``, ``synth-ctr``, ``criteo`` and ``text`` (their flags
are in :mod:`psflow.cli`)."""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Iterator
from typing import Any

from google.protobuf.message import DecodeError

from psflow.data import fs, proto
from psflow.data.schema import format_schema, infer_schema
from psflow.data.tfrecord import TFRecordReader


def _show(value: Any, limit: int = 8) -> str:
    if isinstance(value, list):  # bytes values
        shown = [v if len(v) <= 32 else v[:32] + b"..." for v in value[:limit]]
        more = f" ... ({len(value)} values)" if len(value) > limit else ""
        return f"{shown}{more}"
    items = value.tolist()
    more = f" ... ({len(items)} values)" if len(items) > limit else ""
    return f"{items[:limit]}{more}"


def _records(files: list[str], compression: str) -> Iterator[bytes]:
    for path in files:
        with TFRecordReader(path, compression=compression) as reader:
            yield from reader


def inspect(args: argparse.Namespace) -> int:
    """Prints the record count, the inferred schema and the first records of ``args.file``.

    ``args.file`` is a file, a directory or a glob, as every reader of :mod:`psflow.data` takes.
    """
    if args.head < 0:
        raise ValueError(f"--head must be >= 0, got {args.head}")
    files = fs.expand_paths(args.file)  # FileNotFoundError naming the pattern that matched nothing
    count = 0
    nbytes = 0
    compressions: dict[str, None] = {}
    for path in files:
        with TFRecordReader(path, compression=args.compression) as reader:
            for batch in reader.iter_batches():
                count += len(batch)
                nbytes += batch.nbytes
        compressions[reader.compression or "none"] = None
    print(f"file: {args.file}" + (f" ({len(files)} files)" if len(files) > 1 else ""))
    print(f"compression: {', '.join(compressions)}")
    print(f"records: {count:,} ({nbytes:,} bytes of payload)")
    head = list(itertools.islice(_records(files, args.compression), args.head))
    if args.raw:
        for i, rec in enumerate(head):
            print(f"record {i}: {len(rec)} bytes: {rec[:64]!r}")
        return 0
    try:
        spec = infer_schema(_records(files, args.compression), max_records=args.schema_records)
        shown = [sorted(proto.example_to_dict(rec).items()) for rec in head]
    except DecodeError as e:
        raise ValueError(f"{args.file}: not tf.train.Example records ({e}); try --raw") from e
    print("schema:")
    print("  " + format_schema(spec).replace("\n", "\n  ") if spec else "  (no features)")
    for i, features in enumerate(shown):
        print(f"record {i}:")
        for name, value in features:
            print(f"  {name}: {_show(value)}")
    return 0


def convert(args: argparse.Namespace) -> int:
    from psflow.data.convert import convert_table

    n = convert_table(
        args.input,
        args.output,
        fmt=args.format,
        compression=args.compression,
        progress=not args.quiet,
    )
    print(f"wrote {n:,} records to {args.output}")
    return 0


def synth_ctr(args: argparse.Namespace) -> int:
    from psflow.data.ctr import META_FILE, SynthCTRConfig, write_synth_ctr

    config = SynthCTRConfig(
        train_examples=args.examples,
        test_examples=args.test_examples,
        train_shards=args.shards,
        test_shards=args.test_shards,
        scale=args.scale,
        zipf=args.zipf,
        signal_ids=args.signal_ids,
        ids=args.ids,
        categorical=args.categorical,
        compression=args.compression.upper(),
        seed=args.seed,
    )
    result = write_synth_ctr(args.out, config, log=print)
    print(
        f"best achievable AUC (planted model on the test split): {result['best_auc']}; "
        f"expected over label draws: {result['expected_best_auc']}"
    )
    print(f"wrote {args.out} in {result['seconds']:.1f} s; figures in {META_FILE}")
    return 0


def produce(args: argparse.Namespace) -> int:
    """Sends ``args.files``' records into a Kafka topic (``psflow data produce``)."""
    from psflow.data.kafka_producer import ProducerConfig, produce

    files = fs.expand_paths(args.files)
    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    compression = args.compression if args.compression == "auto" else args.compression.upper()
    records: Iterator[bytes] = (
        itertools.chain.from_iterable(_records(files, compression) for _ in itertools.count())
        if args.loop
        else _records(files, compression)
    )
    if args.limit is not None:
        records = itertools.islice(records, args.limit)
    config = ProducerConfig(
        brokers=args.brokers, topic=args.topic, partitions=args.partitions, rate=args.rate
    )
    start = time.monotonic()
    n = produce(records, config, progress=lambda sent: print(f"{sent:,} records sent", flush=True))
    print(f"{n:,} records into {args.topic} in {time.monotonic() - start:.1f} s", flush=True)
    return 0


def criteo(args: argparse.Namespace) -> int:
    from psflow.data.criteo import META_FILE, convert_criteo

    result = convert_criteo(
        args.inputs,
        args.out,
        test=args.test,
        test_fraction=args.test_fraction,
        shards=args.shards,
        compression=args.compression,
        max_line_bytes=args.max_line_bytes,
        log=print,
    )
    print(f"wrote {args.out} in {result['seconds']:.1f} s; figures in {META_FILE}")
    return 0


def text(args: argparse.Namespace) -> int:
    from psflow.data.text import META_FILE, TextConfig, corpus_files, prepare_text

    if args.corpus is not None:
        if args.train is not None or args.test is not None:
            raise ValueError("give --corpus or --train and --test, not both")
        train, test = corpus_files(args.corpus)
    elif args.train is None or args.test is None:
        raise ValueError("give --train and --test (or --corpus)")
    else:
        train, test = args.train, args.test
    config = TextConfig(
        min_count=args.min_count,
        max_size=args.max_size or None,
        max_length=args.max_length or None,
        shards=args.shards,
        test_shards=args.test_shards,
        compression=args.compression.upper(),
        seed=args.seed,
        max_line_bytes=args.max_line_bytes,
    )
    result = prepare_text(train, test, args.out, config, log=print)
    print(
        f"vocabulary: {result['vocab_size']:,} words; labels: {result['num_labels']}; "
        f"wrote {args.out} in {result['seconds']:.1f} s; figures in {META_FILE}"
    )
    return 0
