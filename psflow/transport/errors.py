"""What can go wrong with a peer: it refused, it did not answer, or it is gone."""

from __future__ import annotations


class PeerError(RuntimeError):
    """A peer failed: it answered with an error, or it did not answer in time.

    Attributes:
        peer: the peer, named as the client knows it (``ps:1``), with its address when it
            did not answer or is gone (``ps:1 at 10.0.0.2:2222``).
        detail: what happened, without the peer's name.
        code: for an error reply, the kind of refusal the peer gave (a
            :class:`~psflow.protocol.Code` value, or ``None`` when it gave none); ``None``
            when the peer did not answer.
    """

    def __init__(self, peer: str, detail: str, *, code: str | None = None) -> None:
        super().__init__(f"{peer}: {detail}")
        self.peer = peer
        self.detail = detail
        self.code = code


class PeerTimeoutError(PeerError, TimeoutError):
    """A peer did not answer before the deadline (dead, hung, unreachable or not authorised)."""


class PeerLostError(PeerError):
    """A peer is gone, or its state is: the transport raises it when a peer hangs up its
    shared-memory lane (it exited); the layers above raise it for error replies whose code says
    the peer lost the state the request was made against (a restarted ps, a restore)."""
