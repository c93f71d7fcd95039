"""``DistributedOptimizer``: a module's parameters live on the ps; ``step()`` trains them there.

A thin composition: the optimizer spec, the mode settings and the placement, each built and
validated once, and the :class:`~psflow.worker.modes.Engine` of the mode, which does the work.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from psflow import allocator, metrics
from psflow.cluster.resolve import resolve
from psflow.cluster.spec import TaskContext
from psflow.protocol.messages import InputMark
from psflow.worker.config import SETTINGS, OptimizerConfig, check_has_ps, unknown_setting
from psflow.worker.engine import AsyncEngine, ExchangeEngine
from psflow.worker.exchange import ParameterExchange
from psflow.worker.modes import Engine, Mode
from psflow.worker.opt_state import State, check_optimizer_state
from psflow.worker.placement import Piece, Placement, dense_parameters
from psflow.worker.staging import Staging
from psflow.worker.staleness import StalenessEngine
from psflow.worker.sync import SyncEngine
from psflow.worker.tables import tables_of


class DistributedOptimizer:
    """Trains ``model`` against the job's parameter servers (or, in all-reduce mode, without).

    The chief sends the model's initial values and the optimizer to the ps tasks; every other
    worker waits for them and starts from the same values. Each :meth:`step` pushes this
    worker's gradients and pulls the fresh parameters back in one round trip per shard; the ps
    tasks apply the named ``torch.optim`` optimizer.

    Args:
        model: the module to train; its parameters are overwritten with the ps values.
        ctx: this task's cluster and identity (default: from flags or ``TF_CONFIG``).
        config: the settings as one object (:class:`~psflow.worker.config.OptimizerConfig`:
            the optimizer, its schedule, the mode, the placement, the transport, the ready
            timeout); or give them as keywords (``**settings``).
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
        **settings: :meth:`OptimizerConfig.of`'s keywords (``optimizer="SGD", lr=0.01,
            mode="sync", transport=...``); see docs/sync.md for the modes and
            docs/training.md for schedules.

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
        config: OptimizerConfig | None = None,
        optimizer_state: Mapping[str, Mapping[str, Any]] | None = None,
        engine: Callable[[State], Engine] | None = None,
        **settings: Any,
    ) -> None:
        if config is not None and settings:
            raise ValueError(f"give either config= or {sorted(settings)}, not both")
        for key in settings.keys() - SETTINGS:
            unknown_setting(key, SETTINGS, "DistributedOptimizer", settings.get("optimizer"))
        config = config if config is not None else OptimizerConfig.of(**settings)
        if ctx is None:
            ctx, _ = resolve()
        if ctx.task.job not in ("worker", "chief"):
            raise ValueError(f"DistributedOptimizer runs on worker or chief tasks, not {ctx.task}")
        allocator.tune()
        self.model = model
        self.ctx = ctx
        self.config = config
        self.spec = config.optimizer
        self.lr_schedule = config.lr_schedule
        self.mode_config = config.mode
        given: State = {}
        if optimizer_state:
            given = check_optimizer_state(
                self.spec, dense_parameters(model), optimizer_state, tables=list(tables_of(model))
            )
        self.engine = engine(given) if engine is not None else _engine(model, ctx, config, given)
        self.metrics = metrics.for_task(str(ctx.task), ctx.host).worker(ctx.cluster.num_tasks("ps"))
        self._flusher: int | None = None
        """The thread this optimizer has taking subnormals as zero (``None``: it left it)."""
        if config.flush_denormals:
            self._flusher = _hold_flush()
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

    def input_positions(self) -> list[InputMark | None]:
        """Per shard, the number and reader position of this task's last input it applied
        (``None``: none): where a restarted worker reads on from
        (:mod:`psflow.train.input_position`)."""
        return self.engine.input_positions()

    def mark_input(self, seq: tuple[int, ...], position: dict[str, Any]) -> None:
        """The next :meth:`step` is input number ``seq``, after which the reader is at
        ``position``: each shard keeps both with the update, or drops a step it holds."""
        self.engine.mark_input(seq, position)

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
        if self._flusher is not None:
            _release_flush(self._flusher)
        if self._frozen:
            gc.unfreeze()  # training is over: what it kept may be collected again
            self._frozen = False
        self.engine.close(finished=finished)

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A failure is not the end of this worker's training: no ``done`` (see close).
        self.close(finished=exc_type is None)


def flushing() -> bool:
    """Whether this thread takes subnormal floats as zero now (a float32 subnormal times 1)."""
    return bool(torch.tensor([1e-39], dtype=torch.float32).mul(1.0).item() == 0.0)


_flush_lock = threading.Lock()
_flush_holds: dict[int, list[Any]] = {}
"""Per thread (its ident): how many open optimizers have it take subnormals as zero, and its
mode before the first: several optimizers on one thread (two workers' in one process) closed
in any order give the thread back its own mode when the last closes."""


def _hold_flush() -> int:
    """This thread takes subnormals as zero while an optimizer holds it; the thread's ident."""
    me = threading.get_ident()
    with _flush_lock:
        held = _flush_holds.get(me)
        if held is None:
            _flush_holds[me] = [1, flushing()]
        else:
            held[0] += 1
    torch.set_flush_denormal(True)
    return me


def _release_flush(thread: int) -> None:
    """An optimizer's hold on ``thread`` let go: the last gives it back the mode it had, when
    it closes on that thread (another thread cannot set it: ``thread`` keeps flushing)."""
    with _flush_lock:
        held = _flush_holds.get(thread)
        if held is None:
            return
        held[0] -= 1
        if held[0] > 0:
            return
        del _flush_holds[thread]
    if thread == threading.get_ident():
        torch.set_flush_denormal(held[1])


def _engine(
    model: nn.Module, ctx: TaskContext, config: OptimizerConfig, optimizer_state: State
) -> Engine:
    """The mode's engine, started: the ps initialised (or restored) and the model pulled."""
    mode, spec, placement = config.mode, config.optimizer, config.placement
    if mode.mode == Mode.ALLREDUCE:
        from psflow.worker.allreduce import AllReduceEngine  # torch.distributed: lazily

        tables = sorted(tables_of(model))
        if tables:
            raise ValueError(
                f"embedding tables {tables} live on the ps, and mode='allreduce' has none: "
                "train them with mode='async' or 'sync'"
            )

        return AllReduceEngine(
            model,
            ctx,
            spec,
            mode,
            lr_schedule=config.lr_schedule,
            optimizer_state=optimizer_state,
            transport=config.transport,
        )
    check_has_ps(ctx, mode.mode)
    exchange = ParameterExchange(
        model,
        ctx,
        pieces=(
            placement.place(model, ctx.cluster.num_tasks("ps"))
            if isinstance(placement, Placement)
            else list(placement)
        ),
        transport=config.transport,
        lr_schedule=config.lr_schedule,
        optimizer_state=optimizer_state,
        staging=Staging(pinned=config.pinned),
    )
    try:
        engine: ExchangeEngine
        if mode.mode == Mode.SYNC:
            engine = SyncEngine(exchange, mode)
        elif mode.max_staleness is not None:
            engine = StalenessEngine(exchange, mode)
        else:
            engine = AsyncEngine(exchange, overlap=mode.overlap)
        engine.start(spec, ready_timeout=config.ready_timeout)
    except BaseException:
        exchange.close(finished=False)
        raise
    return engine
