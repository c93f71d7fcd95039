"""Schema inference: a parsing spec guessed from the records of a file."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from psflow.data import proto
from psflow.data.features import FeatureSpec, FixedLenFeature, VarLenFeature
from psflow.data.tfrecord import TFRecordReader

_KINDS = {"bytes_list": "bytes", "float_list": "float32", "int64_list": "int64"}


@dataclass
class _Stats:
    dtypes: set[str] = field(default_factory=set)
    seen: int = 0
    min_len: int = 1 << 62
    max_len: int = 0


def infer_schema(
    source: str | os.PathLike[str] | Iterable[bytes],
    *,
    max_records: int = 1000,
    compression: str | None = "auto",
) -> dict[str, FeatureSpec]:
    """Guesses a parsing spec from the first ``max_records`` Examples of a file or iterable.

    A feature present in every sampled record with the same number ``n >= 1`` of values becomes a
    :class:`FixedLenFeature` (shape ``()`` for one value, ``(n,)`` otherwise); any other feature
    becomes a padded :class:`VarLenFeature`. Bytes features whose sampled values are all valid
    UTF-8 are still typed ``bytes``: the data cannot say it means text.

    Raises:
        ValueError: a feature stored with different list kinds in different records.

    Example:
        >>> infer_schema("train.tfrecord")  # doctest: +SKIP
        {'label': FixedLenFeature(dtype='int64', shape=(), default=None), ...}
    """
    if max_records < 1:
        raise ValueError(f"max_records must be >= 1, got {max_records}")
    if isinstance(source, str | os.PathLike):
        reader = TFRecordReader(source, compression=compression)
        records: Iterable[bytes] = reader
    else:
        records = source
    stats: dict[str, _Stats] = {}
    total = 0
    for record in itertools.islice(records, max_records):
        total += 1
        for name, feat in proto.Example.FromString(record).features.feature.items():
            st = stats.setdefault(name, _Stats())
            kind = feat.WhichOneof("kind")
            n = len(getattr(feat, kind).value) if kind else 0
            if kind:
                st.dtypes.add(_KINDS[kind])
            st.seen += 1
            st.min_len = min(st.min_len, n)
            st.max_len = max(st.max_len, n)
    if isinstance(source, str | os.PathLike):
        reader.close()
    spec: dict[str, FeatureSpec] = {}
    for name in sorted(stats):
        st = stats[name]
        if len(st.dtypes) > 1:
            raise ValueError(f"feature {name!r} has several kinds in the data: {sorted(st.dtypes)}")
        dtype = st.dtypes.pop() if st.dtypes else "float32"
        if st.seen == total and st.min_len == st.max_len >= 1:
            shape = () if st.max_len == 1 else (st.max_len,)
            spec[name] = FixedLenFeature(dtype=dtype, shape=shape)
        else:
            spec[name] = VarLenFeature(dtype=dtype)
    return spec


def format_schema(spec: Mapping[str, FeatureSpec]) -> str:
    """One line per feature, for people: ``name: fixed int64 shape=()``."""
    width = max((len(n) for n in spec), default=0)
    lines = []
    for name, s in spec.items():
        if isinstance(s, FixedLenFeature):
            lines.append(f"{name:<{width}}  fixed   {s.dtype:<8} shape={s.shape}")
        else:
            lines.append(
                f"{name:<{width}}  varlen  {s.dtype:<8} {'ragged' if s.ragged else 'padded'}"
            )
    return "\n".join(lines)
