"""The parameter server: one shard's variables, its optimizer, and the serving loop.

- ``store.py``: :class:`ShardStore` (variables, optimizer, step), :class:`OptimizerSpec`.
- ``server.py``: :class:`ParameterServer`, which serves a shard until every worker is done.
"""

from psflow.ps.server import ParameterServer
from psflow.ps.store import OptimizerSpec, ShardStore

__all__ = ["OptimizerSpec", "ParameterServer", "ShardStore"]
