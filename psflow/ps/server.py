"""The ps task: serves one shard until every worker has finished.

Requests (``op`` in the header):

- ``hello``/``status``: shard index, whether initialised, the step, who has finished.
- ``init``: the chief's initial values and optimizer for this shard (ignored when already set,
  unless the chief asks to ``replace`` them: a restore after another ps crashed).
- ``pull``: the current values (all, or the names listed in ``names``).
- ``push``: gradients, applied with the shard's optimizer; replies with the new step.
- ``push_pull``: ``push`` then ``pull`` in one round trip.
- ``done``: a worker (or the chief) has finished; after the last one the server exits.
- ``sync_push``/``sync_stage``/``sync_pull``/``sync_status``/``ssp_wait``: synchronous
  training and bounded staleness (:mod:`psflow.ps.sync`).
- ``save``/``save_status``: snapshot the shard and write it in the background; report progress
  (:mod:`psflow.ps.checkpoint`). ``init`` may carry optimizer state and the step of a restore.

Every request is validated; a bad one gets an error reply and a log line, and the server goes
on serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from psflow import allocator
from psflow import env as envvars
from psflow.cluster.spec import TaskContext, TaskSpec
from psflow.protocol import Code, OptimizerSpec
from psflow.ps.checkpoint import ShardCheckpointer, load_optimizer_state, split_init_tensors
from psflow.ps.store import ShardStore
from psflow.ps.sync import SyncService
from psflow.transport import Request, Server, TransportConfig, wire

log = logging.getLogger(__name__)


_POLL_SECONDS = 0.1


class NotInitializedError(ValueError):
    """A request that needs the shard's variables before the chief has set them."""

    code = Code.UNINITIALIZED


class ParameterServer:
    """Serves the shard of one ps task.

    Example:
        >>> # in the training script, for the ps tasks:
        >>> # ctx, _ = psflow.resolve()
        >>> # if ctx.job == "ps":
        >>> #     psflow.ParameterServer(ctx).join()   # returns when the workers are done
    """

    def __init__(
        self,
        ctx: TaskContext,
        config: TransportConfig | None = None,
        *,
        idle_timeout: float | None = None,
    ) -> None:
        if ctx.task.job != "ps":
            raise ValueError(f"a ParameterServer runs on a ps task, not {ctx.task}")
        self.ctx = ctx
        self.config = config or TransportConfig.from_env()
        if idle_timeout is None:
            idle_timeout = float(os.environ.get(envvars.PSFLOW_PS_IDLE_TIMEOUT, 1800))
        if idle_timeout <= 0:
            raise ValueError(f"idle_timeout must be > 0 seconds, got {idle_timeout}")
        self.idle_timeout = idle_timeout
        allocator.tune()
        self.store = ShardStore()
        self.trainers = {str(t) for t in ctx.cluster.trainers}
        self.finished: set[str] = set()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: Server | None = None
        self._handlers: dict[str, Callable[[Request], None]] = {
            "hello": self._status,
            "status": self._status,
            "init": self._init,
            "pull": self._pull,
            "push": self._push,
            "push_pull": self._push,
            "done": self._done,
            "save": lambda r: self._reply(r, self.checkpointer.save(r.header)),
            "save_status": lambda r: self._reply(r, self.checkpointer.status(r.header)),
        }
        self.checkpointer = ShardCheckpointer(
            self.store, shard=ctx.task.index, num_shards=ctx.cluster.num_tasks("ps")
        )
        self.sync = SyncService(self)  # adds the sync_* and ssp_wait handlers

    @property
    def name(self) -> str:
        return str(self.ctx.task)

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

        Raises:
            TimeoutError: when ``timeout`` passes first.
            RuntimeError: when the server stopped on an error (such as no worker for
                ``idle_timeout`` seconds).
        """
        self.start()
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} still serving after {timeout} s")
        self.checkpointer.wait(self.config.timeout)  # a shard file still being written
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
        last_seen = time.monotonic()
        try:
            while not self._stop.is_set():
                try:
                    request = server.recv(_POLL_SECONDS)
                except wire.WireError as e:
                    log.warning("%s: rejected a malformed message: %s", self.name, e)
                    continue
                if request is None:
                    if time.monotonic() - last_seen > self.idle_timeout:
                        missing = sorted(self.trainers - self.finished)
                        raise TimeoutError(
                            f"no request for {self.idle_timeout:g} s; still waiting for "
                            f"{', '.join(missing)} to finish"
                        )
                    continue
                last_seen = time.monotonic()
                self._handle(request)
                if self.finished >= self.trainers:
                    log.info("%s: every worker has finished; exiting", self.name)
                    break
        except BaseException as e:
            self.error = e
            log.error("%s: %s", self.name, e)
        finally:
            self.sync.fail_pending(
                f"{self.name} stopped" + (f": {self.error}" if self.error else "")
            )
            with contextlib.suppress(TimeoutError):
                server.flush(self.config.timeout)
            server.close(linger=2.0)  # let the last replies ('done') reach the workers

    def _handle(self, request: Request) -> None:
        op = request.header["op"]
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            handler(request)
        except (ValueError, TypeError, wire.WireError) as e:
            log.warning("%s: bad %r request from %s: %s", self.name, op, self._sender(request), e)
            assert self._server is not None
            # A ``code`` tells the client what kind of refusal it is (see NotInitializedError).
            code = getattr(e, "code", None)
            self._server.send_error(request, str(e), code if isinstance(code, str) else None)

    def _sender(self, request: Request) -> str:
        sender = request.header.get("task")
        return sender if isinstance(sender, str) else "an unnamed client"

    def _tensors(
        self,
        request: Request,
        into: Mapping[str, torch.Tensor] | None = None,
        *,
        transient: bool = False,
    ) -> list[tuple[str, torch.Tensor]]:
        assert self._server is not None
        return self._server.tensors(request, into=into, transient=transient)

    def _reply(
        self,
        request: Request,
        header: dict[str, Any],
        tensors: list[tuple[str, torch.Tensor]] | wire.TensorSet = (),  # type: ignore[assignment]
    ) -> None:
        assert self._server is not None
        header.setdefault("op", "ok")
        header.setdefault("step", self.store.step)
        self._server.reply(request, header, tensors)

    def _require_initialized(self) -> None:
        if not self.store.initialized:
            raise NotInitializedError(
                f"{self.name} is not initialised yet (the chief initialises it)"
            )

    # -- handlers ---------------------------------------------------------------------------

    def _status(self, request: Request) -> None:
        self._reply(
            request,
            {
                "shard": self.ctx.task.index,
                "initialized": self.store.initialized,
                "finished": sorted(self.finished),
                "variables": {
                    n: [wire.dtype_name(t.dtype), list(t.shape)]
                    for n, t in self.store.variables.items()
                },
            },
        )

    def _init(self, request: Request) -> None:
        tensors = self._tensors(request)
        if self.store.initialized:
            if request.header.get("replace") is not True:
                self._reply(request, {"initialized": True, "already": True})
                return
            # The chief restores every shard after one came back empty (a crashed ps).
            chief = str(self.ctx.cluster.chief)
            if self._sender(request) != chief:
                raise ValueError(f"only the chief ({chief}) may replace initialised variables")
            self.store.reset()  # new tensors: values still being sent keep their own memory
            # Synchronous steps in progress belong to the lost timeline: their workers recover.
            self.sync.reset(f"{self.name} was restored from a checkpoint by {chief}")
        spec = OptimizerSpec.from_wire(request.header.get("optimizer"))
        step = request.header.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bad initial step {step!r}")
        tensors, opt_tensors, opt_plain = split_init_tensors(request.header, tensors)
        self.store.initialize(tensors, spec, step=step)
        if opt_tensors or opt_plain:
            try:
                load_optimizer_state(self.store, opt_tensors, opt_plain)
            except (ValueError, KeyError, RuntimeError) as e:
                self.store.optimizer = None  # not initialised: the chief may try again
                raise ValueError(f"cannot restore the optimizer state: {e}") from None
        log.info(
            "%s initialised by %s: %d variables, %.1f MB, optimizer %s",
            self.name,
            self._sender(request),
            len(tensors),
            self.store.nbytes() / 1e6,
            spec.name,
        )
        self._reply(request, {"initialized": True, "already": False})

    def _pull(self, request: Request) -> None:
        self._require_initialized()
        names = request.header.get("names")
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
        self._reply(request, {}, tensors)

    def _push(self, request: Request) -> None:
        self._require_initialized()
        # Applied before the reply: gradients in a shared-memory lane need no copy.
        grads = self._tensors(request, into=self.store.grad_buffers, transient=True)
        self._server_flush()
        step = self.store.apply(grads)  # validates first: a bad push changes nothing
        if request.header["op"] == "push_pull":
            self._reply(request, {"step": step}, self.store.wire_set)
        else:
            self._reply(request, {"step": step})

    def _server_flush(self) -> None:
        # Values still being sent from their own memory must not change under the sender.
        assert self._server is not None
        self._server.flush(self.config.timeout)

    def _done(self, request: Request) -> None:
        task = request.header.get("task")
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
        self._reply(request, {})
