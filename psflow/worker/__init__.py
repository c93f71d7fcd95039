"""The worker side: placing parameters on shards, pulling and pushing them, training.

- ``placement.py``: :class:`Placement`, :func:`place` (``greedy`` by bytes, ``round_robin``;
  partitioning), :class:`Piece`, :class:`ParamInfo`.
- ``client.py``: :class:`ShardedClient`, every request a worker makes, to all shards at once.
- ``calls.py``: :class:`~psflow.worker.calls.ShardCalls`, the round trips underneath: one
  request per shard sent at once, the replies awaited together, a lost ps's refusal raised as
  :class:`~psflow.transport.PeerLostError`.
- ``exchange.py``: :class:`ParameterExchange`, a model's parameters on the ps: initial values,
  gradients per shard, pulled values back into the model.
- ``modes.py``: :class:`ModeConfig` (the mode and its settings), :class:`Engine` (what every
  mode provides), :class:`SyncTimeoutError`.
- ``engine.py``: :class:`AsyncEngine` (the default mode) and the base of every mode with a ps.
- ``sync.py``: :class:`SyncEngine`, synchronous steps with backup workers.
- ``staleness.py``: :class:`StalenessEngine`, bounded staleness.
- ``allreduce.py``: :class:`~psflow.worker.allreduce.AllReduceEngine`, ``mode="allreduce"``
  over torch.distributed (imported when used).
- ``config.py``: :class:`OptimizerConfig`, what a :class:`DistributedOptimizer` trains
  with (the optimizer, its schedule, the mode, the placement, the transport) as one object.
- ``optimizer.py``: :class:`DistributedOptimizer`, the training API: a composition of the
  above.
- ``tables.py``: :class:`TableClient`, a model's :mod:`psflow.nn` embedding tables on the
  ps: rows pulled by id at forward time, row gradients pushed with the step;
  ``row_layout.py``: :class:`~psflow.worker.row_layout.TableLayout`, the tables as requests
  see them (ids grouped by shard, the rows that come back checked and joined);
  ``prefetch.py``: :class:`~psflow.worker.prefetch.RowPrefetch`, a coming batch's rows
  riding the step; ``lookups.py``: :class:`~psflow.worker.lookups.Lookups`, the lookups the
  next step pushes (kept across ``zero_grad()``).
- ``staging.py``: :class:`~psflow.worker.staging.Staging`, a GPU model's copies to and from
  the host through pinned memory, the host waiting for the device once a step.
- ``towers.py``: :class:`Towers`, one batch split across several local devices.
- ``stages.py``: :class:`Stages`, one model split across several local devices, run in
  micro-batches (GPipe).
"""

from psflow.worker.client import ShardedClient
from psflow.worker.config import OptimizerConfig
from psflow.worker.engine import AsyncEngine
from psflow.worker.exchange import ParameterExchange
from psflow.worker.modes import MODES, Engine, Mode, ModeConfig, SyncTimeoutError
from psflow.worker.optimizer import DistributedOptimizer
from psflow.worker.placement import ParamInfo, Piece, Placement, place, shard_bytes
from psflow.worker.stages import Stages
from psflow.worker.staleness import StalenessEngine
from psflow.worker.sync import SyncEngine
from psflow.worker.tables import TableClient
from psflow.worker.towers import Towers

__all__ = [
    "MODES",
    "AsyncEngine",
    "DistributedOptimizer",
    "Engine",
    "Mode",
    "ModeConfig",
    "OptimizerConfig",
    "ParamInfo",
    "ParameterExchange",
    "Piece",
    "Placement",
    "ShardedClient",
    "Stages",
    "StalenessEngine",
    "SyncEngine",
    "SyncTimeoutError",
    "TableClient",
    "Towers",
    "place",
    "shard_bytes",
]
