"""Reading click-through-rate TFRecord files as batches of tensors for a CTR model.

The files' feature names and list kinds come from their first records (:func:`detect_layout`):
the Criteo layout (:mod:`psflow.data.ctr_layout`, as ``psflow data synth-ctr`` writes it), Criteo
text converted with float or hex-string columns, or tensorflow/models' ``dense-feature-N`` /
``sparse-feature-N`` records.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from psflow.data import fs, proto
from psflow.data.ctr_layout import CATEGORICAL, DENSE, LABEL, BadValue, parse_hex
from psflow.data.features import FixedLenFeature, parse_examples
from psflow.data.tfrecord_reader import TFRecordReader

if TYPE_CHECKING:
    import torch


class CTRBatch(NamedTuple):
    """One batch for a CTR model."""

    dense: torch.Tensor
    """``[B, 13]`` float32: ``log1p`` of the counts (negative ones, as Criteo's I2 has, as 0)."""
    categorical: torch.Tensor
    """``[B, 26]`` int64 ids."""
    label: torch.Tensor
    """``[B]`` float32, 0 or 1."""

    def to(self, device: torch.device | str | None, *, non_blocking: bool = False) -> CTRBatch:
        """The batch on ``device`` (the same tensors where they already are); from pinned
        memory (:meth:`pin_memory`) with ``non_blocking``, without the host waiting."""
        return CTRBatch(*(t.to(device, non_blocking=non_blocking) for t in self))

    def pin_memory(self) -> CTRBatch:
        """The batch in pinned host memory (needs CUDA), as ``DataLoader(pin_memory=True)``
        gives it: its copy to a GPU with ``non_blocking`` does not make the host wait."""
        return CTRBatch(*(t.pin_memory() for t in self))


TF_MODELS_DENSE = tuple(f"dense-feature-{i}" for i in range(1, 14))
TF_MODELS_CATEGORICAL = tuple(f"sparse-feature-{i}" for i in range(14, 40))
"""The names of tensorflow/models' ``CriteoTFRecordReader``
(``official/recommendation/ranking/data/data_pipeline_multi_hot.py``): ``label`` int64,
``dense-feature-1..13`` float32 already ``log1p``-transformed, ``sparse-feature-14..39`` int64."""


@dataclass(frozen=True, kw_only=True)
class CTRLayout:
    """Which features of a CTR file are what, and their list kinds."""

    dense_names: tuple[str, ...] = DENSE
    categorical_names: tuple[str, ...] = CATEGORICAL
    label: str = "int64"
    """List kind of ``label``: ``"int64"`` or ``"float32"``."""
    dense: str = "int64"
    """List kind of the dense features: ``"int64"`` or ``"float32"``."""
    categorical: str = "int64"
    """List kind of the categorical features: ``"int64"`` or ``"bytes"`` (hex strings)."""
    log_dense: bool = True
    """Apply ``log1p`` to the dense values (False where the files hold them transformed)."""


def detect_layout(paths: str | Iterable[str], *, records: int = 100) -> CTRLayout:
    """The layout of CTR files, from their first records.

    Criteo's names (``I1``, ``C1``) with any list kinds, or tensorflow/models' names
    (:data:`TF_MODELS_DENSE`, whose dense values are already transformed). A kind that none of
    the first ``records`` records shows is ``"int64"``.
    """
    seen = 0
    for path in fs.expand_paths(paths):
        with TFRecordReader(path) as reader:
            for record in reader:
                got = proto.example_to_dict(record)
                if seen == 0:
                    tf_models = TF_MODELS_DENSE[0] in got or TF_MODELS_CATEGORICAL[0] in got
                    roles = {
                        "label": (LABEL,),
                        "dense": TF_MODELS_DENSE if tf_models else DENSE,
                        "categorical": TF_MODELS_CATEGORICAL if tf_models else CATEGORICAL,
                    }
                    kinds: dict[str, str] = {}
                for role, names in roles.items():
                    for name in names:
                        if role not in kinds and name in got:
                            v = got[name]
                            kinds[role] = "bytes" if isinstance(v, list) else str(v.dtype)
                seen += 1
                if len(kinds) == len(roles) or seen >= records:
                    break
        if seen and (len(kinds) == len(roles) or seen >= records):
            break
    if not seen:
        raise ValueError(f"no records in {paths!r}")
    return CTRLayout(
        dense_names=roles["dense"],
        categorical_names=roles["categorical"],
        log_dense=not tf_models,
        **{role: kinds.get(role, "int64") for role in roles},
    )


def ctr_spec(layout: CTRLayout | None = None) -> dict[str, FixedLenFeature]:
    """The parsing spec of a CTR layout; a missing dense value is 0, a missing id is 0."""
    layout = layout or CTRLayout()
    spec = {LABEL: FixedLenFeature(dtype=layout.label)}
    for name in layout.dense_names:
        spec[name] = FixedLenFeature(dtype=layout.dense, default=0)
    for name in layout.categorical_names:
        cat = layout.categorical
        spec[name] = FixedLenFeature(dtype=cat, default=b"" if cat == "bytes" else 0)
    return spec


def ctr_arrays(
    parsed: dict[str, Any], layout: CTRLayout | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A parsed batch (numpy, by :func:`ctr_spec`) as ``(dense, categorical, label)`` arrays.

    Raises:
        BadValue: (a ``ValueError``) a label other than 0 or 1, a dense value that is not
            finite (NaN, infinity), an id that is not hexadecimal; it names the first such
            value and its row of the batch.
    """
    layout = layout or CTRLayout()
    raw_label = np.asarray(parsed[LABEL])
    bad = (raw_label != 0) & (raw_label != 1)  # NaN too
    if bad.any():
        row = int(np.argmax(bad))
        raise BadValue(row, f"{LABEL} {raw_label[row]} is not 0 or 1")
    dense = np.stack([np.asarray(parsed[n], dtype=np.float32) for n in layout.dense_names], 1)
    if layout.dense != "int64":  # an int64 count is finite as float32
        finite = np.isfinite(dense)
        if not finite.all():
            first = int(np.argmin(finite))  # row-major: the first row's first bad column
            row, col = divmod(first, dense.shape[1])
            name = layout.dense_names[col]
            raise BadValue(row, f"{name} {dense[row, col]} is not finite")
    if layout.log_dense:
        dense = np.log1p(np.maximum(dense, 0))
    cols = []
    for name in layout.categorical_names:
        v = parsed[name]
        if np.asarray(v).dtype == object:
            try:
                cols.append(parse_hex(v))
            except BadValue as e:
                raise BadValue(e.row, f"{name} {e.what}") from None
        else:
            cols.append(np.asarray(v, np.int64))
    categorical = np.stack(cols, axis=1)
    label = raw_label.astype(np.float32)
    return dense, categorical, label


LOCATE_RECORDS = 4096
"""Records checked at a time when :func:`ctr_batches` looks for the file and record of a value
that :func:`ctr_arrays` refused."""


def _locate(files: list[str], layout: CTRLayout, **options: Any) -> ValueError | None:
    """The first record of ``files`` (in their order) that :func:`ctr_arrays` refuses, as an
    error naming its file and record (counted from 0); None where none does."""
    spec = ctr_spec(layout)
    for path in files:
        with TFRecordReader(path, **options) as reader:
            records = iter(reader)
            start = 0
            while chunk := list(itertools.islice(records, LOCATE_RECORDS)):
                try:
                    ctr_arrays(parse_examples(chunk, spec, backend="numpy"), layout)
                except BadValue as e:
                    return ValueError(f"{path}: record {start + e.row}: {e.what}")
                start += len(chunk)
    return None


def ctr_batches(
    paths: str | Iterable[str],
    *,
    batch_size: int,
    shard_index: int = 0,
    num_shards: int = 1,
    **config: Any,
) -> Iterator[CTRBatch]:
    """Batches of CTR-layout TFRecord files as tensors, this worker's share only.

    Args:
        paths: files, directories or globs (``"data/train-*"``).
        batch_size: examples per batch.
        shard_index: this worker's index among ``num_shards`` (its ``task_index``).
        num_shards: workers sharing the files.
        **config: more :class:`~psflow.data.DatasetConfig` fields (``shuffle_buffer``,
            ``num_epochs``, ``seed``, ``drop_remainder``, ``prefetch`` ...).

    The files' names and list kinds come from their first records (:func:`detect_layout`):
    the Criteo layout (:mod:`psflow.data.ctr_layout`), Criteo text converted with float or
    hex-string columns, or tensorflow/models' ``dense-feature-N``/``sparse-feature-N`` records.

    Raises:
        ValueError: a value no CTR example holds (see :func:`ctr_arrays`), naming its file and
            record (the first such record of the files, which are read again to find it).

    Example:
        >>> for batch in ctr_batches("data/ctr/train-*", batch_size=1024,
        ...                          shard_index=i, num_shards=n):
        ...     loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.categorical),
        ...                                               batch.label)  # doctest: +SKIP
    """
    import torch

    from psflow.data.dataset import TFRecordDataset

    layout = detect_layout(paths)
    spec = ctr_spec(layout)
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
        try:
            dense, categorical, label = ctr_arrays(parsed, layout)
        except BadValue as e:  # a batch has no file names: the files are read again for them
            cfg = ds.config
            found = _locate(
                ds.files, layout, compression=cfg.compression, skip_corrupt=cfg.skip_corrupt
            )
            raise found or ValueError(f"{paths!r}: a batch's {e}") from None
        yield CTRBatch(
            torch.from_numpy(dense), torch.from_numpy(categorical), torch.from_numpy(label)
        )
