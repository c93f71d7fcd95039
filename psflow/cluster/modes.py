"""The training modes, each named once: what ``--mode``, ``PSFLOW_MODE`` and ``ModeConfig`` take."""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """How the workers combine their gradients (a member equals its name: ``Mode.SYNC ==
    "sync"``).

    Example:
        >>> Mode("sync") is Mode.SYNC, Mode.SYNC == "sync"
        (True, True)
    """

    ASYNC = "async"
    """Each gradient is applied on the ps as it arrives (the default)."""
    SYNC = "sync"
    """The gradients of ``replicas_to_aggregate`` workers are averaged on the ps per step."""
    ALLREDUCE = "allreduce"
    """No ps: torch.distributed averages the gradients and every worker applies them."""


MODES: tuple[str, ...] = tuple(m.value for m in Mode)
"""The modes' names, in :class:`Mode`'s order."""
