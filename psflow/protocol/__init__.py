"""The protocol between tasks: its vocabulary and the settings that travel as data.

Both sides import it (the ps serves these requests, the worker makes them, the transport frames
them), and it imports nothing of psflow: it sits under every other layer.

- ``messages.py``: :class:`Op` (every request and reply), :class:`Code` (every kind of
  refusal), :class:`Key` (every header key), :class:`SaveState`, :data:`PROTOCOL_VERSION`; :data:`WORKER_TIMEOUT` and
  :data:`HEARTBEATS_PER_TIMEOUT`, the liveness both sides agree on.
- ``specs.py``: :class:`OptimizerSpec`, a ``torch.optim`` optimizer named with its arguments;
  :class:`ScheduleSpec`, a ``torch.optim.lr_scheduler`` schedule named with its arguments, and
  :class:`StepSchedule`, the scheduler it builds, driven by the global step.
- ``tables.py``: :class:`TableSpec`, a sparse embedding table held by the ps;
  :class:`RowOptimizerSpec`, how its rows are updated (one of :data:`ROW_OPTIMIZERS`);
  :data:`PARTITIONS`, how its ids map to shards.
"""

from psflow.protocol.messages import (
    HEARTBEATS_PER_TIMEOUT,
    PROTOCOL_VERSION,
    WORKER_TIMEOUT,
    Code,
    Key,
    Op,
    SaveState,
)
from psflow.protocol.specs import OptimizerSpec, ScheduleSpec, StepSchedule
from psflow.protocol.tables import PARTITIONS, ROW_OPTIMIZERS, RowOptimizerSpec, TableSpec

__all__ = [
    "HEARTBEATS_PER_TIMEOUT",
    "PARTITIONS",
    "PROTOCOL_VERSION",
    "ROW_OPTIMIZERS",
    "WORKER_TIMEOUT",
    "Code",
    "Key",
    "Op",
    "OptimizerSpec",
    "RowOptimizerSpec",
    "SaveState",
    "ScheduleSpec",
    "StepSchedule",
    "TableSpec",
]
