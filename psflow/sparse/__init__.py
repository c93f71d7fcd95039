"""Sparse embedding tables on the ps: rows, their initial values, shards and row-wise updates.

Pure torch, no sockets: the ps holds a :class:`Rows` per table it serves, and a local
``psflow.nn`` module uses the same pieces, so a table starts and learns the same wherever it is.

- ``init.py``: :func:`initial_rows`, a row's initial values from ``(seed, id, column)`` alone.
- ``partition.py``: :class:`Partition`, which shard holds an id and where (``mod``/``div``);
  :func:`coalesce`, row gradients summed per id.
- ``optim.py``: :class:`RowOptimizer`, the row-wise SGD, Adagrad, lazy Adam and FTRL updates.
- ``idmap.py``: :class:`IdMap`, a hashed table's id -> slot map in tensors (open addressing).
- ``mapped.py``: :class:`~psflow.sparse.mapped.MappedIds`, a table's ids as each task last
  looked them up, with their rows, for its push of the same ids.
- ``admission.py``: :class:`~psflow.sparse.admission.Admission`, a hashed table's count of the
  pushes of ids it does not hold yet (a count-min sketch).
- ``kernels.py`` (+ ``_kernels.c`` binding ``_rows.c``, ``_ids.c``, ``_init.c`` and
  ``_sketch.c``, optional): the row kernels in C, fused row-wise updates, row gathers and their
  gradient, ids grouped and indexed by shard, the id map's probes, initial rows' hashes, the
  admission counts; torch's index operations where they were not built or
  ``PSFLOW_KERNELS=0``.
- ``rows.py``: :class:`Rows`, one shard's part of one table (the interface, shared checks).
- ``fixed.py``: :class:`FixedRows` (dense, a range of ids).
- ``hashed.py``: :class:`HashedRows` (any int64 id, rows made on first update, admission and
  eviction); ``growth.py``: :class:`~psflow.sparse.growth.Columns`, its tensors grown together
  (in place, in a reservation, past a size); ``evict.py``:
  :class:`~psflow.sparse.evict.EvictionPool`, the least recently updated rows a full one
  evicts next.
- ``make.py``: :func:`make_rows`, the one a :class:`~psflow.protocol.TableSpec` needs.
- ``snapshot.py``: :class:`~psflow.sparse.snapshot.RowSnapshot`, a table's rows at one moment
  (a checkpoint's), taken without a pause.
"""

from psflow.sparse.fixed import FixedRows
from psflow.sparse.hashed import HashedRows
from psflow.sparse.idmap import IdMap
from psflow.sparse.init import initial_rows
from psflow.sparse.make import make_rows
from psflow.sparse.optim import RowOptimizer
from psflow.sparse.partition import Partition, coalesce
from psflow.sparse.rows import Rows

__all__ = [
    "FixedRows",
    "HashedRows",
    "IdMap",
    "Partition",
    "RowOptimizer",
    "Rows",
    "coalesce",
    "initial_rows",
    "make_rows",
]
