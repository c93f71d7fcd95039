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
:class:`TaskContext`, :func:`resolve`, :func:`resolve_or_alone`, :class:`Mode`), ps
(:class:`ParameterServer`), protocol (:class:`OptimizerSpec`, :class:`ScheduleSpec`), worker
(:class:`DistributedOptimizer` in async, sync or all-reduce mode, :class:`ModeConfig`,
:class:`Towers`, :class:`Stages`), train (:class:`TrainingSession` and its hooks, checkpoints,
:class:`Evaluator`), transport (:class:`TransportConfig`, errors), and :func:`auc`, the metric a
click-through-rate script reports. Data (TFRecord, Example, Spark, the CTR and text readers) is
in :mod:`psflow.data`, deployment templates in :mod:`psflow.deploy`, embedding tables that can
live on the ps (``psflow.nn.Embedding``, ``psflow.nn.EmbeddingBag``, ``psflow.nn.TableConfig``,
``psflow.nn.RowOptimizerSpec``) in :mod:`psflow.nn`. One reference page lists it all:
``docs/api.md``.

``import psflow`` imports nothing heavy: each name above is imported on first use, so that
``psflow --help``, ``psflow launch`` and a task's ``psflow.resolve()`` do not wait for torch and
ZeroMQ to load (about 2 s on a small machine) before they need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it, imported when the name is first used (PEP 562).
_EXPORTS = {
    "ClusterSpec": "psflow.cluster",
    "TaskContext": "psflow.cluster",
    "TaskSpec": "psflow.cluster",
    "resolve": "psflow.cluster",
    "resolve_or_alone": "psflow.cluster",
    "Mode": "psflow.cluster.modes",
    "auc": "psflow.data.auc",
    "OptimizerSpec": "psflow.protocol",
    "ScheduleSpec": "psflow.protocol",
    "ParameterServer": "psflow.ps",
    "ServerConfig": "psflow.ps",
    "Evaluator": "psflow.train",
    "Hook": "psflow.train",
    "LoggingHook": "psflow.train",
    "ModeStatsHook": "psflow.train",
    "MonitoredTrainingSession": "psflow.train",
    "NanGuardHook": "psflow.train",
    "NanLossError": "psflow.train",
    "SessionConfig": "psflow.train",
    "CheckpointConfig": "psflow.train",
    "SummaryConfig": "psflow.train",
    "StopAtStepHook": "psflow.train",
    "TrainingSession": "psflow.train",
    "export_state_dict": "psflow.train",
    "load_checkpoint": "psflow.train",
    "PeerError": "psflow.transport",
    "PeerTimeoutError": "psflow.transport",
    "TransportConfig": "psflow.transport",
    "DistributedOptimizer": "psflow.worker",
    "ModeConfig": "psflow.worker",
    "OptimizerConfig": "psflow.worker",
    "SyncTimeoutError": "psflow.worker",
    "Towers": "psflow.worker",
    "Stages": "psflow.worker",
}

# Subpackages reachable as attributes (``psflow.data.TFRecordReader``) after ``import psflow``.
_SUBPACKAGES = frozenset(
    (
        "allocator",
        "cluster",
        "data",
        "deploy",
        "env",
        "nn",
        "protocol",
        "ps",
        "train",
        "transport",
        "worker",
    )
)

__all__ = [
    "CheckpointConfig",
    "ClusterSpec",
    "DistributedOptimizer",
    "Evaluator",
    "Hook",
    "LoggingHook",
    "Mode",
    "ModeConfig",
    "ModeStatsHook",
    "MonitoredTrainingSession",
    "NanGuardHook",
    "NanLossError",
    "OptimizerConfig",
    "OptimizerSpec",
    "ParameterServer",
    "PeerError",
    "PeerTimeoutError",
    "ScheduleSpec",
    "ServerConfig",
    "SessionConfig",
    "Stages",
    "StopAtStepHook",
    "SummaryConfig",
    "SyncTimeoutError",
    "TaskContext",
    "TaskSpec",
    "Towers",
    "TrainingSession",
    "TransportConfig",
    "__version__",
    "auc",
    "export_state_dict",
    "load_checkpoint",
    "resolve",
    "resolve_or_alone",
]

if TYPE_CHECKING:
    from psflow.cluster import ClusterSpec, TaskContext, TaskSpec
    from psflow.cluster.modes import Mode
    from psflow.cluster.resolve import resolve, resolve_or_alone
    from psflow.data.auc import auc
    from psflow.protocol import OptimizerSpec, ScheduleSpec
    from psflow.ps import ParameterServer, ServerConfig
    from psflow.train import (
        CheckpointConfig,
        Evaluator,
        Hook,
        LoggingHook,
        ModeStatsHook,
        MonitoredTrainingSession,
        NanGuardHook,
        NanLossError,
        SessionConfig,
        StopAtStepHook,
        SummaryConfig,
        TrainingSession,
        export_state_dict,
        load_checkpoint,
    )
    from psflow.transport import PeerError, PeerTimeoutError, TransportConfig
    from psflow.worker import (
        DistributedOptimizer,
        ModeConfig,
        OptimizerConfig,
        Stages,
        SyncTimeoutError,
        Towers,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES})
