"""Parsing specs for ``tf.train.Example``: batches of records to numpy arrays or torch tensors.

:class:`FixedLenFeature` and :class:`VarLenFeature` mirror ``tf.io.FixedLenFeature`` and
``tf.io.VarLenFeature``/``RaggedFeature``. :func:`parse_examples` decodes the records of a batch
that share a layout along it (:mod:`psflow.data.layout`), the others with the general vectorized
wire decoder (:mod:`psflow.data.fastparse`), and what neither takes with protobuf;
``method="protobuf"`` decodes each record with protobuf instead (the reference: both give
identical output for every record protobuf accepts). Like TensorFlow's own parser, the fast path
does not look into features outside the spec, so a record that protobuf rejects only for one of
those (a broken list, a key that is not UTF-8) still decodes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from psflow.data import fastparse, layout, native, proto
from psflow.data.fastparse import BYTES, FLOAT, INT64, Column
from psflow.data.tfrecord import RecordBatch

DTYPES = {"int64": INT64, "float32": FLOAT, "bytes": BYTES, "string": BYTES}
_KIND_NAMES = {0: "no list", BYTES: "bytes_list", FLOAT: "float_list", INT64: "int64_list"}
_NP = {"int64": np.int64, "float32": np.float32, "bytes": object, "string": object}


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def _checked_default(default: Any, dtype: str) -> np.ndarray:
    """``default`` as an array of ``dtype``, refusing one that the cast would change.

    int64 takes ints, bools (as 0/1, as :func:`~psflow.data.proto.make_feature` stores them)
    and whole floats within int64. float32 takes numbers within its range (and inf, nan), a
    fraction rounded to float32 as every ``float_list`` value is, but a whole number only if
    float32 holds it exactly (16777217 would be 16777216). Strings are refused for both.
    """
    if dtype not in ("int64", "float32"):
        return np.asarray(default, dtype=_NP[dtype])
    given = np.asarray(default)
    if given.dtype.kind not in "biuf":
        raise ValueError(
            f"default {default!r} for a {dtype} feature: give numbers within {dtype}'s range "
            f"(got {given.dtype} values)"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        cast = given.astype(_NP[dtype])
    for a, b in zip(given.reshape(-1).tolist(), cast.reshape(-1).tolist(), strict=True):
        if isinstance(a, float) and not math.isfinite(a):
            survives = dtype == "float32"  # inf and nan stay as they are; an int64 has neither
        elif isinstance(a, float) and a != math.floor(a):
            survives = dtype == "float32" and math.isfinite(b)  # rounded, as float_lists are
        else:
            survives = int(a) == b  # a whole number: exactly, or refused
        if not survives:
            raise ValueError(
                f"default {default!r}: {a!r} does not survive the cast to {dtype} exactly "
                f"(it would be {b!r})"
            )
    return cast


@dataclass(frozen=True, kw_only=True)
class FixedLenFeature:
    """A feature with the same number of values in every record, as a dense array.

    Example:
        >>> spec = {"label": FixedLenFeature(dtype="int64"),
        ...         "x": FixedLenFeature(dtype="float32", shape=(4,), default=0.0)}
    """

    dtype: str
    """``"int64"``, ``"float32"``, ``"bytes"`` or ``"string"`` (bytes decoded as UTF-8)."""
    shape: tuple[int, ...] = ()
    """Shape of one record's value; the values are read in row-major order."""
    default: Any = None
    """Value for records without the feature (a scalar is broadcast); None makes it required."""

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        object.__setattr__(self, "shape", tuple(self.shape))
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"shape must be non-negative ints, got {self.shape!r}")
        if self.default is not None:
            size = int(np.prod(self.shape))
            d = _checked_default(self.default, self.dtype).reshape(-1)
            if d.size not in (1, size):
                raise ValueError(
                    f"default must be a scalar or have {size} values for shape {self.shape}, "
                    f"got {d.size} values"
                )

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class VarLenFeature:
    """A feature whose number of values varies: padded to a dense array, or ragged.

    Example:
        >>> spec = {"ids": VarLenFeature(dtype="int64", ragged=True)}
    """

    dtype: str
    """``"int64"``, ``"float32"``, ``"bytes"`` or ``"string"``."""
    ragged: bool = False
    """False: a dense ``(batch, length)`` array padded with ``padding_value``; True: a
    :class:`Ragged` of flat values and row splits (no padding, lengths recoverable)."""
    padding_value: Any = None
    """Fill for padded output (default 0, or b"" for bytes)."""
    pad_to: int | None = None
    """Fixed padded length; a record with more values is an error (no silent truncation)."""

    def __post_init__(self) -> None:
        _check_dtype(self.dtype)
        if self.pad_to is not None and self.pad_to < 0:
            raise ValueError(f"pad_to must be >= 0, got {self.pad_to}")
        if self.padding_value is not None:  # refused as a FixedLenFeature's default would be
            _checked_default(self.padding_value, self.dtype)


FeatureSpec = FixedLenFeature | VarLenFeature


class Ragged(NamedTuple):
    """Ragged values of a batch: record ``i`` has ``values[row_splits[i]:row_splits[i + 1]]``."""

    values: Any
    row_splits: Any

    def row(self, i: int) -> Any:
        return self.values[int(self.row_splits[i]) : int(self.row_splits[i + 1])]


def _where(batch: RecordBatch, i: int) -> str:
    if batch.path:
        return f"{batch.path} record {int(batch.indices[i])}"
    return f"record {int(batch.indices[i])} of the batch"


def _columns_protobuf(
    batch: RecordBatch, rows: Sequence[int], names: Mapping[str, int]
) -> dict[str, Column]:
    """The reference decoder: protobuf per record."""
    acc: dict[str, tuple[list[int], list[int], list[int], list[Any]]] = {
        n: ([], [], [], []) for n in names
    }
    for i in rows:
        try:
            ex = proto.Example.FromString(batch[i])
        except Exception as e:  # protobuf's DecodeError type differs between its runtimes
            raise ValueError(f"{_where(batch, i)}: not a valid tf.train.Example: {e}") from e
        fmap = ex.features.feature
        for name, (rid, kind, counts, values) in acc.items():
            if name not in fmap:
                continue
            feat = fmap[name]
            k = feat.WhichOneof("kind")
            code = {"bytes_list": BYTES, "float_list": FLOAT, "int64_list": INT64}.get(k or "", 0)
            vals = list(getattr(feat, k).value) if k else []
            rid.append(i)
            kind.append(code)
            counts.append(len(vals) if code == names[name] else 0)
            if code == names[name]:
                values.append(vals)
    out = {}
    for name, (rid, kind, counts, values) in acc.items():
        flat = list(itertools.chain.from_iterable(values))
        want = names[name]
        arr: np.ndarray | list[bytes] = (
            flat
            if want == BYTES
            else np.asarray(flat, dtype=np.float32 if want == FLOAT else np.int64)
        )
        out[name] = Column(
            np.asarray(rid, dtype=np.int64),
            np.asarray(kind, dtype=np.int8),
            np.asarray(counts, dtype=np.int64),
            arr,
        )
    return out


def _columns_fast(batch: RecordBatch, names: Mapping[str, int]) -> dict[str, Column]:
    """Layouts first (:mod:`layout`), the general wire walker next, protobuf for what is left."""
    raw = batch.buffer if isinstance(batch.buffer, bytes) else bytes(batch.buffer)
    arr = np.frombuffer(raw, dtype=np.uint8)
    starts = np.asarray(batch.starts, dtype=np.int64)
    ends = starts + np.asarray(batch.lengths, dtype=np.int64)
    want = dict(names)
    parts: list[dict[str, Column]] = []
    rest = np.arange(len(batch), dtype=np.int64)
    unlearned: list[int] = []  # records whose own layout is not a plain one
    for _ in range(layout.MAX_LAYOUTS):
        if not len(rest):
            break
        first = int(rest[0])
        keys = layout.learn(raw, int(starts[first]), int(ends[first]))
        if keys is None:
            unlearned.append(first)
            rest = rest[1:]
            continue
        ok, cols = layout.decode(raw, arr, rest, starts[rest], ends[rest], want, keys)
        parts.append(cols)
        rest = rest[~ok]
        if len(rest) and rest[0] == first:  # its lists did not decode: not a layout's job
            unlearned.append(first)
            rest = rest[1:]
    if unlearned:
        rest = np.union1d(rest, np.asarray(unlearned, dtype=np.int64))
    if len(rest):
        decoded = fastparse.decode_batch(raw, starts[rest], ends[rest] - starts[rest], want)
        keep = np.ones(len(rest), dtype=bool)
        keep[decoded.irregular] = False
        parts.append(
            {n: fastparse.select(c, keep[c.rid], rest) for n, c in decoded.columns.items()}
        )
        if len(decoded.irregular):
            parts.append(_columns_protobuf(batch, rest[decoded.irregular].tolist(), names))
    return {
        n: fastparse.merge([fastparse.empty_column(k)] + [p[n] for p in parts])
        for n, k in names.items()
    }


def _finalize(name: str, spec: FeatureSpec, col: Column, batch: RecordBatch, backend: str) -> Any:
    n = len(batch)
    want = DTYPES[spec.dtype]
    wrong = np.flatnonzero((col.kind != want) & (col.kind != 0))
    if len(wrong):
        j = int(wrong[0])
        raise ValueError(
            f"{_where(batch, int(col.rid[j]))}: feature {name!r} is a "
            f"{_KIND_NAMES[int(col.kind[j])]}, the spec wants {spec.dtype} ({_KIND_NAMES[want]})"
        )
    is_bytes = want == BYTES
    values: Any = col.values
    if is_bytes:
        if spec.dtype == "string":
            values = [v.decode("utf-8") for v in values]
        if not (isinstance(values, np.ndarray) and values.dtype == object):
            values = np.array([*values, None], dtype=object)[:-1]  # never a 2-D array of chars
    if isinstance(spec, FixedLenFeature) and len(col.rid) == n and (col.counts == spec.size).all():
        # Every record has the feature with the right count (rids are then 0..n-1 in order):
        # the values are the output as they are, without a copy.
        return _to_backend(np.asarray(values).reshape((n, *spec.shape)), backend)
    counts = np.zeros(n, dtype=np.int64)
    counts[col.rid] = col.counts
    if isinstance(spec, FixedLenFeature):
        present = np.zeros(n, dtype=bool)
        present[col.rid] = True
        size = spec.size
        # TensorFlow also takes an empty list as "absent" when there is a default.
        given = present & ((counts > 0) | (spec.default is None) | (size == 0))
        badlen = np.flatnonzero(given & (counts != size))
        if len(badlen):
            i = int(badlen[0])
            raise ValueError(
                f"{_where(batch, i)}: feature {name!r} has {int(counts[i])} values, "
                f"the spec wants {size} (shape {spec.shape})"
            )
        missing = np.flatnonzero(~given)
        if len(missing) and spec.default is None:
            raise ValueError(
                f"{_where(batch, int(missing[0]))}: required feature {name!r} is missing "
                "(give the spec a default to allow that)"
            )
        out = np.empty((n, size), dtype=_NP[spec.dtype])
        out[given] = np.asarray(values).reshape(-1, size) if size else out[given]
        if len(missing):
            out[missing] = np.asarray(spec.default, dtype=_NP[spec.dtype]).reshape(-1)
        out = out.reshape((n, *spec.shape))
        return _to_backend(out, backend)
    splits = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=splits[1:])
    if spec.ragged:
        return Ragged(_to_backend(values, backend), _to_backend(splits, backend))
    width = int(counts.max()) if n else 0
    if spec.pad_to is not None:
        if width > spec.pad_to:
            i = int(np.argmax(counts))
            raise ValueError(
                f"{_where(batch, i)}: feature {name!r} has {width} values, more than "
                f"pad_to={spec.pad_to}"
            )
        width = spec.pad_to
    pad = spec.padding_value
    if pad is None:
        pad = b"" if is_bytes and spec.dtype == "bytes" else ("" if is_bytes else 0)
    out = np.full((n, width), pad, dtype=_NP[spec.dtype])
    rows = np.repeat(np.arange(n), counts)
    cols = np.arange(len(rows)) - np.repeat(splits[:-1], counts)
    out[rows, cols] = values
    return _to_backend(out, backend)


def _to_backend(arr: np.ndarray, backend: str) -> Any:
    if not arr.flags.writeable:  # values read straight out of a bytes object: hand out a copy
        arr = arr.copy()
    if backend == "torch" and arr.dtype != object:
        import torch

        return torch.from_numpy(np.ascontiguousarray(arr))
    return arr


def _fixed_numeric(
    batch: RecordBatch, spec: Mapping[str, FeatureSpec], backend: str
) -> dict[str, Any] | None:
    """The batch by the compiled parser (:func:`psflow.data.native.parse_fixed`) when every
    feature is a :class:`FixedLenFeature` of ``int64`` or ``float32`` values and every record
    holds each in the plain wire form, with its count: the common case (CTR data, dense
    features) in one C pass. ``None`` otherwise (a record missing a feature, another list kind
    or count, an unusual encoding, the parser not built): the general path decodes the batch,
    defaults and errors included."""
    n = len(batch)
    if not n or not spec or native.NATIVE is None:
        return None
    fixed = [(name, s) for name, s in spec.items() if isinstance(s, FixedLenFeature)]
    if len(fixed) != len(spec) or any(s.dtype not in ("int64", "float32") for _, s in fixed):
        return None
    outs: list[np.ndarray] = [
        np.empty((n, s.size), dtype=np.int64 if s.dtype == "int64" else np.float32)
        for _, s in fixed
    ]
    keys = [name.encode() for name, _ in fixed]
    kinds = [DTYPES[s.dtype] for _, s in fixed]
    if not native.parse_fixed(batch.buffer, batch.starts, batch.lengths, keys, kinds, outs):
        return None  # not built, or a record not in the plain form or outside the buffer
    return {
        name: _to_backend(out.reshape((n, *s.shape)), backend)
        for (name, s), out in zip(fixed, outs, strict=True)
    }


def parse_examples(
    records: RecordBatch | Iterable[bytes],
    spec: Mapping[str, FeatureSpec],
    *,
    backend: Literal["numpy", "torch"] = "numpy",
    method: Literal["fast", "protobuf"] = "fast",
) -> dict[str, Any]:
    """Decodes a batch of serialized ``tf.train.Example`` records by a parsing spec.

    Args:
        records: a :class:`RecordBatch` (no copy) or any iterable of serialized records.
        spec: feature name to :class:`FixedLenFeature` or :class:`VarLenFeature`.
        backend: ``"numpy"`` arrays or ``"torch"`` tensors (bytes features stay numpy object
            arrays: torch has no string tensors).
        method: ``"fast"`` (vectorized wire decoding, falling back to protobuf for unusual
            records) or ``"protobuf"`` (the reference).

    Returns:
        Feature name to a ``(batch, *shape)`` array for fixed-length features, a padded
        ``(batch, length)`` array or a :class:`Ragged` for variable-length ones.

    Raises:
        ValueError: a record that is not an Example, or does not match the spec; the message
            names the file, the record index and the feature.

    Example:
        >>> batch = [serialize_example({"label": 1, "x": [1.0, 2.0]})] * 3
        >>> out = parse_examples(batch, {"x": FixedLenFeature(dtype="float32", shape=(2,))})
        >>> out["x"].shape
        (3, 2)
    """
    if backend not in ("numpy", "torch"):
        raise ValueError(f"backend must be 'numpy' or 'torch', got {backend!r}")
    batch = records if isinstance(records, RecordBatch) else RecordBatch.from_records(records)
    if method == "fast":
        fixed = _fixed_numeric(batch, spec, backend)
        if fixed is not None:
            return fixed
    names = {name: DTYPES[s.dtype] for name, s in spec.items()}
    if method == "protobuf":
        cols = _columns_protobuf(batch, range(len(batch)), names)
    elif method == "fast":
        cols = _columns_fast(batch, names)
    else:
        raise ValueError(f"method must be 'fast' or 'protobuf', got {method!r}")
    return {name: _finalize(name, s, cols[name], batch, backend) for name, s in spec.items()}
