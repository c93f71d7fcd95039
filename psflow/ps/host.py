"""How a ps server's services read a request and answer it: through the server's socket.

:class:`TransportHost` is the part of :class:`~psflow.ps.service.ServiceHost` that speaks
through the server's :class:`~psflow.transport.Server`: a request's tensors, the reply (with the
shard's step and learning rate), the tensors a reply is gathered into, an error, and the wait
until replies have left. :class:`~psflow.ps.server.ParameterServer` is one, and adds the rest
(the shard, who is alive, who has finished) and the serving loop.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from psflow.protocol import Code, Key, Op
from psflow.ps.store import ShardStore
from psflow.transport import Request, Server, TransportConfig, wire

# Bound once: reading an enum member off its class costs more than the dict lookup it serves,
# and push/push_pull run thousands of times a second.
_OP, _STEP, _OK, _LR = Key.OP, Key.STEP, Op.OK, Key.LEARNING_RATE


class TransportHost:
    """The :class:`~psflow.ps.service.ServiceHost` methods that use the server's socket.

    The server sets :attr:`store` and :attr:`transport`, and :attr:`_server` when it starts: these
    methods are for handlers, which run only while it serves.
    """

    store: ShardStore
    transport: TransportConfig
    _server: Server | None

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
        only: Container[str] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """The tensors of ``request``, validated (see ``Server.tensors``)."""
        assert self._server is not None
        return self._server.tensors(request, into=into, transient=transient, only=only)

    def reply(
        self,
        request: Request,
        header: dict[str, Any],
        tensors: Sequence[tuple[str, torch.Tensor]] | wire.TensorSet = (),
    ) -> None:
        """Answers ``request`` (op ``ok`` and the shard's step unless ``header`` says)."""
        assert self._server is not None
        self._defaults(header)
        self._server.reply(request, header, tensors)

    def reply_tensors(
        self, request: Request, specs: Sequence[tuple[torch.dtype, Sequence[int]]]
    ) -> list[torch.Tensor] | None:
        """Tensors to fill and answer ``request`` with, made where the reply goes (see
        ``Server.reply_tensors``), or ``None``."""
        assert self._server is not None
        return self._server.reply_tensors(request, specs)

    def tensor_buffers(self, request: Request) -> list[tuple[Any, int]] | None:
        """Where each tensor of ``request`` lies as it came, or ``None`` (see
        ``Server.tensor_buffers``)."""
        assert self._server is not None
        return self._server.tensor_buffers(request)

    def reply_area(
        self, request: Request, sizes: Sequence[int]
    ) -> tuple[np.ndarray[Any, Any], list[int]] | None:
        """Where a native path writes a reply's tensors of these byte sizes in ``request``'s
        lane, or ``None`` (see ``Server.reply_area``)."""
        assert self._server is not None
        return self._server.reply_area(request, sizes)

    def reply_placed(
        self,
        request: Request,
        header: dict[str, Any],
        metas: list[list[Any]],
        raws: Sequence[Any] | None = None,
        *,
        live: bool = False,
    ) -> None:
        """Answers ``request`` as :meth:`reply` does, with tensors a native path wrote itself
        (see ``Server.reply_placed``)."""
        assert self._server is not None
        self._defaults(header)
        self._server.reply_placed(request, header, metas, raws, live=live)

    def _defaults(self, header: dict[str, Any]) -> None:
        """A reply's op ``ok`` and the shard's step (and learning rate), unless it says."""
        header.setdefault(_OP, _OK)
        header.setdefault(_STEP, self.store.step)
        if self.store.schedule is not None:
            header.setdefault(_LR, self.store.learning_rate())

    def refuse(self, request: Request, message: str, code: Code) -> None:
        """Answers ``request`` with an error of kind ``code``."""
        assert self._server is not None
        self._server.send_error(request, message, code)

    def flush(self) -> None:
        """Waits until every reply's tensors have left (call it before changing variables)."""
        # Values still being sent from their own memory must not change under the sender.
        assert self._server is not None
        self._server.flush(self.transport.timeout)
