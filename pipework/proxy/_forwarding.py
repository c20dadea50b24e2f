"""Which headers a proxied request and its answer carry on: pure functions, no I/O.

Request side (:func:`request_headers`), each rule tied to a test in
tests/test_proxy_forwarding.py:

- Names are lower-cased. Hop-by-hop fields (:data:`HOP_BY_HOP`, RFC 9110 §7.6.1) and every
  field the ``Connection`` header names are removed, as are HTTP/2 pseudo-fields
  (``:authority``...), which an ASGI server may pass on.
- **Framing never passes**: ``Content-Length``, ``Transfer-Encoding``, ``Expect`` and
  ``Host`` are removed; the upstream client frames every request itself, so no client can
  send a backend an ambiguous one. ``Host`` is set to the ``host`` given.
- **Forwarding fields** depend on whether the peer (the address the request came from) is
  trusted (in ``trusted``): a trusted peer's ``X-Forwarded-For`` gets the peer appended and
  its ``Forwarded`` a new element; its ``X-Forwarded-Proto`` and ``-Host`` are kept (set
  from this request when it sent none). An untrusted peer's four fields are dropped and
  replaced by this hop's alone: nobody outside the trusted set can forge a client address.
- ``Forwarded`` (RFC 7239) carries ``for=`` (an IPv6 address quoted and bracketed,
  ``unknown`` when the peer has no address), ``proto=`` and ``host=`` (quoted when it is no
  token); no port, no ``by=``. An IPv4 peer seen as an IPv4-mapped IPv6 address (a
  dual-stack socket) is written, and checked for trust, as its IPv4 address.
- ``Via`` is appended to; the request id is set under ``request_id_header`` (replacing the
  client's) when one is given.
- **No look-alikes**: a field whose name, read with ``-`` for ``_``, is one of those this
  hop removes or sets (``Content_Length``, ``Transfer_Encoding``, ``X_Forwarded_For``...)
  is dropped: CGI and WSGI servers, and the frameworks on them, read both spellings as the
  same ``HTTP_*`` variable, so it would reach the application as the real one.
- Everything else -- ``Authorization``, ``Cookie``, ``traceparent``, ``tracestate``,
  ``baggage`` -- passes untouched, in its order.

Answer side (:func:`response_headers`): names lower-cased, hop-by-hop and
``Connection``-named fields removed (``Transfer-Encoding`` with them: the server re-frames
the relay), ``Content-Length`` kept (the server frames the relay by it) unless the answer
came with ``Transfer-Encoding`` too (RFC 9112 §6.3: its chunks frame it, and an
intermediary removes the length before passing it on), ``Via`` appended.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from typing import Any, Final, TypeAlias

from .._headers import HOP_BY_HOP as _HOP_BY_HOP

__all__ = [
    "HOP_BY_HOP",
    "Network",
    "Peer",
    "connection_named",
    "forwarded_element",
    "is_trusted",
    "request_headers",
    "response_headers",
    "trusted_networks",
]

Network: TypeAlias = IPv4Network | IPv6Network

#: Fields that describe one connection, never passed on: the one list pipework keeps
#: (:data:`pipework._headers.HOP_BY_HOP`), as bytes.
HOP_BY_HOP: Final[frozenset[bytes]] = frozenset(name.encode("ascii") for name in _HOP_BY_HOP)

# The upstream client frames each request itself and sets Host; 100-continue is this
# server's business with its client.
_REQUEST_DROPPED: Final = HOP_BY_HOP | {b"content-length", b"expect", b"host"}
_FORWARDING: Final = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded"}
)
# The fields this hop removes or sets itself: a name that is one of them with "_" for "-"
# is dropped too (CGI and WSGI servers read both as the same HTTP_* variable).
_CONTROLLED: Final = _REQUEST_DROPPED | _FORWARDING | {b"via"}
_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
# What a quoted-string can carry (qdtext, and quoted-pairs for '"' and '\').
_QUOTABLE: Final = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")
_SCHEMES: Final = {"ws": "http", "wss": "https"}


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent the request, as this server saw it: the connection's far end
    (``scope["client"]``), the scheme it spoke (``"http"`` or ``"https"``) and the ``Host``
    it asked for, as received (None: it sent none)."""

    client: tuple[str, int] | None
    scheme: str
    host: bytes | None

    @classmethod
    def from_scope(cls, scope: Mapping[str, Any]) -> Peer:
        """The peer of an ASGI ``http`` or ``websocket`` scope (``ws``/``wss`` are taken as
        ``http``/``https``; HTTP/2's ``:authority`` stands in for a missing ``Host``)."""
        host = authority = None
        for name, value in scope.get("headers", ()):
            lowered = name.lower()
            if lowered == b"host" and host is None:
                host = value
            elif lowered == b":authority" and authority is None:
                authority = value
        scheme = scope.get("scheme", "http")
        client = scope.get("client")
        return cls(
            (str(client[0]), int(client[1])) if client else None,
            _SCHEMES.get(scheme, scheme),
            host if host is not None else authority,
        )


def trusted_networks(values: Iterable[str]) -> tuple[Network, ...]:
    """Addresses and CIDR blocks (``"10.0.0.0/8"``, ``"127.0.0.1"``, ``"::1"``) as networks;
    ValueError naming the first that is neither (or a block with host bits set)."""
    found: list[Network] = []
    for value in values:
        try:
            found.append(ip_network(value))
        except ValueError:
            try:
                meant = ip_network(value, strict=False)
            except ValueError:
                raise ValueError(f"{value!r} is not an IP address or CIDR block") from None
            raise ValueError(
                f"{value!r} is not an IP address or CIDR block: it has bits set past the "
                f"/{meant.prefixlen}; write {str(meant)!r}"
            ) from None
    return tuple(found)


def _address(client: tuple[str, int] | None) -> IPv4Address | IPv6Address | None:
    if client is None:
        return None
    try:
        address = ip_address(client[0])
    except ValueError:
        return None  # a unix socket's path, or a name: no address to speak of
    if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_trusted(client: tuple[str, int] | None, trusted: Sequence[Network]) -> bool:
    """Whether the peer at ``client`` is in one of the ``trusted`` networks."""
    if not trusted:
        return False
    address = _address(client)
    return address is not None and any(address in network for network in trusted)


def connection_named(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The field names (lower-case) every ``Connection`` field of ``headers`` lists."""
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(t for token in value.split(b",") if (t := token.strip().lower()))
    return frozenset(named)


def _value(value: bytes) -> bytes | None:
    """``value`` as an RFC 7239 value: a token as it is, else a quoted-string; None if
    it cannot be written as either."""
    if _TOKEN.match(value):
        return value
    if not _QUOTABLE.match(value):
        return None
    return b'"' + value.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'


def forwarded_element(peer: Peer) -> bytes:
    """This hop's ``Forwarded`` element: ``for=`` the peer, ``proto=`` and ``host=`` of
    the request as received."""
    address = _address(peer.client)
    if address is None:
        node = b"unknown"
    elif isinstance(address, IPv6Address):
        node = b'"[' + address.compressed.encode("ascii") + b']"'
    else:
        node = address.compressed.encode("ascii")
    parts = [b"for=" + node]
    proto = _value(peer.scheme.encode("ascii", "replace"))
    if proto is not None:
        parts.append(b"proto=" + proto)
    if peer.host:
        host = _value(peer.host)
        if host is not None:
            parts.append(b"host=" + host)
    return b";".join(parts)


def _joined(values: list[bytes], last: bytes | None = None) -> bytes | None:
    """Several list-valued fields as one (RFC 9110 §5.3), with ``last`` after them."""
    items = [v for value in values if (v := value.strip())]
    if last is not None:
        items.append(last)
    return b", ".join(items) if items else None


def request_headers(
    headers: Iterable[tuple[bytes, bytes]],
    *,
    peer: Peer,
    trusted: Sequence[Network],
    host: bytes,
    via: bytes | None = b"1.1 pipework",
    request_id: bytes | None,
    request_id_header: bytes | None = b"x-request-id",
) -> list[tuple[bytes, bytes]]:
    """The fields a proxied request carries to the service (see the module's rules):
    ``Host: host`` first, the client's end-to-end fields in their order, then the
    forwarding fields, ``Via`` and the request id."""
    received = [(name.lower(), value) for name, value in headers]
    named = connection_named(received)
    own_id = (
        request_id_header.lower()
        if request_id is not None and request_id_header is not None
        else None
    )
    trust = is_trusted(peer.client, trusted)
    controlled = _CONTROLLED if own_id is None else _CONTROLLED | {own_id}
    out: list[tuple[bytes, bytes]] = [(b"host", host)]
    forwarding: dict[bytes, list[bytes]] = {name: [] for name in _FORWARDING}
    vias: list[bytes] = []
    for name, value in received:
        if name in _REQUEST_DROPPED or name in named or name.startswith(b":") or name == own_id:
            continue
        if b"_" in name and name.replace(b"_", b"-") in controlled:
            continue  # read as one of this hop's own fields by CGI-style servers
        if name in _FORWARDING:
            if trust:
                forwarding[name].append(value)
        elif name == b"via":
            vias.append(value)
        else:
            out.append((name, value))
    address = _address(peer.client)
    chain = _joined(
        forwarding[b"x-forwarded-for"],
        address.compressed.encode("ascii") if address is not None else None,
    )
    if chain is not None:
        out.append((b"x-forwarded-for", chain))
    protos = forwarding[b"x-forwarded-proto"] or [peer.scheme.encode("ascii", "replace")]
    out.extend((b"x-forwarded-proto", proto) for proto in protos)
    hosts = forwarding[b"x-forwarded-host"] or ([peer.host] if peer.host else [])
    out.extend((b"x-forwarded-host", value) for value in hosts)
    elements = _joined(forwarding[b"forwarded"], forwarded_element(peer))
    assert elements is not None  # this hop's element is always there
    out.append((b"forwarded", elements))
    hops = _joined(vias, via)
    if hops is not None:
        out.append((b"via", hops))
    if own_id is not None and request_id is not None:
        out.append((own_id, request_id))
    return out


def response_headers(
    headers: Iterable[tuple[bytes, bytes]], *, via: bytes | None = b"1.1 pipework"
) -> list[tuple[bytes, bytes]]:
    """The fields of a service's answer relayed to the client (see the module's rules):
    in their order, then ``Via``."""
    received = [(name.lower(), value) for name, value in headers]
    named = connection_named(received)
    # Transfer-Encoding overrides Content-Length (the answer was read by its chunks): a
    # length passed on would frame the relay otherwise.
    dropped = HOP_BY_HOP | named
    if any(name == b"transfer-encoding" for name, _ in received):
        dropped |= {b"content-length"}
    out: list[tuple[bytes, bytes]] = []
    vias: list[bytes] = []
    for name, value in received:
        if name in dropped or name.startswith(b":"):
            continue
        if name == b"via":
            vias.append(value)
        else:
            out.append((name, value))
    hops = _joined(vias, via)
    if hops is not None:
        out.append((b"via", hops))
    return out
