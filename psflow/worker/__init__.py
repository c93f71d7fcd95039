"""The worker side: placing parameters on shards, pulling and pushing them, training.

- ``placement.py``: :func:`place` (``greedy`` by bytes, ``round_robin``; partitioning).
- ``client.py``: :class:`ShardedClient`, requests to every shard at once.
- ``optimizer.py``: :class:`DistributedOptimizer`, the training API.
- ``sync.py``: training modes: :class:`ModeConfig`, synchronous steps with backup workers,
  bounded staleness, :class:`SyncTimeoutError`.
- ``allreduce.py``: ``mode="allreduce"`` over torch.distributed (imported when used).
- ``towers.py``: :class:`Towers`, one batch split across several local devices.
"""

from psflow.worker.client import ShardedClient
from psflow.worker.optimizer import DistributedOptimizer
from psflow.worker.placement import ParamInfo, Piece, place, shard_bytes
from psflow.worker.sync import MODES, ModeConfig, SyncTimeoutError
from psflow.worker.towers import Towers

__all__ = [
    "MODES",
    "DistributedOptimizer",
    "ModeConfig",
    "ParamInfo",
    "Piece",
    "ShardedClient",
    "SyncTimeoutError",
    "Towers",
    "place",
    "shard_bytes",
]
