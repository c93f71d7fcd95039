"""Spark DataFrames to and from TFRecord files of ``tf.train.Example`` (one Example per row).

Writing runs on the executors: each partition writes its own shard
``part-NNNNN.tfrecord[.gz]`` with :class:`~psflow.data.tfrecord.TFRecordWriter`, and only the
file names and counts come back to the driver; a ``_SUCCESS`` file marks a complete output. Reading
parallelizes the list of files, decodes each file on an executor and builds a DataFrame with an
explicit or inferred schema.

Column types and how they are stored:

==================================================  ============================================
Spark type                                          Example feature
==================================================  ============================================
Boolean, Byte, Short, Integer, Long                 ``int64_list`` (booleans as 0/1)
Float, Double                                       ``float_list`` (float32: doubles lose precision)
String                                              ``bytes_list`` (UTF-8)
Binary                                              ``bytes_list``
Array of any of the above                           the same list, one value per element
==================================================  ============================================

Nulls: a null cell is written as an absent feature (TensorFlow's convention: give the spec a
default, or use a VarLenFeature); reading an absent feature gives null, or an error for a
non-nullable column. A null *element* inside an array cannot be represented in an Example and
raises ``ValueError`` naming the column. Other types (decimal, date, timestamp, map, struct,
nested arrays) raise ``ValueError`` naming the column: cast them first.

pyspark is imported only by these functions (the optional extra ``psflow[spark]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from psflow.data import fs, proto
from psflow.data.features import FixedLenFeature
from psflow.data.schema import infer_schema
from psflow.data.tfrecord import TFRecordReader, TFRecordWriter

_INT, _FLOAT, _BYTES, _STRING = "int", "float", "bytes", "string"
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _kind_of(dtype: Any, column: str) -> str:
    from pyspark.sql import types as T

    if isinstance(dtype, T.BooleanType | T.ByteType | T.ShortType | T.IntegerType | T.LongType):
        return _INT
    if isinstance(dtype, T.FloatType | T.DoubleType):
        return _FLOAT
    if isinstance(dtype, T.StringType):
        return _STRING
    if isinstance(dtype, T.BinaryType):
        return _BYTES
    raise ValueError(
        f"column {column!r}: Spark type {dtype.simpleString()} has no Example encoding; cast it "
        "to an integer, float, double, string or binary column (or an array of one)"
    )


def _column_plan(schema: Any) -> list[tuple[str, str, bool]]:
    """(name, kind, is_array) per column, checked before any executor work starts."""
    from pyspark.sql import types as T

    proto.check_unique_names([f.name for f in schema.fields], rename=", e.g. with toDF")
    plan = []
    for f in schema.fields:
        if isinstance(f.dataType, T.ArrayType):
            plan.append((f.name, _kind_of(f.dataType.elementType, f.name), True))
        else:
            plan.append((f.name, _kind_of(f.dataType, f.name), False))
    return plan


def _row_to_example(row: Sequence[Any], plan: list[tuple[str, str, bool]]) -> bytes:
    ex = proto.Example()
    fmap = ex.features.feature
    for value, (name, kind, is_array) in zip(row, plan, strict=True):
        if value is None:
            continue  # a null cell: the feature is absent
        values = list(value) if is_array else [value]
        if any(v is None for v in values):
            raise ValueError(
                f"column {name!r}: an array with a null element cannot be stored in an Example "
                "(filter or fill the nulls first)"
            )
        if kind == _INT:
            fmap[name].int64_list.value.extend(int(v) for v in values)
        elif kind == _FLOAT:
            if any(abs(v) > _FLOAT32_MAX for v in values):  # inf, or a double beyond float32
                proto.check_float32(np.asarray(values, dtype=np.float64), f"column {name!r}")
            fmap[name].float_list.value.extend(values)
        elif kind == _STRING:
            fmap[name].bytes_list.value.extend(v.encode("utf-8") for v in values)
        else:
            fmap[name].bytes_list.value.extend(bytes(v) for v in values)
        if not values:  # an empty array keeps its type, unlike an absent feature
            fmap[name].SetInParent()
            getattr(
                fmap[name], {_INT: "int64_list", _FLOAT: "float_list"}.get(kind, "bytes_list")
            ).SetInParent()
    return bytes(ex.SerializeToString(deterministic=True))


def write_dataframe(
    df: Any,
    path: str | os.PathLike[str],
    *,
    compression: str = "",
    overwrite: bool = False,
) -> list[tuple[str, int]]:
    """Writes a DataFrame as TFRecord shards of Examples, one file per partition.

    Args:
        df: a ``pyspark.sql.DataFrame``; ``df.repartition(n)`` first to choose the shard count.
        path: output directory (local or any fsspec URL the executors can reach).
        compression: ``""``, ``"GZIP"`` or ``"ZLIB"``.
        overwrite: replace existing ``part-*`` files; otherwise existing ones are an error.

    Returns:
        (file, record count) per shard.

    Example:
        >>> write_dataframe(spark.range(100).toDF("id"), "/data/ids", compression="GZIP")  # doctest: +SKIP
    """
    out = os.fspath(path)
    comp = {"": "", "GZIP": "GZIP", "ZLIB": "ZLIB"}.get(compression.upper())
    if comp is None:
        raise ValueError(f"compression must be '', 'GZIP' or 'ZLIB', got {compression!r}")
    suffix = {"": ".tfrecord", "GZIP": ".tfrecord.gz", "ZLIB": ".tfrecord.zlib"}[comp]
    plan = _column_plan(df.schema)
    filesystem = fs.file_system(out)
    if filesystem.exists(out):
        existing = [
            p for p in filesystem.ls(out, detail=False) if fs.basename(p).startswith("part-")
        ]
        if existing and not overwrite:
            raise ValueError(f"{out} already holds {len(existing)} part files; pass overwrite=True")
        for p in existing:
            filesystem.rm(p)
    filesystem.makedirs(out, exist_ok=True)

    def write_partition(index: int, rows: Iterable[Any]) -> Iterator[tuple[str, int]]:
        target = fs.join(out, f"part-{index:05d}{suffix}")
        with TFRecordWriter(target, compression=comp) as w:
            for row in rows:
                w.write(_row_to_example(row, plan))
        yield target, w.records

    written = df.rdd.mapPartitionsWithIndex(write_partition).collect()
    with fs.open_write(fs.join(out, "_SUCCESS")):
        pass
    return [(str(p), int(n)) for p, n in written]


def spark_schema(spec: dict[str, Any]) -> Any:
    """A Spark ``StructType`` for a parsing spec: scalars for one-value fixed features, else arrays."""
    from pyspark.sql import types as T

    base = {
        "int64": T.LongType(),
        "float32": T.FloatType(),
        "bytes": T.BinaryType(),
        "string": T.StringType(),
    }
    fields = []
    for name, s in spec.items():
        t = base[s.dtype]
        scalar = isinstance(s, FixedLenFeature) and s.shape == ()
        fields.append(
            T.StructField(name, t if scalar else T.ArrayType(t, containsNull=False), True)
        )
    return T.StructType(fields)


def _converter(field: Any) -> Callable[[Any, str], Any]:
    """Turns one Example feature into a cell of ``field``'s type."""
    from pyspark.sql import types as T

    is_array = isinstance(field.dataType, T.ArrayType)
    elem = field.dataType.elementType if is_array else field.dataType
    kind = _kind_of(elem, field.name)
    want = {_INT: "int64_list", _FLOAT: "float_list", _STRING: "bytes_list", _BYTES: "bytes_list"}[
        kind
    ]

    def to_bool(v: int) -> bool:
        if v not in (0, 1):
            raise ValueError(
                f"feature {field.name!r}: {v} in a boolean column (only 0 and 1 are booleans)"
            )
        return v == 1

    cast: Callable[[Any], Any] = {
        _INT: (to_bool if isinstance(elem, T.BooleanType) else int),
        _FLOAT: float,
        _STRING: lambda b: b.decode("utf-8"),
        _BYTES: bytes,
    }[kind]

    def convert(feature: Any, where: str) -> Any:
        if feature is None:
            if not field.nullable:
                raise ValueError(
                    f"{where}: feature {field.name!r} is missing, the column is not nullable"
                )
            return None
        got = feature.WhichOneof("kind")
        if got is not None and got != want:
            raise ValueError(
                f"{where}: feature {field.name!r} is a {got}, column type wants {want}"
            )
        values = list(getattr(feature, want).value) if got else []
        if not is_array and len(values) != 1:
            if not values and field.nullable:
                return None
            raise ValueError(
                f"{where}: feature {field.name!r} has {len(values)} values for a scalar column "
                "(use an array column)"
            )
        try:
            return [cast(v) for v in values] if is_array else cast(values[0])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e

    return convert


def read_dataframe(
    spark: Any,
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    schema: Any = None,
    *,
    compression: str | None = "auto",
    sample: int = 1000,
) -> Any:
    """Reads TFRecord files of Examples into a DataFrame, one row per record.

    Args:
        spark: the ``SparkSession``.
        paths: files, directories, globs or fsspec URLs, resolved on the driver.
        schema: a ``StructType`` (columns are looked up by feature name), or None to infer one
            from the first ``sample`` records of the first file (see :func:`spark_schema`).
        compression: as for :class:`~psflow.data.tfrecord.TFRecordReader`.

    Example:
        >>> df = read_dataframe(spark, "/data/ids/*.tfrecord.gz")  # doctest: +SKIP
    """
    files = fs.expand_paths(paths)
    if schema is None:
        schema = spark_schema(infer_schema(files[0], max_records=sample, compression=compression))
    converters = [_converter(f) for f in schema.fields]
    names = [f.name for f in schema.fields]

    def read_file(path: str) -> Iterator[tuple[Any, ...]]:
        with TFRecordReader(path, compression=compression) as reader:
            for index, record in enumerate(reader):
                fmap = proto.Example.FromString(record).features.feature
                where = f"{path} record {index}"
                yield tuple(
                    conv(fmap.get(n), where) for n, conv in zip(names, converters, strict=True)
                )

    rdd = spark.sparkContext.parallelize(files, max(1, len(files))).flatMap(read_file)
    return spark.createDataFrame(rdd, schema)
