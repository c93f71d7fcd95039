"""``TrainingSession``: TensorFlow's ``MonitoredTrainingSession``/``Supervisor`` for psflow.

The chief restores the latest checkpoint or initialises the ps, the other workers wait for a
ready model, checkpoints are saved on a schedule (and at the end), summaries go to
TensorBoard, and hooks run around every step. In all-reduce mode the chief saves and restores
its own copy of the model (:mod:`psflow.train.local_shard`). SIGTERM ends a session cleanly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from psflow import env as envvars
from psflow import metrics
from psflow.cluster.resolve import resolve_or_alone
from psflow.cluster.spec import TaskContext
from psflow.protocol import Code, Key, OptimizerSpec, ScheduleSpec
from psflow.protocol.messages import OPT_SEP
from psflow.ps.checkpoint import decode_shard, shard_file_name
from psflow.train.alone import LocalEngine
from psflow.train.checkpoint import Checkpoint, Checkpointer, ShardSaver, load_checkpoint
from psflow.train.hooks import (
    Hook,
    LoggingHook,
    NanGuardHook,
    StepContext,
    StopAtStepHook,
)
from psflow.train.local_shard import LocalShard
from psflow.train.manifest import CheckpointDir
from psflow.train.summary import SummaryHook
from psflow.transport import PeerError, PeerLostError, PeerTimeoutError, TransportConfig
from psflow.worker import DistributedOptimizer, Mode, ModeConfig, Placement, ShardedClient
from psflow.worker.optimizer import READY_TIMEOUT
from psflow.worker.placement import Piece, dense_parameters
from psflow.worker.tables import table_specs, tables_of

if TYPE_CHECKING:
    from psflow.worker.allreduce import AllReduceEngine

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SessionConfig:
    """How a :class:`TrainingSession` supervises training (TensorFlow's argument names)."""

    checkpoint_dir: str | None = None
    """Where checkpoints (and, by default, summaries) go: a path or fsspec URL. ``None``:
    ``PSFLOW_LOGDIR`` when it is set (the rendered manifests and the image set it), else no
    checkpoints and no summaries."""
    summary_dir: str | None = None
    """TensorBoard event files (a local path); default ``checkpoint_dir``."""
    save_checkpoint_secs: float | None = None
    """Save every this many seconds (default 600 when no ``save_checkpoint_steps``)."""
    save_checkpoint_steps: int | None = None
    """Save every this many global steps."""
    max_to_keep: int | None = 5
    """Complete checkpoints kept (older ones are deleted); ``None`` keeps all."""
    save_summaries_steps: int | None = 100
    """Scalar summaries every this many global steps; ``None``: no summaries."""
    histogram_steps: int | None = 1000
    """Parameter histograms every this many global steps; ``None``: none."""
    log_step_count_steps: int | None = 100
    """Progress line every this many steps on the chief (``None``: no progress output)."""
    last_step: int | None = None
    """Stop once the global step reaches this (a :class:`StopAtStepHook`)."""
    nan_guard: bool = True
    """Stop with an error on a non-finite loss or gradient, before it reaches the ps."""
    restore: bool = True
    """Whether the chief restores the latest checkpoint (when there is one)."""
    ready_timeout: float | None = None
    """Seconds a worker waits for the chief to make the model ready (default 300)."""
    save_timeout: float = 300.0
    """Seconds one checkpoint may take to write before it fails."""
    end_timeout: float = 60.0
    """Seconds the chief waits for the other workers before the final checkpoint."""
    recovery_timeout: float | None = dataclasses.field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_RECOVERY_TIMEOUT, 300.0)
    )
    """Seconds a worker waits, after a ps failed to answer, for every ps to answer again (a
    crashed one restarted by its cluster manager, a cut link mended); the chief then restores
    the latest checkpoint into every shard if one came back empty, and training goes on
    (asynchronous and synchronous modes; all-reduce has no ps). Default
    ``PSFLOW_RECOVERY_TIMEOUT``, else 300. ``None``: the error stops the worker."""
    stop_on_sigterm: bool = True
    """SIGTERM (what Kubernetes sends a pod 30 s before SIGKILL), and a first Ctrl-C of a
    script run by hand, stop the session cleanly: the step in progress ends, the loop's
    :meth:`TrainingSession.should_stop` turns true once the chief has saved its final
    checkpoint (before anything the script does after its loop), and closing says ``done``
    (when the session runs in the main thread; the previous handlers come back at close; a
    second Ctrl-C raises ``KeyboardInterrupt`` at once)."""

    def __post_init__(self) -> None:
        for name in ("save_checkpoint_secs", "ready_timeout", "recovery_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        for name in (
            "save_checkpoint_steps",
            "max_to_keep",
            "save_summaries_steps",
            "histogram_steps",
            "log_step_count_steps",
        ):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be >= 1 or None, got {value!r}")
        if self.last_step is not None and self.last_step < 0:
            raise ValueError(f"last_step must be >= 0, got {self.last_step}")
        if self.save_timeout <= 0 or self.end_timeout <= 0:
            raise ValueError("save_timeout and end_timeout must be > 0 seconds")
        if self.checkpoint_dir is None:
            self.checkpoint_dir = envvars.text(envvars.PSFLOW_LOGDIR)
        if self.checkpoint_dir is not None:
            CheckpointDir(self.checkpoint_dir)  # validates the URL
            if self.save_checkpoint_secs is None and self.save_checkpoint_steps is None:
                self.save_checkpoint_secs = 600.0
        if self.summary_dir is None:
            self.summary_dir = self.checkpoint_dir


_CONFIG_FIELDS = {f.name for f in dataclasses.fields(SessionConfig)}


class TrainingSession:
    """Trains ``model`` on the ps with supervision: restore or init, checkpoints, summaries, hooks.

    The PyTorch spelling of TensorFlow's ``tf.train.MonitoredTrainingSession`` (also exported
    under that name). It builds the optimizer spec, the mode settings and the placement once
    and hands them to a :class:`~psflow.worker.DistributedOptimizer`; every keyword that is
    neither named below nor a :class:`SessionConfig` field is an optimizer argument
    (``lr=...``), checked against the optimizer at once.

    Args:
        model: the module to train (the same on every worker).
        ctx: this task (default: from flags or ``TF_CONFIG``).
        optimizer: a ``torch.optim`` class name, applied on the ps (or an
            :class:`~psflow.protocol.OptimizerSpec`).
        lr_schedule: a ``torch.optim.lr_scheduler`` schedule the ps apply by the global
            step, as for ``DistributedOptimizer`` (``("StepLR", {"step_size": 1000,
            "gamma": 0.5})``); it goes on from the restored step after a restore.
        hooks: extra :class:`~psflow.train.hooks.Hook` objects, run on every worker.
        placement, partition_bytes, transport: as for ``DistributedOptimizer``.
        mode, replicas_to_aggregate, total_num_replicas, max_staleness, sync_timeout: the
            training mode, as for ``DistributedOptimizer`` (or ``mode`` a
            :class:`~psflow.worker.ModeConfig`).
        optimizer_state: the optimizer's first state by parameter name, as for
            ``DistributedOptimizer`` (a TensorFlow model's:
            :meth:`~psflow.train.tf_checkpoint.TFCheckpoint.optimizer_state`). A checkpoint
            restored from ``checkpoint_dir`` wins.
        config: a :class:`SessionConfig`; or give its fields as keyword arguments.

    Example:
        >>> # ctx, argv = psflow.resolve()
        >>> # model = torch.nn.Linear(1, 1)
        >>> # with psflow.TrainingSession(model, ctx, optimizer="SGD", lr=0.001,
        >>> #                             checkpoint_dir="runs/linreg", last_step=10000,
        >>> #                             save_checkpoint_steps=1000) as sess:
        >>> #     while not sess.should_stop():
        >>> #         loss = F.mse_loss(model(x), y)
        >>> #         sess.zero_grad()
        >>> #         loss.backward()
        >>> #         sess.step(loss=loss)
    """

    def __init__(
        self,
        model: nn.Module,
        ctx: TaskContext | None = None,
        *,
        optimizer: str | OptimizerSpec = "SGD",
        lr_schedule: ScheduleSpec | tuple[str, Mapping[str, Any]] | str | None = None,
        hooks: Sequence[Hook] = (),
        placement: str | Placement = "greedy",
        partition_bytes: int | None = Placement.partition_bytes,
        transport: TransportConfig | None = None,
        mode: str | ModeConfig | None = None,
        replicas_to_aggregate: int | None = None,
        total_num_replicas: int | None = None,
        max_staleness: int | None = None,
        sync_timeout: float | None = None,
        optimizer_state: Mapping[str, Mapping[str, Any]] | None = None,
        config: SessionConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if ctx is None:
            ctx, _ = resolve_or_alone()
        if ctx.task.job not in ("worker", "chief"):
            raise ValueError(f"a TrainingSession runs on worker or chief tasks, not {ctx.task}")
        session_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONFIG_FIELDS}
        if config is not None and session_kwargs:
            raise ValueError(f"give either config= or {sorted(session_kwargs)}, not both")
        self.config = config or SessionConfig(**session_kwargs)
        self.model = model
        self.ctx = ctx
        self.transport = transport or TransportConfig.from_env()
        self.spec = OptimizerSpec.of(optimizer, **kwargs)
        self.lr_schedule = ScheduleSpec.of(lr_schedule)
        if self.lr_schedule is not None:
            self.lr_schedule.check(self.spec)
        self.mode_config = ModeConfig.of(
            mode,
            replicas_to_aggregate=replicas_to_aggregate,
            total_num_replicas=total_num_replicas,
            max_staleness=max_staleness,
            sync_timeout=sync_timeout,
        )
        self.metrics = metrics.for_task(str(ctx.task), ctx.host).worker(ctx.cluster.num_tasks("ps"))
        """This task's Prometheus metrics (:mod:`psflow.metrics`)."""
        self._optimizer_state = optimizer_state
        """For the first optimizer only: one built after a lost ps came back goes on from the
        ps (restored), not from the start."""
        self.global_step = 0
        self.checkpointer: Checkpointer | None = None
        self.restored_from: str | None = None
        self._stop = False
        self._last_save_t = time.monotonic()
        self._last_save_step = 0
        self._summary: SummaryHook | None = None
        self._allreduce: AllReduceEngine | None = None
        self._local: LocalShard | None = None
        self._terminated = False
        """SIGTERM reached this task."""
        self._waiting_for_ps = False
        """In :meth:`_recover`'s wait for a lost ps: SIGTERM then ends the wait at once."""
        self._previous_sigterm: Any = None
        self._previous_sigint: Any = None
        self._signal_name = "SIGTERM"
        self._sigterm_installed = False
        self.hooks = self._builtin_hooks() + list(hooks)
        stops = [h.last_step for h in self.hooks if isinstance(h, StopAtStepHook)]
        if stops:
            self.metrics.last_step.set(min(stops))
        self.alone = ctx.cluster.num_tasks("ps") == 0 and (
            ctx.is_alone or self.mode_config.mode != Mode.ALLREDUCE
        )
        """A cluster of one (:mod:`psflow.train.alone`): trains in this process, no ps."""
        self.pieces: list[Piece] = []
        """Where the parameters live on the ps (none in all-reduce mode; alone, one shard)."""
        if not self.alone and self.mode_config.mode != Mode.ALLREDUCE:
            self.pieces = Placement.of(placement, partition_bytes=partition_bytes).place(
                model, ctx.cluster.num_tasks("ps")
            )
        self._client: ShardedClient | None = None
        ready_timeout = self.config.ready_timeout
        if ready_timeout is None:
            ready_timeout = envvars.seconds(envvars.PSFLOW_READY_TIMEOUT, READY_TIMEOUT)
        try:
            if self.is_chief and not self.alone and self.mode_config.mode != Mode.ALLREDUCE:
                self._client = ShardedClient(ctx, self.transport)
                self._client.wait_ready(ready_timeout, initialized=False)  # ps may be starting
                self._restore_or_nothing(ready_timeout)
            self.opt = self._optimizer(ready_timeout)
            if self.alone:
                self._start_alone()
            elif self.opt.mode == Mode.ALLREDUCE:
                self._start_allreduce()
        except BaseException:
            if self._client is not None:
                self._client.close()
            if self._allreduce is not None:
                self.opt.close(finished=False)
            raise
        self.global_step = self._last_save_step = self.opt.global_step
        if self.is_chief and self.config.checkpoint_dir is not None:
            self.checkpointer = self._checkpointer(self.config.checkpoint_dir)
        for hook in self.hooks:
            hook.begin(self)
        if self.config.stop_on_sigterm:
            self._stop_on_sigterm()

    # -- start ------------------------------------------------------------------------------

    @property
    def is_chief(self) -> bool:
        return self.ctx.is_chief

    def _builtin_hooks(self) -> list[Hook]:
        cfg = self.config
        hooks: list[Hook] = []
        if cfg.nan_guard:
            hooks.append(NanGuardHook())
        if cfg.last_step is not None:
            hooks.append(StopAtStepHook(cfg.last_step))
        if self.is_chief and cfg.log_step_count_steps is not None:
            hooks.append(
                LoggingHook(every_n_steps=cfg.log_step_count_steps, last_step=cfg.last_step)
            )
        if self.is_chief and cfg.summary_dir is not None and cfg.save_summaries_steps is not None:
            self._summary = SummaryHook(
                cfg.summary_dir,
                every_n_steps=cfg.save_summaries_steps,
                histogram_steps=cfg.histogram_steps,
            )
            hooks.append(self._summary)
        return hooks

    def _optimizer(self, ready_timeout: float) -> DistributedOptimizer:
        state, self._optimizer_state = self._optimizer_state, None
        if self.alone:
            return DistributedOptimizer(
                self.model,
                self.ctx,
                optimizer=self.spec,
                mode=self.mode_config,
                engine=lambda given: LocalEngine(
                    self.model,
                    self.spec,
                    self.mode_config,
                    lr_schedule=self.lr_schedule,
                    optimizer_state=given,
                    tables=table_specs(tables_of(self.model), self.spec),
                ),
                optimizer_state=state,
            )
        return DistributedOptimizer(
            self.model,
            self.ctx,
            optimizer=self.spec,
            lr_schedule=self.lr_schedule,
            placement=self.pieces,
            mode=self.mode_config,
            config=self.transport,
            ready_timeout=ready_timeout,
            optimizer_state=state,
        )

    def _checkpointer(self, checkpoint_dir: str) -> Checkpointer:
        """The chief's: through the ps, or in all-reduce mode from its own model."""
        local = self._local
        shards: ShardSaver
        if local is not None:
            shards = local
            pieces = local.pieces
        else:
            assert self._client is not None
            shards = self._client
            pieces = self.pieces
        return Checkpointer(
            checkpoint_dir,
            client=shards,
            pieces=pieces,
            params={n: p for n, p in dense_parameters(self.model).items()},
            make_client=(
                (lambda: local)
                if local is not None
                else lambda: ShardedClient(self.ctx, self.transport)
            ),
            max_to_keep=self.config.max_to_keep,
            timeout=self.config.save_timeout,
            metrics=self.metrics,
        )

    def _restore_or_nothing(self, timeout: float) -> None:
        """The chief: restore the latest checkpoint into the ps (else the optimizer inits);
        ``timeout`` bounds the ps's answer (they load the checkpoint's tables first)."""
        cfg = self.config
        if cfg.checkpoint_dir is None:
            return
        self._prune_incomplete(cfg.checkpoint_dir)
        if cfg.restore:
            self._restore(replace=False, timeout=timeout)

    @staticmethod
    def _prune_incomplete(checkpoint_dir: str) -> None:
        removed = CheckpointDir(checkpoint_dir).prune(None, incomplete_below=2**62)
        if removed:  # left by a task killed mid-save
            log.info("removed incomplete checkpoints %s", ", ".join(removed))

    def _start_allreduce(self) -> None:
        """All-reduce mode, on every rank: the chief loads the latest checkpoint into its own
        model and optimizer, and sends them to every other rank, which loads the same (the
        engine's start already gave every rank the chief's parameters)."""
        from psflow.worker.allreduce import AllReduceEngine  # torch.distributed: lazily

        engine = self.opt.engine
        assert isinstance(engine, AllReduceEngine)
        self._allreduce = engine
        self._local = LocalShard.of_model(
            self.model,
            engine.optimizer,
            self.spec,
            lambda: engine.global_step,
            root=self.config.checkpoint_dir,
        )
        ckpt = None
        if self.is_chief and self.config.checkpoint_dir is not None:
            self._prune_incomplete(self.config.checkpoint_dir)
            ckpt = load_checkpoint(self.config.checkpoint_dir) if self.config.restore else None
            if ckpt is not None:
                self._restore_local(ckpt)
            else:
                log.info("no checkpoint in %s: initialising", self.config.checkpoint_dir)
        mine = None if ckpt is None else self._local.state_bytes(ckpt.global_step)
        data = engine.broadcast_bytes(mine)  # every rank, with or without a checkpoint
        if ckpt is not None:
            engine.start_at(ckpt.global_step)
        elif data:
            state = decode_shard(data, f"the state {self.ctx.cluster.chief} restored")
            self._local.load_shard(state)
            engine.start_at(state.step)

    def _start_alone(self) -> None:
        """A cluster of one: the latest checkpoint (of any mode, any number of ps) into the
        model, its optimizer and its tables, here; else the model as it is."""
        engine = self.opt.engine
        assert isinstance(engine, LocalEngine)
        self._local = LocalShard(
            engine.store,
            engine.pieces_here,
            lambda: engine.global_step,
            root=self.config.checkpoint_dir,
        )
        self.pieces = engine.pieces_here
        if self.config.checkpoint_dir is None:
            return
        self._prune_incomplete(self.config.checkpoint_dir)
        ckpt = load_checkpoint(self.config.checkpoint_dir) if self.config.restore else None
        if ckpt is None:
            log.info("no checkpoint in %s: initialising", self.config.checkpoint_dir)
            return
        self._restore_local(ckpt, "")
        engine.start_at(ckpt.global_step)

    def _restore_local(self, ckpt: Checkpoint, then: str = "; sending it to every rank") -> None:
        """The chief in all-reduce mode, or a cluster of one: ``ckpt`` (saved in any mode)
        into its model (and a cluster of one's tables)."""
        assert self._local is not None and self.config.checkpoint_dir is not None
        ckpt.check_model({n: p.detach() for n, p in dense_parameters(self.model).items()})
        refused = ckpt.optimizer_state_refused(self.spec)
        if refused is not None:
            log.warning("%s: optimizer state not restored: %s", ckpt.name, refused)
        d = CheckpointDir(self.config.checkpoint_dir)
        n = ckpt.manifest.num_shards
        files = [d.url_of(f"{ckpt.name}/{shard_file_name(i, n)}") for i in range(n)]
        self._local.load(ckpt, optimizer_state=refused is None, table_files=files)
        self.restored_from = ckpt.name
        log.info(
            "restored %s from %s (global step %d, saved on %d ps)%s",
            self.model.__class__.__name__,
            d.url_of(ckpt.name),
            ckpt.global_step,
            n,
            then,
        )

    def _restore(self, *, replace: bool, timeout: float) -> bool:
        """The chief: loads the latest checkpoint into the ps; False when there is none.

        With ``replace``, shards that are already initialised take its values too. ``timeout``
        bounds the ps's answer, not one request's ``PSFLOW_TIMEOUT``: a ps loads the
        checkpoint's tables before it answers.
        """
        cfg = self.config
        assert cfg.checkpoint_dir is not None
        d = CheckpointDir(cfg.checkpoint_dir)
        ckpt = load_checkpoint(cfg.checkpoint_dir)
        if ckpt is None:
            log.info("no checkpoint in %s: initialising", cfg.checkpoint_dir)
            return False
        ckpt.check_model({n: p.detach() for n, p in dense_parameters(self.model).items()})
        values, plain = ckpt.place(self.pieces)
        assert self._client is not None
        spec = self.spec
        refused = ckpt.optimizer_state_refused(spec)
        if refused is not None:
            log.warning("%s: optimizer state not restored: %s", ckpt.name, refused)
            values = {s: [(n, t) for n, t in ts if OPT_SEP not in n] for s, ts in values.items()}
            plain = {}
        saved_schedule = ckpt.manifest.lr_schedule
        if saved_schedule != (self.lr_schedule.to_wire() if self.lr_schedule else None):
            log.info(
                "%s was saved with lr_schedule %s; the job's, %s, goes on from its step %d",
                ckpt.name,
                saved_schedule,
                self.lr_schedule.describe() if self.lr_schedule else "none",
                ckpt.global_step,
            )
        tables = table_specs(tables_of(self.model), spec)
        fresh = self._client.initialize_restored(
            values,
            plain,
            spec,
            ckpt.global_step,
            replace=replace,
            schedule=self.lr_schedule,
            tables=[t.to_wire() for t in tables],
            tables_from=[
                d.url_of(f"{ckpt.name}/{shard_file_name(i, ckpt.manifest.num_shards)}")
                for i in range(ckpt.manifest.num_shards)
            ],
            timeout=timeout,
        )
        if fresh:
            self.restored_from = ckpt.name
            log.info(
                "restored %s from %s (global step %d, saved on %d ps)",
                self.model.__class__.__name__,
                d.url_of(ckpt.name),
                ckpt.global_step,
                ckpt.manifest.num_shards,
            )
        else:
            log.info("the ps were already initialised: not restoring %s", ckpt.name)
        return True

    # -- the loop ---------------------------------------------------------------------------

    def should_stop(self) -> bool:
        """True once a hook (or :meth:`request_stop`, or SIGTERM) asked to stop."""
        if self._stop:
            return True
        if self._allreduce is not None:
            # Some rank's SIGTERM, which every rank sees after the same step.
            by_signal = self._allreduce.stop_requested
        else:
            by_signal = self._terminated
        if by_signal:
            self._stop = True
            log.warning(
                "%s: stopping at global step %d on %s%s%s",
                self.ctx.task,
                self.global_step,
                self._signal_name,
                "" if self._terminated else " (to another rank)",
                "; saving the final checkpoint" if self.checkpointer is not None else "",
            )
            # Now, before the script's own end (an evaluation, an export): the grace period
            # after SIGTERM (30 s on Kubernetes) may not outlast it. close() finds it saved.
            if self.checkpointer is not None:
                self._save_final()
        return self._stop

    def pull(self) -> int:
        """Brings the model up to date with the job's parameters (the ps's, or in all-reduce
        mode and alone, its own), e.g. to evaluate it after the loop; returns the global
        step."""
        self.global_step = self.opt.pull()
        return self.global_step

    def request_stop(self) -> None:
        self._stop = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none)

    def step(
        self,
        loss: torch.Tensor | float | None = None,
        *,
        examples: int | None = None,
        **values: Any,
    ) -> int:
        """Runs the hooks, pushes the gradients, pulls the parameters; returns the global step.

        ``loss`` feeds the NaN guard, the progress line, the ``loss`` summary and the
        ``psflow_worker_loss`` metric; ``examples`` (the batch size) the
        ``psflow_worker_examples_total`` metric.
        """
        loss_value = (
            None
            if loss is None
            else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        )
        if loss_value is not None:
            self.metrics.loss.set(loss_value)
        if examples is not None:
            self.metrics.examples.inc(examples)
        ctx = StepContext(
            session=self, global_step=self.global_step, loss=loss_value, values=values
        )
        for hook in self.hooks:
            hook.before_step(ctx)
        try:
            step = self.opt.step()
        except PeerError as e:
            step = self._ended_by_sigterm(e) if self._terminated else self._recover(e)
        self.global_step = ctx.global_step = step
        for hook in self.hooks:
            hook.after_step(ctx)
        if self.checkpointer is not None and self._save_due():
            try:
                self._save(wait=False)
            except PeerError as e:
                self.global_step = self._recover(e)
        return self.global_step

    def _recover(self, error: PeerError) -> int:
        """After a ps failed to answer: waits for every ps to answer again; the chief restores
        the latest checkpoint into every shard when one came back empty (a crashed ps that its
        cluster manager restarted); then a new optimizer pulls. Returns the global step.
        """
        timeout = self.config.recovery_timeout
        lost = isinstance(error, PeerTimeoutError | PeerLostError)  # not a refused request
        if timeout is None or not lost or self.opt.mode == Mode.ALLREDUCE:
            raise error
        log.warning(
            "%s: %s; waiting up to %g s for every ps to answer", self.ctx.task, error, timeout
        )
        self._waiting_for_ps = True
        try:
            return self._wait_and_restore(error, timeout)
        except _StopWaiting:
            raise RuntimeError(
                f"{self.ctx.task} stopped by SIGTERM while it waited for the ps ({error})"
            ) from error
        finally:
            self._waiting_for_ps = False

    def _wait_and_restore(self, error: PeerError, timeout: float) -> int:
        self.opt.close(finished=False)
        if self.checkpointer is not None:
            self.checkpointer.wait(raise_error=False)  # a save the crash cut short
        if self.is_chief:
            if self._client is not None:
                self._client.close()  # requests queued for the dead ps go with it
            self._client = ShardedClient(self.ctx, self.transport)
            if self.checkpointer is not None:
                self.checkpointer.client = self._client
            self._client.wait_ready(
                timeout, initialized=False, setting=envvars.PSFLOW_RECOVERY_TIMEOUT
            )
            empty = [
                self._client.shards[s]
                for s, h in self._client.status().items()
                if not h.get(Key.INITIALIZED)
            ]
            if empty:
                names = ", ".join(empty)
                restored = self.config.checkpoint_dir is not None and self._restore(
                    replace=True, timeout=timeout
                )
                if not restored:
                    raise RuntimeError(
                        f"{names} came back empty and there is no checkpoint to restore it from"
                    ) from error
                log.warning(
                    "%s came back empty: every shard restored from %s", names, self.restored_from
                )
        self.opt = self._optimizer(timeout)
        log.warning("%s: training goes on at global step %d", self.ctx.task, self.opt.global_step)
        return self.opt.global_step

    def _ended_by_sigterm(self, error: PeerError) -> int:
        """After SIGTERM: a synchronous step that can no longer complete (the other workers,
        signalled too, finished first) ends the loop like the signal; the ps keep the last
        complete step, which the final checkpoint saves. Any other error stands."""
        if error.code != Code.STOPPING:
            return self._recover(error)
        log.warning("%s: %s; this step is dropped", self.ctx.task, error)
        return self.global_step

    def _save_due(self) -> bool:
        cfg = self.config
        if (
            cfg.save_checkpoint_steps
            and self.global_step - self._last_save_step >= cfg.save_checkpoint_steps
        ):
            return True
        return bool(
            cfg.save_checkpoint_secs
            and time.monotonic() - self._last_save_t >= cfg.save_checkpoint_secs
        )

    def _save(self, *, wait: bool, final: bool = False) -> str | None:
        assert self.checkpointer is not None
        name = self.checkpointer.save(self.global_step, wait=wait, final=final)
        if name is not None:
            self._last_save_t = time.monotonic()
            self._last_save_step = self.global_step
        return name

    def save(self) -> str | None:
        """Saves a checkpoint now and waits for it (chief only; elsewhere returns ``None``)."""
        if self.checkpointer is None:
            return None
        name = self._save(wait=True)
        return None if name is None else self.checkpointer.dir.url_of(name)

    @property
    def latest_checkpoint(self) -> str | None:
        if self.config.checkpoint_dir is None:
            return None
        return CheckpointDir(self.config.checkpoint_dir).latest()

    def add_scalar(self, tag: str, value: float | torch.Tensor, step: int | None = None) -> None:
        """A user summary (chief only; a no-op on other workers)."""
        if self._summary is not None:
            v = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
            self._summary.scalar(tag, v, self.global_step if step is None else step)

    # -- end --------------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """Ends the session: on the chief, a final checkpoint (unless ``error``); then ``done``,
        unless ``error``: a task that failed has not finished (a restart may follow, and the ps
        must not end the job as if it had); the ps declare it dead if it does not come back."""
        try:
            if error is None:
                for hook in self.hooks:
                    hook.end(self)
                if self.checkpointer is not None:
                    self._save_final()
            elif self.checkpointer is not None:
                self.checkpointer.wait(raise_error=False)
        finally:
            self._restore_sigterm()
            if self._summary is not None:
                self._summary.close()
            if self._client is not None:
                self._client.close()
            self.opt.close(finished=error is None)

    def _save_final(self) -> None:
        """The chief's last checkpoint (an existing one of this step is not written again)."""
        assert self.checkpointer is not None
        # After SIGTERM the grace period is short, and the others may not be stopping at all
        # (one evicted pod): save what the ps hold now.
        if self._client is not None and not self._terminated:
            self._wait_for_workers()
        self.opt.pull()
        self.global_step = self.opt.global_step
        self.checkpointer.wait()
        # Stopped by a signal (to any rank), a restart may follow: not the end.
        signalled = self._terminated or (
            self._allreduce is not None and self._allreduce.stop_requested
        )
        self._save(wait=True, final=not signalled)

    def _wait_for_workers(self) -> None:
        """The chief waits (bounded) for the other workers to finish (or die), so the final
        checkpoint holds their last updates too."""
        assert self._client is not None
        others = {str(t) for t in self.ctx.cluster.trainers} - {str(self.ctx.task)}
        deadline = time.monotonic() + self.config.end_timeout
        while others:
            status = self._client.status()[0]
            # A dead worker (silent past PSFLOW_WORKER_TIMEOUT) is not waited for.
            finished = set(status.get(Key.FINISHED, [])) | set(status.get(Key.DEAD, []))
            if others <= finished:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "%s still training after %g s; saving the final checkpoint without waiting",
                    ", ".join(sorted(others - finished)),
                    self.config.end_timeout,
                )
                return
            time.sleep(0.05)

    # -- SIGTERM ----------------------------------------------------------------------------

    def _stop_on_sigterm(self) -> None:
        """In the main thread, SIGTERM asks the session to stop, as a hook would: the loop ends
        at :meth:`should_stop` and :meth:`close` saves. In all-reduce mode the request rides
        with the next step's gradients, so that every rank stops after the same step."""
        if threading.current_thread() is not threading.main_thread():
            return
        pid = os.getpid()

        def on_sigterm(signum: int, frame: FrameType | None) -> None:
            if os.getpid() != pid:  # a forked child (a DataLoader process) dies as it would have
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            if signum == signal.SIGINT and self._terminated:
                raise KeyboardInterrupt  # Ctrl-C twice: now, without the final checkpoint
            # Only flags: should_stop() says so (the main thread may be inside logging now).
            self._terminated = True
            self._signal_name = signal.Signals(signum).name
            if self._waiting_for_ps:
                # A wait of up to recovery_timeout for a lost ps: the stop must not wait for
                # it (the launcher's or Kubernetes' grace period is shorter).
                self._waiting_for_ps = False
                raise _StopWaiting
            if self._allreduce is not None:
                self._allreduce.request_stop()

        self._previous_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            # Ctrl-C of a script run by hand (psflow launch's tasks never see it): the first
            # stops as SIGTERM does, the second raises KeyboardInterrupt as usual.
            self._previous_sigint = signal.signal(signal.SIGINT, on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if not self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        self._sigterm_installed = False
        previous = self._previous_sigterm  # None: a handler set from C, which cannot come back
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)


class _StopWaiting(Exception):
    """SIGTERM arrived while the session waited for a lost ps."""


MonitoredTrainingSession = TrainingSession
"""TensorFlow's name for :class:`TrainingSession`."""
