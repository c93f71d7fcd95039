"""CSV and Parquet to TFRecord, through pyarrow (imported only here: the ``psflow[spark]`` extra)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np

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
        try:
            lst.value.extend(cast(v) for v in values)
        except ValueError as e:
            if field != "int64_list":
                raise
            raise ValueError(f"column {name!r}: {e} (an int64_list holds -2**63 .. 2**63-1)") from e

    return encode


def _check_floats(src: str, name: str, column: Any, first_row: int, csv: bool) -> None:
    """Refuses what a ``float_list`` (float32) would silently change in one float column.

    Everywhere: a finite value beyond float32's range (it would become inf). In a CSV: also an
    integer whose float32 is another integer (pyarrow reads a column as floats as soon as one
    cell is not an integer, so ``16777217`` would come back as ``16777216.0``). Other values are
    rounded to float32's precision, as a float_list always is.
    """
    import pyarrow as pa

    t = column.type
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    values = column.flatten() if is_list else column
    if not pa.types.is_floating(values.type) or len(values) == 0:
        return
    wide = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64)  # null -> nan

    def where(bad: np.ndarray) -> str:
        return (
            f"{src}: column {name!r}"
            if is_list
            else (f"{src} row {first_row + int(np.flatnonzero(bad)[0])}: column {name!r}")
        )

    with np.errstate(over="ignore", invalid="ignore"):
        narrow = wide.astype(np.float32).astype(np.float64)
    overflow = np.isinf(narrow) & np.isfinite(wide)
    if overflow.any():
        proto.check_float32(wide, where(overflow))
    if csv:
        with np.errstate(invalid="ignore"):
            bad = np.isfinite(wide) & (wide == np.floor(wide)) & (narrow != wide)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{where(bad)}: the integer {int(wide[i])} would be stored as the float32 "
                f"{int(narrow[i])}: the column is read as floats (not every cell is an integer) "
                "and a float_list holds float32; make every cell of the column an integer to "
                "keep it as int64, or convert from Parquet with the column as int64 or string"
            )


# pyarrow's default null spellings less the NaN ones: a literal nan in a CSV stays NaN, as it
# does in Parquet; an empty cell (and NA, null, N/A, ...) in a number column is a null, which
# the Example leaves out (an absent feature).
_NAN_SPELLINGS = ("nan", "NaN", "-nan", "-NaN")


def _csv_convert_options() -> Any:
    import pyarrow.csv as pcsv

    nulls = [v for v in pcsv.ConvertOptions().null_values if v not in _NAN_SPELLINGS]
    return pcsv.ConvertOptions(null_values=nulls)


def _batches(path: str, fmt: str) -> tuple[Iterator[Any], int | None, Callable[[], int]]:
    """(record batches, total rows if known, rows or bytes read so far)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(fs.open_read(path))
        return pf.iter_batches(batch_size=8192), pf.metadata.num_rows, lambda: 0
    import pyarrow.csv as pcsv

    f = fs.open_read(path)
    reader = pcsv.open_csv(
        f,
        read_options=pcsv.ReadOptions(block_size=1 << 20),
        convert_options=_csv_convert_options(),
    )
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

    Raises:
        ValueError: naming the file (and row, column and value where there is one) for what an
            Example cannot hold as it is: a column type without an encoding, two columns of one
            name, a finite float beyond float32's range, an integer beyond int64, and in a CSV an
            integer that a float column would round (see ``docs/data.md``).
    """
    fmt = fmt or ("parquet" if src.lower().endswith((".parquet", ".pq")) else "csv")
    if fmt not in ("csv", "parquet"):
        raise ValueError(f"format must be 'csv' or 'parquet', got {fmt!r}")
    resolve_compression(dst, compression)
    batches, total, _ = _batches(src, fmt)
    bar = Progress(total, "rows") if progress else None
    encoders: list[tuple[str, Callable[[Any, Any], None]]] | None = None
    first_row = 0
    with TFRecordWriter(dst, compression=compression) as w:
        for batch in batches:
            if encoders is None:
                proto.check_unique_names([f.name for f in batch.schema], where=f"{src}: ")
                try:
                    encoders = [(f.name, _column_encoder(f.name, f.type)) for f in batch.schema]
                except ValueError as e:
                    raise ValueError(f"{src}: {e}") from e
            for (name, _), column in zip(encoders, batch.columns, strict=True):
                _check_floats(src, name, column, first_row, fmt == "csv")
            columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            for i, row in enumerate(zip(*columns, strict=True)):
                ex = proto.Example()
                fmap = ex.features.feature
                try:
                    for (_, enc), value in zip(encoders, row, strict=True):
                        enc(fmap, value)
                except ValueError as e:
                    raise ValueError(f"{src} row {first_row + i}: {e}") from e
                w.write(ex.SerializeToString(deterministic=True))
            first_row += batch.num_rows
            if bar is not None:
                bar.update(batch.num_rows)
        if bar is not None:
            bar.close()
        return w.records
