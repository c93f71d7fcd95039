"""What a ps service is: the ops it serves, what it hears of the server's life, what it may use.

A :class:`~psflow.ps.server.ParameterServer` dispatches every request to the one handler
registered for its op (:class:`~psflow.protocol.Op`). Handlers come in :class:`Service` objects:
the shard's state and who is done (:class:`~psflow.ps.status.StatusService`), ``init``
(:class:`~psflow.ps.init.InitService`), pull and push
(:class:`~psflow.ps.exchange.ExchangeService`), the tables' ops
(:class:`~psflow.ps.tables.TableService`), the synchronous ones
(:class:`~psflow.ps.sync.SyncService`), the checkpoint ones
(:class:`~psflow.ps.checkpoint.CheckpointService`). A service sees the server only as a
:class:`ServiceHost`, so that the server may import its services and never the other way round.

A new request type is one :class:`~psflow.protocol.Op` member, one handler in a service, and
one :meth:`~psflow.ps.server.ParameterServer.register` of that service.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import numpy as np
import torch

from psflow.metrics import PsMetrics
from psflow.protocol import Code, Op
from psflow.ps.store import ShardStore
from psflow.transport import Request, wire

Handler = Callable[[Request], None]
"""Answers one request (through :meth:`ServiceHost.reply`, now or later), or raises."""


class ServiceHost(Protocol):
    """What a :class:`Service` sees of the server it runs on.

    Every method is for the serving thread only (where handlers and callbacks run).
    """

    @property
    def name(self) -> str:
        """The ps task, as ``ps:0``."""
        ...

    @property
    def shard(self) -> int:
        """The index of the shard this server holds."""
        ...

    @property
    def store(self) -> ShardStore:
        """The shard's variables, optimizer and step."""
        ...

    @property
    def trainers(self) -> AbstractSet[str]:
        """The workers of the job (the tasks that push gradients), as ``worker:1``."""
        ...

    @property
    def finished(self) -> AbstractSet[str]:
        """The workers that have sent ``done``."""
        ...

    @property
    def dead(self) -> AbstractSet[str]:
        """The workers silent for longer than the worker timeout (:mod:`psflow.ps.liveness`)."""
        ...

    def reply(
        self,
        request: Request,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] | wire.TensorSet = (),
    ) -> None:
        """Answers ``request`` (op ``ok`` and the shard's step unless ``header`` says)."""
        ...

    def reply_tensors(
        self, request: Request, specs: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> list[torch.Tensor] | None:
        """Tensors of these dtypes and shapes made where :meth:`reply` would copy them (the
        request's lane), for a handler to fill and answer with; ``None``: answer with tensors
        of its own. They overlay the request's tensors: take those without ``transient``."""
        ...

    def tensor_buffers(self, request: Request) -> list[tuple[Any, int]] | None:
        """Where each tensor of ``request`` lies as it came, ``(buffer, byte offset)``, for a
        native path; ``None`` where only :meth:`tensors` can make them."""
        ...

    def reply_area(
        self, request: Request, sizes: Sequence[int]
    ) -> tuple[np.ndarray[Any, Any], list[int]] | None:
        """Where a native path writes a reply's tensors of these byte sizes (``request``'s
        lane, its request area) and each one's offset; ``None``: not by lane, or too large."""
        ...

    def reply_placed(
        self,
        request: Request,
        header: dict[str, Any],
        metas: list[list[Any]],
        raws: Sequence[Any] | None = None,
        *,
        live: bool = False,
    ) -> None:
        """Answers ``request`` as :meth:`reply` does, with tensors (``metas``: ``[name,
        dtype, shape]`` each) a native path wrote where :meth:`reply_area` said, or whose
        bytes are ``raws`` (``live``: some may change later, a shard's variables)."""
        ...

    def refuse(self, request: Request, message: str, code: Code) -> None:
        """Answers a request that waited with an error (a handler refuses the request it is
        handling by raising instead)."""
        ...

    def tensors(
        self,
        request: Request,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        transient: bool = False,
        only: Container[str] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors of ``request``, validated; assembled in ``into`` when they arrive in
        pieces; with ``transient``, possibly views of a lane, valid until the reply is sent;
        with ``only``, those of these names alone."""
        ...

    def flush(self) -> None:
        """Waits until every reply's tensors have left: call it before changing variables."""
        ...

    def require_initialized(self) -> None:
        """Raises :class:`NotInitializedError` unless the chief has initialised the shard."""
        ...

    def sender(self, request: Request) -> str:
        """The task that sent ``request`` (as it says), for messages."""
        ...

    @property
    def metrics(self) -> PsMetrics:
        """The shard's Prometheus metrics (bound children: cheap to update)."""
        ...


class Service(ABC):
    """A set of ops served by a :class:`~psflow.ps.server.ParameterServer`.

    The server calls the handlers and the ``on_*`` callbacks in its serving thread, one at a
    time, so a service needs no lock for its own state; only :meth:`wait` runs in the thread
    that joins the server. A handler answers its request with :meth:`ServiceHost.reply` (at
    once, or later: a request may wait for others), and refuses it by raising ``ValueError``
    (see :class:`RequestError`).

    Example:
        >>> from psflow.protocol import Key, Op
        >>> class StepService(Service):
        ...     def __init__(self, host: ServiceHost) -> None:
        ...         self.host = host
        ...
        ...     def handlers(self) -> Mapping[Op, Handler]:
        ...         return {Op.STEP: self._step}  # Op.STEP: a member you add
        ...
        ...     def _step(self, request: Request) -> None:
        ...         self.host.reply(request, {Key.STEP: self.host.store.step})
        >>> # ps.register(StepService(ps))
    """

    @abstractmethod
    def handlers(self) -> Mapping[Op, Handler]:
        """The ops this service serves: read once, when it is registered."""

    def on_worker_finished(self, worker: str) -> None:  # noqa: B027 - optional callback
        """``worker`` has sent ``done`` (it is in :attr:`ServiceHost.finished` already)."""

    def on_worker_dead(self, worker: str, reason: str) -> None:  # noqa: B027 - optional callback
        """``worker`` has been silent too long (it is in :attr:`ServiceHost.dead` already):
        what waits for it should go on without it, or be refused naming it (``reason``)."""

    def on_worker_back(self, worker: str) -> None:  # noqa: B027 - optional callback
        """``worker``, declared dead or finished, spoke again (a restart, or SIGCONT): it
        rejoins (it is out of :attr:`ServiceHost.dead` and :attr:`ServiceHost.finished`)."""

    def on_restored(self, reason: str) -> None:  # noqa: B027 - optional callback
        """The chief is replacing the shard's variables (a restore from a checkpoint): work in
        progress belongs to a timeline that is gone, and what waits for it should be refused
        with :attr:`Code.RESTORED <psflow.protocol.Code.RESTORED>`."""

    def on_stopping(self, reason: str) -> None:  # noqa: B027 - optional callback
        """The server stops serving: answer every request still waiting (with
        :attr:`Code.STOPPING <psflow.protocol.Code.STOPPING>`); the socket closes next."""

    def wait(self, timeout: float) -> None:  # noqa: B027 - optional callback
        """Waits up to ``timeout`` seconds for background work (before the ps task exits)."""

    @property
    def waiting(self) -> int:
        """Requests this service holds unanswered (read by the metrics, from another thread)."""
        return 0
