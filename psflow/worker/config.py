"""What a :class:`~psflow.worker.DistributedOptimizer` trains with, as one object:
:class:`OptimizerConfig`, which nests the mode's settings (:class:`~psflow.worker.ModeConfig`),
the placement and the transport's.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from psflow import env as envvars
from psflow.cluster.spec import TaskContext
from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.transport import TransportConfig
from psflow.worker.modes import Mode, ModeConfig
from psflow.worker.placement import Piece, Placement

READY_TIMEOUT = 300.0
"""Seconds a worker waits for the ps and the chief by default (``PSFLOW_READY_TIMEOUT``)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer the ps apply and how the workers reach them.

    The common case is one line of keywords (:meth:`of`); each field is also a settings
    object of its own, built and checked once.

    Example:
        >>> cfg = OptimizerConfig.of(optimizer="Adam", lr=1e-3, mode="sync")
        >>> cfg.optimizer.name, cfg.optimizer.lr, cfg.mode.mode
        ('Adam', 0.001, <Mode.SYNC: 'sync'>)
    """

    optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec.of("SGD"))
    """The ``torch.optim`` optimizer of the dense parameters, applied on the ps (the tables'
    row-wise optimizers are theirs, :class:`~psflow.nn.TableConfig`)."""
    lr_schedule: ScheduleSpec | None = None
    """A ``torch.optim.lr_scheduler`` schedule the ps apply by the global step."""
    mode: ModeConfig = field(default_factory=ModeConfig)
    """How the workers combine their gradients."""
    placement: Placement | Sequence[Piece] = field(default_factory=Placement)
    """Which ps holds each parameter: a strategy, or the pieces one placed."""
    transport: TransportConfig = field(default_factory=TransportConfig.from_env)
    """Timeouts, shared memory, keys (default from the environment)."""
    ready_timeout: float = field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_READY_TIMEOUT, READY_TIMEOUT)
    )
    """Seconds a worker waits, at its start, for the ps and the chief (``PSFLOW_READY_TIMEOUT``,
    else 300)."""
    flush_denormals: bool = field(
        default_factory=lambda: envvars.flag(envvars.PSFLOW_FLUSH_DENORMALS, True)
    )
    """Whether the thread that makes the optimizer (the one that trains) takes subnormal floats
    as zero while it is open, as TensorFlow's runtime does on its threads
    (``PSFLOW_FLUSH_DENORMALS``, else on; the ps tasks' own setting has the same default). A
    value below about 1.2e-38 (float32) then counts as 0. A CTR worker (DeepRec's DLRM shape)
    ran 1.05-1.11x faster with them flushed; where in its step it met them was not measured.
    The last of a thread's open optimizers to ``close()`` gives it back the mode it had before
    the first; off, the mode is left alone."""
    pinned: bool = field(default_factory=lambda: envvars.flag(envvars.PSFLOW_PINNED, True))
    """Whether a model on a CUDA device moves its rows, values and gradients through pinned
    host memory, the host waiting for the device once a step (:mod:`psflow.worker.staging`;
    ``PSFLOW_PINNED``, else on); off, each is a plain copy that waits for the device."""

    def __post_init__(self) -> None:
        kinds: Mapping[str, type | tuple[type, ...]] = {
            "optimizer": OptimizerSpec,
            "lr_schedule": (ScheduleSpec, type(None)),
            "mode": ModeConfig,
            "placement": (Placement, list, tuple),
            "transport": TransportConfig,
        }
        for name, kind in kinds.items():
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise TypeError(
                    f"OptimizerConfig.{name} must be a {_names(kind)}, got {value!r} (give "
                    f"plain values through OptimizerConfig.of(...) or the keywords)"
                )
        for flag in ("flush_denormals", "pinned"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.ready_timeout <= 0:
            raise ValueError(f"ready_timeout must be > 0 seconds, got {self.ready_timeout}")
        if self.lr_schedule is not None:
            self.lr_schedule.check(self.optimizer)  # here, rather than refused by every ps

    @classmethod
    def of(
        cls,
        *,
        optimizer: str | OptimizerSpec = "SGD",
        lr: float | None = None,
        lr_schedule: ScheduleSpec | tuple[str, Mapping[str, Any]] | str | None = None,
        mode: str | Mode | ModeConfig | None = None,
        replicas_to_aggregate: int | None = None,
        total_num_replicas: int | None = None,
        max_staleness: int | None = None,
        sync_timeout: float | None = None,
        overlap: bool | None = None,
        placement: str | Placement | Sequence[Piece] = "greedy",
        partition_bytes: int | None = Placement.partition_bytes,
        transport: TransportConfig | None = None,
        ready_timeout: float | None = None,
        flush_denormals: bool | None = None,
        pinned: bool | None = None,
    ) -> OptimizerConfig:
        """The settings as keywords, each turned into its object here (the one place they are
        spelled as keywords; a misspelt one is a ``TypeError`` naming it).

        Args:
            optimizer: a ``torch.optim`` class name (its arguments other than ``lr`` in an
                :class:`~psflow.protocol.OptimizerSpec`: ``OptimizerSpec.of("SGD", lr=0.1,
                momentum=0.9)``), or the spec.
            lr: the optimizer's learning rate (with a name only).
            lr_schedule: a :class:`~psflow.protocol.ScheduleSpec`, a ``(name, {arguments})``
                pair or a name.
            mode, replicas_to_aggregate, total_num_replicas, max_staleness, sync_timeout,
                overlap: the mode (:meth:`ModeConfig.of`).
            placement, partition_bytes: a strategy (``"greedy"``, ``"round_robin"``) and the
                size above which a parameter is split, or a :class:`Placement`, or the pieces.
            transport: default from the environment.
            ready_timeout: default ``PSFLOW_READY_TIMEOUT``, else 300.
            flush_denormals: default ``PSFLOW_FLUSH_DENORMALS``, else on.
            pinned: default ``PSFLOW_PINNED``, else on.
        """
        if isinstance(optimizer, OptimizerSpec):
            if lr is not None:
                raise ValueError("give lr in the OptimizerSpec, not beside it")
            spec = optimizer
        else:
            spec = OptimizerSpec.of(optimizer, **({} if lr is None else {"lr": lr}))
        if isinstance(placement, str | Placement):
            placement = Placement.of(placement, partition_bytes=partition_bytes)
        elif partition_bytes != Placement.partition_bytes:
            raise ValueError("partition_bytes applies to a placement strategy, not to pieces")
        else:
            placement = list(placement)
        given: dict[str, Any] = {
            "transport": transport,
            "ready_timeout": ready_timeout,
            "flush_denormals": flush_denormals,
            "pinned": pinned,
        }
        return cls(
            optimizer=spec,
            lr_schedule=ScheduleSpec.of(lr_schedule),
            mode=ModeConfig.of(
                mode,
                replicas_to_aggregate=replicas_to_aggregate,
                total_num_replicas=total_num_replicas,
                max_staleness=max_staleness,
                sync_timeout=sync_timeout,
                overlap=overlap,
            ),
            placement=placement,
            **{k: v for k, v in given.items() if v is not None},  # else from the environment
        )


SETTINGS = frozenset(inspect.signature(OptimizerConfig.of).parameters)
"""The keywords :meth:`OptimizerConfig.of` takes."""


def _names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def unknown_setting(
    key: str, known: Collection[str], owner: str, optimizer: object = None
) -> NoReturn:
    """Refuses the keyword ``key``, which no setting of ``owner`` (among ``known``) is called:
    with the closest name, or where an optimizer's own arguments go (in the spec of
    ``optimizer``, the one given beside it, if any).

    Raises:
        ValueError: always.
    """
    close = difflib.get_close_matches(key, known, n=1)
    name = optimizer.name if isinstance(optimizer, OptimizerSpec) else optimizer
    name = name if isinstance(name, str) and hasattr(torch.optim, name) else "SGD"
    takes = set(inspect.signature(getattr(torch.optim, name)).parameters) - {"params"}
    theirs = [key] if key in takes else difflib.get_close_matches(key, takes, n=1)
    if close:
        hint = f"; did you mean {close[0]!r}?"
    elif theirs:
        hint = (
            "; an argument of the optimizer other than lr goes in its spec: "
            f"optimizer=psflow.OptimizerSpec.of({name!r}, lr=..., {theirs[0]}=...)"
        )
    else:
        hint = f"; nor is it an argument of torch.optim.{name}"
    raise ValueError(
        f"unexpected keyword argument {key!r}: no setting of {owner} has that name{hint} "
        f"(the settings: {', '.join(sorted(known))})"
    )


def check_has_ps(ctx: TaskContext, mode: Mode) -> None:
    """Raises ``ValueError`` when ``mode`` trains against ps tasks and the cluster has none."""
    if mode != Mode.ALLREDUCE and ctx.cluster.num_tasks("ps") == 0:
        raise ValueError(
            f"the cluster has no ps task for mode={mode.value!r}: give it ps tasks, or train "
            "with mode='allreduce', or (one task that trains) through a psflow.TrainingSession, "
            "which trains a cluster of one in its own process"
        )
