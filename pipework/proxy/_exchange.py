"""One proxied request's record (:class:`Exchange`) and the small rules the proxy layer
applies to it: the head it reads and sends on, its body's framing, its time limits, the
route's CORS headers, the problem a failure is answered with.

Apart from :mod:`._asgi` (which serves the request) because they are shared by the
layer's parts (the HTTP exchange, the websocket, the service's stream) and each reads on
its own, apart from the order a request meets them in.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Final

from .._errors import PipeworkError
from .._http._auth import Identity
from .._http._cors import CorsPolicy, header_pairs
from .._http._problems import Problem, problem_for_exception
from .._http._request_ids import request_id
from ..backends._failures import CallTimeout, ConnectFailed
from ..backends._stream import StreamTimeouts
from ._relay import ASGISend, BodyTooLarge, Upload
from ._route import ProxyRoute
from ._upstream import Upstream

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "EMPTY_BODY_METHODS",
    "PREFLIGHT_HEADERS",
    "Exchange",
    "body_framing",
    "correlation_id_of",
    "failure_problem",
    "first_leaf",
    "from_pairs",
    "log_cut",
    "lower_name",
    "raw_header",
    "sent_target",
    "stream_timeouts",
    "to_pairs",
    "too_large",
    "with_cors",
]

_log = logging.getLogger("pipework.proxy")

#: Idle time between two chunks when neither the route nor the service says (seconds).
DEFAULT_IDLE_TIMEOUT: Final = 60.0
#: Methods sent on with ``Content-Length: 0`` when the client sent no body: some servers
#: refuse them without a length (411).
EMPTY_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


@dataclass(slots=True)
class Exchange:
    """One proxied request's bookkeeping, for its metrics and access log line."""

    route: ProxyRoute
    correlation_id: str
    method: str
    path: str
    started: float
    scope: MutableMapping[str, Any]
    status: int | None = None  # sent to the client; None: nothing was
    upstream: int | None = None  # the backend's own status
    sent: int = 0  # body bytes to the client
    upload: Upload | None = None
    host: str | None = None  # the service's host that answered (or failed last)
    retries: int = 0
    client_gone: bool = False
    # The answer's last message was handed to the server (the backend's, or a problem's).
    answered: bool = False
    identity: Identity | None = None  # who the route's auth says the caller is


PREFLIGHT_HEADERS: Final = frozenset(
    {b"origin", b"access-control-request-method", b"access-control-request-headers"}
)


def with_cors(send: ASGISend, cors: CorsPolicy, scope: MutableMapping[str, Any]) -> ASGISend:
    """``send`` adding the route's CORS headers to the answer's head (the service's own
    ``Access-Control-*`` headers are replaced: the route's policy decides)."""
    origin = raw_header(scope["headers"], b"origin")
    text = None if origin is None else origin.decode("latin-1")
    added = header_pairs(cors.response_headers(text))

    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            kept = [
                (name, value)
                for name, value in message["headers"]
                if not name.lower().startswith(b"access-control-")
            ]
            message = {**message, "headers": [*kept, *added]}
        await send(message)

    return sending


def raw_header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def sent_target(route: ProxyRoute, scope: MutableMapping[str, Any]) -> bytes:
    """The target sent on; :class:`BadTarget` for a path that must not be (a dot segment
    would leave the route's prefix on the service)."""
    return route.target(scope.get("raw_path") or scope["path"].encode(), scope["query_string"])


def lower_name(name: str | None) -> bytes | None:
    return None if name is None else name.lower().encode("latin-1")


def correlation_id_of(scope: MutableMapping[str, Any]) -> str:
    given = raw_header(scope["headers"], b"x-request-id")
    return request_id(None if given is None else given.decode("latin-1"))


def body_framing(headers: list[tuple[bytes, bytes]], method: str) -> tuple[int | None, bool]:
    """The request body's declared length and whether it has a body at all. The server
    (h11) has refused ambiguous framing already; the body is framed again on the way out."""
    declared = raw_header(headers, b"content-length")
    if declared is not None:
        return int(declared), True
    if raw_header(headers, b"transfer-encoding") is not None:
        return None, True
    # No framing is an empty body (RFC 9112 §6.3); one that usually has a body says so.
    return (0, True) if method in EMPTY_BODY_METHODS else (None, False)


def stream_timeouts(route: ProxyRoute, service: Upstream) -> StreamTimeouts:
    connect = route.connect_timeout or service.connect_timeout or service.timeout
    first_byte = route.first_byte_timeout or service.timeout
    idle = route.idle_timeout or DEFAULT_IDLE_TIMEOUT
    return StreamTimeouts(connect=connect, first_byte=first_byte, idle=idle)


def to_pairs(headers: list[tuple[bytes, bytes]]) -> list[list[str]]:
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]


def from_pairs(pairs: Any) -> list[tuple[bytes, bytes]]:
    return [(str(n).lower().encode("latin-1"), str(v).encode("latin-1")) for n, v in pairs]


def first_leaf(group: BaseExceptionGroup[Any]) -> Any:
    """The first leaf of ``group``: the failure the answer names."""
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def too_large(exc: BodyTooLarge) -> Problem:
    return Problem(
        413,
        "Content Too Large",
        f"{exc}; send a smaller body",
        slug="body-too-large",
    )


def failure_problem(route: ProxyRoute, exc: BaseException) -> Problem:
    """The problem for a failed exchange, before any byte of the answer was sent."""
    if isinstance(exc, PipeworkError):
        return problem_for_exception(exc)
    where = f"proxy route {route.name!r} to service {route.service!r}"
    if isinstance(exc, CallTimeout):
        return Problem(
            504,
            "Gateway Timeout",
            f"{where}: {exc}",
            slug="deadline-exceeded",
            service=route.service,
            phase=exc.phase,
        )
    what = "could not connect" if isinstance(exc, ConnectFailed) else "failed"
    return Problem(
        502,
        "Bad Gateway",
        f"{where}: the backend {what}: {exc}",
        slug="backend-failed",
        service=route.service,
    )


def log_cut(ex: Exchange, exc: BaseException) -> None:
    _log.warning(
        "proxy route %r: the answer from service %r was cut after %d bytes: %s",
        ex.route.name,
        ex.route.service,
        ex.sent,
        exc,
        extra={"correlation_id": ex.correlation_id, "route": ex.route.name},
    )
