"""``DistributedOptimizer``: a module's parameters live on the ps; ``step()`` trains them there.

A thin composition: the optimizer spec, the mode settings and the placement, each built and
validated once, and the :class:`~psflow.worker.modes.Engine` of the mode, which does the work.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from psflow import allocator, metrics
from psflow import env as envvars
from psflow.cluster.resolve import resolve
from psflow.cluster.spec import TaskContext
from psflow.protocol import OptimizerSpec, ScheduleSpec
from psflow.transport import TransportConfig
from psflow.worker.engine import AsyncEngine, ExchangeEngine
from psflow.worker.exchange import ParameterExchange
from psflow.worker.modes import Engine, Mode, ModeConfig
from psflow.worker.opt_state import State, check_optimizer_state
from psflow.worker.placement import Piece, Placement, dense_parameters
from psflow.worker.staleness import StalenessEngine
from psflow.worker.sync import SyncEngine
from psflow.worker.tables import tables_of

READY_TIMEOUT = 300.0
"""Seconds a worker waits for the ps and the chief by default (``PSFLOW_READY_TIMEOUT``)."""


class DistributedOptimizer:
    """Trains ``model`` against the job's parameter servers (or, in all-reduce mode, without).

    The chief sends the model's initial values and the optimizer to the ps tasks; every other
    worker waits for them and starts from the same values. Each :meth:`step` pushes this
    worker's gradients and pulls the fresh parameters back in one round trip per shard; the ps
    tasks apply the named ``torch.optim`` optimizer.

    Args:
        model: the module to train; its parameters are overwritten with the ps values.
        ctx: this task's cluster and identity (default: from flags or ``TF_CONFIG``).
        optimizer: a ``torch.optim`` class name, applied on the ps, with its arguments as
            keywords (``lr=0.01``); or an :class:`~psflow.protocol.OptimizerSpec`.
        lr_schedule: a ``torch.optim.lr_scheduler`` schedule the ps apply by the global
            step: ``("StepLR", {"step_size": 1000, "gamma": 0.5})`` or a
            :class:`~psflow.protocol.ScheduleSpec` (see docs/training.md). Default: the
            optimizer's learning rate throughout.
        placement: ``"greedy"`` (by bytes) or ``"round_robin"``, or a
            :class:`~psflow.worker.placement.Placement`, or the pieces one placed.
        partition_bytes: a parameter larger than this is split across the shards along dim 0
            (default 64 MiB; with a string ``placement`` only).
        config: transport settings (timeouts, keys); default from the environment.
        ready_timeout: seconds a worker waits for the chief to initialise the ps.
        mode: ``"async"`` (default, or ``PSFLOW_MODE``), ``"sync"`` (gradients of
            ``replicas_to_aggregate`` workers averaged per step on the ps) or ``"allreduce"``
            (no ps: torch.distributed averages the gradients, each worker applies them); see
            docs/sync.md. Or a :class:`~psflow.worker.modes.ModeConfig`.
        replicas_to_aggregate, total_num_replicas: sync mode; more replicas than are
            aggregated makes backup workers (default: every worker, no backup).
        max_staleness: async mode: no worker pushes more than this many steps ahead of the
            slowest (it waits).
        sync_timeout: seconds a worker waits for its synchronous step (or for the slowest
            worker) before it fails with :class:`~psflow.worker.SyncTimeoutError`.
        optimizer_state: the optimizer's first state, by parameter name, each a map of the
            optimizer's own state keys (``{"fc.weight": {"step": 3, "exp_avg": ...,
            "exp_avg_sq": ...}}``): training goes on from another's, a TensorFlow model's
            (:meth:`~psflow.train.tf_checkpoint.TFCheckpoint.optimizer_state`) or a torch
            run's. Checked here against what the optimizer keeps; the chief sends it with the
            model's values, and ps restored from a checkpoint keep theirs. See
            :mod:`psflow.worker.opt_state`.
        engine: builds the engine that trains, given the checked ``optimizer_state``, in
            place of the mode's own: a cluster of one's (:mod:`psflow.train.alone`), which
            holds the ps's parts in this process.
        **optimizer_kwargs: the optimizer's arguments (``lr=0.01``, ``momentum=0.9``, ...).

    Example:
        >>> # ctx, _ = psflow.resolve()
        >>> # model = torch.nn.Linear(1, 1)
        >>> # with psflow.DistributedOptimizer(model, ctx, optimizer="SGD", lr=0.001) as opt:
        >>> #     for x, y in data:
        >>> #         opt.zero_grad()
        >>> #         torch.nn.functional.mse_loss(model(x), y).backward()
        >>> #         step = opt.step()   # the global step after this update
    """

    def __init__(
        self,
        model: nn.Module,
        ctx: TaskContext | None = None,
        *,
        optimizer: str | OptimizerSpec = "SGD",
        lr_schedule: ScheduleSpec | tuple[str, Mapping[str, Any]] | str | None = None,
        placement: str | Placement | Sequence[Piece] = "greedy",
        partition_bytes: int | None = Placement.partition_bytes,
        config: TransportConfig | None = None,
        ready_timeout: float | None = None,
        mode: str | ModeConfig | None = None,
        replicas_to_aggregate: int | None = None,
        total_num_replicas: int | None = None,
        max_staleness: int | None = None,
        sync_timeout: float | None = None,
        optimizer_state: Mapping[str, Mapping[str, Any]] | None = None,
        engine: Callable[[State], Engine] | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if ctx is None:
            ctx, _ = resolve()
        if ctx.task.job not in ("worker", "chief"):
            raise ValueError(f"DistributedOptimizer runs on worker or chief tasks, not {ctx.task}")
        if ready_timeout is None:
            ready_timeout = envvars.seconds(envvars.PSFLOW_READY_TIMEOUT, READY_TIMEOUT)
        allocator.tune()
        self.model = model
        self.ctx = ctx
        self.spec = OptimizerSpec.of(optimizer, **optimizer_kwargs)
        self.lr_schedule = ScheduleSpec.of(lr_schedule)
        if self.lr_schedule is not None:
            self.lr_schedule.check(self.spec)  # here, rather than refused by every ps
        self.mode_config = ModeConfig.of(
            mode,
            replicas_to_aggregate=replicas_to_aggregate,
            total_num_replicas=total_num_replicas,
            max_staleness=max_staleness,
            sync_timeout=sync_timeout,
        )
        if isinstance(placement, str | Placement):
            placement = Placement.of(placement, partition_bytes=partition_bytes)
        elif partition_bytes != Placement.partition_bytes:
            raise ValueError("partition_bytes applies to a placement strategy, not to pieces")
        given: State = {}
        if optimizer_state:
            given = check_optimizer_state(
                self.spec, dense_parameters(model), optimizer_state, tables=list(tables_of(model))
            )
        self.engine = (
            engine(given)
            if engine is not None
            else _engine(
                model,
                ctx,
                self.spec,
                self.lr_schedule,
                self.mode_config,
                placement,
                config,
                ready_timeout,
                given,
            )
        )
        self.metrics = metrics.for_task(str(ctx.task), ctx.host).worker(ctx.cluster.num_tasks("ps"))
        self._closed = False
        self._frozen = allocator.freeze_gc()  # what is alive now lives as long as the training

    @property
    def is_chief(self) -> bool:
        return self.ctx.is_chief

    @property
    def mode(self) -> Mode:
        """The training mode."""
        return self.mode_config.mode

    @property
    def pieces(self) -> list[Piece]:
        """Where the parameters live on the ps (empty in all-reduce mode)."""
        return self.engine.pieces

    @property
    def global_step(self) -> int:
        """The global step after the last :meth:`step` or :meth:`pull`."""
        return self.engine.global_step

    @property
    def learning_rate(self) -> float | None:
        """The learning rate at :attr:`global_step`: with a schedule, the one the ps reported
        (or, in all-reduce mode, applied here); else the optimizer's."""
        lr = self.engine.learning_rate
        return self.spec.lr if lr is None else lr

    def pull(self) -> int:
        """Overwrites the model's parameters with the ps values; returns the global step."""
        return self.engine.pull()

    def step(self) -> int:
        """Pushes the gradients, pulls the updated parameters, returns the new global step.

        Parameters whose ``grad`` is ``None`` are not pushed (they still get pulled).
        """
        step = self.engine.step()
        self.metrics.steps.inc()
        self.metrics.global_step.set(step)
        return step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients of the model's parameters, like ``torch.optim.Optimizer``."""
        self.engine.zero_grad(set_to_none)

    def stats(self) -> dict[str, Any]:
        """The training mode's counters: sync accepted/dropped gradients, staleness, waits."""
        return {**self.engine.stats(), "global_step": self.global_step}

    def sync_status(self, timeout: float | None = None) -> dict[str, Any]:
        """ps:0's synchronous state: step, arrivals, dropped gradients per worker, decisions."""
        return self.engine.sync_status(timeout)

    def close(self, *, finished: bool = True) -> None:
        """Tells the ps this worker has finished (the ps exit after the last one) and disconnects.

        With ``finished=False`` it only disconnects: the worker goes on with a new optimizer
        (after a ps came back from a crash), or it failed (leaving a ``with`` block by an
        exception does that): a restart may follow, and the ps, told ``done``, would end the
        job without it.
        """
        if self._closed:
            return
        self._closed = True
        if self._frozen:
            gc.unfreeze()  # training is over: what it kept may be collected again
            self._frozen = False
        self.engine.close(finished=finished)

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A failure is not the end of this worker's training: no ``done`` (see close).
        self.close(finished=exc_type is None)


def _engine(
    model: nn.Module,
    ctx: TaskContext,
    spec: OptimizerSpec,
    lr_schedule: ScheduleSpec | None,
    mode: ModeConfig,
    placement: Placement | Sequence[Piece],
    transport: TransportConfig | None,
    ready_timeout: float,
    optimizer_state: State,
) -> Engine:
    """The mode's engine, started: the ps initialised (or restored) and the model pulled."""
    if mode.mode == Mode.ALLREDUCE:
        from psflow.worker.allreduce import AllReduceEngine  # torch.distributed: lazily

        tables = sorted(tables_of(model))
        if tables:
            raise ValueError(
                f"embedding tables {tables} live on the ps, and mode='allreduce' has none: "
                "train them with mode='async' or 'sync'"
            )

        return AllReduceEngine(
            model, ctx, spec, mode, lr_schedule=lr_schedule, optimizer_state=optimizer_state
        )
    exchange = ParameterExchange(
        model,
        ctx,
        pieces=(
            placement.place(model, ctx.cluster.num_tasks("ps"))
            if isinstance(placement, Placement)
            else placement
        ),
        transport=transport or TransportConfig.from_env(),
        lr_schedule=lr_schedule,
        optimizer_state=optimizer_state,
    )
    try:
        engine: ExchangeEngine
        if mode.mode == Mode.SYNC:
            engine = SyncEngine(exchange, mode)
        elif mode.max_staleness is not None:
            engine = StalenessEngine(exchange, mode)
        else:
            engine = AsyncEngine(exchange)
        engine.start(spec, ready_timeout=ready_timeout)
    except BaseException:
        exchange.close(finished=False)
        raise
    return engine
