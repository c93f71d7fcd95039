"""The transport: how tasks talk. Nothing above this package knows ZeroMQ.

It knows frames, peers and errors, not what a ps is: the words of the protocol are
:mod:`psflow.protocol`'s, and an error reply reaches the caller as a :class:`PeerError` carrying
the reply's code, for the layer above to act on.

- ``wire/``: the message format (msgpack header + raw tensor frames), one module a role:
  ``framing.py`` (limits, :data:`DTYPES`, :class:`TensorMeta`, :class:`WireError`),
  ``encoding.py`` (``encode``, ``Layout``, ``TensorSet``), ``decoding.py`` (``decode_header``,
  ``decode_tensors``), ``lanes.py`` (where tensors lie in a lane's area); every name is taken
  from ``psflow.transport.wire``.
- ``config.py``: :class:`TransportConfig`, and how an address becomes a ZeroMQ endpoint.
- ``errors.py``: :class:`PeerError`, :class:`PeerTimeoutError`, :class:`PeerLostError`.
- ``server.py``: :class:`Server` (a ROUTER socket receiving requests one at a time, and the
  lanes clients attach).
- ``replier.py``: :class:`Request`, and how a server answers one (``Replier``, the base of
  :class:`Server`: the reply through the lane or the socket, error replies, ``flush``).
- ``client.py``: :class:`Client` (one DEALER socket per peer, many requests in flight).
- ``receiver.py``: how a client waits for its replies (``Receiver``, the base of
  :class:`Client`: lanes and sockets at once, a deadline naming the late peers).
- ``shm.py``: :class:`Lane`, shared memory for large tensors between a client and a server on
  the same host; ``looks.py``: whether a side of a lane looks for its next message before it
  sleeps.
- ``auth.py``: CurveZMQ keys, :func:`generate_keys`, :class:`CurveKeys`; the server's ZAP
  authenticator that logs the clients it refuses.
- ``seal.py``: sealed sockets: with keys, a client reached only by socket moves to a second
  socket of its server, each message sealed with AES-256-GCM under keys handed over through
  CurveZMQ (a sixth of CurveZMQ's cipher's CPU).
- ``monitor.py``: connection reports of sockets read in the background: why a peer is silent
  (nothing listening, a refused key), which clients failed their handshake.
- ``cli.py``: ``psflow keys generate DIR``.
"""

from psflow.transport.auth import CurveKeys, generate_keys
from psflow.transport.client import Client
from psflow.transport.config import TransportConfig
from psflow.transport.errors import PeerError, PeerLostError, PeerTimeoutError
from psflow.transport.replier import Request
from psflow.transport.server import Server
from psflow.transport.shm import Lane
from psflow.transport.wire import DTYPES, TensorMeta, WireError

__all__ = [
    "DTYPES",
    "Client",
    "CurveKeys",
    "Lane",
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
