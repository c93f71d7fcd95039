"""The transport's settings, and how an address becomes a ZeroMQ endpoint."""

from __future__ import annotations

import socket as pysocket
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from psflow import allocator
from psflow import env as envvars
from psflow.cluster.spec import parse_address
from psflow.transport import wire
from psflow.transport.auth import CurveKeys
from psflow.transport.shm import SPIN_SECONDS


@dataclass(kw_only=True)
class TransportConfig:
    """Settings shared by servers and clients.

    A field not given is read from its ``PSFLOW_*`` variable (:mod:`psflow.env`), else its
    default; a variable that holds what it cannot mean (``PSFLOW_TIMEOUT=abc``,
    ``PSFLOW_SHM=maybe``) raises ``ValueError`` naming the variable and its value.

    Example:
        >>> TransportConfig(timeout=5, shared_memory=False).timeout
        5
    """

    timeout: float = field(default_factory=lambda: envvars.seconds(envvars.PSFLOW_TIMEOUT, 60.0))
    """Seconds a request may take before it fails with an error naming the peer
    (``PSFLOW_TIMEOUT``, default 60)."""
    link_timeout: float = field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_LINK_TIMEOUT, 20.0)
    )
    """Seconds a client's connection may go without a sign of life from its peer (ZeroMQ's
    heartbeats, every quarter of it) before it is closed and a request in flight on it fails,
    or on the peer's shared-memory lane beside it (``PSFLOW_LINK_TIMEOUT``, default 20)."""
    max_message_bytes: int = 8 << 30
    """Largest message (sum of tensor bytes) a server accepts."""
    chunk_bytes: int = field(
        default_factory=lambda: (
            wire.WHOLE_TENSOR_CHUNK_BYTES if allocator.tune() else wire.DEFAULT_CHUNK_BYTES
        )
    )
    """Bytes per frame for large tensors: whole tensors with the tuned allocator."""
    keys: CurveKeys | None = None
    """CurveZMQ keys: when given, traffic is encrypted and clients must be authorised."""
    shared_memory: bool = field(default_factory=lambda: envvars.flag(envvars.PSFLOW_SHM, True))
    """Move large tensors through a shared-memory lane when client and server share a host
    (:mod:`psflow.transport.shm`); the socket otherwise (``PSFLOW_SHM``, default on)."""
    sealed: bool = field(default_factory=lambda: envvars.flag(envvars.PSFLOW_SEALED, True))
    """With :attr:`keys`, requests to a peer reached only by socket travel on its sealed socket
    once it has one, sealed with AES-256-GCM (:mod:`psflow.transport.seal`); else all inside
    CurveZMQ (``PSFLOW_SEALED``, default on)."""
    spin_seconds: float = field(
        default_factory=lambda: envvars.micros(envvars.PSFLOW_SPIN_US, SPIN_SECONDS)
    )
    """How long after its last message a side of a shared-memory lane looks for the next one
    before it sleeps, while its last waits ended that soon (``PSFLOW_SPIN_US``; 0: it sleeps at
    once). See the doorbells in :mod:`psflow.transport.shm` and :mod:`psflow.transport.looks`."""
    io_threads: int = field(default_factory=lambda: envvars.count(envvars.PSFLOW_IO_THREADS, 1))
    """ZeroMQ I/O threads of the process's context (``PSFLOW_IO_THREADS``, default 1): with
    CurveZMQ keys they encrypt and decrypt every byte inside CurveZMQ (not a sealed socket's
    messages, which the threads that send them seal), a ps's for all its workers'
    connections, which ZeroMQ shares out among them by load as they connect. Set where psflow
    makes the process's first ZeroMQ socket (:func:`context`); later, ZeroMQ keeps the threads
    it started."""
    wait_log_seconds: float = field(
        default_factory=lambda: envvars.seconds(envvars.PSFLOW_WAIT_LOG_SECONDS, 10.0)
    )
    """Seconds between the lines of a long wait (for peers to come up) or of a recurring
    event (a client failing its handshake again and again) (``PSFLOW_WAIT_LOG_SECONDS``,
    default 10)."""

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if self.link_timeout <= 0:
            raise ValueError(
                f"link_timeout ({envvars.PSFLOW_LINK_TIMEOUT}) must be > 0 seconds, "
                f"got {self.link_timeout}"
            )
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {self.max_message_bytes}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")
        if self.spin_seconds < 0:
            raise ValueError(
                f"spin_seconds ({envvars.PSFLOW_SPIN_US}) must be >= 0, got {self.spin_seconds}"
            )
        if self.io_threads < 1:
            raise ValueError(
                f"io_threads ({envvars.PSFLOW_IO_THREADS}) must be >= 1, got {self.io_threads}"
            )
        if self.wait_log_seconds <= 0:
            raise ValueError(
                f"wait_log_seconds ({envvars.PSFLOW_WAIT_LOG_SECONDS}) must be > 0 seconds, "
                f"got {self.wait_log_seconds}"
            )

    @classmethod
    def from_env(cls, **overrides: Any) -> TransportConfig:
        """Defaults, with keys from ``PSFLOW_KEYS_DIR`` when it is set."""
        keys_dir = envvars.text(envvars.PSFLOW_KEYS_DIR)
        if keys_dir and "keys" not in overrides:
            overrides["keys"] = CurveKeys.load(keys_dir)
        return cls(**overrides)


def context(config: TransportConfig) -> zmq.Context[Any]:
    """The process's ZeroMQ context, asked for ``config.io_threads`` I/O threads: ZeroMQ starts
    them with the context's first socket and keeps them, so the ask counts only before it."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    if ctx.get(zmq.IO_THREADS) != config.io_threads:
        ctx.set(zmq.IO_THREADS, config.io_threads)
    return ctx


def endpoint(address: str, *, bind: bool, timeout: float = 0.0) -> str:
    """The ZeroMQ endpoint (``tcp://host:port``) for ``host:port``.

    To ``bind``, a host name is resolved first, retried for up to ``timeout`` seconds.

    Raises:
        ValueError: when ``address`` is not ``host:port``, or its host cannot be resolved.
    """
    host, port = parse_address(address)
    if bind and host not in ("*", "0.0.0.0", "::"):
        # A task's own DNS name (a Kubernetes headless Service) can appear a little after the
        # task starts: keep trying for up to ``timeout`` seconds.
        deadline = time.monotonic() + timeout
        while True:
            try:
                host = pysocket.gethostbyname(host)
                break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise ValueError(f"cannot resolve {host!r} to bind {address!r}: {e}") from None
                time.sleep(0.5)
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
