"""The ps task: serves one shard until every worker has finished.

Each request (its header's ``op``, a :class:`~psflow.protocol.Op`) goes to the one
:class:`~psflow.ps.service.Service` registered for it:

- ``hello``/``status``/``heartbeat``/``done``: the shard's state, who is alive, who has
  finished (:class:`~psflow.ps.status.StatusService`); after the last ``done`` the server exits.
- ``init``: the chief's initial values, optimizer, learning-rate schedule and tables, or a
  restore (:class:`~psflow.ps.init.InitService`). With a schedule, every reply carries the
  learning rate (``lr``) the shard applies at the reply's step.
- ``pull``/``push``/``push_pull``: values out, gradients in
  (:class:`~psflow.ps.exchange.ExchangeService`).
- ``lookup``/``table_status``: embedding rows by id (:class:`~psflow.ps.tables.TableService`).
- ``sync_push``/``sync_stage``/``sync_pull``/``sync_status``/``ssp_wait``: synchronous
  training and bounded staleness (:class:`~psflow.ps.sync.SyncService`).
- ``save``/``save_status``: snapshot the shard and write it in the background; report progress
  (:class:`~psflow.ps.checkpoint.CheckpointService`). A ps given the job's checkpoint directory
  (``checkpoint_dir``, or ``PSFLOW_CHECKPOINT_DIR``) writes only into its ``ckpt-<step>``
  directories.
- ``export``/``export_status``: the chief's incremental exports for serving, a base or the rows
  changed and ids evicted since the last (:class:`~psflow.ps.exports.ExportService`).

A worker (or the chief) silent for ``worker_timeout`` seconds (``PSFLOW_WORKER_TIMEOUT``, 30)
after its first request is dead (:mod:`psflow.ps.liveness`): the services stop waiting for it,
and the server exits once every worker has finished or is dead (and one has finished). A dead
worker that speaks again rejoins.

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
import threading
import time
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from psflow import allocator, metrics
from psflow import env as envvars
from psflow.cluster.spec import TaskContext
from psflow.protocol import Code, Key, Op
from psflow.ps.checkpoint import CheckpointService
from psflow.ps.config import ServerConfig
from psflow.ps.errors import BusyError, NotInitializedError, RequestError
from psflow.ps.exchange import ExchangeService
from psflow.ps.exports import ExportService
from psflow.ps.host import TransportHost
from psflow.ps.init import InitService
from psflow.ps.liveness import Liveness
from psflow.ps.service import Handler, Service
from psflow.ps.sigterm import Termination
from psflow.ps.status import StatusService
from psflow.ps.store import ShardStore
from psflow.ps.sync import SyncService
from psflow.ps.tables import TableService
from psflow.sparse import stripes
from psflow.transport import Request, Server, wire
from psflow.transport.monitor import RateLimitedLog

log = logging.getLogger(__name__)


_POLL_SECONDS = 0.1

# Bound once: reading an enum member off its class costs more than the dict lookup it serves,
# and push/push_pull run thousands of times a second.
_OP, _TASK = Key.OP, Key.TASK

_JOIN_SLICE = 0.5
"""Seconds :meth:`ParameterServer.join` waits for its serving thread at a time."""

_LATE = frozenset({Op.DONE.value, Op.HEARTBEAT.value})
"""Requests a finished worker may still have in flight: ``done`` again, and a heartbeat from its
own sockets that its ``done`` overtook. Any other request from it is a new incarnation's."""

_CHIEF_ONLY = frozenset({Op.INIT.value, Op.SAVE.value, Op.SAVE_STATUS.value})
"""Requests that act on the whole job, served to the chief alone: only the chief initialises
(or, with ``replace``, restores) the shard and checkpoints it. The sender is whom the header names (:attr:`Key.TASK`): without
CurveZMQ keys any peer can claim any name; with them, only holders of the job's client key."""


class ParameterServer(TransportHost):
    """Serves the shard of one ps task.

    Its settings are one :class:`~psflow.ps.config.ServerConfig` (``config=``), or its fields
    as keywords: ``checkpoint_dir`` (default ``PSFLOW_CHECKPOINT_DIR``: the job's checkpoint
    directory, the only place a ``save`` may write this shard to), ``idle_timeout``,
    ``worker_timeout`` (default ``PSFLOW_WORKER_TIMEOUT``, 30: seconds of silence after which a
    worker that has joined is dead, :mod:`psflow.ps.liveness`), ``threads`` (default
    ``PSFLOW_PS_THREADS``, else torch's: the threads one request's rows and dense update use,
    :mod:`psflow.sparse.stripes`) and ``transport``.

    Example:
        >>> # in the training script, for the ps tasks:
        >>> # ctx, _ = psflow.resolve()
        >>> # if ctx.job == "ps":
        >>> #     psflow.ParameterServer(ctx, checkpoint_dir=logdir).join()  # until workers are done
    """

    def __init__(
        self, ctx: TaskContext, *, config: ServerConfig | None = None, **settings: Any
    ) -> None:
        if config is not None and settings:
            raise ValueError(f"give either config= or {sorted(settings)}, not both")
        if ctx.task.job != "ps":
            raise ValueError(f"a ParameterServer runs on a ps task, not {ctx.task}")
        self.ctx = ctx
        self.config = config if config is not None else ServerConfig(**settings)
        self.checkpoint_dir = self.config.checkpoint_dir
        """The job's checkpoint directory: ``save`` writes only into its ``ckpt-<step>``."""
        self.transport = self.config.transport
        self.idle_timeout = self.config.idle_timeout
        self._bad_log = RateLimitedLog(log, self.transport.wait_log_seconds)
        allocator.tune()
        if self.config.threads != torch.get_num_threads():
            torch.set_num_threads(self.config.threads)  # the dense optimizer's
        stripes.set_threads(self.config.threads, flush_denormals=self.config.flush_denormals)
        self.store = ShardStore()
        self.trainers = {str(t) for t in ctx.cluster.trainers}
        self.finished: set[str] = set()
        self.liveness = Liveness(self.trainers, self.config.worker_timeout)
        """Who has been heard from lately; who is dead."""
        self._unjoined_since: float | None = None
        """When every joined worker was finished or dead while others had never joined."""
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._term = Termination(self.name, self._stop, self.trainers, self.finished)
        """SIGTERM, taken while :meth:`join` waits."""
        self._thread: threading.Thread | None = None
        self._server: Server | None = None
        self._handlers: dict[str, Handler] = {}
        self._owners: dict[str, str] = {}
        self._services: list[Service] = []
        self.handling_cpu: dict[str, float] = {}
        """CPU seconds the serving thread spent handling each op's requests (its own CPU
        time: not its waits, not other threads'): what a shard's core does per request, for
        benchmarks (``benchmarks/embedding.py``'s rows per shard core)."""
        self.metrics = metrics.for_task(self.name, ctx.host).ps(self.shard)
        """This shard's Prometheus metrics (:mod:`psflow.metrics`)."""
        self.register(
            StatusService(self, finished=self.finished, worker_finished=self._worker_finished)
        )
        self.register(
            InitService(
                self,
                chief=str(ctx.cluster.chief),
                num_shards=ctx.cluster.num_tasks("ps"),
                checkpoint_dir=self.checkpoint_dir,
                restored=self._restored,
                under_way=self._under_way,
            )
        )
        self.register(ExchangeService(self))
        self.register(SyncService(self))
        self.register(TableService(self))
        self.register(
            CheckpointService(
                self, num_shards=ctx.cluster.num_tasks("ps"), root=self.checkpoint_dir
            )
        )
        self.register(
            ExportService(
                self, chief=str(ctx.cluster.chief), num_shards=ctx.cluster.num_tasks("ps")
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
            ValueError: when one of its ops is served already (by a service registered
                before), or is not an :class:`~psflow.protocol.Op`.
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
            self.handling_cpu[op] = 0.0

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> ParameterServer:
        """Binds the address and starts serving in a background thread; returns when ready."""
        if self._thread is not None:
            return self
        address = self.ctx.address
        assert address is not None
        self._server = Server(address, self.transport)
        self._thread = threading.Thread(target=self._serve, name=f"psflow-{self.name}", daemon=True)
        self._thread.start()
        self.ready.set()
        threads = self.config.threads
        log.info("%s serving on %s%s", self.name, address, f" ({threads} threads)" * (threads > 1))
        return self

    def join(self, timeout: float | None = None) -> None:
        """Serves until every worker has finished (starting first if needed).

        Called from the main thread, it takes SIGTERM (unless the script handles it): the ps
        serves on while its workers still ask (a chief stopped by the same SIGTERM saves a
        last checkpoint), and stops once none has asked for
        :data:`~psflow.ps.sigterm.TERM_IDLE_SECONDS`, after
        :data:`~psflow.ps.sigterm.TERM_SECONDS` at most, or at a second SIGTERM; ``join`` then
        returns.

        Raises:
            TimeoutError: when ``timeout`` passes first.
            RuntimeError: when the server stopped on an error (such as no worker for
                ``idle_timeout`` seconds).
        """
        self.start()
        assert self._thread is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._term.handled():
            # In short waits: a SIGTERM taken by another thread (as one sent while the process
            # was stopped is, once it goes on) runs its handler only when this main thread
            # next runs Python, which an unbounded join would never do.
            while self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._thread.join(_JOIN_SLICE if left is None else min(left, _JOIN_SLICE))
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} still serving after {timeout} s")
        # Background work (a shard file still being written), within one timeout for all.
        deadline = time.monotonic() + self.transport.timeout
        for service in self._services:
            service.wait(max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            raise RuntimeError(f"{self.name} stopped: {self.error}") from self.error

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
        # The mode is the thread's own, and the threads it starts inherit it (the row stripes'
        # pool): the process that holds this server keeps its own.
        torch.set_flush_denormal(self.config.flush_denormals)
        last_seen = time.monotonic()
        liveness = self.liveness
        # Often enough that a death is noticed within a tenth of the timeout of its bound.
        check_every = min(0.5, liveness.timeout / 10)
        next_check = last_seen + check_every
        handling = self.handling_cpu
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
                    began = time.thread_time()
                    self._handle(request)
                    op = request.header[_OP]
                    if op in handling:  # an op no one serves (a peer's garbage) counts nowhere
                        handling[op] += time.thread_time() - began
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
                if self._term.at is not None and self._term.over(last_seen):
                    break
            if self._stop.is_set() and self._term.at is not None:
                log.info("%s: a second SIGTERM: stopping now", self.name)
        except BaseException as e:
            self.error = e
            log.error("%s: %s", self.name, e)
        finally:
            reason = f"{self.name} stopped" + (f": {self.error}" if self.error else "")
            for service in self._services:
                service.on_stopping(reason)
            with contextlib.suppress(TimeoutError):
                server.flush(self.transport.timeout)
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
        setting = f"{envvars.PSFLOW_WORKER_TIMEOUT}={self.liveness.timeout:g}"
        if worker in self.liveness.expected:
            reason = (
                f"{worker} is dead: {self.name} has not heard from it in the {silence:.1f} s "
                f"since it was restored mid-job (it finished or failed before {self.name} "
                f"restarted?) ({setting})"
            )
        else:
            reason = (
                f"{worker} is dead: {self.name} has not heard from it for {silence:.1f} s "
                f"({setting})"
            )
        log.warning("%s: %s", self.name, reason)
        for service in self._services:
            service.on_worker_dead(worker, reason)

    def _worker_finished(self, worker: str) -> None:
        """``worker`` has said ``done`` (:class:`StatusService`)."""
        for service in self._services:
            service.on_worker_finished(worker)

    def _restored(self, reason: str) -> None:
        """The chief is replacing the shard's variables (:class:`InitService`)."""
        for service in self._services:
            service.on_restored(reason)

    def _under_way(self) -> None:
        """The chief restored this shard mid-job: the workers it has not heard from since it
        started have started long ago (some may have finished before it crashed)."""
        expected = self.liveness.expect(time.monotonic(), self.finished)
        if expected:
            log.info(
                "%s: restored mid-job: %s dead unless heard from within %g s",
                self.name,
                ", ".join(expected),
                self.liveness.timeout,
            )

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
        except stripes.StripeError as e:
            # The shard's rows may be half-updated: it stops (_serve), never serves on; the
            # sender hears why at once.
            self.refuse(request, f"{self.name} stops: {e}", Code.STOPPING)
            raise
        except BusyError as e:  # not bad input: the chief asks again later
            self.refuse(request, str(e), e.code)
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

    # -- what services use (psflow.ps.service.ServiceHost; the rest: TransportHost) ---------

    def _waiting(self) -> int:
        """Requests received and not answered yet (read when the metrics are scraped)."""
        queued = 0 if self._server is None else self._server.queued
        return queued + sum(s.waiting for s in self._services)

    def require_initialized(self) -> None:
        """Raises :class:`NotInitializedError` unless the chief has initialised the shard."""
        if not self.store.initialized:
            raise NotInitializedError(
                f"{self.name} is not initialised yet (the chief initialises it)"
            )
