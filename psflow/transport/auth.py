"""CurveZMQ keys: loading them in each task (generating them for a job:
:func:`psflow.cluster.keys.generate_keys`, re-exported here).

A job's key directory holds one server key pair (every ps task uses it) and one client key
pair (every worker uses it); a server accepts the clients whose public keys (``*.key``) are in
``DIR/authorized_clients/`` when that exists, else in ``DIR`` itself. The layout is flat so that
``kubectl create secret generic --from-file=DIR`` carries it whole. With keys, every connection
is encrypted and a peer whose key is not authorised cannot connect at all.

Layout::

    DIR/server.key          public        DIR/client.key          public
    DIR/server.key_secret   secret        DIR/client.key_secret   secret
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from psflow.cluster.keys import generate_keys

__all__ = ["CurveKeys", "Gatekeeper", "configure_client", "configure_server", "generate_keys"]


@dataclass(frozen=True, kw_only=True)
class CurveKeys:
    """The keys one task needs: the server's key pair and a client key pair."""

    server_public: bytes
    """Public key of the ps tasks (clients need it to connect)."""
    server_secret: bytes | None
    """Secret key of the ps tasks (only servers need it)."""
    client_public: bytes
    client_secret: bytes
    authorized_dir: Path | None
    """Directory of public keys a server accepts (only servers need it)."""

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> CurveKeys:
        """Loads the keys of a directory written by :func:`generate_keys`.

        Raises:
            ValueError: naming the missing or unreadable file.
        """
        d = Path(directory)
        server_public, server_secret = _load(d / "server.key_secret", d / "server.key")
        client_public, client_secret = _load(d / "client.key_secret", d / "client.key")
        if client_secret is None:
            raise ValueError(f"no client secret key in {str(d)!r}: expected client.key_secret")
        authorized = d / "authorized_clients"
        if not authorized.is_dir():
            authorized = d
        return cls(
            server_public=server_public,
            server_secret=server_secret,
            client_public=client_public,
            client_secret=client_secret,
            authorized_dir=authorized,
        )


def _load(secret_path: Path, public_path: Path) -> tuple[bytes, bytes | None]:
    path = secret_path if secret_path.exists() else public_path
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load CurveZMQ key {str(path)!r}: {e}") from None
    if public is None:
        raise ValueError(f"key file {str(path)!r} has no public key")
    return public, secret


def configure_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Makes ``sock`` a CurveZMQ server (call before ``bind``)."""
    if keys.server_secret is None:
        raise ValueError("this task needs the server secret key (server.key_secret) to serve")
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def configure_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Makes ``sock`` a CurveZMQ client of the job's servers (call before ``connect``)."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


SEALED_DOMAIN = "psflow-sealed"
"""The ZAP domain of a server's sealed socket (:mod:`psflow.transport.seal`): its PLAIN
connections' tokens are checked there."""

_ZAP_BIND_SECONDS = 2.0
"""How long a server's authenticator tries again to bind ZeroMQ's authenticator endpoint while
the one of a server this process stopped a moment ago still holds it."""


class Gatekeeper(ThreadAuthenticator):
    """pyzmq's ZAP authenticator for a server's CurveZMQ clients, in its own thread, that logs
    each client it refuses (WARNING, with the client's address and key) on ``refusals``.

    pyzmq's own authenticator decides as ``configure_curve`` would (the public keys in
    ``authorized_dir``, read once); it only logs refusals at DEBUG, without the address.

    Example:
        >>> # gate = Gatekeeper(zmq.Context.instance(), Path("keys"), refusals=log.warning)
        >>> # gate.start(); ...; gate.stop()
    """

    def __init__(
        self,
        context: zmq.Context[Any],
        authorized_dir: Path,
        *,
        refusals: Callable[..., None],
        log: logging.Logger | None = None,
    ) -> None:
        super().__init__(context, log=log)
        self.authorized_dir = authorized_dir
        self.authorized = set(zmq.auth.load_certificates(str(authorized_dir)))
        """The z85 public keys this server accepts."""
        self._refusals = refusals
        self._address = "an unknown address"
        self.sealed_tokens: dict[str, str] = {}
        """The tokens of the server's sealed sessions by their ids in hex (its sealed socket's
        :attr:`~psflow.transport.seal.Sessions.tokens`)."""

    def start(self) -> None:
        # ZeroMQ's authenticator endpoint is one per context: one closed a moment ago (a server
        # of this process, stopped) is released by the context's reaper thread, soon after.
        deadline = time.monotonic() + _ZAP_BIND_SECONDS
        while True:
            try:
                super().start()
                break
            except zmq.ZMQError as e:
                if self.zap_socket is not None:
                    self.zap_socket.close(linger=0)
                    self.zap_socket = None  # type: ignore[assignment]
                if e.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        self.configure_curve_callback(domain="*", credentials_provider=self)

    def handle_zap_message(self, msg: list[bytes]) -> Any:
        # One request at a time, on the authenticator's thread: the callback below follows.
        if len(msg) >= 4:
            self._address = msg[3].decode("utf-8", "replace") or "an unknown address"
        return super().handle_zap_message(msg)

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        # PLAIN is only a sealed socket's: its user name is a session's id, its password the
        # session's token (psflow.transport.seal), both handed out through CurveZMQ.
        expected = self.sealed_tokens.get(username) if domain == SEALED_DOMAIN else None
        if expected is not None and hmac.compare_digest(expected, password):
            return True, b"OK"
        self._refusals(
            ("sealed", self._address),
            "refused a connection to the sealed socket from %s: no session of its name and "
            "token (one this server dropped, or not a psflow task of this job)",
            self._address,
        )
        return False, b"no such session"

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether the client with this z85 public key may connect (pyzmq's provider hook)."""
        if key in self.authorized:
            return True
        text = key.decode("ascii", "replace")
        self._refusals(
            (self._address, text),
            "refused a client at %s: its CurveZMQ key %s... is not among the authorised keys in "
            "%s (a task started with another job's keys?)",
            self._address,
            text[:10],
            self.authorized_dir,
        )
        return False
