"""The proxy's header policy both ways, without a server (the rules in
pipework/proxy/_forwarding.py's docstring): examples, then properties over any headers."""

from __future__ import annotations

import re
from ipaddress import IPv6Address, ip_address, ip_network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipework.proxy._forwarding import (
    HOP_BY_HOP,
    Network,
    Peer,
    connection_named,
    forwarded_element,
    is_trusted,
    request_headers,
    response_headers,
    trusted_networks,
)

Headers = list[tuple[bytes, bytes]]
CLIENT = Peer(("203.0.113.7", 51000), "https", b"shop.example")
PROXY = Peer(("10.1.2.3", 40000), "http", b"internal:8080")
TRUSTED = trusted_networks(["10.0.0.0/8", "127.0.0.1"])


def forward(
    headers: Headers,
    peer: Peer = CLIENT,
    trusted: tuple[Network, ...] = TRUSTED,
    **options: object,
) -> Headers:
    fields: dict[str, object] = {"host": b"svc.internal", "request_id": None, **options}
    # The keyword options are each a different type; the call checks them at run time.
    return request_headers(headers, peer=peer, trusted=trusted, **fields)  # type: ignore[arg-type]  # mixed options, checked at run time


def values(headers: Headers, name: bytes) -> list[bytes]:
    return [v for n, v in headers if n == name]


# -- request side: examples ----------------------------------------------------------------


def test_hop_by_hop_and_connection_named_fields_are_removed() -> None:
    sent = [
        (b"Connection", b"keep-alive, X-Secret ,upgrade"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Upgrade", b"h2c"),
        (b"TE", b"trailers"),
        (b"Trailer", b"X-Checksum"),
        (b"Proxy-Authorization", b"Basic abc"),
        (b"Proxy-Connection", b"keep-alive"),
        (b"x-secret", b"hop"),
        (b"X-Kept", b"end-to-end"),
    ]
    out = forward(sent)
    assert [n for n, _ in out if n not in FORWARDED_NAMES] == [b"host", b"x-kept", b"via"]


def test_framing_never_passes_and_host_is_set() -> None:
    sent = [
        (b"Host", b"shop.example"),
        (b"Content-Length", b"5"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Length", b"7"),
        (b"Expect", b"100-continue"),
        (b"Content-Type", b"text/plain"),
    ]
    out = forward(sent, host=b"svc.internal:9000")
    assert out[0] == (b"host", b"svc.internal:9000")
    assert values(out, b"host") == [b"svc.internal:9000"]
    names = {n for n, _ in out}
    assert not names & {b"content-length", b"transfer-encoding", b"expect"}
    assert values(out, b"content-type") == [b"text/plain"]


def test_fields_named_as_this_hop_s_own_with_underscores_never_pass() -> None:
    """CGI, WSGI and the frameworks on them read ``_`` and ``-`` alike in a field's name
    (both are ``HTTP_CONTENT_LENGTH``): ``Content_Length`` or ``X_Forwarded_For`` would
    reach the service's application as a field this hop removes or sets itself. They are
    dropped (as nginx and gunicorn drop them); other names with underscores pass."""
    sent = [
        (b"Transfer_Encoding", b"chunked"),
        (b"Content_Length", b"5"),
        (b"X_Forwarded_For", b"1.1.1.1"),
        (b"x_forwarded-host", b"evil.example"),
        (b"X_REQUEST_ID", b"forged"),
        (b"Proxy_Authorization", b"Basic abc"),
        (b"HOST", b"shop.example"),
        (b"X_Custom", b"kept"),
    ]
    for trusted in ((), TRUSTED):
        out = forward(sent, PROXY, trusted, request_id=b"rid-1")
        assert [(n, v) for n, v in out if b"_" in n] == [(b"x_custom", b"kept")]
        assert values(out, b"x-request-id") == [b"rid-1"]


def test_end_to_end_fields_pass_untouched_in_their_order() -> None:
    sent = [
        (b"Authorization", b"Bearer t0ken"),
        (b"Cookie", b"a=1"),
        (b"traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        (b"tracestate", b"congo=t61rcWkgMzE"),
        (b"baggage", b"userId=alice"),
        (b"Cookie", b"b=2"),
        (b"Accept", b"*/*"),
    ]
    out = forward(sent)
    assert out[1 : 1 + len(sent)] == [(n.lower(), v) for n, v in sent]


def test_http2_pseudo_fields_are_dropped() -> None:
    out = forward([(b":authority", b"shop.example"), (b":method", b"GET"), (b"a", b"1")])
    assert [n for n, _ in out if n.startswith(b":")] == []


def test_an_untrusted_peer_s_forwarding_fields_are_replaced() -> None:
    sent = [
        (b"X-Forwarded-For", b"1.1.1.1, 2.2.2.2"),
        (b"X-Forwarded-Proto", b"http"),
        (b"X-Forwarded-Host", b"evil.example"),
        (b"Forwarded", b"for=1.1.1.1;host=evil.example"),
    ]
    out = forward(sent, CLIENT)
    assert values(out, b"x-forwarded-for") == [b"203.0.113.7"]
    assert values(out, b"x-forwarded-proto") == [b"https"]
    assert values(out, b"x-forwarded-host") == [b"shop.example"]
    assert values(out, b"forwarded") == [b"for=203.0.113.7;proto=https;host=shop.example"]


def test_a_trusted_peer_s_forwarding_fields_are_kept_and_appended_to() -> None:
    sent = [
        (b"X-Forwarded-For", b"198.51.100.1, 198.51.100.2"),
        (b"x-forwarded-for", b" 198.51.100.3 "),
        (b"X-Forwarded-Proto", b"https"),
        (b"X-Forwarded-Host", b"shop.example"),
        (b"Forwarded", b'for="[2001:db8::1]";proto=https'),
        (b"Forwarded", b"for=198.51.100.2"),
    ]
    out = forward(sent, PROXY)
    assert values(out, b"x-forwarded-for") == [
        b"198.51.100.1, 198.51.100.2, 198.51.100.3, 10.1.2.3"
    ]
    assert values(out, b"x-forwarded-proto") == [b"https"]
    assert values(out, b"x-forwarded-host") == [b"shop.example"]
    assert values(out, b"forwarded") == [
        b'for="[2001:db8::1]";proto=https, for=198.51.100.2, '
        b'for=10.1.2.3;proto=http;host="internal:8080"'
    ]


def test_a_trusted_peer_that_sent_no_forwarding_fields_gets_this_hop_s() -> None:
    out = forward([], PROXY)
    assert values(out, b"x-forwarded-for") == [b"10.1.2.3"]
    assert values(out, b"x-forwarded-proto") == [b"http"]
    assert values(out, b"x-forwarded-host") == [b"internal:8080"]
    assert values(out, b"forwarded") == [b'for=10.1.2.3;proto=http;host="internal:8080"']


@pytest.mark.parametrize(
    ("client", "trusted", "expected"),
    [
        ("10.200.0.1", ["10.0.0.0/8"], True),
        ("11.0.0.1", ["10.0.0.0/8"], False),
        ("127.0.0.1", ["127.0.0.1"], True),
        ("127.0.0.2", ["127.0.0.1"], False),
        ("::ffff:10.0.0.9", ["10.0.0.0/8"], True),  # IPv4 on a dual-stack socket
        ("2001:db8::5", ["2001:db8::/32"], True),
        ("2001:db9::5", ["2001:db8::/32"], False),
        ("10.0.0.1", [], False),
        ("/run/pipework.sock", ["0.0.0.0/0"], False),  # no address: never trusted
    ],
)
def test_trust_is_by_address_in_a_network(client: str, trusted: list[str], expected: bool) -> None:
    assert is_trusted((client, 1), trusted_networks(trusted)) is expected
    assert not is_trusted(None, trusted_networks(trusted))


@pytest.mark.parametrize(
    ("client", "xff", "element"),
    [
        (("2001:db8::17", 1), b"2001:db8::17", b'for="[2001:db8::17]"'),
        (("2001:DB8:0:0::17", 1), b"2001:db8::17", b'for="[2001:db8::17]"'),
        (("::ffff:192.0.2.1", 1), b"192.0.2.1", b"for=192.0.2.1"),
        (("fe80::1%eth0", 1), b"fe80::1%eth0", b'for="[fe80::1%eth0]"'),
        (None, None, b"for=unknown"),
        (("unix-socket", 0), None, b"for=unknown"),
    ],
)
def test_the_peer_s_address_as_written(
    client: tuple[str, int] | None, xff: bytes | None, element: bytes
) -> None:
    out = forward([(b"X-Forwarded-For", b"1.2.3.4")], Peer(client, "http", None))
    assert values(out, b"x-forwarded-for") == ([xff] if xff else [])
    assert values(out, b"forwarded") == [element + b";proto=http"]
    assert values(out, b"x-forwarded-host") == []


@pytest.mark.parametrize(
    ("host", "written"),
    [
        (b"shop.example", b"host=shop.example"),
        (b"shop.example:8443", b'host="shop.example:8443"'),
        (b"[::1]:8000", b'host="[::1]:8000"'),
        (b'we"ird\\', b'host="we\\"ird\\\\"'),
        (b"bad\x01host", None),  # no quoted-string holds a control character
    ],
)
def test_the_host_in_forwarded_is_a_token_or_a_quoted_string(
    host: bytes, written: bytes | None
) -> None:
    element = forwarded_element(Peer(("192.0.2.1", 1), "https", host))
    expected = b"for=192.0.2.1;proto=https" + (b";" + written if written else b"")
    assert element == expected


def test_via_is_appended_to() -> None:
    assert values(forward([]), b"via") == [b"1.1 pipework"]
    sent = [(b"Via", b"1.0 fred, 1.1 p.example"), (b"via", b"2 edge")]
    assert values(forward(sent), b"via") == [b"1.0 fred, 1.1 p.example, 2 edge, 1.1 pipework"]
    assert values(forward(sent, via=b"2 gw"), b"via")[0].endswith(b", 2 gw")
    assert values(forward(sent, via=None), b"via") == [b"1.0 fred, 1.1 p.example, 2 edge"]
    assert values(forward([], via=None), b"via") == []


def test_the_request_id_replaces_the_client_s_when_given() -> None:
    sent = [(b"X-Request-ID", b"client-chosen"), (b"a", b"1")]
    assert values(forward(sent, request_id=b"abc"), b"x-request-id") == [b"abc"]
    assert values(forward(sent), b"x-request-id") == [b"client-chosen"]
    out = forward(sent, request_id=b"abc", request_id_header=b"X-Correlation-ID")
    assert values(out, b"x-correlation-id") == [b"abc"]
    assert values(out, b"x-request-id") == [b"client-chosen"]
    out = forward(sent, request_id=b"abc", request_id_header=None)
    assert values(out, b"x-request-id") == [b"client-chosen"]


# -- the peer and the trusted networks ----------------------------------------------------


def test_the_peer_of_an_asgi_scope() -> None:
    scope = {
        "type": "http",
        "scheme": "https",
        "client": ["192.0.2.9", 4444],
        "headers": [(b"accept", b"*/*"), (b"host", b"a.example"), (b"host", b"b.example")],
    }
    assert Peer.from_scope(scope) == Peer(("192.0.2.9", 4444), "https", b"a.example")
    h2 = {"scheme": "http", "client": None, "headers": [(b":authority", b"c.example")]}
    assert Peer.from_scope(h2) == Peer(None, "http", b"c.example")
    ws = {"type": "websocket", "scheme": "wss", "headers": []}
    assert Peer.from_scope(ws) == Peer(None, "https", None)
    assert Peer.from_scope({"type": "websocket", "scheme": "ws"}).scheme == "http"


def test_trusted_networks_take_addresses_and_blocks() -> None:
    found = trusted_networks(["10.0.0.0/8", "127.0.0.1", "::1", "fd00::/8"])
    assert found == (
        ip_network("10.0.0.0/8"),
        ip_network("127.0.0.1/32"),
        ip_network("::1/128"),
        ip_network("fd00::/8"),
    )


@pytest.mark.parametrize("value", ["10.0.0.1/8", "localhost", "10.0.0.0/33", ""])
def test_trusted_networks_refuse_what_is_not_an_address_or_block(value: str) -> None:
    with pytest.raises(ValueError, match=f"{re.escape(repr(value))} is not an IP address"):
        trusted_networks(["127.0.0.1", value])


def test_connection_names_are_case_insensitive_tokens() -> None:
    sent = [(b"Connection", b"Close, X-A,, x-b "), (b"connection", b"X-C")]
    assert connection_named(sent) == {b"close", b"x-a", b"x-b", b"x-c"}


# -- answer side: examples -----------------------------------------------------------------


def test_an_answer_keeps_its_length_and_loses_its_hop_by_hop_fields() -> None:
    sent = [
        (b"Content-Type", b"application/json"),
        (b"Content-Length", b"12"),
        (b"Connection", b"keep-alive, X-Hop"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Hop", b"1"),
        (b"Set-Cookie", b"a=1"),
        (b"Set-Cookie", b"b=2"),
        (b"Trailer", b"X-Sum"),
        (b"Proxy-Authenticate", b"Basic"),
        (b"Upgrade", b"websocket"),
    ]
    assert response_headers(sent) == [
        (b"content-type", b"application/json"),
        (b"content-length", b"12"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"via", b"1.1 pipework"),
    ]


def test_a_chunked_answer_loses_its_framing_and_any_length() -> None:
    """RFC 9112 §6.3: Transfer-Encoding overrides Content-Length, and an intermediary
    removes the length before passing such an answer on (the server re-frames it)."""
    sent = [
        (b"Content-Length", b"3"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Content-Type", b"text/plain"),
    ]
    assert response_headers(sent) == [(b"content-type", b"text/plain"), (b"via", b"1.1 pipework")]
    assert response_headers(sent[1:]) == response_headers(sent)


def test_an_answer_s_via_is_appended_to() -> None:
    assert response_headers([(b"Via", b"1.1 backend")]) == [(b"via", b"1.1 backend, 1.1 pipework")]
    assert response_headers([(b"Via", b"1.1 backend")], via=None) == [(b"via", b"1.1 backend")]
    assert response_headers([], via=None) == []


# -- properties ----------------------------------------------------------------------------

FORWARDED_NAMES = {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"forwarded"}
FRAMING = {b"content-length", b"transfer-encoding", b"expect", b"host"}
# This hop's own fields: set by request_headers whatever came in.
OWN = {b"host", b"via", b"x-request-id", *FORWARDED_NAMES}
NAMES = sorted(
    {*HOP_BY_HOP, *FRAMING, *FORWARDED_NAMES}
    | {b"via", b"x-request-id", b"authorization", b"cookie", b"traceparent", b"x-a", b"x-b"}
)


def cased(name: bytes) -> st.SearchStrategy[bytes]:
    return st.sampled_from([name, name.upper(), name.title()])


names = st.sampled_from(NAMES).flatmap(cased) | st.from_regex(rb"\A:?[a-z][a-z0-9-]{0,8}\Z")
field_values = st.from_regex(rb"\A[\x21-\x7e]([\x20-\x7e]{0,16}[\x21-\x7e])?\Z")
connection_values = st.lists(st.sampled_from(NAMES).flatmap(cased), max_size=3).map(
    lambda tokens: b", ".join(tokens)
)
fields = st.lists(
    st.tuples(names, field_values) | st.tuples(st.just(b"Connection"), connection_values),
    max_size=12,
)
addresses = st.ip_addresses().map(str) | st.sampled_from(["10.0.0.1", "127.0.0.1", "::1"])
peers = st.builds(
    Peer,
    st.none() | st.tuples(addresses, st.integers(0, 65535)),
    st.sampled_from(["http", "https"]),
    st.none() | st.binary(min_size=1, max_size=16),
)
trust_lists = st.sampled_from([(), TRUSTED, trusted_networks(["0.0.0.0/0", "::/0"])])


def end_to_end(headers: Headers) -> Headers:
    named = connection_named(headers)
    return [
        (n.lower(), v)
        for n, v in headers
        if n.lower() not in HOP_BY_HOP | FRAMING | OWN | named and not n.startswith(b":")
    ]


@given(headers=fields, peer=peers, trusted=trust_lists, rid=st.none() | st.just(b"rid-1"))
def test_no_hop_by_hop_connection_named_or_framing_field_reaches_the_service(
    headers: Headers, peer: Peer, trusted: tuple[Network, ...], rid: bytes | None
) -> None:
    out = forward(headers, peer, trusted, request_id=rid)
    named = connection_named(headers)
    for name, _ in out:
        assert name == name.lower()
        assert name not in HOP_BY_HOP
        assert name not in {b"content-length", b"transfer-encoding", b"expect"}
        assert not name.startswith(b":")
        assert name not in named or name in OWN
    assert values(out, b"host") == [b"svc.internal"]
    # A field the Connection header names has no say in what is sent.
    unnamed = [(n, v) for n, v in headers if n.lower() not in named or n.lower() == b"connection"]
    assert forward(unnamed, peer, trusted, request_id=rid) == out
    # Everything end to end passes, in its order.
    assert [(n, v) for n, v in out if n not in OWN] == end_to_end(headers)


@given(headers=fields, peer=peers)
def test_an_untrusted_peer_s_forwarding_fields_never_pass(headers: Headers, peer: Peer) -> None:
    out = forward(headers, peer, ())
    fresh = forward([], peer, ())
    for name in FORWARDED_NAMES:
        assert values(out, name) == values(fresh, name)
    assert values(out, b"forwarded") == [forwarded_element(peer)]
    assert values(out, b"x-forwarded-proto") == [peer.scheme.encode()]
    assert values(out, b"x-forwarded-host") == ([peer.host] if peer.host else [])


@given(headers=fields, peer=peers)
def test_a_trusted_peer_s_forwarding_fields_are_appended_to(headers: Headers, peer: Peer) -> None:
    everyone = trusted_networks(["0.0.0.0/0", "::/0"])
    out = forward(headers, peer, everyone)
    named = connection_named(headers)

    # Trusted: every peer with an address (one without is never trusted).
    address = is_trusted(peer.client, everyone)

    def came(name: bytes) -> list[bytes]:
        kept = address and name not in named
        return [v.strip() for n, v in headers if n.lower() == name and kept]

    mine = forwarded_element(peer)
    assert values(out, b"forwarded") == [b", ".join([v for v in came(b"forwarded") if v] + [mine])]
    chain = [v for v in came(b"x-forwarded-for") if v]
    if address:
        assert peer.client is not None
        chain.append(_written(peer.client[0]))
    assert values(out, b"x-forwarded-for") == ([b", ".join(chain)] if chain else [])
    kept = [v for n, v in headers if n.lower() == b"x-forwarded-proto" and n.lower() not in named]
    if address:
        assert values(out, b"x-forwarded-proto") == (kept or [peer.scheme.encode()])


def _written(address: str) -> bytes:
    found = ip_address(address)
    if isinstance(found, IPv6Address) and found.ipv4_mapped is not None:
        found = found.ipv4_mapped
    return found.compressed.encode()


# RFC 7239 §4: Forwarded = 1#forwarded-element; forwarded-element = [ forwarded-pair ]
# *( ";" [ forwarded-pair ] ); forwarded-pair = token "=" value; value = token / quoted-string.
TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
PAIR = rb"(" + TOKEN + rb")=(" + TOKEN + rb"|" + QUOTED + rb")"
ELEMENT = rb"(?:" + PAIR + rb")?(?:;(?:" + PAIR + rb")?)*"
FORWARDED = re.compile(ELEMENT + rb"(?:[ \t]*,[ \t]*" + ELEMENT + rb")*")


def parse_element(element: bytes) -> dict[bytes, bytes]:
    """One element's pairs, quoted-strings unquoted."""
    assert FORWARDED.fullmatch(element), element
    pairs = {}
    for found in re.finditer(PAIR, element):
        name, value = found.group(1).lower(), found.group(2)
        if value.startswith(b'"'):
            value = re.sub(rb"\\(.)", rb"\1", value[1:-1], flags=re.DOTALL)
        assert name not in pairs, "a parameter appears once per element"
        pairs[name] = value
    return pairs


@given(peer=peers, trusted=trust_lists)
def test_this_hop_s_forwarded_element_parses_back(peer: Peer, trusted: tuple[Network, ...]) -> None:
    out = forward([(b"Forwarded", b"for=192.0.2.60;proto=http;by=203.0.113.43")], peer, trusted)
    (value,) = values(out, b"forwarded")
    assert FORWARDED.fullmatch(value)
    pairs = parse_element(forwarded_element(peer))
    if peer.client is None or not _is_address(peer.client[0]):
        assert pairs[b"for"] == b"unknown"
    else:
        written = _written(peer.client[0])
        assert pairs[b"for"] == (b"[" + written + b"]" if b":" in written else written)
    assert pairs[b"proto"] == peer.scheme.encode()
    quotable = peer.host is not None and re.fullmatch(rb"[\t\x20-\x7e\x80-\xff]+", peer.host)
    assert pairs.get(b"host") == (peer.host if quotable else None)


def _is_address(text: str) -> bool:
    try:
        ip_address(text)
    except ValueError:
        return False
    return True


response_fields = st.lists(
    st.tuples(names, field_values) | st.tuples(st.just(b"Connection"), connection_values),
    max_size=12,
)


@given(headers=response_fields)
def test_no_hop_by_hop_or_connection_named_field_reaches_the_client(headers: Headers) -> None:
    out = response_headers(headers)
    named = connection_named(headers)
    assert out[-1][0] == b"via"
    for name, _ in out[:-1]:
        assert name not in HOP_BY_HOP
        assert name not in named
        assert name != b"via"
    dropped = HOP_BY_HOP | named | {b"via"}
    if any(n.lower() == b"transfer-encoding" for n, _ in headers):
        dropped |= {b"content-length"}  # the chunks framed it
    expected = [(n.lower(), v) for n, v in headers if n.lower() not in dropped and n[:1] != b":"]
    assert out[:-1] == expected  # content-length among them, when it came alone
