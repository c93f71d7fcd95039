"""The parameter server: one shard's variables, its optimizer, and the serving loop.

- ``store.py``: :class:`ShardStore` (variables, optimizer, step).
- ``server.py``: :class:`ParameterServer`, which serves a shard until every worker is done.
- ``sync.py``: :class:`SyncAggregator` (synchronous steps, backup workers, decisions shared by
  the shards), :class:`SyncService` (its ops on the server).
- ``staleness.py``: :class:`ClockTable`, bounded staleness for asynchronous training.
"""

from psflow.ps.server import ParameterServer
from psflow.ps.staleness import ClockTable
from psflow.ps.store import ShardStore
from psflow.ps.sync import SyncAggregator, SyncService

__all__ = [
    "ClockTable",
    "ParameterServer",
    "ShardStore",
    "SyncAggregator",
    "SyncService",
]
