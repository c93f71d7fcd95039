"""Drop-in ``torch.nn`` modules whose parameters a worker can leave on the parameter servers.

- ``config.py``: :class:`TableConfig`, a table described once (size, initial rows, dtype,
  partition, row-wise optimizer, hashed-table admission and eviction), from which a module is
  built and the :class:`~psflow.protocol.TableSpec` a ps creates is derived.
- ``embedding.py``: :class:`Embedding` and :class:`EmbeddingBag`, ``torch.nn.Embedding`` and
  ``torch.nn.EmbeddingBag`` with the same arguments and arithmetic, plus hashed tables.
- ``table.py``: their base :class:`TableModule` (``spec(name)``, ``attach(source)``, the forward
  pass's parts), and :class:`RowSource`, where an attached table's rows come from.
- ``state.py``: what a table module holds on this process (its weight's optimizer state, a
  hashed table's rows, trained here in the backward pass) and saves in a state dict.
- ``gather.py``: an attached table's rows gathered, and their gradients scatter-added, by
  :mod:`psflow.sparse.kernels`.
- ``frozen.py``: a table in eval mode (a hashed table reads a snapshot of its rows: zeros for
  an id it does not hold), and what ``torch.jit.trace``, ``torch.export`` and ONNX may record
  of a table (the rest refused, saying what to use instead).
- :class:`RowOptimizerSpec`: :mod:`psflow.protocol`'s, a row-wise optimizer with its arguments,
  here so that a model's script needs only ``psflow.nn``.

It imports only torch, :mod:`psflow.protocol` and :mod:`psflow.sparse`.
"""

from psflow.nn.config import TableConfig
from psflow.nn.embedding import Embedding, EmbeddingBag
from psflow.nn.table import RowSource, RowSourceReplaced, TableModule
from psflow.protocol import RowOptimizerSpec

__all__ = [
    "Embedding",
    "EmbeddingBag",
    "RowOptimizerSpec",
    "RowSource",
    "RowSourceReplaced",
    "TableConfig",
    "TableModule",
]
