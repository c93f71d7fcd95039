"""A job's CurveZMQ key files: written here, below the transport that loads them
(:mod:`psflow.transport.auth`), so that ``psflow launch`` makes a job's keys without loading
the transport (and torch) in the launcher.

Layout (flat, so that ``kubectl create secret generic --from-file=DIR`` carries it whole)::

    DIR/server.key          public        DIR/client.key          public
    DIR/server.key_secret   secret        DIR/client.key_secret   secret
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq.auth


def generate_keys(directory: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Writes a fresh server and client key pair for one job into ``directory`` (mode 0700,
    the secret keys 0600).

    Example:
        >>> import tempfile
        >>> d = generate_keys(tempfile.mkdtemp() + "/keys")
        >>> sorted(p.name for p in d.iterdir())
        ['client.key', 'client.key_secret', 'server.key', 'server.key_secret']
    """
    d = Path(directory)
    if d.exists() and any(d.iterdir()) and not force:
        raise ValueError(f"key directory {str(d)!r} is not empty: pass --force to replace it")
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in ("server", "client"):
        zmq.auth.create_certificates(str(d), name)
        os.chmod(d / f"{name}.key_secret", 0o600)
    return d
