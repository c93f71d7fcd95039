"""psflow: parameter-server training for PyTorch.

A training script, in full (``psflow launch --ps 1 --workers 2 train.py`` runs it)::

    import psflow, torch

    ctx, argv = psflow.resolve()            # flags, TF_CONFIG or a cluster file
    if ctx.job == "ps":
        psflow.ParameterServer(ctx).join()  # serves until every worker is done
    else:
        model = torch.nn.Linear(1, 1)
        with psflow.DistributedOptimizer(model, ctx, optimizer="SGD", lr=0.001) as opt:
            for x, y in data:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()

The public API, by layer: cluster (:class:`ClusterSpec`, :class:`TaskSpec`,
:class:`TaskContext`, :func:`resolve`), ps (:class:`ParameterServer`), protocol (:class:`OptimizerSpec`, :class:`ScheduleSpec`),
worker (:class:`DistributedOptimizer` in async, sync or all-reduce mode, :class:`Towers`), train (:class:`TrainingSession` and its hooks,
checkpoints), transport (:class:`TransportConfig`, errors). Data (TFRecord, Example, Spark) is
in :mod:`psflow.data`, deployment templates in :mod:`psflow.deploy`.
"""

from psflow.cluster import ClusterSpec, TaskContext, TaskSpec, resolve
from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.ps import ParameterServer
from psflow.train import (
    Hook,
    LoggingHook,
    ModeStatsHook,
    MonitoredTrainingSession,
    NanGuardHook,
    NanLossError,
    SessionConfig,
    StopAtStepHook,
    TrainingSession,
    export_state_dict,
    load_checkpoint,
)
from psflow.transport import PeerError, PeerTimeoutError, TransportConfig
from psflow.worker import DistributedOptimizer, ModeConfig, SyncTimeoutError, Towers

__version__ = "0.1.0"

__all__ = [
    "ClusterSpec",
    "DistributedOptimizer",
    "Hook",
    "LoggingHook",
    "ModeConfig",
    "ModeStatsHook",
    "MonitoredTrainingSession",
    "NanGuardHook",
    "NanLossError",
    "OptimizerSpec",
    "ParameterServer",
    "PeerError",
    "PeerTimeoutError",
    "ScheduleSpec",
    "SessionConfig",
    "StopAtStepHook",
    "SyncTimeoutError",
    "TaskContext",
    "TaskSpec",
    "Towers",
    "TrainingSession",
    "TransportConfig",
    "__version__",
    "export_state_dict",
    "load_checkpoint",
    "resolve",
]
