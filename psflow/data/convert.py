"""CSV and Parquet to TFRecord, through pyarrow (imported only here: the ``psflow[spark]`` extra)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from psflow.data import fs, proto
from psflow.data.tfrecord import TFRecordWriter, resolve_compression


class Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int | None, unit: str, stream: IO[str] | None = None):
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.monotonic()
        self._last = 0.0

    def update(self, n: int, force: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        rate = self.done / max(now - self.start, 1e-9)
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            text = f"[{bar:<30}] {frac:6.1%} {self.done:,}/{self.total:,} {self.unit}"
        else:
            text = f"{self.done:,} {self.unit}"
        self.stream.write(f"\r{text}  {rate:,.0f} {self.unit}/s ")
        self.stream.flush()

    def close(self) -> None:
        self.update(0, force=True)
        self.stream.write("\n")
        self.stream.flush()


def _column_encoder(name: str, arrow_type: Any) -> Callable[[Any, Any], None]:
    """How one Arrow column becomes a feature: ``encode(feature_map, python_value)``."""
    import pyarrow as pa

    t = arrow_type
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    elem = t.value_type if is_list else t
    cast: Callable[[Any], Any]
    if pa.types.is_integer(elem) or pa.types.is_boolean(elem):
        field, cast = "int64_list", int
    elif pa.types.is_floating(elem):
        field, cast = "float_list", float
    elif pa.types.is_string(elem) or pa.types.is_large_string(elem):
        field, cast = "bytes_list", lambda s: s.encode("utf-8")
    elif pa.types.is_binary(elem) or pa.types.is_large_binary(elem):
        field, cast = "bytes_list", bytes
    else:
        raise ValueError(
            f"column {name!r}: Arrow type {t} has no Example encoding (integers, floats, "
            "strings, binary and lists of those do)"
        )

    def encode(fmap: Any, value: Any) -> None:
        if value is None:
            return  # null: the feature is absent, as TensorFlow writes missing values
        values = value if is_list else [value]
        if any(v is None for v in values):
            raise ValueError(f"column {name!r}: a list with a null element cannot be stored")
        lst = getattr(fmap[name], field)
        lst.SetInParent()
        lst.value.extend(cast(v) for v in values)

    return encode


def _batches(path: str, fmt: str) -> tuple[Iterator[Any], int | None, Callable[[], int]]:
    """(record batches, total rows if known, rows or bytes read so far)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(fs.open_read(path))
        return pf.iter_batches(batch_size=8192), pf.metadata.num_rows, lambda: 0
    import pyarrow.csv as pcsv

    f = fs.open_read(path)
    reader = pcsv.open_csv(f, read_options=pcsv.ReadOptions(block_size=1 << 20))
    return iter(reader), None, lambda: 0


def convert_table(
    src: str,
    dst: str,
    *,
    fmt: str | None = None,
    compression: str | None = "auto",
    progress: bool = True,
) -> int:
    """Writes one Example per row of a CSV or Parquet file to a TFRecord file.

    Args:
        src: the input file (local or fsspec URL).
        dst: the TFRecord file to write.
        fmt: ``"csv"`` or ``"parquet"``; None picks by the input's suffix.
        compression: of the output, as for :class:`TFRecordWriter`.
        progress: draw a progress bar on stderr.

    Returns:
        The number of records written.
    """
    fmt = fmt or ("parquet" if src.lower().endswith((".parquet", ".pq")) else "csv")
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"format must be 'csv' or 'parquet', got {fmt!r}")
    resolve_compression(dst, compression)
    batches, total, _ = _batches(src, fmt)
    bar = Progress(total, "rows") if progress else None
    encoders: list[tuple[str, Callable[[Any, Any], None]]] | None = None
    with TFRecordWriter(dst, compression=compression) as w:
        for batch in batches:
            if encoders is None:
                encoders = [(f.name, _column_encoder(f.name, f.type)) for f in batch.schema]
            columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            for row in zip(*columns, strict=True):
                ex = proto.Example()
                fmap = ex.features.feature
                for (_, enc), value in zip(encoders, row, strict=True):
                    enc(fmap, value)
                w.write(ex.SerializeToString(deterministic=True))
            if bar is not None:
                bar.update(batch.num_rows)
        if bar is not None:
            bar.close()
        return w.records
