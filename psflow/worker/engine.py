"""The modes that train against the ps share one :class:`ParameterExchange`:
:class:`ExchangeEngine` is their common part, :class:`KeepsInputPositions` that of the modes
that keep input positions, :class:`AsyncEngine` the default mode.
"""

from __future__ import annotations

from typing import Any

from psflow.protocol import OptimizerSpec
from psflow.protocol.messages import InputMark
from psflow.worker.exchange import ParameterExchange
from psflow.worker.modes import Engine, Mode
from psflow.worker.placement import Piece


class ExchangeEngine(Engine):
    """A mode whose parameters live on the ps: it owns the exchange, and pulls, clears
    gradients and closes through it."""

    def __init__(self, exchange: ParameterExchange) -> None:
        self.exchange = exchange
        self.client = exchange.client

    @property
    def global_step(self) -> int:
        return self.exchange.global_step

    @property
    def pieces(self) -> list[Piece]:
        return self.exchange.pieces

    @property
    def learning_rate(self) -> float | None:
        return self.exchange.learning_rate  # as shard 0 reported it

    def start(self, spec: OptimizerSpec, *, ready_timeout: float) -> int:
        """The chief initialises the ps (others wait for it), then this worker pulls the
        mode's way. Returns the global step."""
        self.exchange.start(spec, ready_timeout=ready_timeout)
        return self.pull()

    def pull(self) -> int:
        return self.exchange.pull()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.exchange.zero_grad(set_to_none)

    def sync_status(self, timeout: float | None = None) -> dict[str, Any]:
        return self.client.sync_status(timeout)

    def close(self, *, finished: bool) -> None:
        self.exchange.close(finished=finished)


class KeepsInputPositions(ExchangeEngine):
    """A mode whose every step reaches the shards' optimizers (asynchronous, bounded
    staleness): each push carries the input it trained on, kept by the shards with its update
    (:mod:`psflow.train.input_position`). Synchronous training drops stale steps, so it keeps
    none (:meth:`Engine.input_positions` refuses)."""

    def input_positions(self) -> list[InputMark | None]:
        standing = self.client.input_positions()
        self.exchange.input_epochs = {s: st.epoch for s, st in standing.items()}
        return [standing[s].mark for s in range(self.client.num_shards)]

    def mark_input(self, seq: tuple[int, ...], position: dict[str, Any]) -> None:
        if self.exchange.input_epochs is None:
            raise RuntimeError("mark_input() before input_positions(): the shards' epochs")
        self.exchange.input_mark = (seq, position)


class AsyncEngine(KeepsInputPositions):
    """Asynchronous training: each step pushes this worker's gradients, which every shard
    applies on arrival, and pulls the values that result, in one round trip per shard; with
    ``overlap``, that round trip ends at the next step's push (:meth:`ParameterExchange.
    push_pull`)."""

    mode = Mode.ASYNC

    def __init__(self, exchange: ParameterExchange, *, overlap: bool = False) -> None:
        super().__init__(exchange)
        self.overlap = overlap

    def step(self) -> int:
        grads, layouts, rows = self.exchange.gradients()
        return self.exchange.push_pull(grads, layouts, rows, overlap=self.overlap)
