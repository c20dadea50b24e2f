"""What the lean client (:mod:`._pool` over :mod:`._h1`) raises when a call fails, as a set
of its own: the trio, socket and h11 errors underneath are each kept as ``__cause__``.
:class:`~._http.Backends` translates these, and httpx's exceptions on the path of an
injected transport, into pipework's errors; nothing above the backends layer sees either set.

    TransportFailure        a call failed before its whole answer arrived
    ├── ConnectFailed       no connection could be made: nothing was sent
    ├── ConnectionBroken    the connection failed after the request went out, before the
    │                       answer's end (reset, or closed early): the backend may have acted
    ├── BadAnswer           the answer is not valid HTTP/1.1
    │   └── BadEncoding     its body does not decode in the coding it declared (in :mod:`._h1`)
    └── CallTimeout         the call's deadline passed; ``phase`` says in which part
"""

from __future__ import annotations

from typing import Literal, TypeAlias

__all__ = [
    "BadAnswer",
    "CallTimeout",
    "ConnectFailed",
    "ConnectionBroken",
    "Phase",
    "TransportFailure",
]

#: Where a call's time ran out: waiting for a free connection, connecting, the exchange, or
#: (a streamed exchange) a wait between two pieces of a body.
Phase: TypeAlias = Literal["pool", "connect", "answer", "idle"]


class TransportFailure(Exception):
    """A call through the lean client failed before its whole answer arrived. A streamed
    exchange sets ``host`` (the last try's ``Host``) and ``retries`` on the one it raises,
    for the access log."""

    host: str | None = None
    retries: int = 0


class ConnectFailed(TransportFailure):
    """No connection could be made (refused, unresolvable, unreachable, or the pool was
    closed): nothing of the request was sent."""


class ConnectionBroken(TransportFailure):
    """The connection failed after the request began to go out and before the answer's end:
    reset, or closed by the peer before the answer was complete. The backend may have
    received the request and acted on it."""


class BadAnswer(TransportFailure):
    """The answer is not valid HTTP/1.1 (a malformed head or framing), or its body does not
    decode."""


class CallTimeout(TransportFailure):
    """The call's deadline passed while it ``phase``: ``pool`` (waiting for a free
    connection), ``connect`` or ``answer`` (sending the request and reading the answer) —
    or, in a streamed exchange (:mod:`._stream`), ``idle``: the backend sent nothing of its
    answer's body, or took nothing of the request's, for the exchange's idle timeout."""

    def __init__(self, message: str, *, phase: Phase) -> None:
        super().__init__(message)
        self.phase: Phase = phase
