"""What a :class:`~psflow.ps.ParameterServer` serves with, as one object: :class:`ServerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field

from psflow import env as envvars
from psflow.protocol.messages import WORKER_TIMEOUT
from psflow.transport import TransportConfig

IDLE_TIMEOUT = 1800.0
"""Seconds a ps serves with no request at all before it gives up (``PSFLOW_PS_IDLE_TIMEOUT``)."""


@dataclass(kw_only=True)
class ServerConfig:
    """A ps task's settings; each defaults to its environment variable.

    Example:
        >>> ServerConfig(checkpoint_dir="/tmp/run", worker_timeout=10).worker_timeout
        10
    """

    checkpoint_dir: str | None = field(
        default_factory=lambda: envvars.text(envvars.PSFLOW_CHECKPOINT_DIR)
    )
    """The job's checkpoint directory: the only place a ``save`` may write this shard to (its
    ``ckpt-<step>`` directories). Default ``PSFLOW_CHECKPOINT_DIR``; ``None``: where the chief
    says (a warning)."""
    idle_timeout: float = field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_PS_IDLE_TIMEOUT, IDLE_TIMEOUT)
    )
    """Seconds the ps serves with no request before it gives up, naming the workers it still
    waits for (``PSFLOW_PS_IDLE_TIMEOUT``, else 1800)."""
    worker_timeout: float = field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_WORKER_TIMEOUT, WORKER_TIMEOUT)
    )
    """Seconds of silence after which a worker that has joined is dead
    (``PSFLOW_WORKER_TIMEOUT``, else 30; :mod:`psflow.ps.liveness`)."""
    transport: TransportConfig = field(default_factory=TransportConfig.from_env)
    """Timeouts, shared memory, keys (default from the environment)."""
    threads: int = field(default_factory=envvars.ps_threads)
    """Threads one request is served with: its rows in stripes, one a thread, and torch's
    threads for the dense optimizer (``PSFLOW_PS_THREADS``, else the ``OMP_NUM_THREADS`` that
    ``psflow launch`` and the rendered manifests give a task, else 1). Requests are still
    served one at a time: a checkpoint's snapshot between two of them is consistent."""

    flush_denormals: bool = field(
        default_factory=lambda: envvars.flag(envvars.PSFLOW_FLUSH_DENORMALS, True)
    )
    """Whether the serving thread (and the row threads it starts) take subnormal floats as
    zero, as TensorFlow's runtime does (``PSFLOW_FLUSH_DENORMALS``, else on). A value below
    about 1.2e-38 (float32) then counts as 0: an update that would make one makes 0 instead.
    Off, every update keeps IEEE subnormals, at their cost: arithmetic on them takes the CPU's
    slow path, and in a dense Adam the moments of units whose gradients stay 0 decay into that
    range and stay there for hundreds of steps."""

    def __post_init__(self) -> None:
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, str):
            raise TypeError(f"checkpoint_dir must be a path or URL, got {self.checkpoint_dir!r}")
        for name in ("idle_timeout", "worker_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        if not isinstance(self.flush_denormals, bool):
            raise TypeError(f"flush_denormals must be a bool, got {self.flush_denormals!r}")
        if not isinstance(self.transport, TransportConfig):
            raise TypeError(f"transport must be a TransportConfig, got {self.transport!r}")
