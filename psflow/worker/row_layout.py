"""Where a worker's table rows are: each table's ids grouped by the shard that holds them, and
the rows that come back checked, and joined or cast, shard after shard.

:class:`TableLayout` holds what every request for rows reads of a table (its spec, its
:class:`~psflow.sparse.Partition` over the shards, the dtype its rows travel in); the
:class:`~psflow.worker.tables.TableClient` asks it at each forward, and the
:class:`~psflow.worker.prefetch.RowPrefetch` for the rows that ride a step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

import psflow.sparse.kernels as kernels
from psflow.nn import TableModule
from psflow.protocol import TableSpec
from psflow.sparse import Partition

Split = dict[int, tuple[torch.Tensor, Any]]
"""Ids by shard: each shard's ids and where they are among all: their positions
(``Partition.split``), or a slice when the rows are grouped by shard (:meth:`TableLayout.group`)."""


class Grouped(NamedTuple):
    """A batch's ids (flat) and their grouping by shard (:meth:`TableLayout.group`), and the
    device of the batch they came from."""

    ids: torch.Tensor
    unique: torch.Tensor
    positions: torch.Tensor
    split: Split
    device: torch.device


class TableLayout:
    """A worker's tables by name, as its requests for rows see them.

    Args:
        num_shards: the ps tasks the tables' rows are partitioned over.
    """

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards
        self.specs: dict[str, TableSpec] = {}
        self.partitions: dict[str, Partition] = {}
        self.wire: dict[str, str] = {}
        """Per table whose rows travel narrower than the table holds them, that dtype's name
        (``bfloat16``): its lookups ask for it, its gradients go in it."""

    def add(self, spec: TableSpec, wire: str | None) -> None:
        """Takes a table: its ``spec``, and the dtype its rows travel in when narrower."""
        self.specs[spec.name] = spec
        if wire is not None:
            self.wire[spec.name] = wire
        self.partitions[spec.name] = Partition(spec.partition, spec.num_embeddings, self.num_shards)

    def group(
        self, name: str, ids: torch.Tensor, check: TableModule | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Split]:
        """``ids``' unique ids grouped by shard, where each id is among them, and each shard's
        share as a slice of them: one pass of :func:`psflow.sparse.kernels.group_ids`, or
        ``torch.unique`` and :meth:`Partition.split`. With ``check`` (the table), their range
        is checked too (:meth:`TableModule.check_range`), in the same pass."""
        partition = self.partitions[name]
        limit = self.specs[name].num_embeddings if check is not None else None
        grouped = kernels.group_ids(ids, partition, limit)
        if isinstance(grouped, int):  # outside the table
            assert check is not None
            check.check_range(grouped, grouped)
            raise AssertionError(f"id {grouped} is in range")  # check_range raised
        if grouped is not None:
            unique, positions, counts = grouped
        else:
            if check is not None and ids.numel():
                check.check_range(*torch.aminmax(ids))
            unique, positions = torch.unique(ids, return_inverse=True)
            split = partition.split(unique)
            if len(split) > 1:  # shard after shard: where each unique id went
                order = torch.cat([at for _, at in split.values()])
                where = torch.empty_like(order)
                where[order] = torch.arange(order.numel())
                unique, positions = unique[order], where[positions]
            counts = [0] * partition.num_shards
            for s, (shard_ids, _) in split.items():
                counts[s] = shard_ids.numel()
        out: Split = {}
        start = 0
        for s, count in enumerate(counts):
            if count:
                out[s] = (unique[start : start + count], slice(start, start + count))
                start += count
        return unique, positions, out

    def check_parts(self, name: str, split: Split, parts: dict[int, torch.Tensor]) -> None:
        """Raises ``ValueError`` when a shard of ``split`` is missing from ``parts`` or sent
        rows of the wrong shape or dtype."""
        spec = self.specs[name]
        dtype = getattr(torch, self.wire.get(name, spec.dtype))
        if set(parts) != set(split):
            raise ValueError(f"rows of {name!r} came from ps {sorted(parts)}, not {sorted(split)}")
        for s, (shard_ids, _) in split.items():
            values = parts[s]
            if values.shape != (shard_ids.shape[0], spec.embedding_dim) or values.dtype != dtype:
                raise ValueError(
                    f"ps:{s} sent rows of {name!r} shaped {list(values.shape)} "
                    f"{values.dtype}; expected [{shard_ids.shape[0]}, {spec.embedding_dim}] {dtype}"
                )

    @staticmethod
    def joined(
        split: Split, parts: dict[int, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each shard's rows of its share of the ids (``split``), checked
        (:meth:`check_parts`), in one tensor, shard after shard: ``out`` (rows, dim) when
        given, where rows received into their place stay."""
        if out is None:
            if len(parts) == 1:
                return next(iter(parts.values()))
            return torch.cat([parts[s] for s in split])
        for s, (_, at) in split.items():
            if not isinstance(at, slice) or parts[s].data_ptr() != out[at].data_ptr():
                out[at] = parts[s]  # came by socket
        return out

    def widened(
        self, name: str, split: Split, parts: dict[int, torch.Tensor], views: bool
    ) -> list[torch.Tensor]:
        """Rows that came narrower than the table holds them (:attr:`wire`), each shard's
        part cast back to its dtype as it is copied out of where it came: a part each with
        ``views``, else one tensor of them all, shard after shard."""
        dtype = getattr(torch, self.specs[name].dtype)
        if views:
            return [parts[s].to(dtype) for s in split]
        rows = sum(parts[s].shape[0] for s in split)
        out = torch.empty((rows, self.specs[name].embedding_dim), dtype=dtype)
        start = 0
        for s in split:
            n = parts[s].shape[0]
            out[start : start + n].copy_(parts[s])
            start += n
        return [out]

    def row_dtypes(self, tables: dict[int, list[str]]) -> dict[int, dict[str, str]]:
        """Per shard, the dtypes that the rows of ``tables[shard]`` it is asked for travel in
        (:attr:`~psflow.protocol.Key.ROW_DTYPES`), for the tables of :attr:`wire` among them."""
        out = {}
        for s, names in tables.items():
            narrow = {n: self.wire[n] for n in names if n in self.wire}
            if narrow:
                out[s] = narrow
        return out
