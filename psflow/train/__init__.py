"""Training supervision: the monitored session, checkpoints, summaries, hooks.

- ``session.py``: :class:`TrainingSession` (alias :data:`MonitoredTrainingSession`); its
  settings in ``session_config.py`` (:class:`SessionConfig`, nesting
  :class:`CheckpointConfig` and :class:`SummaryConfig`), its restore at start and recovery
  from a lost ps in ``restoring.py``, its stop on SIGTERM/Ctrl-C in ``stopping.py``.
- ``alone.py``: a cluster of one (no cluster given): :class:`~psflow.train.alone.LocalEngine`
  and :class:`~psflow.train.alone.LocalTables`, the ps's parts in the session's process.
- ``checkpoint.py``: :class:`Checkpointer` (saving through the ps); re-exports
  :func:`load_checkpoint` and :class:`Checkpoint` (``checkpoint_read.py``: a checkpoint read
  back whole) and :func:`export_state_dict` (``checkpoint_export.py``); ``checkpoint_check.py``:
  the checks every reader of a checkpoint makes, in one place.
- ``manifest.py``: :class:`CheckpointDir` (``latest`` pointer, retention), :class:`Manifest`.
- ``local_shard.py``: :class:`~psflow.train.local_shard.LocalShard`, all-reduce mode's
  checkpoints (the chief's own model and optimizer saved and restored as one ps shard).
- ``hooks.py``: :class:`Hook`, :class:`StepContext`, :class:`Session` (what a hook sees of
  its session), :class:`StopAtStepHook`, :class:`NanGuardHook` (:class:`NanLossError`),
  :class:`LoggingHook`.
- ``evaluator.py``: :class:`Evaluator` (the ``evaluator`` task: every checkpoint scored into
  TensorBoard), :class:`EvalResult`.
- ``summary.py``: :class:`SummaryHook` (TensorBoard event files).
- ``mode_stats.py``: :class:`ModeStatsHook` (sync drops, staleness, waits as summaries).
- ``cli.py``: ``psflow checkpoint inspect|export``.
- ``tf_checkpoint.py``: :class:`~psflow.train.tf_checkpoint.TFCheckpoint`, TensorFlow's
  checkpoints read without TensorFlow (tables in id order, optimizer slots as torch's state);
  ``tf_reader.py``: :class:`~psflow.train.tf_reader.BundleReader`, its base (the tensors, by
  key or variable name, checked); ``tf_objects.py``: a TensorFlow 2 checkpoint's object graph
  (Keras's variables and slots); ``tf_bundle.py``: a checkpoint's index and entries;
  ``tf_proto.py``: protobuf's wire format.

The shard-file format the ps tasks write is in :mod:`psflow.ps.shard_file`.
"""

from psflow.train.checkpoint import Checkpoint, Checkpointer, export_state_dict, load_checkpoint
from psflow.train.evaluator import EvalResult, Evaluator
from psflow.train.hooks import (
    Hook,
    LoggingHook,
    NanGuardHook,
    NanLossError,
    Session,
    StepContext,
    StopAtStepHook,
)
from psflow.train.manifest import CheckpointDir, Manifest
from psflow.train.mode_stats import ModeStatsHook
from psflow.train.session import MonitoredTrainingSession, TrainingSession
from psflow.train.session_config import (
    CheckpointConfig,
    ExportConfig,
    SessionConfig,
    SummaryConfig,
)
from psflow.train.summary import SummaryHook

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointDir",
    "Checkpointer",
    "EvalResult",
    "Evaluator",
    "ExportConfig",
    "Hook",
    "LoggingHook",
    "Manifest",
    "ModeStatsHook",
    "MonitoredTrainingSession",
    "NanGuardHook",
    "NanLossError",
    "Session",
    "SessionConfig",
    "StepContext",
    "StopAtStepHook",
    "SummaryConfig",
    "SummaryHook",
    "TrainingSession",
    "export_state_dict",
    "load_checkpoint",
]
