"""The refusals of a ps: each a ``ValueError`` whose :attr:`~RequestError.code` the reply carries
(:class:`~psflow.protocol.Code`), raised by a handler and answered by the server (its
``_handle``). Here, below every service and the shard's state, so that any of them may raise
one without importing the others."""

from __future__ import annotations

from typing import ClassVar

from psflow.protocol import Code


class RequestError(ValueError):
    """A request the ps refuses; :attr:`code` says what kind of refusal, for the client.

    A handler refuses a request by raising: a plain ``ValueError`` or ``TypeError`` is answered
    with :attr:`Code.REFUSED <psflow.protocol.Code.REFUSED>`, a subclass of this one with its
    own code.
    """

    code: ClassVar[Code] = Code.REFUSED


class NotInitializedError(RequestError):
    """A request that needs the shard's variables before the chief has set them."""

    code = Code.UNINITIALIZED


class InputOvertakenError(RequestError):
    """A push whose input position its worker learnt from an earlier state of the shard
    (:attr:`~psflow.protocol.Key.INPUT_EPOCH`): applied, it would read on past what the shard
    lost."""

    code = Code.RESTORED


class BusyError(RequestError):
    """A save or an export while the shard still writes an earlier one."""

    code = Code.BUSY
