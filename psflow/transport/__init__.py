"""The transport: how tasks talk. Nothing above this package knows ZeroMQ.

- ``wire.py``: the message format (msgpack header + raw tensor frames), :class:`WireError`.
- ``connection.py``: :class:`Server` (ROUTER), :class:`Client` (requests to many peers in
  flight), :class:`TransportConfig`, :class:`PeerError`, :class:`PeerTimeoutError`, :class:`PeerLostError`.
- ``shm.py``: :class:`~psflow.transport.shm.Lane`, shared memory for large tensors between
  a client and a server on the same host.
- ``auth.py``: CurveZMQ keys, :func:`generate_keys`, :class:`CurveKeys`.
- ``cli.py``: ``psflow keys generate DIR``.
"""

from psflow.transport.auth import CurveKeys, generate_keys
from psflow.transport.connection import (
    Client,
    PeerError,
    PeerLostError,
    PeerTimeoutError,
    Request,
    Server,
    TransportConfig,
)
from psflow.transport.wire import DTYPES, TensorMeta, WireError

__all__ = [
    "DTYPES",
    "Client",
    "CurveKeys",
    "PeerError",
    "PeerLostError",
    "PeerTimeoutError",
    "Request",
    "Server",
    "TensorMeta",
    "TransportConfig",
    "WireError",
    "generate_keys",
]
