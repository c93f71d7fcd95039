"""The chief's restore at start, and every worker's recovery when a ps stopped answering: the
part of :class:`~psflow.train.TrainingSession` that brings the job back to its last checkpoint.

- at start (:meth:`Restoring._restore_or_nothing`): the latest checkpoint into the ps, or in
  all-reduce mode and alone into the chief's own model (:meth:`Restoring._start_allreduce`,
  :meth:`Restoring._start_alone`);
- after a ps failed to answer (:meth:`Restoring._recover`): wait for every ps, restore the
  shards that came back empty (with no checkpoint yet, initialise them again from the chief's
  model: :meth:`Restoring._initialise_again`), go on with a new optimizer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from torch import nn

from psflow import env as envvars
from psflow.cluster.spec import TaskContext
from psflow.protocol import Code, Key, OptimizerSpec, SaveState, ScheduleSpec
from psflow.protocol.messages import OPT_SEP
from psflow.ps.checkpoint import decode_shard
from psflow.train.alone import LocalEngine
from psflow.train.checkpoint import Checkpoint, Checkpointer, load_checkpoint
from psflow.train.checkpoint_buffers import model_buffers
from psflow.train.input_position import InputTracker
from psflow.train.local_shard import LocalShard
from psflow.train.manifest import CheckpointDir
from psflow.train.session_config import SessionConfig
from psflow.transport import PeerError, PeerLostError, PeerTimeoutError, TransportConfig
from psflow.worker import DistributedOptimizer, Mode, ShardedClient
from psflow.worker.heartbeat import Heartbeat
from psflow.worker.placement import Piece, dense_parameters
from psflow.worker.tables import TableClient, table_specs, tables_of

if TYPE_CHECKING:
    from psflow.worker.allreduce import AllReduceEngine

log = logging.getLogger("psflow.train.session")  # the session's own lines, by its name


class StopWaiting(Exception):
    """SIGTERM arrived while the session waited for a lost ps."""


class Restoring:
    """Restore and recovery, for :class:`~psflow.train.TrainingSession` (a mixin: the session
    holds the state below)."""

    config: SessionConfig
    model: nn.Module
    ctx: TaskContext
    spec: OptimizerSpec
    lr_schedule: ScheduleSpec | None
    transport: TransportConfig
    pieces: list[Piece]
    opt: DistributedOptimizer
    checkpointer: Checkpointer | None
    restored_from: str | None
    _client: ShardedClient | None
    _input: InputTracker | None
    _local: LocalShard | None
    _allreduce: AllReduceEngine | None
    _terminated: bool
    _waiting_for_ps: bool
    _stuck: dict[int, float]
    """The global step the last recovery was at, and since when it has failed (monotonic)."""
    global_step: int

    @property
    def is_chief(self) -> bool:
        """This task is the job's chief: it restores, checkpoints and writes summaries."""
        return self.ctx.is_chief

    def _optimizer(self, ready_timeout: float) -> DistributedOptimizer:
        raise NotImplementedError

    def _restore_or_nothing(self, timeout: float) -> None:
        """The chief: restore the latest checkpoint into the ps (else the optimizer inits);
        ``timeout`` bounds the ps's answer (they load the checkpoint's tables first)."""
        cfg = self.config.checkpoint
        if cfg.checkpoint_dir is None:
            return
        self._prune_incomplete(cfg.checkpoint_dir, spare=self._still_written(cfg.checkpoint_dir))
        if not cfg.restore:
            return
        # A ps that came back empty while this chief was away (both lost at once): every shard
        # is restored, as after a lost ps (_recover). Restoring the empty ones alone would mix
        # the checkpoint's values with the others' later ones, and their input positions from
        # two timelines (psflow.train.input_position).
        assert self._client is not None
        status = self._client.status()
        initialized = [bool(status[s].get(Key.INITIALIZED)) for s in sorted(status)]
        partial = any(initialized) and not all(initialized)
        if self._restore(replace=partial, timeout=timeout) and partial:
            empty = [self._client.shards[s] for s, up in enumerate(initialized) if not up]
            log.warning(
                "%s came back empty: every shard restored from %s",
                ", ".join(empty), self.restored_from,
            )  # fmt: skip

    @staticmethod
    def _prune_incomplete(checkpoint_dir: str, *, spare: Collection[str] = ()) -> None:
        removed = CheckpointDir(checkpoint_dir).prune(None, incomplete_below=2**62, spare=spare)
        if removed:  # left by a task killed mid-save
            log.info("removed incomplete checkpoints %s", ", ".join(removed))
        if spare:  # the next complete save removes them
            log.info("left incomplete checkpoints %s: a ps still writes them", ", ".join(spare))

    def _still_written(self, checkpoint_dir: str) -> list[str]:
        """The incomplete checkpoints some ps still writes: asked for by a chief before this
        one restarted (removed, the ps's write would fail; the ps refuses saves until done)."""
        assert self._client is not None
        saved = CheckpointDir(checkpoint_dir)
        shards = range(self._client.num_shards)
        writing = []
        for c in saved.checkpoints():
            if not c.complete:
                status = self._client.save_status({s: saved.url_of(c.name) for s in shards})
                if any(h.get(Key.STATE) == SaveState.WRITING for h in status.values()):
                    writing.append(c.name)
        return writing

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
            root=self.config.checkpoint.checkpoint_dir,
        )
        ckpt = None
        if self.is_chief and self.config.checkpoint.checkpoint_dir is not None:
            self._prune_incomplete(self.config.checkpoint.checkpoint_dir)
            ckpt = (
                load_checkpoint(self.config.checkpoint.checkpoint_dir)
                if self.config.checkpoint.restore
                else None
            )
            if ckpt is not None:
                self._restore_local(ckpt)
            else:
                log.info("no checkpoint in %s: initialising", self.config.checkpoint.checkpoint_dir)
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
            root=self.config.checkpoint.checkpoint_dir,
        )
        self.pieces = engine.pieces_here
        if self.config.checkpoint.checkpoint_dir is None:
            return
        self._prune_incomplete(self.config.checkpoint.checkpoint_dir)
        ckpt = (
            load_checkpoint(self.config.checkpoint.checkpoint_dir)
            if self.config.checkpoint.restore
            else None
        )
        if ckpt is None:
            log.info("no checkpoint in %s: initialising", self.config.checkpoint.checkpoint_dir)
            return
        self._restore_local(ckpt, "")
        engine.start_at(ckpt.global_step)

    def _restore_local(self, ckpt: Checkpoint, then: str = "; sending it to every rank") -> None:
        """The chief in all-reduce mode, or a cluster of one: ``ckpt`` (saved in any mode)
        into its model (and a cluster of one's tables)."""
        assert self._local is not None and self.config.checkpoint.checkpoint_dir is not None
        ckpt.check_model({n: p.detach() for n, p in dense_parameters(self.model).items()})
        ckpt.check_buffers(model_buffers(self.model))
        refused = ckpt.optimizer_state_refused(self.spec)
        if refused is not None:
            log.warning("%s: optimizer state not restored: %s", ckpt.name, refused)
        d = CheckpointDir(self.config.checkpoint.checkpoint_dir)
        n = ckpt.manifest.num_shards
        self._local.load(
            ckpt, optimizer_state=refused is None, table_files=d.shard_urls(ckpt.name, n)
        )
        self._restore_buffers(ckpt)
        self.restored_from = ckpt.name
        log.info(
            "restored %s from %s (global step %d, saved on %d ps)%s",
            self.model.__class__.__name__,
            d.url_of(ckpt.name),
            ckpt.global_step,
            n,
            then,
        )

    def _restore_buffers(self, ckpt: Checkpoint) -> None:
        """The checkpoint's buffers (a BatchNorm's running statistics) into the chief's model,
        checked by :meth:`Checkpoint.check_buffers` already; a checkpoint saved before they were
        leaves the model's as they are, said when the model has some."""
        if not ckpt.load_buffers(self.model) and model_buffers(self.model):
            log.info(
                "%s holds no buffers (saved before psflow saved them): the model's stay as "
                "they are",
                ckpt.name,
            )

    def _restore(self, *, replace: bool, timeout: float) -> bool:
        """The chief: loads the latest checkpoint into the ps; False when there is none.

        With ``replace``, shards that are already initialised take its values too. ``timeout``
        bounds the ps's answer, not one request's ``PSFLOW_TIMEOUT``: a ps loads the
        checkpoint's tables before it answers.
        """
        cfg = self.config.checkpoint
        assert cfg.checkpoint_dir is not None
        d = CheckpointDir(cfg.checkpoint_dir)
        # Every part checked here, the tables' rows a file at a time and let go: each ps reads
        # its own rows (TABLES_FROM), and the chief never holds a table whole.
        ckpt = load_checkpoint(cfg.checkpoint_dir, table_rows=False)
        if ckpt is None:
            log.info("no checkpoint in %s: initialising", cfg.checkpoint_dir)
            return False
        ckpt.check_model({n: p.detach() for n, p in dense_parameters(self.model).items()})
        ckpt.check_buffers(model_buffers(self.model))  # before the ps take anything
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
        try:
            fresh = self._client.initialize_restored(
                values,
                plain,
                spec,
                ckpt.global_step,
                replace=replace,
                schedule=self.lr_schedule,
                tables=[t.to_wire() for t in tables],
                tables_from=d.shard_urls(ckpt.name, ckpt.manifest.num_shards),
                timeout=timeout,
            )
        except PeerError as e:
            if isinstance(e, PeerTimeoutError | PeerLostError):
                raise  # no answer: the recovery's to handle, not a refusal
            # The ps's own one-line reason is what the user needs, not the client's traceback.
            raise ValueError(
                f"{d.url_of(ckpt.name)}: {e.peer} refused the restore: {e.detail}"
            ) from None
        # The chief's own buffers (not the ps's): the checkpoint's, even where the ps were
        # already initialised (this chief restarted: its buffers are a new model's).
        self._restore_buffers(ckpt)
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

    def _watch_lookups(self) -> None:
        """A table's lookup in the forward pass that meets a lost ps recovers as a step does
        (:meth:`_recover`), then asks the tables' new source again. Not with ``input=``: the
        batch in that forward was read past what the ps hold, and the reader goes back to
        where they stand (it fails, and the job's restart replays exactly)."""
        exchange = getattr(self.opt.engine, "exchange", None)
        tables = getattr(exchange, "tables", None)
        if isinstance(tables, TableClient) and tables and self._input is None:
            tables.on_lost = self._lost_in_a_lookup

    def _lost_in_a_lookup(self, error: PeerError) -> None:
        # _recover attaches a new source to the tables or raises: the table never asks the
        # old one again (a lost ps or a timeout, never SIGTERM's STOPPING refusal).
        log.warning("%s: a table's lookup met a lost ps (%s): recovering", self.ctx.task, error)
        self.global_step = self._recover(error)

    def _recover(self, error: PeerError) -> int:
        """After a ps failed to answer: waits for every ps to answer again; the chief restores
        the latest checkpoint into every shard when one came back empty (a crashed ps that its
        cluster manager restarted), or with no checkpoint initialises the empty ones again from
        its own model; then a new optimizer pulls. Returns the global step.
        """
        timeout = self.config.recovery_timeout
        lost = isinstance(error, PeerTimeoutError | PeerLostError)  # not a refused request
        if timeout is None or not lost or self.opt.mode == Mode.ALLREDUCE:
            raise error
        # Every ps answering again does not make a step that cannot complete complete (a sync
        # step awaiting a worker hung in its own code, whose heartbeat still beats): one step
        # failing for longer than the recovery timeout ends the recoveries.
        step = self.global_step
        first = self._stuck.get(step, time.monotonic())
        self._stuck = {step: first}
        if time.monotonic() - first > timeout:
            raise RuntimeError(
                f"{self.ctx.task}: global step {step} has failed for {time.monotonic() - first:.0f}"
                f" s, every ps answering (longer than {envvars.PSFLOW_RECOVERY_TIMEOUT}, "
                f"{timeout:g} s): {error}"
            ) from error
        log.warning(
            "%s: %s; waiting up to %g s for every ps to answer", self.ctx.task, error, timeout
        )
        self._waiting_for_ps = True
        # The ps keep hearing from this task while it waits (a ps still up would otherwise
        # declare it dead, and fail the steps of the others that wait for it).
        heartbeat = Heartbeat(self.ctx, self.transport)
        try:
            return self._wait_and_restore(error, timeout, heartbeat)
        except StopWaiting:
            raise RuntimeError(
                f"{self.ctx.task} stopped by SIGTERM while it waited for the ps ({error})"
            ) from error
        finally:
            heartbeat.stop()
            self._waiting_for_ps = False

    def _wait_and_restore(self, error: PeerError, timeout: float, heartbeat: Heartbeat) -> int:
        self.opt.close(finished=False)
        heartbeat.start()
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
            empty = sorted(
                s for s, h in self._client.status().items() if not h.get(Key.INITIALIZED)
            )
            if empty:
                names = ", ".join(self._client.shards[s] for s in empty)
                restored = self.config.checkpoint.checkpoint_dir is not None and self._restore(
                    replace=True, timeout=timeout
                )
                if restored:
                    log.warning(
                        "%s came back empty: every shard restored from %s",
                        names, self.restored_from,
                    )  # fmt: skip
                else:
                    self._initialise_again(empty, timeout)
        else:  # the wait named for what it is (the optimizer's own names the ready timeout)
            waiting = ShardedClient(self.ctx, self.transport)
            try:
                waiting.wait_ready(timeout, setting=envvars.PSFLOW_RECOVERY_TIMEOUT)
            finally:
                waiting.close()
        self.opt = self._optimizer(timeout)
        self._watch_lookups()
        if self._input is not None:  # where the ps stand now: maybe a checkpoint's positions
            self._input.resume(self.opt)
        log.warning("%s: training goes on at global step %d", self.ctx.task, self.opt.global_step)
        return self.opt.global_step

    def _initialise_again(self, shards: list[int], timeout: float) -> None:
        """The chief, after ``shards`` came back empty with no checkpoint to restore them from:
        initialises them as at the job's start (:meth:`ParameterExchange.start
        <psflow.worker.exchange.ParameterExchange.start>`), from this model's values (the last
        it pulled: the freshest there are) at the last global step it saw, their tables' rows
        from the tables' seeds (a table the model held rows of when the job began gave them
        to the ps then: they are not held any longer). What only the lost shards held is lost:
        their optimizer state and table rows. The other shards keep their values (they answer
        the init with ``already``)."""
        assert self._client is not None
        params = dense_parameters(self.model)
        values = {
            s: [
                (p.var, params[p.param].detach()[slice(*p.rows) if p.rows else slice(None)])
                for p in self.pieces
                if p.shard == s
            ]
            for s in shards
        }
        specs = table_specs(tables_of(self.model), self.spec)
        tables = [t.to_wire() for t in specs] or None
        step = self.global_step
        self._client.initialize(
            values, self.spec, step, schedule=self.lr_schedule, tables=tables, timeout=timeout
        )
        names = ", ".join(self._client.shards[s] for s in shards)
        where = self.config.checkpoint.checkpoint_dir
        rows = ", ".join(t.name for t in specs)
        lost = "their optimizer state" + (f" and their rows of tables {rows}" if specs else "")
        kept = len(shards) < self._client.num_shards
        log.warning(
            "%s came back empty and there is no checkpoint%s to restore from: initialised "
            "again from %s's values (its last pull) at global step %d; lost: %s since the "
            "job's start, and what other workers pushed since that pull; nothing else%s",
            names,
            f" in {where}" if where is not None else " (no checkpoint_dir)",
            self.ctx.task,
            step,
            lost,
            " (the other shards keep theirs)" if kept else "",
        )

    def _ended_by_sigterm(self, error: PeerError) -> int:
        """After SIGTERM: a synchronous step that can no longer complete (the other workers,
        signalled too, finished first) ends the loop like the signal; the ps keep the last
        complete step, which the final checkpoint saves. Any other error stands."""
        if error.code != Code.STOPPING:
            return self._recover(error)
        log.warning("%s: %s; this step is dropped", self.ctx.task, error)
        return self.global_step
