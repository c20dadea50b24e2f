"""Which of a client's request headers travel on: one policy, for the proxy routes' relay
and for the HTTP pipes' ``pass_headers``. Pure functions on lower-case names, no I/O.

- **Hop-by-hop** fields (:data:`HOP_BY_HOP`, RFC 9110 §7.6.1, and RFC 2616's
  ``Trailers``) describe one connection: never passed on, nor any field the
  ``Connection`` header names (:func:`connection_named`).
- **An HTTP pipe** passes the headers its ``pass_headers`` names (:func:`pass_problem` says
  which names it may hold) or, with ``"*"``, every end-to-end header but those below
  (:func:`passes`):

  - never, named or not (:data:`NOT_PASSED`): what describes the client's own exchange
    with the gateway, which the pipe's call replaces -- ``Host``, ``Content-Length``,
    ``Expect``, ``Content-Type``, ``Content-Encoding`` (the pipe's body has its own) and
    ``Accept-Encoding`` (the gateway decodes answers itself);
  - never by name or ``"*"`` (:data:`CARRIED`): ``traceparent``, ``tracestate`` and
    ``baggage``, which every backend call carries already, checked;
  - only when named (:data:`ONLY_NAMED`): the credentials ``Authorization`` and
    ``Cookie``, and ``Forwarded``, ``X-Forwarded-*`` and ``Via``, which only a trusted
    proxy may say (a client could claim another address with them).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final

__all__ = [
    "CARRIED",
    "HOP_BY_HOP",
    "NOT_PASSED",
    "ONLY_NAMED",
    "WILDCARD",
    "connection_named",
    "pass_problem",
    "passed",
    "passes",
]

#: Fields that describe one connection, never passed on (RFC 9110 §7.6.1; ``Trailer`` and
#: RFC 2616's ``Trailers`` too: a passed-on message is framed anew, so announced trailers
#: may not come).
HOP_BY_HOP: Final[frozenset[str]] = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
#: Never passed by a pipe: the client's exchange with the gateway, which the call replaces.
NOT_PASSED: Final[frozenset[str]] = HOP_BY_HOP | {
    "host",
    "content-length",
    "expect",
    "content-type",
    "content-encoding",
    "accept-encoding",
}
#: The W3C trace context: every backend call of a job carries the request's, checked.
CARRIED: Final[frozenset[str]] = frozenset({"traceparent", "tracestate", "baggage"})
#: Passed by a pipe only when named: credentials, and claims about the client's address.
ONLY_NAMED: Final[frozenset[str]] = frozenset(
    {
        "authorization",
        "cookie",
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
        "via",
    }
)
#: In ``pass_headers``: every end-to-end header but those only passed when named.
WILDCARD: Final = "*"


def _hop_by_hop(lowered: str) -> bool:
    return lowered in HOP_BY_HOP or lowered.startswith("proxy-")


def pass_problem(name: str) -> str | None:
    """Why ``name`` cannot be one of a pipe's ``pass_headers``, or None if it can (the
    name's syntax is the caller's to check)."""
    lowered = name.lower()
    if lowered == WILDCARD:
        return None
    if _hop_by_hop(lowered):
        return f"{name!r} is a hop-by-hop header; pipework never passes those on"
    if lowered in CARRIED:
        return (
            f"{name!r} is part of the W3C trace context, which every backend call carries "
            "already (checked); leave it out"
        )
    if lowered in ("accept-encoding", "content-encoding"):
        return (
            f"{name!r} describes the client's exchange with the gateway, which decodes "
            "answers itself; it is never passed on"
        )
    if lowered == "content-type":
        return (
            "'Content-Type' comes with the pipe's body (JSON, or the raw body's own "
            "with body_from); set another in headers"
        )
    if lowered in NOT_PASSED:
        return f"{name!r} frames the client's request to the gateway; it is never passed on"
    return None


def passes(lowered: str, names: Collection[str]) -> bool:
    """Whether a header of lower-case name ``lowered`` passes under ``names`` (a pipe's
    ``pass_headers``, lower-cased; ``"*"`` among them for every end-to-end one)."""
    if lowered in NOT_PASSED or lowered in CARRIED or _hop_by_hop(lowered):
        return False
    if lowered in names:
        return True
    return WILDCARD in names and lowered not in ONLY_NAMED


def connection_named(headers: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The field names (lower-case) every ``Connection`` field of ``headers`` lists."""
    named: set[str] = set()
    for name, value in headers:
        if name.lower() == "connection":
            named.update(t for token in value.split(",") if (t := token.strip().lower()))
    return frozenset(named)


def passed(headers: Iterable[tuple[str, str]], names: Collection[str]) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs of ``headers`` (a request's, in order) that pass under
    ``names``, their names lower-cased; none that the ``Connection`` header names."""
    pairs = [(name.lower(), value) for name, value in headers]
    named = connection_named(pairs)
    return [(name, value) for name, value in pairs if passes(name, names) and name not in named]
