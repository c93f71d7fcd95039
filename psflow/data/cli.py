"""``psflow data inspect`` and ``psflow data convert`` (registered by ``psflow.cli``)."""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

from psflow.data import proto
from psflow.data.schema import format_schema, infer_schema
from psflow.data.tfrecord import DataLossError, TFRecordReader


def add_parser(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Registers ``psflow data {inspect,convert}``."""
    data = subparsers.add_parser("data", help="TFRecord files: inspect, convert")
    sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    inspect = sub.add_parser(
        "inspect", help="record count, inferred schema and the first records of a TFRecord file"
    )
    inspect.add_argument("file", help="TFRecord file (local path or fsspec URL)")
    inspect.add_argument("-n", "--head", type=int, default=3, help="records to print (default 3)")
    inspect.add_argument("--compression", default="auto", help="'', GZIP, ZLIB or auto (suffix)")
    inspect.add_argument(
        "--schema-records", type=int, default=1000, help="records sampled for the schema"
    )
    inspect.add_argument("--raw", action="store_true", help="records are not tf.train.Example")
    inspect.set_defaults(func=run_inspect)

    convert = sub.add_parser(
        "convert", help="write TFRecord (one Example per row) from CSV or Parquet"
    )
    convert.add_argument("input", help="CSV or Parquet file")
    convert.add_argument("output", help="TFRecord file to write (.gz/.zlib suffix compresses)")
    convert.add_argument("--format", choices=["csv", "parquet"], help="default: by input suffix")
    convert.add_argument("--compression", default="auto", help="'', GZIP, ZLIB or auto (suffix)")
    convert.add_argument("--quiet", action="store_true", help="no progress bar")
    convert.set_defaults(func=run_convert)


def _show(value: Any, limit: int = 8) -> str:
    if isinstance(value, list):  # bytes values
        shown = [v if len(v) <= 32 else v[:32] + b"..." for v in value[:limit]]
        more = f" ... ({len(value)} values)" if len(value) > limit else ""
        return f"{shown}{more}"
    items = value.tolist()
    more = f" ... ({len(items)} values)" if len(items) > limit else ""
    return f"{items[:limit]}{more}"


def run_inspect(args: argparse.Namespace) -> int:
    if args.head < 0:
        raise ValueError(f"--head must be >= 0, got {args.head}")
    try:
        with TFRecordReader(args.file, compression=args.compression) as reader:
            count = 0
            nbytes = 0
            for batch in reader.iter_batches():
                count += len(batch)
                nbytes += batch.nbytes
        print(f"file: {args.file}")
        print(f"compression: {reader.compression or 'none'}")
        print(f"records: {count:,} ({nbytes:,} bytes of payload)")
        with TFRecordReader(args.file, compression=args.compression) as reader:
            head = list(itertools.islice(reader, args.head))
        if args.raw:
            for i, rec in enumerate(head):
                print(f"record {i}: {len(rec)} bytes: {rec[:64]!r}")
            return 0
        print("schema:")
        spec = infer_schema(
            args.file, max_records=args.schema_records, compression=args.compression
        )
        print("  " + format_schema(spec).replace("\n", "\n  ") if spec else "  (no features)")
        for i, rec in enumerate(head):
            print(f"record {i}:")
            for name, value in sorted(proto.example_to_dict(rec).items()):
                print(f"  {name}: {_show(value)}")
    except DataLossError as e:
        print(f"psflow data inspect: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if type(e).__name__ == "DecodeError":
            print(
                f"psflow data inspect: {args.file}: not tf.train.Example records ({e}); try --raw",
                file=sys.stderr,
            )
            return 1
        raise
    return 0


def run_convert(args: argparse.Namespace) -> int:
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
