"""The rows a table spec needs on one shard: :func:`make_rows`."""

from __future__ import annotations

import time
from collections.abc import Callable

from psflow.protocol import RowOptimizerSpec, TableSpec
from psflow.sparse.fixed import FixedRows
from psflow.sparse.hashed import HashedRows
from psflow.sparse.rows import Rows


def make_rows(
    spec: TableSpec,
    shard: int,
    num_shards: int,
    *,
    optimizer: RowOptimizerSpec | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Rows:
    """:class:`FixedRows` or :class:`HashedRows`, as the spec says; ``clock`` is what a hashed
    table's ``ttl_seconds`` is measured by (seconds)."""
    if spec.hashed:
        return HashedRows(spec, shard, num_shards, optimizer=optimizer, clock=clock)
    return FixedRows(spec, shard, num_shards, optimizer=optimizer)
