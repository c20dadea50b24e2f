"""The access log: one line per request on the ``pipework.access`` logger, for every kind of
request the server answers (a route's, a proxy route's, a websocket's, the job and admin
endpoints'). Pure functions but :func:`log_access`, which writes the line.

Fields (each a record attribute, set through ``extra``; None ones are left out):

- ``client``: the client's address: the peer's, or, when the peer is one of the trusted
  proxies (``[server] trusted_proxies``), the address its forwarding headers name
  (:func:`client_address`); nobody else can choose the address logged;
- ``method``, ``path``, ``query`` (the raw query, each value of a parameter named in the
  redaction list replaced by ``REDACTED``: :func:`redacted_query`), ``status``;
- ``bytes_in`` (the request body: as received, else as declared), ``bytes_out`` (the
  answer's body: as sent, else its ``Content-Length``; none for a stream still going);
- ``duration`` (seconds: to the answer's head for a route, to its last byte for a proxied
  request, the connection's life for a websocket), ``user_agent``;
- ``route`` (a route's or proxy route's name), ``endpoint`` (the container's own: ``jobs``,
  ``admin``...), ``service``, ``host`` and ``retries`` (the backend calls it made: the
  services, their hosts, the retries in all), ``upstream_status``;
- ``correlation_id`` (the request id), ``trace_id`` (with tracing on, the server span's;
  else a well-formed W3C ``traceparent``'s), ``pid``.

The text form is the message: ``CLIENT METHOD TARGET STATUS DURATION name=value...
request_id=ID``, values with a space or a quote JSON-quoted.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from ipaddress import ip_address
from typing import Any, Final
from urllib.parse import unquote_plus

from .. import _tracing
from .._http._trace import traceparent
from .._logging import take_upstreams
from ._forwarding import Network, is_trusted

__all__ = [
    "ALWAYS_REDACTED",
    "DEFAULT_REDACTED",
    "access_logger",
    "client_address",
    "header",
    "log_access",
    "redacted_query",
    "trace_id",
    "upstreams",
]

access_logger = logging.getLogger("pipework.access")

#: Query parameters redacted unless the file says otherwise: names that usually carry a
#: secret.
DEFAULT_REDACTED: Final = ("token", "access_token", "api_key", "apikey", "password", "secret")
#: Redacted whatever the file says: the signature of the container's own callback URLs.
ALWAYS_REDACTED: Final = frozenset({"sig"})
_REDACTED: Final = b"REDACTED"
#: The text form's fields after ``duration``, in order (``request_id`` ends the line).
_TEXT_FIELDS: Final = (
    "bytes_in",
    "bytes_out",
    "route",
    "endpoint",
    "service",
    "host",
    "retries",
    "upstream_status",
    "client_gone",
    "close_code",
    "user_agent",
    "trace_id",
    "pid",
)


def redacted_query(query: bytes, redact: Collection[str]) -> str | None:
    """``query`` as received (None when empty), each value of a parameter whose name
    (percent-decoded, any case) is in ``redact`` (lower-case names) replaced."""
    if not query:
        return None
    if not redact:
        return query.decode("latin-1")
    parts = []
    for part in query.split(b"&"):
        name, sep, _ = part.partition(b"=")
        if sep and unquote_plus(name.decode("latin-1")).lower() in redact:
            part = name + b"=" + _REDACTED
        parts.append(part)
    return b"&".join(parts).decode("latin-1")


def client_address(
    peer: str | None, headers: Iterable[tuple[bytes, bytes]], trusted: Sequence[Network]
) -> str | None:
    """Who sent the request. ``peer``'s address, unless it is a trusted proxy: then the
    nearest address its ``Forwarded`` ``for=`` (else its ``X-Forwarded-For``) names that is
    no trusted proxy itself, read from the right (the leftmost when all are trusted). A value
    that is no address (``unknown``, an obfuscated name) is taken as it is."""
    if peer is None or not trusted or not is_trusted((peer, 0), trusted):
        return peer
    forwarded: list[str] = []
    chain: list[str] = []
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"forwarded":
            forwarded.extend(_forwarded_for(value.decode("latin-1")))
        elif lowered == b"x-forwarded-for":
            chain.extend(v.strip() for v in value.decode("latin-1").split(",") if v.strip())
    hops = forwarded or chain
    for hop in reversed(hops):
        address = _bare_address(hop)
        if address is None or not is_trusted((address, 0), trusted):
            return address or hop
    return (_bare_address(hops[0]) or hops[0]) if hops else peer


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` values of a ``Forwarded`` field (RFC 7239), in order, unquoted."""
    found = []
    for element in value.split(","):
        for pair in element.split(";"):
            key, sep, item = pair.strip().partition("=")
            if sep and key.strip().lower() == "for":
                found.append(item.strip().strip('"'))
    return found


def _bare_address(hop: str) -> str | None:
    """The IP address in a forwarding hop (``1.2.3.4``, ``1.2.3.4:80``, ``[::1]:80``,
    ``::1``), or None when it holds none."""
    text = hop.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        return str(ip_address(text))
    except ValueError:
        return None


def trace_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The trace id of a well-formed W3C ``traceparent`` among ``headers``."""
    for name, value in headers:
        if name.lower() == b"traceparent":
            parent = traceparent(value.decode("latin-1"))
            return None if parent is None else parent.split("-")[1]
    return None


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case), decoded as Latin-1."""
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def upstreams(correlation_id: str) -> dict[str, Any]:
    """The ``service``, ``host`` and ``retries`` fields of the backend calls this process
    made for the request (each service and host once, in order; the retries summed)."""
    calls = take_upstreams(correlation_id)
    if not calls:
        return {}
    services = dict.fromkeys(service for service, _, _ in calls)
    hosts = dict.fromkeys(host for _, host, _ in calls if host)
    return {
        "service": ",".join(services),
        "host": ",".join(hosts) or None,
        "retries": sum(retries for _, _, retries in calls),
    }


def log_access(fields: Mapping[str, Any]) -> None:
    """Write the access line of ``fields`` (see the module), adding ``pid``."""
    extra = {name: value for name, value in fields.items() if value is not None}
    # With tracing on, the server span's trace (the incoming traceparent's, or a new one).
    traced = _tracing.current_trace_id()
    if traced is not None:
        extra["trace_id"] = traced
    extra["event"] = "request"
    extra["pid"] = os.getpid()
    status = extra.get("status")
    duration = extra.get("duration")
    query = extra.get("query")
    target = extra.get("path", "") + ("" if query is None else f"?{query}")
    head = (
        f"{extra.get('client') or '-'} {extra.get('method', '-')} {target} "
        f"{'-' if status is None else status} "
        f"{'-' if duration is None else f'{duration:.3f}s'}"
    )
    text = [f"{name}={_quoted(extra[name])}" for name in _TEXT_FIELDS if name in extra]
    text.append(f"request_id={extra.get('correlation_id', '-')}")
    access_logger.info("%s %s", head, " ".join(text), extra=extra)


def _quoted(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text
