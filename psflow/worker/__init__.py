"""The worker side: placing parameters on shards, pulling and pushing them, training.

- ``placement.py``: :func:`place` (``greedy`` by bytes, ``round_robin``; partitioning).
- ``client.py``: :class:`ShardedClient`, requests to every shard at once.
- ``optimizer.py``: :class:`DistributedOptimizer`, the training API.
"""

from psflow.worker.client import ShardedClient
from psflow.worker.optimizer import DistributedOptimizer
from psflow.worker.placement import ParamInfo, Piece, place, shard_bytes

__all__ = ["DistributedOptimizer", "ParamInfo", "Piece", "ShardedClient", "place", "shard_bytes"]
