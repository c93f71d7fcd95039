"""How the workers combine their gradients: the mode settings, and what every mode provides.

- :class:`ModeConfig`: the mode and its settings, validated once.
- :class:`Engine`: the small interface every mode implements; :class:`DistributedOptimizer`
  composes one. The engines: :class:`~psflow.worker.engine.AsyncEngine` (async, the default),
  :class:`~psflow.worker.staleness.StalenessEngine` (async with ``max_staleness``),
  :class:`~psflow.worker.sync.SyncEngine` (sync, backup workers) and
  :class:`~psflow.worker.allreduce.AllReduceEngine` (no ps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from psflow import env as envvars
from psflow.cluster.modes import MODES, Mode
from psflow.protocol.messages import InputMark
from psflow.transport import PeerTimeoutError
from psflow.worker.placement import Piece

__all__ = ["MODES", "Engine", "Mode", "ModeConfig", "SyncTimeoutError"]


def _default_mode() -> Mode:
    return Mode(envvars.choice(envvars.PSFLOW_MODE, MODES, Mode.ASYNC))


def _default_timeout() -> float | None:
    return envvars.seconds_or_none(envvars.PSFLOW_SYNC_TIMEOUT)


@dataclass(kw_only=True)
class ModeConfig:
    """How the workers combine their gradients.

    Example:
        >>> ModeConfig(mode="sync", replicas_to_aggregate=2, total_num_replicas=3).mode
        'sync'
    """

    mode: Mode = field(default_factory=_default_mode)
    """A :class:`~psflow.cluster.modes.Mode` or its name (default: ``PSFLOW_MODE``, else
    async)."""
    replicas_to_aggregate: int | None = None
    """Sync: gradients averaged per step (default: every worker)."""
    total_num_replicas: int | None = None
    """Sync: workers in the job (default and required: the cluster's workers, chief included);
    more than ``replicas_to_aggregate`` makes backup workers."""
    max_staleness: int | None = None
    """Async: a worker may push its gradient number ``c + 1`` only once every unfinished
    worker has pushed at least ``c - max_staleness`` (it waits otherwise; nothing is dropped)."""
    timeout: float | None = field(default_factory=_default_timeout)
    """Seconds a worker waits for its step (sync) or for the slowest worker (bounded
    staleness), and for the all-reduce group; default: the transport timeout."""
    overlap: bool = False
    """Async: each step's push stays in flight while the next step computes, its reply (the
    values, and the rows a prefetch asked for) taken at the next step's push: the round trip
    hidden behind the next forward and backward, each gradient one step staler. A prefetch
    must then ask for the batch after next."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}: expected one of {MODES}")
        self.mode = Mode(self.mode)
        for name in ("replicas_to_aggregate", "total_num_replicas"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if v is not None and self.mode != Mode.SYNC:
                raise ValueError(f"{name}={v} applies to mode='sync', not {self.mode!r}")
        r, n = self.replicas_to_aggregate, self.total_num_replicas
        if r is not None and n is not None and r > n:
            raise ValueError(f"replicas_to_aggregate={r} exceeds total_num_replicas={n}")
        s = self.max_staleness
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, int) or s < 0:
                raise ValueError(f"max_staleness must be an integer >= 0, got {s!r}")
            if self.mode != Mode.ASYNC:
                raise ValueError(f"max_staleness={s} applies to mode='async', not {self.mode!r}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if not isinstance(self.overlap, bool):
            raise TypeError(f"overlap must be a bool, got {self.overlap!r}")
        if self.overlap and (self.mode != Mode.ASYNC or self.max_staleness is not None):
            raise ValueError(
                "overlap applies to mode='async' without max_staleness, not "
                f"mode={self.mode.value!r}"
                + ("" if self.max_staleness is None else f", max_staleness={self.max_staleness}")
            )

    @classmethod
    def of(
        cls,
        mode: str | Mode | ModeConfig | None = None,
        *,
        replicas_to_aggregate: int | None = None,
        total_num_replicas: int | None = None,
        max_staleness: int | None = None,
        sync_timeout: float | None = None,
        overlap: bool | None = None,
    ) -> ModeConfig:
        """The settings given as keywords (a mode's name, or ``None`` for ``PSFLOW_MODE``), or
        ``mode`` itself when it is a :class:`ModeConfig` (then no other keyword may be given).
        """
        given = {
            "replicas_to_aggregate": replicas_to_aggregate,
            "total_num_replicas": total_num_replicas,
            "max_staleness": max_staleness,
            "sync_timeout": sync_timeout,
            "overlap": overlap,
        }
        if isinstance(mode, ModeConfig):
            extra = sorted(k for k, v in given.items() if v is not None)
            if extra:
                raise ValueError(f"give {extra} in the ModeConfig, not beside it")
            return mode
        optional: dict[str, Any] = {"mode": mode, "timeout": sync_timeout, "overlap": overlap}
        return cls(
            replicas_to_aggregate=replicas_to_aggregate,
            total_num_replicas=total_num_replicas,
            max_staleness=max_staleness,
            **{k: v for k, v in optional.items() if v is not None},  # else from the environment
        )

    def replicas(self, num_trainers: int) -> tuple[int, int]:
        """``(replicas_to_aggregate, total_num_replicas)`` for a job of ``num_trainers``."""
        n = self.total_num_replicas or num_trainers
        if n != num_trainers:
            raise ValueError(
                f"total_num_replicas={n} but the cluster has {num_trainers} worker task(s) "
                "(chief included): give every replica a task"
            )
        r = self.replicas_to_aggregate or n
        if r > n:
            raise ValueError(f"replicas_to_aggregate={r} exceeds the {n} workers of the cluster")
        return r, n


class SyncTimeoutError(PeerTimeoutError):
    """A synchronous step (or a bounded-staleness wait) did not complete in time.

    ``arrived`` names the workers whose gradients reached ps:0 for ``step``, ``missing`` the
    unfinished workers that sent none.
    """

    def __init__(
        self, peer: str, message: str, *, step: int, arrived: list[str], missing: list[str]
    ) -> None:
        super().__init__(peer, message)
        self.step = step
        self.arrived = arrived
        self.missing = missing


class Engine(ABC):
    """One training mode: what :class:`~psflow.worker.DistributedOptimizer` delegates to."""

    mode: Mode
    """The mode."""

    @property
    @abstractmethod
    def global_step(self) -> int:
        """The global step after the last step or pull."""

    @property
    def pieces(self) -> list[Piece]:
        """Where the parameters live on the ps (none without ps)."""
        return []

    @property
    def learning_rate(self) -> float | None:
        """The learning rate of the schedule at :attr:`global_step`, as applied (``None``
        without a schedule)."""
        return None

    @abstractmethod
    def step(self) -> int:
        """Applies this worker's gradients the mode's way; the model then holds the new
        parameters. Returns the global step."""

    @abstractmethod
    def pull(self) -> int:
        """Brings the model's parameters up to date; returns the global step."""

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradients, like ``torch.optim.Optimizer.zero_grad``."""

    def input_positions(self) -> list[InputMark | None]:
        """Per shard, this task's last input it applied: its number and the reader's position
        past it (``None``: none). Modes that keep them: asynchronous, bounded staleness, a
        cluster of one (:mod:`psflow.train.input_position`)."""
        raise ValueError(
            f"{self.mode.value} training keeps no input positions: a reader given to the "
            "session (input=) needs asynchronous or bounded-staleness training, or a cluster "
            "of one"
        )

    def mark_input(self, seq: tuple[int, ...], position: dict[str, Any]) -> None:
        """The next :meth:`step` applies input number ``seq``, after which the reader is at
        ``position``: each shard keeps both with the update, or drops a step it holds."""
        Engine.input_positions(self)  # the refusal of a mode that keeps none

    def stats(self) -> dict[str, Any]:
        """The mode's counters (accepted and dropped gradients, staleness, waits)."""
        return {"mode": self.mode}

    def sync_status(self, timeout: float | None = None) -> dict[str, Any]:
        """ps:0's synchronous state (modes with a ps)."""
        raise ValueError(f"mode={self.mode!r} has no ps to ask")

    @abstractmethod
    def close(self, *, finished: bool) -> None:
        """Releases what the engine holds; with ``finished``, says so to the ps."""
