"""The parameter server: one shard's variables, its optimizer, and the serving loop.

- ``server.py``: :class:`ParameterServer`, which serves a shard until every worker is done; it
  dispatches each request to the service registered for its op, and serves the shard's own
  ops (status, init, pull, push, push_pull, done).
- ``service.py``: :class:`Service` (ops and lifecycle callbacks), :class:`ServiceHost` (what a
  service may use of the server), :data:`Handler`, :class:`RequestError` and
  :class:`NotInitializedError` (a refusal and its :class:`~psflow.protocol.Code`).
- ``store.py``: :class:`ShardStore` (variables, optimizer, step).
- ``sync.py``: :class:`SyncAggregator` (synchronous steps, backup workers, decisions shared by
  the shards), :class:`SyncService` (its ops, and bounded staleness's), :class:`StepOvertakenError`.
- ``staleness.py``: :class:`ClockTable`, bounded staleness for asynchronous training.
- ``checkpoint.py``: the shard file format, :class:`ShardCheckpointer` (snapshot, background
  write), :class:`CheckpointService` (its ops).
- ``files.py``: local paths and fsspec URLs, atomic writes (shared with :mod:`psflow.train`).
"""

from psflow.ps.checkpoint import CheckpointService, ShardCheckpointer
from psflow.ps.server import ParameterServer
from psflow.ps.service import Handler, NotInitializedError, RequestError, Service, ServiceHost
from psflow.ps.staleness import ClockTable
from psflow.ps.store import ShardStore
from psflow.ps.sync import StepOvertakenError, SyncAggregator, SyncService

__all__ = [
    "CheckpointService",
    "ClockTable",
    "Handler",
    "NotInitializedError",
    "ParameterServer",
    "RequestError",
    "Service",
    "ServiceHost",
    "ShardCheckpointer",
    "ShardStore",
    "StepOvertakenError",
    "SyncAggregator",
    "SyncService",
]
