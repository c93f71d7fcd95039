"""``TrainingSession``: TensorFlow's ``MonitoredTrainingSession``/``Supervisor`` for psflow.

The chief restores the latest checkpoint or initialises the ps, the other workers wait for a
ready model, checkpoints are saved on a schedule (and at the end), summaries go to
TensorBoard, and hooks run around every step. In all-reduce mode the chief saves and restores
its own copy of the model (:mod:`psflow.train.local_shard`); alone, a cluster of one trains
in this process (:mod:`psflow.train.alone`). SIGTERM ends a session cleanly.

Its parts: :class:`~psflow.train.session_config.SessionConfig` (the settings),
:class:`~psflow.train.restoring.Restoring` (restore at start, recovery from a lost ps),
:class:`~psflow.train.stopping.StopOnSignals` (SIGTERM and Ctrl-C as a stop).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from psflow import metrics
from psflow.cluster.resolve import resolve_or_alone
from psflow.cluster.spec import TaskContext
from psflow.protocol import Key
from psflow.train.alone import LocalEngine
from psflow.train.checkpoint import Checkpointer, ShardSaver
from psflow.train.checkpoint_buffers import snapshot_buffers
from psflow.train.exports import Exporter
from psflow.train.hooks import (
    Hook,
    LoggingHook,
    NanGuardHook,
    StepContext,
    StopAtStepHook,
)
from psflow.train.input_position import InputTracker, PositionedReader
from psflow.train.local_shard import LocalShard
from psflow.train.manifest import CheckpointDir
from psflow.train.restoring import Restoring
from psflow.train.session_config import SessionConfig
from psflow.train.stopping import StopOnSignals
from psflow.train.summary import SummaryHook
from psflow.transport import PeerError
from psflow.worker import DistributedOptimizer, Mode, Placement, ShardedClient
from psflow.worker.config import check_has_ps
from psflow.worker.placement import Piece, dense_parameters
from psflow.worker.tables import table_specs, tables_of

if TYPE_CHECKING:
    from psflow.worker.allreduce import AllReduceEngine

log = logging.getLogger(__name__)


_CONFIG_FIELDS = {f.name for f in dataclasses.fields(SessionConfig)}

_NO_POSITIONS = frozenset({Mode.SYNC, Mode.ALLREDUCE})
"""Modes that cannot say which inputs reached the optimizer (:mod:`.input_position`)."""


class TrainingSession(Restoring, StopOnSignals):
    """Trains ``model`` on the ps with supervision: restore or init, checkpoints, summaries, hooks.

    The PyTorch spelling of TensorFlow's ``tf.train.MonitoredTrainingSession`` (also exported
    under that name). Its settings are one :class:`~psflow.train.SessionConfig` (the training's,
    the checkpoints', the summaries', the supervision's), given as ``config=`` or as flat
    keywords with TensorFlow's names (:meth:`SessionConfig.of`; a misspelt one is a
    ``ValueError`` naming it). It hands the training's part to a
    :class:`~psflow.worker.DistributedOptimizer`. With no cluster (``ctx`` from
    :func:`psflow.resolve_or_alone`, or ``None`` and no cluster given), it trains a cluster of
    one in this process (:mod:`psflow.train.alone`).

    Args:
        model: the module to train (the same on every worker).
        ctx: this task (default: from flags or ``TF_CONFIG``, else a cluster of one).
        config: the settings as one :class:`SessionConfig`; or give them as keywords.
        hooks: extra :class:`~psflow.train.hooks.Hook` objects, run on every worker.
        optimizer_state: the optimizer's first state by parameter name, as for
            ``DistributedOptimizer`` (a TensorFlow model's:
            :meth:`~psflow.train.tf_checkpoint.TFCheckpoint.optimizer_state`). A checkpoint
            restored from ``checkpoint_dir`` wins.
        input: the reader the loop reads its batches from (a
            :class:`~psflow.data.KafkaReader`, a :class:`~psflow.data.FileStreamReader`):
            each step's push carries its position, which the ps keep with the update and in
            their checkpoints, and the session puts the reader back where the ps stand at its
            start and after a lost ps: each record trained once across restarts of any task
            (:mod:`psflow.train.input_position`). One batch read per step.
        **settings: :meth:`SessionConfig.of`'s keywords: ``optimizer``, ``lr``,
            ``lr_schedule``, ``mode`` (and ``replicas_to_aggregate``, ``total_num_replicas``,
            ``max_staleness``, ``sync_timeout``, ``overlap``), ``placement``, ``partition_bytes``,
            ``transport``, ``ready_timeout``; ``checkpoint_dir``, ``save_checkpoint_secs``,
            ``save_checkpoint_steps``, ``max_to_keep``, ``restore``, ``save_timeout``;
            ``summary_dir``, ``save_summaries_steps``, ``histogram_steps``,
            ``log_step_count_steps``; ``export_dir``, ``export_every``, ``export_base_every``,
            ``export_keep_bases``, ``export_reserve_bytes``, ``export_timeout`` (incremental
            exports for serving, :mod:`psflow.train.exports`); ``last_step``, ``nan_guard``,
            ``end_timeout``, ``recovery_timeout``, ``stop_on_sigterm``.

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
        config: SessionConfig | None = None,
        hooks: Sequence[Hook] = (),
        optimizer_state: Mapping[str, Mapping[str, Any]] | None = None,
        input: PositionedReader | None = None,
        **settings: Any,
    ) -> None:
        if config is not None and settings:
            raise ValueError(f"give either config= or {sorted(settings)}, not both")
        self.config = config if config is not None else SessionConfig.of(**settings)
        if ctx is None:
            ctx, _ = resolve_or_alone()
        if ctx.task.job not in ("worker", "chief"):
            raise ValueError(f"a TrainingSession runs on worker or chief tasks, not {ctx.task}")
        self.model = model
        self.ctx = ctx
        training = self.config.training
        self.transport = training.transport
        self.spec = training.optimizer
        self.lr_schedule = training.lr_schedule
        self.mode_config = training.mode
        self.metrics = metrics.for_task(str(ctx.task), ctx.host).worker(ctx.cluster.num_tasks("ps"))
        """This task's Prometheus metrics (:mod:`psflow.metrics`)."""
        self._optimizer_state = optimizer_state
        """For the first optimizer only: one built after a lost ps came back goes on from the
        ps (restored), not from the start."""
        self.global_step = 0
        self.checkpointer: Checkpointer | None = None
        self.exporter: Exporter | None = None
        """The chief's incremental exports (with an ``export_dir``)."""
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
        self._stuck: dict[int, float] = {}
        """In :meth:`_recover`'s wait for a lost ps: SIGTERM then ends the wait at once."""
        self._previous_sigterm: Any = None
        self._previous_sigint: Any = None
        self._signal_name = "SIGTERM"
        self._sigterm_installed = False
        self.hooks = self._builtin_hooks() + list(hooks)
        stops = [h.last_step for h in self.hooks if isinstance(h, StopAtStepHook)]
        if stops:
            self.metrics.last_step.set(min(stops))
        self.alone = ctx.is_alone or (
            ctx.cluster.num_tasks("ps") == 0
            and len(ctx.cluster.trainers) == 1
            and self.mode_config.mode != Mode.ALLREDUCE
        )
        """A cluster of one (:mod:`psflow.train.alone`): one task that trains, no ps; it trains
        in this process. (Several workers without ps train in all-reduce mode, or not at all.)"""
        self.pieces: list[Piece] = []
        """Where the parameters live on the ps (none in all-reduce mode; alone, one shard)."""
        placement = training.placement
        if not self.alone:
            check_has_ps(ctx, self.mode_config.mode)
        if self.config.export.export_dir is not None and (
            self.alone or self.mode_config.mode == Mode.ALLREDUCE
        ):
            raise ValueError("export_dir: the ps tasks write the exports; this job has none")
        if not self.alone and self.mode_config.mode != Mode.ALLREDUCE:
            self.pieces = (
                placement.place(model, ctx.cluster.num_tasks("ps"))
                if isinstance(placement, Placement)
                else list(placement)
            )
        if input is not None and not self.alone and self.mode_config.mode in _NO_POSITIONS:
            raise ValueError(
                f"input=: {self.mode_config.mode.value} training keeps no input positions (a "
                "step's gradients may be dropped or never reach a ps); train asynchronously "
                "or with bounded staleness"
            )
        self._input = None if input is None else InputTracker(input, str(ctx.task))
        """Numbers the inputs of ``input`` and keeps it where the ps stand."""
        self._client: ShardedClient | None = None
        ready_timeout = training.ready_timeout
        try:
            if self.is_chief and not self.alone and self.mode_config.mode != Mode.ALLREDUCE:
                self._client = ShardedClient(ctx, self.transport)
                self._client.wait_ready(ready_timeout, initialized=False)  # ps may be starting
                self._restore_or_nothing(ready_timeout)
            self.opt = self._optimizer(ready_timeout)
            self._watch_lookups()
            if self.alone:
                self._start_alone()
            elif self.opt.mode == Mode.ALLREDUCE:
                self._start_allreduce()
            if self._input is not None:
                self._input.resume(self.opt)
        except BaseException:
            if self._client is not None:
                self._client.close()
            opt = getattr(self, "opt", None)  # made, or not yet
            if opt is not None and (self._allreduce is not None or self._input is not None):
                opt.close(finished=False)
            raise
        self.global_step = self._last_save_step = self.opt.global_step
        if self.is_chief and self.config.checkpoint.checkpoint_dir is not None:
            self.checkpointer = self._checkpointer(self.config.checkpoint.checkpoint_dir)
        if self.is_chief and self.config.export.export_dir is not None:
            self.exporter = Exporter(
                self.config.export,
                make_client=lambda: ShardedClient(self.ctx, self.transport),
                pieces=self.pieces,
                params=dict(dense_parameters(self.model)),
            )
        for hook in self.hooks:
            hook.begin(self)
        if self.config.stop_on_sigterm:
            self._stop_on_sigterm()

    # -- start ------------------------------------------------------------------------------

    def _builtin_hooks(self) -> list[Hook]:
        cfg, last_step = self.config.summaries, self.config.last_step
        hooks: list[Hook] = []
        if self.config.nan_guard:
            hooks.append(NanGuardHook())
        if last_step is not None:
            hooks.append(StopAtStepHook(last_step))
        if self.is_chief and cfg.log_step_count_steps is not None:
            hooks.append(LoggingHook(every_n_steps=cfg.log_step_count_steps, last_step=last_step))
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
                config=self.config.training,
                engine=lambda given: LocalEngine(
                    self.model,
                    self.spec,
                    self.mode_config,
                    lr_schedule=self.lr_schedule,
                    optimizer_state=given,
                    tables=table_specs(tables_of(self.model), self.spec),
                    task=str(self.ctx.task),
                ),
                optimizer_state=state,
            )
        # The pieces placed once (the chief restored into them); the wait as the caller says.
        training = dataclasses.replace(
            self.config.training, placement=self.pieces, ready_timeout=ready_timeout
        )
        return DistributedOptimizer(self.model, self.ctx, config=training, optimizer_state=state)

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
        warned: set[str] = set()  # buffers of a dtype a checkpoint cannot hold: said once
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
            max_to_keep=self.config.checkpoint.max_to_keep,
            timeout=self.config.checkpoint.save_timeout,
            metrics=self.metrics,
            buffers=lambda: snapshot_buffers(self.model, warned=warned),
        )

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
        if self._input is not None:
            self._input.mark(self.opt)
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
        if self.exporter is not None:
            self.exporter.maybe_export()
        return self.global_step

    def _save_due(self) -> bool:
        cfg = self.config.checkpoint
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

    def export(self) -> str | None:
        """Exports for serving now and waits (chief with an ``export_dir``; elsewhere returns
        ``None``); returns the export's directory (:mod:`psflow.train.exports`)."""
        return None if self.exporter is None else self.exporter.export()

    @property
    def latest_checkpoint(self) -> str | None:
        if self.config.checkpoint.checkpoint_dir is None:
            return None
        return CheckpointDir(self.config.checkpoint.checkpoint_dir).latest()

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
                if self.exporter is not None:  # the served model gets the last rows too
                    self.exporter.export()
            else:
                if self.checkpointer is not None:
                    self.checkpointer.wait(raise_error=False)
                if self.exporter is not None:
                    self.exporter.wait(raise_error=False)
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

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)


MonitoredTrainingSession = TrainingSession
"""TensorFlow's name for :class:`TrainingSession`."""
