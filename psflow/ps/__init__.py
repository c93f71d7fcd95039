"""The parameter server: one shard's variables, its optimizer, and the serving loop.

- ``server.py``: :class:`ParameterServer`, which serves a shard until every worker is done: the
  serving loop, the dispatch of each request to the service registered for its op, liveness,
  start, stop and join; its settings in ``config.py`` (:class:`ServerConfig`).
- ``host.py``: :class:`~psflow.ps.host.TransportHost`, what services use of the server's socket
  (a request's tensors, the reply, an error).
- ``sigterm.py``: :class:`~psflow.ps.sigterm.Termination`, serving on after SIGTERM while the
  workers still ask.
- ``liveness.py``: :class:`~psflow.ps.liveness.Liveness`, who has been heard from; who is dead.
- ``service.py``: :class:`Service` (ops and lifecycle callbacks), :class:`ServiceHost` (what a
  service may use of the server), :data:`Handler`.
- ``errors.py``: :class:`RequestError` (a refusal and its :class:`~psflow.protocol.Code`),
  :class:`NotInitializedError`, :class:`InputOvertakenError`.
- ``status.py``: :class:`StatusService`, the ``hello``, ``status``, ``heartbeat`` and ``done``
  ops.
- ``init.py``: :class:`InitService`, the chief's ``init`` (the shard's values, optimizer,
  schedule and tables, or a restore).
- ``exchange.py``: :class:`ExchangeService`, ``pull``, ``push`` and ``push_pull`` (the hot path).
- ``native.py``: :class:`~psflow.ps.native.NativeLookup`, lookups served from the request's
  bytes in one C call (the Python path serves and refuses the rest); ``native_push.py``:
  :class:`~psflow.ps.native_push.NativePush`, the tables' part of pushes the same way;
  ``native_rows.py``: what both take from the kernels (their jobs' rows, the ids not held, a
  reply's buffers and casts).
- ``tables.py``: the embedding tables on a shard (:func:`~psflow.ps.tables.build_tables`, row
  gradients, restore), :class:`TableService` (``lookup``, ``table_status``).
- ``row_wire.py``: rows and row gradients on the wire narrower than their table
  (:func:`~psflow.ps.row_wire.row_dtypes`, :func:`~psflow.ps.row_wire.narrowed`), for both paths.
- ``store.py``: :class:`ShardStore` (variables, optimizer, step).
- ``sync.py``: :class:`SyncAggregator` (synchronous steps, backup workers, decisions shared by
  the shards), :class:`SyncService` (its ops, and bounded staleness's), :class:`StepOvertakenError`.
- ``staleness.py``: :class:`ClockTable`, bounded staleness for asynchronous training.
- ``checkpoint.py``: :class:`ShardCheckpointer` (snapshot, background write),
  :class:`CheckpointService` (its ops).
- ``exports.py``: the ``export`` and ``export_status`` ops: a shard's rows changed since the
  last export and the ids evicted since (or all of them: a base), written in the background in
  :mod:`psflow.serve`'s format.
- ``shard_file.py``: the shard file format: :class:`~psflow.ps.shard_file.ShardSnapshot`
  (:func:`~psflow.ps.shard_file.snapshot`), written and read back
  (:class:`~psflow.ps.shard_file.ShardFile`).
- ``optimizer_state.py``: a shard's optimizer state as named tensors and plain data, and back.
- ``files.py``: local paths and fsspec URLs, atomic writes (shared with :mod:`psflow.train`).
"""

from psflow.ps.checkpoint import CheckpointService, ShardCheckpointer
from psflow.ps.config import ServerConfig
from psflow.ps.errors import InputOvertakenError, NotInitializedError, RequestError
from psflow.ps.exchange import ExchangeService
from psflow.ps.init import InitService
from psflow.ps.server import ParameterServer
from psflow.ps.service import Handler, Service, ServiceHost
from psflow.ps.staleness import ClockTable
from psflow.ps.status import StatusService
from psflow.ps.store import ShardStore
from psflow.ps.sync import StepOvertakenError, SyncAggregator, SyncService
from psflow.ps.tables import TableService

__all__ = [
    "CheckpointService",
    "ClockTable",
    "ExchangeService",
    "Handler",
    "InitService",
    "InputOvertakenError",
    "NotInitializedError",
    "ParameterServer",
    "RequestError",
    "ServerConfig",
    "Service",
    "ServiceHost",
    "ShardCheckpointer",
    "ShardStore",
    "StatusService",
    "StepOvertakenError",
    "SyncAggregator",
    "SyncService",
    "TableService",
]
