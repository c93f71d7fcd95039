"""The rows a table spec needs on one shard: :func:`make_rows`."""

from __future__ import annotations

from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse.fixed import FixedRows
from psflow.sparse.hashed import HashedRows
from psflow.sparse.rows import Rows


def make_rows(
    spec: TableSpec, shard: int, num_shards: int, *, optimizer: RowOptimizerSpec | None = None
) -> Rows:
    """:class:`FixedRows` or :class:`HashedRows`, as the spec says."""
    cls = HashedRows if spec.hashed else FixedRows
    return cls(spec, shard, num_shards, optimizer=optimizer)
