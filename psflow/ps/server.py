"""The ps task: serves one shard until every worker has finished.

Requests (:class:`~psflow.protocol.Op`, the ``op`` of the header), each served by the one
:class:`~psflow.ps.service.Service` registered for it:

- ``hello``/``status``: shard index, whether initialised, the step, who has finished.
- ``init``: the chief's initial values, optimizer and learning-rate schedule for this shard
  (ignored when already set, unless the chief asks to ``replace`` them: a restore after
  another ps crashed). With a schedule, every reply carries the learning rate (``lr``) the
  shard applies at the reply's step.
- ``pull``: the current values (all, or the names listed in ``names``).
- ``push``: gradients, applied with the shard's optimizer; replies with the new step.
- ``push_pull``: ``push`` then ``pull`` in one round trip.
- ``done``: a worker (or the chief) has finished; after the last one the server exits.
- ``heartbeat``: a worker is alive. A worker (or the chief) silent for ``worker_timeout``
  seconds (``PSFLOW_WORKER_TIMEOUT``, 30) after its first request is dead
  (:mod:`psflow.ps.liveness`): the services stop waiting for it, and the server exits once
  every worker has finished or is dead (and one has finished). A dead worker that speaks again
  rejoins.
- ``sync_push``/``sync_stage``/``sync_pull``/``sync_status``/``ssp_wait``: synchronous
  training and bounded staleness (:class:`~psflow.ps.sync.SyncService`).
- ``save``/``save_status``: snapshot the shard and write it in the background; report progress
  (:class:`~psflow.ps.checkpoint.CheckpointService`). ``init`` may carry optimizer state and
  the step of a restore. A ps given the job's checkpoint directory (``checkpoint_dir``, or
  ``PSFLOW_CHECKPOINT_DIR``) writes only into its ``ckpt-<step>`` directories.

``init``, ``save`` and ``save_status`` are served to the chief alone, ``done`` finishes its
sender: the sender is the task the header names (anyone without CurveZMQ keys; a holder of the
job's one client key with them).

Every request is validated; a bad one gets an error reply with a :class:`~psflow.protocol.Code`
and a log line (at most one per op every ``PSFLOW_WAIT_LOG_SECONDS``), and the server goes on
serving: whatever one request raises fails that request alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from psflow import allocator, metrics
from psflow import env as envvars
from psflow.cluster.spec import TaskContext, TaskSpec
from psflow.protocol import Code, Key, Op, OptimizerSpec, ScheduleSpec
from psflow.protocol.messages import prefetch_tensor_names
from psflow.ps.checkpoint import (
    CheckpointService,
    is_checkpoint_of,
    load_optimizer_state,
    split_init_tensors,
)
from psflow.ps.liveness import DEFAULT_TIMEOUT, Liveness
from psflow.ps.service import Handler, NotInitializedError, RequestError, Service
from psflow.ps.store import ShardStore
from psflow.ps.sync import SyncService
from psflow.ps.tables import (
    FirstRows,
    TableService,
    build_tables,
    check_lookup,
    count_rows,
    lookup_rows,
    restore_tables,
    row_specs,
    set_initial_rows,
    split_initial_rows,
    split_prefetch,
    split_rows,
    table_specs,
)
from psflow.transport import Request, Server, TransportConfig, wire
from psflow.transport.monitor import RateLimitedLog

log = logging.getLogger(__name__)


_POLL_SECONDS = 0.1

TERM_SECONDS = 20.0
"""At most this long a ps serves on after SIGTERM: the chief's final checkpoint goes through it,
within Kubernetes' default grace period of 30 s (and ``psflow launch``'s)."""
TERM_IDLE_SECONDS = 5.0
"""After SIGTERM, a ps stops once no request has come for this long (its workers are gone, or
stopped without saying ``done``): longer than a slow step, so a worker still finishing its
last step finds its ps."""

# Bound once: reading an enum member off its class costs more than the dict lookup it serves,
# and push/push_pull run thousands of times a second.
_OP, _STEP, _OK, _LR, _ROWS = Key.OP, Key.STEP, Op.OK, Key.LEARNING_RATE, Key.ROWS
_PREFETCH = Key.PREFETCH
_TASK = Key.TASK

_LATE = frozenset({Op.DONE.value, Op.HEARTBEAT.value})
"""Requests a finished worker may still have in flight: ``done`` again, and a heartbeat from its
own sockets that its ``done`` overtook. Any other request from it is a new incarnation's."""

_CHIEF_ONLY = frozenset({Op.INIT.value, Op.SAVE.value, Op.SAVE_STATUS.value})
"""Requests that act on the whole job, served to the chief alone: only the chief initialises
(or, with ``replace``, restores) the shard and checkpoints it. The sender is whom the header names (:attr:`Key.TASK`): without
CurveZMQ keys any peer can claim any name; with them, only holders of the job's client key."""


class ParameterServer:
    """Serves the shard of one ps task.

    ``checkpoint_dir`` (default ``PSFLOW_CHECKPOINT_DIR``): the job's checkpoint directory,
    the only place a ``save`` may write this shard to (its ``ckpt-<step>`` directories).
    ``worker_timeout`` (default ``PSFLOW_WORKER_TIMEOUT``, 30): seconds of silence after which
    a worker that has joined is dead (:mod:`psflow.ps.liveness`).

    Example:
        >>> # in the training script, for the ps tasks:
        >>> # ctx, _ = psflow.resolve()
        >>> # if ctx.job == "ps":
        >>> #     psflow.ParameterServer(ctx, checkpoint_dir=logdir).join()  # until workers are done
    """

    def __init__(
        self,
        ctx: TaskContext,
        config: TransportConfig | None = None,
        *,
        idle_timeout: float | None = None,
        checkpoint_dir: str | None = None,
        worker_timeout: float | None = None,
    ) -> None:
        if ctx.task.job != "ps":
            raise ValueError(f"a ParameterServer runs on a ps task, not {ctx.task}")
        self.ctx = ctx
        if checkpoint_dir is None:
            checkpoint_dir = os.environ.get(envvars.PSFLOW_CHECKPOINT_DIR) or None
        if checkpoint_dir is not None and not isinstance(checkpoint_dir, str):
            raise TypeError(f"checkpoint_dir must be a path or URL, got {checkpoint_dir!r}")
        self.checkpoint_dir = checkpoint_dir
        """The job's checkpoint directory: ``save`` writes only into its ``ckpt-<step>``."""
        self.config = config or TransportConfig.from_env()
        if idle_timeout is None:
            idle_timeout = float(os.environ.get(envvars.PSFLOW_PS_IDLE_TIMEOUT, 1800))
        if idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be > 0 seconds, got {idle_timeout}")
        self.idle_timeout = idle_timeout
        self._bad_log = RateLimitedLog(log, self.config.wait_log_seconds)
        allocator.tune()
        self.store = ShardStore()
        self.trainers = {str(t) for t in ctx.cluster.trainers}
        self.finished: set[str] = set()
        if worker_timeout is None:
            worker_timeout = envvars.seconds(envvars.PSFLOW_WORKER_TIMEOUT, DEFAULT_TIMEOUT)
        self.liveness = Liveness(self.trainers, worker_timeout)
        """Who has been heard from lately; who is dead."""
        self._unjoined_since: float | None = None
        """When every joined worker was finished or dead while others had never joined."""
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._term_at: float | None = None
        """When SIGTERM came (to :meth:`join`), if it did."""
        self._term_logged = False
        self._thread: threading.Thread | None = None
        self._server: Server | None = None
        self._handlers: dict[str, Handler] = {}
        self._owners: dict[str, str] = {}
        self._services: list[Service] = []
        self.metrics = metrics.for_task(self.name, ctx.host).ps(self.shard)
        """This shard's Prometheus metrics (:mod:`psflow.metrics`)."""
        self._add_handlers(
            "the server",
            {
                Op.HELLO: self._status,
                Op.STATUS: self._status,
                Op.INIT: self._init,
                Op.PULL: self._pull,
                Op.PUSH: self._push,
                Op.PUSH_PULL: self._push_pull,
                Op.DONE: self._done,
                Op.HEARTBEAT: self._heartbeat,
            },
        )
        self.register(SyncService(self))
        self.register(TableService(self))
        self.register(
            CheckpointService(
                self, num_shards=ctx.cluster.num_tasks("ps"), root=self.checkpoint_dir
            )
        )
        self._requests = {op: self.metrics.requests(Op(op).value) for op in self._handlers}
        self.metrics.watch(
            step=lambda: self.store.step,
            nbytes=lambda: sum(t.nbytes for t in list(self.store.variables.values())),
            waiting=self._waiting,
            tables=lambda: {n: t.stats for n, t in list(self.store.tables.items())},
        )

    @property
    def name(self) -> str:
        """The ps task, as ``ps:0``."""
        return str(self.ctx.task)

    @property
    def shard(self) -> int:
        """The index of the shard this server holds."""
        return self.ctx.task.index

    @property
    def dead(self) -> AbstractSet[str]:
        """The workers silent for longer than the worker timeout."""
        return self.liveness.dead

    @property
    def services(self) -> tuple[Service, ...]:
        """The registered services, in the order they were registered."""
        return tuple(self._services)

    def register(self, service: Service) -> None:
        """Serves ``service``'s ops from now on, and tells it of the server's life.

        Raises:
            ValueError: when one of its ops is served already (by the server or a service
                registered before), or is not an :class:`~psflow.protocol.Op`.
            RuntimeError: when the server has started.
        """
        if self._thread is not None:
            raise RuntimeError(f"register {type(service).__name__} before {self.name} starts")
        self._add_handlers(type(service).__name__, service.handlers())
        self._services.append(service)

    def _add_handlers(self, owner: str, handlers: Mapping[Op, Handler]) -> None:
        ops: list[Op] = []
        for op in handlers:
            try:
                ops.append(Op(op))
            except ValueError:
                raise ValueError(f"{owner} serves {op!r}, not a psflow.protocol.Op") from None
        taken = [f"{op} (by {self._owners[op]})" for op in ops if op in self._handlers]
        if taken:
            raise ValueError(f"{owner} cannot serve ops already served: {', '.join(taken)}")
        for op in ops:
            self._handlers[op] = handlers[op]
            self._owners[op] = owner

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> ParameterServer:
        """Binds the address and starts serving in a background thread; returns when ready."""
        if self._thread is not None:
            return self
        address = self.ctx.address
        assert address is not None
        self._server = Server(address, self.config)
        self._thread = threading.Thread(target=self._serve, name=f"psflow-{self.name}", daemon=True)
        self._thread.start()
        self.ready.set()
        log.info("%s serving on %s", self.name, address)
        return self

    def join(self, timeout: float | None = None) -> None:
        """Serves until every worker has finished (starting first if needed).

        Called from the main thread, it takes SIGTERM (unless the script handles it): the ps
        serves on while its workers still ask (a chief stopped by the same SIGTERM saves a
        last checkpoint), and stops once none has asked for :data:`TERM_IDLE_SECONDS`, after
        :data:`TERM_SECONDS` at most, or at a second SIGTERM; ``join`` then returns.

        Raises:
            TimeoutError: when ``timeout`` passes first.
            RuntimeError: when the server stopped on an error (such as no worker for
                ``idle_timeout`` seconds).
        """
        self.start()
        assert self._thread is not None
        with self._sigterm():
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} still serving after {timeout} s")
        # Background work (a shard file still being written), within one timeout for all.
        deadline = time.monotonic() + self.config.timeout
        for service in self._services:
            service.wait(max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            raise RuntimeError(f"{self.name} stopped: {self.error}") from self.error

    @contextlib.contextmanager
    def _sigterm(self) -> Iterator[None]:
        if (
            threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        ):
            yield  # the script's own handler stands
            return

        def on_term(_signum: int, _frame: object) -> None:
            # Nothing that takes a lock here: the serving thread logs what happens.
            if self._term_at is None:
                self._term_at = time.monotonic()
            else:
                self._stop.set()

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def stop(self, timeout: float = 10.0) -> None:
        """Stops serving and closes the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> ParameterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop ---------------------------------------------------------------------------

    def _serve(self) -> None:
        server = self._server
        assert server is not None
        last_seen = time.monotonic()
        liveness = self.liveness
        # Often enough that a death is noticed within a tenth of the timeout of its bound.
        check_every = min(0.5, liveness.timeout / 10)
        next_check = last_seen + check_every
        try:
            while not self._stop.is_set():
                try:
                    request = server.recv(_POLL_SECONDS)
                except wire.WireError as e:
                    self._bad_log.warning(
                        "malformed", "%s: rejected a malformed message: %s", self.name, e
                    )
                    continue
                now = time.monotonic()
                if request is not None:
                    last_seen = now
                    self._heard(request, now)
                    self._handle(request)
                    sender = request.header.get(_TASK)
                    if isinstance(sender, str):
                        # Its request had this ps's attention until now: a long one (an init
                        # allocating the tables) is no silence of the sender's.
                        now = time.monotonic()
                        liveness.heard(sender, now)
                    if self.finished >= self.trainers:
                        log.info("%s: every worker has finished; exiting", self.name)
                        break
                if now >= next_check:
                    next_check = now + check_every
                    # What came while this ps was busy (or stalled) is no silence either.
                    try:
                        for waiting in server.waiting():
                            self._heard(waiting, now)
                    except wire.WireError as e:  # answered already, as recv would have
                        self._bad_log.warning(
                            "malformed", "%s: rejected a malformed message: %s", self.name, e
                        )
                    for worker in liveness.check(now, self.finished):
                        self._declare_dead(worker, now)
                    if self._over_without_the_dead(now):
                        break
                if request is None and now - last_seen > self.idle_timeout:
                    missing = sorted(self.trainers - self.finished)
                    raise TimeoutError(
                        f"no request for {self.idle_timeout:g} s; still waiting for "
                        f"{', '.join(missing)} to finish"
                    )
                if self._term_at is not None and self._terminated(last_seen):
                    break
            if self._stop.is_set() and self._term_at is not None:
                log.info("%s: a second SIGTERM: stopping now", self.name)
        except BaseException as e:
            self.error = e
            log.error("%s: %s", self.name, e)
        finally:
            reason = f"{self.name} stopped" + (f": {self.error}" if self.error else "")
            for service in self._services:
                service.on_stopping(reason)
            with contextlib.suppress(TimeoutError):
                server.flush(self.config.timeout)
            server.close(linger=2.0)  # let the last replies ('done') reach the workers

    def _heard(self, request: Request, now: float) -> None:
        """Notes ``request``'s sender as alive (a dead or finished one rejoins)."""
        sender = request.header.get(_TASK)
        if not isinstance(sender, str):
            return
        if self.liveness.heard(sender, now):
            self._back(sender, "declared dead, is back")
        elif sender in self.finished and request.header.get(_OP) not in _LATE:
            # A task that said done and is started again (psflow launch --max-restarts, or a
            # pod's restart policy): its requests must count.
            self.finished.discard(sender)
            self._back(sender, "finished, speaks again (restarted)")

    def _declare_dead(self, worker: str, now: float) -> None:
        silence = self.liveness.silence(worker, now)
        reason = (
            f"{worker} is dead: {self.name} has not heard from it for {silence:.1f} s "
            f"({envvars.PSFLOW_WORKER_TIMEOUT}={self.liveness.timeout:g})"
        )
        log.warning("%s: %s", self.name, reason)
        for service in self._services:
            service.on_worker_dead(worker, reason)

    def _back(self, worker: str, how: str) -> None:
        log.info("%s: %s, %s: it rejoins", self.name, worker, how)
        for service in self._services:
            service.on_worker_back(worker)

    def _over_without_the_dead(self, now: float) -> bool:
        """Whether the job is over although not every worker said ``done``: each one has
        finished or is dead (and one has finished); one that never joined is waited for one
        worker timeout more."""
        if not self.finished:
            return False
        joined = self.liveness.joined()
        gone = self.finished | self.liveness.dead
        if not all(w in gone for w in joined):
            self._unjoined_since = None
            return False
        never = sorted(self.trainers - gone - joined)
        if never:
            if self._unjoined_since is None:
                self._unjoined_since = now
            if now - self._unjoined_since <= self.liveness.timeout:
                return False
        dead = sorted(self.liveness.dead - self.finished)
        log.warning(
            "%s: every worker has finished or is gone; exiting without %s",
            self.name,
            ", ".join([f"{w} (dead)" for w in dead] + [f"{w} (never joined)" for w in never]),
        )
        return True

    def _terminated(self, last_seen: float) -> bool:
        """After SIGTERM: whether to stop now (nobody asks any more, or time is up)."""
        assert self._term_at is not None
        now = time.monotonic()
        if not self._term_logged:
            self._term_logged = True
            waiting = ", ".join(sorted(self.trainers - self.finished)) or "nobody"
            log.info(
                "%s received SIGTERM: serving on while its workers ask (for %s), at most %g s",
                self.name,
                waiting,
                TERM_SECONDS,
            )
        if now - last_seen >= TERM_IDLE_SECONDS or now - self._term_at >= TERM_SECONDS:
            log.info("%s: stopping on SIGTERM", self.name)
            return True
        return False

    def _handle(self, request: Request) -> None:
        op = request.header[_OP]
        handler = self._handlers.get(op)
        counter = self._requests.get(op)
        if counter is not None:
            counter.inc()
        try:
            if handler is None:
                raise RequestError(f"unknown op {wire.brief(op)}")
            if op in _CHIEF_ONLY:
                chief = str(self.ctx.cluster.chief)
                if self.sender(request) != chief:
                    raise RequestError(f"only the chief ({chief}) may ask for {op!r}")
            handler(request)
        except RequestError as e:
            self._refuse_bad(request, e, e.code)
        except wire.WireError as e:  # a ValueError too: the tensors do not match the header
            self._refuse_bad(request, e, Code.MALFORMED)
        except (ValueError, TypeError) as e:
            self._refuse_bad(request, e, Code.REFUSED)
        except Exception as e:
            # A request nobody foresaw (a bug, or input that slipped past the checks) fails
            # alone: the shard validates before it changes, and the other workers go on.
            log.exception("%s: %r request from %s failed", self.name, op, self.sender(request))
            self.refuse(request, f"{type(e).__name__}: {e}", Code.REFUSED)

    def _refuse_bad(self, request: Request, error: Exception, code: Code) -> None:
        op = request.header[_OP]
        # At most one line per op and wait_log_seconds: a peer that sends garbage in a loop
        # must not fill the disk with this ps's log.
        key = op if op in self._handlers else "unknown"
        self._bad_log.warning(
            key,
            "%s: bad %s request from %s: %s",
            self.name,
            wire.brief(op),
            wire.brief(self.sender(request)),
            error,
        )
        self.refuse(request, str(error), code)

    # -- what services use (psflow.ps.service.ServiceHost) ----------------------------------

    def _waiting(self) -> int:
        """Requests received and not answered yet (read when the metrics are scraped)."""
        queued = 0 if self._server is None else self._server.queued
        return queued + sum(s.waiting for s in self._services)

    def sender(self, request: Request) -> str:
        """The task that sent ``request`` (as it says), for messages."""
        sender = request.header.get(Key.TASK)
        return sender if isinstance(sender, str) else "an unnamed client"

    def tensors(
        self,
        request: Request,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        transient: bool = False,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors of ``request``, validated (see ``Server.tensors``)."""
        assert self._server is not None
        return self._server.tensors(request, into=into, transient=transient)

    def reply(
        self,
        request: Request,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] | wire.TensorSet = (),
    ) -> None:
        """Answers ``request`` (op ``ok`` and the shard's step unless ``header`` says)."""
        assert self._server is not None
        header.setdefault(_OP, _OK)
        header.setdefault(_STEP, self.store.step)
        if self.store.schedule is not None:
            header.setdefault(_LR, self.store.learning_rate())
        self._server.reply(request, header, tensors)

    def reply_tensors(
        self, request: Request, specs: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> list[torch.Tensor] | None:
        """Tensors to fill and answer ``request`` with, made where the reply goes (see
        ``Server.reply_tensors``), or ``None``."""
        assert self._server is not None
        return self._server.reply_tensors(request, specs)

    def refuse(self, request: Request, message: str, code: Code) -> None:
        """Answers ``request`` with an error of kind ``code``."""
        assert self._server is not None
        self._server.send_error(request, message, code)

    def flush(self) -> None:
        """Waits until every reply's tensors have left (call it before changing variables)."""
        # Values still being sent from their own memory must not change under the sender.
        assert self._server is not None
        self._server.flush(self.config.timeout)

    def require_initialized(self) -> None:
        """Raises :class:`NotInitializedError` unless the chief has initialised the shard."""
        if not self.store.initialized:
            raise NotInitializedError(
                f"{self.name} is not initialised yet (the chief initialises it)"
            )

    # -- the server's own ops ---------------------------------------------------------------

    def _status(self, request: Request) -> None:
        self.reply(
            request,
            {
                Key.SHARD: self.shard,
                Key.INITIALIZED: self.store.initialized,
                Key.FINISHED: sorted(self.finished),
                Key.DEAD: sorted(self.liveness.dead),
                Key.VARIABLES: {
                    n: [wire.dtype_name(t.dtype), list(t.shape)]
                    for n, t in self.store.variables.items()
                },
            },
        )

    def _init(self, request: Request) -> None:
        tensors = self.tensors(request)
        if self.store.initialized:
            if request.header.get(Key.REPLACE) is not True:
                self.reply(request, {Key.INITIALIZED: True, Key.ALREADY: True})
                return
            # The chief (_CHIEF_ONLY) restores every shard after one came back empty (a
            # crashed ps).
            chief = str(self.ctx.cluster.chief)
            self.store.reset()  # new tensors: values still being sent keep their own memory
            # Synchronous steps in progress belong to the lost timeline: their workers recover.
            for service in self._services:
                service.on_restored(f"{self.name} was restored from a checkpoint by {chief}")
        spec = OptimizerSpec.from_wire(request.header.get(Key.OPTIMIZER))
        wired = request.header.get(Key.LR_SCHEDULE)
        schedule = None if wired is None else ScheduleSpec.from_wire(wired)
        step = request.header.get(Key.STEP, 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bad initial step {step!r}")
        tensors, first_rows = split_initial_rows(request.header, tensors)
        tensors, opt_tensors, opt_plain = split_init_tensors(request.header, tensors)
        specs = table_specs(request.header)
        tables_from = self._tables_from(request)
        tables = build_tables(specs, self.shard, self.ctx.cluster.num_tasks("ps"))
        set_initial_rows(tables, first_rows)  # the chief's model held them
        self.store.initialize(tensors, spec, step=step, schedule=schedule, tables=tables)
        try:
            if opt_tensors or opt_plain:
                load_optimizer_state(self.store, opt_tensors, opt_plain)
            if tables_from:
                restore_tables(self.store.tables, tables_from)
        except (ValueError, KeyError, RuntimeError) as e:
            self.store.reset()  # not initialised: the chief may try again
            raise ValueError(f"cannot restore the optimizer state or tables: {e}") from None
        log.info(
            "%s initialised by %s: %d variables, %d tables%s, %.1f MB, optimizer %s%s",
            self.name,
            self.sender(request),
            len(tensors),
            len(tables),
            " (restored)" if tables_from else _given(first_rows),
            self.store.nbytes() / 1e6,
            spec.name,
            "" if schedule is None else f", lr_schedule {schedule.describe()} at step {step}",
        )
        self.reply(request, {Key.INITIALIZED: True, Key.ALREADY: False})

    def _tables_from(self, request: Request) -> list[str]:
        """The checkpoint files a restoring init (the chief's) reads its tables from: only
        shard files of a checkpoint under this ps's checkpoint directory, when it has one."""
        urls = request.header.get(Key.TABLES_FROM)
        if urls is None:
            return []
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"'{Key.TABLES_FROM}' must be a list of shard file URLs")
        root = self.checkpoint_dir
        if root is not None:
            outside = [u for u in urls if not is_checkpoint_of(root, u.rsplit("/", 1)[0])]
            if outside:
                raise ValueError(
                    f"tables are restored only from {root}/ckpt-<step> (this ps's checkpoint "
                    f"directory), not {outside[0]!r}"
                )
        return urls

    def _pull(self, request: Request) -> None:
        self.require_initialized()
        names = request.header.get(Key.NAMES)
        tensors: list[tuple[str, torch.Tensor]] | wire.TensorSet
        if names is None:
            tensors = self.store.wire_set
        else:
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("'names' must be a list of variable names")
            missing = [n for n in names if n not in self.store.variables]
            if missing:
                raise ValueError(f"unknown variable(s) {missing}")
            tensors = [(n, self.store.variables[n]) for n in names]
        self.reply(request, {}, tensors)

    def _push(self, request: Request) -> None:
        step, prefetch = self._apply_push(request)
        if not prefetch:
            self.reply(request, {_STEP: step})
            return
        self._reply_with_rows(request, step, [], prefetch)

    def _push_pull(self, request: Request) -> None:
        step, prefetch = self._apply_push(request)
        if not prefetch:
            self.reply(request, {_STEP: step}, self.store.wire_set)
            return
        self._reply_with_rows(request, step, list(self.store.variables.items()), prefetch)

    def _apply_push(self, request: Request) -> tuple[int, dict[str, torch.Tensor]]:
        """Applies a push; returns the new step and the ids per table whose rows it asks to
        prefetch (copies: the rows may be made where they were)."""
        self.require_initialized()
        # Applied before the reply: gradients in a shared-memory lane need no copy.
        grads = self.tensors(request, into=self.store.grad_buffers, transient=True)
        rows = None
        header = request.header
        prefetch: dict[str, torch.Tensor] = {}
        if _PREFETCH in header:
            grads, prefetch = split_prefetch(header, grads)
            check_lookup(self.store.tables, prefetch)  # before anything changes
            prefetch = {name: ids.clone() for name, ids in prefetch.items()}
        if _ROWS in header:
            grads, rows = split_rows(header, grads)
        self.flush()
        start = time.perf_counter()
        if self.store.schedule is None or self.shard == 0:
            step = self.store.apply(grads, rows=rows)  # validates first: a bad push changes nothing
        else:
            # Shard 0 keeps the global step; the others learn it (their schedule's) from pushes.
            step = self.store.apply(grads, global_step=header.get(_STEP), rows=rows)
        self.metrics.apply_seconds.observe(time.perf_counter() - start)
        if rows:
            count_rows(self.metrics, rows, pushed=True)
        return step, prefetch

    def _reply_with_rows(
        self,
        request: Request,
        step: int,
        dense: list[tuple[str, torch.Tensor]],
        prefetch: dict[str, torch.Tensor],
    ) -> None:
        """Answers a push with ``dense`` and the rows of the ``prefetch`` ids (named
        ``<table>#rows``), read after its update: gathered straight into the lane that
        carries the reply, where there is one."""
        tables = self.store.tables
        names = [prefetch_tensor_names(n)[1] for n in prefetch]
        specs = [(t.dtype, tuple(t.shape)) for _, t in dense] + row_specs(tables, prefetch)
        out = self.reply_tensors(request, specs)
        if out is None:
            fetched = lookup_rows(tables, prefetch)
        else:
            placed = out[: len(dense)]
            for (_, value), place in zip(dense, placed, strict=True):
                place.copy_(value)
            dense = [(name, place) for (name, _), place in zip(dense, placed, strict=True)]
            fetched = lookup_rows(tables, prefetch, out[len(dense) :])
        count_rows(self.metrics, prefetch, pushed=False)
        rows = [(name, t) for name, (_, t) in zip(names, fetched, strict=True)]
        self.reply(request, {_STEP: step}, [*dense, *rows])

    def _heartbeat(self, request: Request) -> None:
        # Heard already (the serving loop notes every sender); the reply tells the worker its
        # ps is alive too.
        self.reply(request, {})

    def _done(self, request: Request) -> None:
        # The task that finishes is the sender (the header's one name for both): a peer
        # cannot finish another, except by claiming its name (see _CHIEF_ONLY).
        task = request.header.get(Key.TASK)
        job, _, index = task.partition(":") if isinstance(task, str) else ("", "", "")
        try:
            name = str(TaskSpec(job=job, index=int(index)))
        except ValueError:
            raise ValueError(
                f"'done' must name the finished task as job:index, got {task!r}"
            ) from None
        if name not in self.trainers:
            raise ValueError(f"{name} is not a worker of this job")
        self.finished.add(name)
        log.info("%s: %s finished (%d/%d)", self.name, name, len(self.finished), len(self.trainers))
        self.reply(request, {})
        for service in self._services:
            service.on_worker_finished(name)


def _given(first_rows: Mapping[str, FirstRows]) -> str:
    """The init's log note on tables whose first rows (and optimizer state) the chief gave."""
    named = [n + (" and its optimizer state" if r.state else "") for n, r in first_rows.items()]
    return f" ({', '.join(sorted(named))} with the chief's rows)" if named else ""
