"""``TFRecordDataset``: a ``torch.utils.data.IterableDataset`` over TFRecord files, sharded."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch.utils.data

from psflow.data import fs, pipeline
from psflow.data.features import FeatureSpec, Ragged, VarLenFeature, parse_examples
from psflow.data.shuffle import shuffle_batches
from psflow.data.tfrecord import RecordBatch, TFRecordReader, resolve_compression


@dataclass(kw_only=True)
class DatasetConfig:
    """How a :class:`TFRecordDataset` reads, shards, shuffles and batches."""

    batch_size: int | None = None
    """Records per batch; None yields single records."""
    drop_remainder: bool = False
    """Drop each epoch's last, smaller batch."""
    shard_index: int = 0
    """This worker task's index among ``num_shards`` (e.g. the worker's ``task_index``)."""
    num_shards: int = 1
    """Number of worker tasks sharing the data; loader processes subdivide each task's share."""
    shuffle_buffer: int = 0
    """Records in the shuffle buffer (0: no record shuffle); file order is shuffled whenever
    this is > 0 or ``shuffle_files`` is set."""
    shuffle_files: bool = False
    """Shuffle the file order every epoch even without a record shuffle buffer."""
    seed: int = 0
    """Base seed; the order in epoch ``e`` depends on ``(seed, e)`` only, so every worker agrees."""
    num_epochs: int | None = 1
    """Epochs per iteration, starting at :meth:`TFRecordDataset.set_epoch`'s; None repeats forever."""
    cycle_length: int = 1
    """Files read at once, interleaved."""
    block_length: int = 16
    """Records taken from one file before moving to the next when interleaving."""
    prefetch: int = 2
    """Batches prepared ahead by a background thread (0: none)."""
    compression: str | None = "auto"
    """``""``, ``"GZIP"``, ``"ZLIB"`` or ``"auto"`` (by file suffix)."""
    skip_corrupt: bool = False
    """Skip (log and count) corrupt records instead of raising."""
    backend: Literal["numpy", "torch"] = "torch"
    """What parsed batches hold."""

    def __post_init__(self) -> None:
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {self.batch_size}")
        if self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {self.num_shards}")
        if not 0 <= self.shard_index < self.num_shards:
            raise ValueError(
                f"shard_index must be in [0, num_shards={self.num_shards}), got {self.shard_index}"
            )
        if self.shuffle_buffer < 0:
            raise ValueError(f"shuffle_buffer must be >= 0, got {self.shuffle_buffer}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None, got {self.num_epochs}")
        if self.cycle_length < 1 or self.block_length < 1:
            raise ValueError(
                f"cycle_length and block_length must be >= 1, got {self.cycle_length}, "
                f"{self.block_length}"
            )
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.backend not in ("numpy", "torch"):
            raise ValueError(f"backend must be 'numpy' or 'torch', got {self.backend!r}")
        resolve_compression("", self.compression)


PARSE_UNIT_RECORDS = 8192
"""Most records parsed in one call when batches are cut from a larger parse (see
:meth:`TFRecordDataset._parsed_batches`)."""


class TFRecordDataset(torch.utils.data.IterableDataset[Any]):
    """TFRecord files as an ``IterableDataset``, each (worker task x loader process) its own share.

    Files are assigned to shards ``i::N`` (or records, with fewer files than shards), where the
    shards are all pairs of worker task (``shard_index`` of ``num_shards``) and ``DataLoader``
    process: in one epoch, every record is read exactly once across all of them.

    Args:
        paths: files, directories, glob patterns or fsspec URLs.
        spec: a parsing spec: batches become dicts of tensors. None yields raw records
            (``bytes``, or a ``list[bytes]`` per batch).
        config: a :class:`DatasetConfig`; keyword arguments override its fields.

    Example:
        >>> ds = TFRecordDataset("data/train-*.tfrecord",
        ...                      spec={"x": FixedLenFeature(dtype="float32", shape=(4,))},
        ...                      batch_size=256, shuffle_buffer=10_000, seed=1,
        ...                      shard_index=task_index, num_shards=num_workers)  # doctest: +SKIP
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)  # doctest: +SKIP
        >>> for epoch in range(3):  # doctest: +SKIP
        ...     ds.set_epoch(epoch)
        ...     for batch in loader:
        ...         train_step(batch["x"])
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        spec: Mapping[str, FeatureSpec] | None = None,
        config: DatasetConfig | None = None,
        **overrides: Any,
    ):
        super().__init__()
        self.files = fs.expand_paths(paths)
        self.spec = dict(spec) if spec is not None else None
        self.config = replace(config or DatasetConfig(), **overrides)
        self.epoch = 0
        self.skipped = 0
        """Corrupt records skipped so far in this process (with ``skip_corrupt``)."""

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration starts at; set it before each ``DataLoader`` pass."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = epoch

    def shard(self) -> tuple[int, int]:
        """(index, count) of the shard this process reads, loader processes included."""
        info = torch.utils.data.get_worker_info()
        loaders, loader_id = (info.num_workers, info.id) if info is not None else (1, 0)
        cfg = self.config
        return cfg.shard_index * loaders + loader_id, cfg.num_shards * loaders

    def __iter__(self) -> Iterator[Any]:
        return pipeline.prefetch(self._generate(), self.config.prefetch)

    def _open(self, path: str, keep: tuple[int, int, int] | None) -> TFRecordReader:
        return _CountingReader(
            self,
            path,
            compression=self.config.compression,
            skip_corrupt=self.config.skip_corrupt,
            shard=keep,
        )

    def _generate(self) -> Iterator[Any]:
        cfg = self.config
        index, count = self.shard()
        epoch = self.epoch
        while cfg.num_epochs is None or epoch < self.epoch + cfg.num_epochs:
            yield from self._epoch(epoch, index, count)
            epoch += 1

    def _epoch(self, epoch: int, index: int, count: int) -> Iterator[Any]:
        cfg = self.config
        shards = pipeline.assign_files(
            self.files,
            index,
            count,
            seed=cfg.seed,
            epoch=epoch,
            shuffle=cfg.shuffle_buffer > 0 or cfg.shuffle_files,
        )
        batches = pipeline.interleave(
            shards, self._open, cycle_length=cfg.cycle_length, block_length=cfg.block_length
        )
        if cfg.shuffle_buffer > 0:
            rng = np.random.default_rng([cfg.seed, epoch, index, count])
            batches = shuffle_batches(batches, cfg.shuffle_buffer, rng)
        if cfg.batch_size is None:
            for b in batches:
                if self.spec is None:
                    yield from b
                else:
                    parsed = parse_examples(b, self.spec, backend=cfg.backend)
                    for i in range(len(b)):
                        yield {k: _row(v, i) for k, v in parsed.items()}
            return
        if self.spec is None:
            for b in pipeline.rebatch(batches, cfg.batch_size, drop_remainder=cfg.drop_remainder):
                yield b.tolist()
            return
        yield from self._parsed_batches(batches, self.spec, cfg.batch_size)

    def _parsed_batches(
        self, batches: Iterator[RecordBatch], spec: dict[str, FeatureSpec], batch_size: int
    ) -> Iterator[dict[str, Any]]:
        """The batches of :func:`pipeline.rebatch`, parsed several at a time, then cut apart.

        A padded :class:`VarLenFeature` without ``pad_to`` is as wide as the longest list of its
        own batch, so such specs parse batch by batch. A unit that fails to parse is parsed
        again batch by batch, so that the error comes with the same batch as it would alone.
        """
        cfg = self.config
        padded = any(
            isinstance(s, VarLenFeature) and not s.ragged and s.pad_to is None
            for s in spec.values()
        )
        units = pipeline.batch_units(
            batches, batch_size, max_records=batch_size if padded else PARSE_UNIT_RECORDS
        )
        for unit in units:
            if len(unit) <= batch_size:
                if len(unit) == batch_size or not cfg.drop_remainder:
                    yield parse_examples(unit, spec, backend=cfg.backend)
                continue
            try:
                parsed = parse_examples(unit, spec, backend=cfg.backend)
            except ValueError:
                parsed = None  # parsed again batch by batch below, up to the bad batch
            for lo in range(0, len(unit), batch_size):
                if cfg.drop_remainder and len(unit) - lo < batch_size:
                    break  # only the last unit has a remainder
                if parsed is None:
                    part = pipeline.slice_batch(unit, lo, lo + batch_size)
                    yield parse_examples(part, spec, backend=cfg.backend)
                else:
                    yield {k: _rows(v, lo, lo + batch_size) for k, v in parsed.items()}


def _rows(value: Any, lo: int, hi: int) -> Any:
    """Rows ``lo:hi`` of a parsed feature (a view, no copy)."""
    if isinstance(value, Ragged):
        splits = value.row_splits[lo : hi + 1]
        start, stop = int(splits[0]), int(splits[-1])
        return Ragged(value.values[start:stop], splits - splits[0])
    return value[lo:hi]


def _row(value: Any, i: int) -> Any:
    if hasattr(value, "row_splits"):
        return value.row(i)
    return value[i]


class _CountingReader(TFRecordReader):
    """A reader that adds its skipped-record count to the dataset's when it finishes a file."""

    def __init__(self, dataset: TFRecordDataset, path: str, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._dataset = dataset

    def iter_batches(self) -> Iterator[RecordBatch]:
        try:
            yield from super().iter_batches()
        finally:
            self._dataset.skipped += self.skipped
