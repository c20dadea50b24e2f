"""Proxy routes without a server: declarations, prefix matching, the table's choice and the
target sent on (the rules in pipework/proxy/_route.py's docstring)."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import pipework as pw
from pipework._http._paths import PROXY_RESERVED_PREFIXES, RESERVED_PREFIXES
from pipework.proxy._route import (
    BadTarget,
    ProxyMiss,
    ProxyRoute,
    ProxyTable,
    is_method,
    shadowing,
)


def route(prefix: str = "/api", name: str = "r", **fields: Any) -> ProxyRoute:
    return ProxyRoute(name, "svc", prefix, **fields)


# -- declarations --------------------------------------------------------------------------


def test_defaults() -> None:
    r = route()
    assert (r.methods, r.strip_prefix, r.rewrite, r.host, r.key) == (
        None,
        False,
        None,
        "service",
        None,
    )
    assert (r.timeout, r.connect_timeout, r.first_byte_timeout, r.idle_timeout) == (None,) * 4
    assert (r.max_body, r.chain, r.after, r.websocket) == (None, None, None, True)
    assert r.pool_key == "svc"
    assert route(key="shared").pool_key == "shared"


@pytest.mark.parametrize(
    ("given_prefix", "kept"),
    [("/api", "/api"), ("/api/", "/api"), ("/", "/"), ("/a/b/", "/a/b"), ("/v1.2", "/v1.2")],
)
def test_a_prefix_is_kept_without_its_trailing_slash(given_prefix: str, kept: str) -> None:
    assert route(given_prefix).prefix == kept


def test_methods_are_upper_case_and_get_lets_head_through() -> None:
    assert route(methods=frozenset({"get", "post"})).methods == frozenset({"GET", "HEAD", "POST"})
    assert route(methods=frozenset({"PROPFIND"})).methods == frozenset({"PROPFIND"})
    assert route(methods=("DELETE",)).methods == frozenset({"DELETE"})  # any iterable of names


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param({"name": ""}, "non-empty name", id="name"),
        pytest.param({"service": ""}, "name the service", id="service"),
        pytest.param({"prefix": "api"}, "must start with '/'", id="relative"),
        pytest.param({"prefix": "/a%20b"}, "unencoded", id="percent"),
        pytest.param({"prefix": "/a b"}, "characters of a URL path", id="space"),
        pytest.param({"prefix": "/a?b"}, "characters of a URL path", id="query"),
        pytest.param({"prefix": "/a//b"}, r"empty segment \('//'\)", id="empty-segment"),
        pytest.param({"prefix": "/a/../b"}, "has a '..' segment", id="dot-dot"),
        pytest.param({"prefix": "/a/."}, "has a '.' segment", id="dot"),
        pytest.param({"prefix": "/jobs"}, "under /jobs, which the container", id="jobs"),
        pytest.param({"prefix": "/admin/pool"}, "under /admin", id="admin"),
        pytest.param({"prefix": "/boards/"}, "under /boards", id="boards"),
        pytest.param({"prefix": "/ui/jobs"}, "under /ui", id="ui"),
        pytest.param({"prefix": 7}, "prefix must be a string", id="prefix-type"),
        pytest.param({"methods": frozenset()}, "methods is empty", id="no-methods"),
        pytest.param({"methods": "GET"}, "set of method names", id="methods-string"),
        pytest.param({"methods": frozenset({"GE T"})}, "not an HTTP method token", id="token"),
        pytest.param({"methods": frozenset({""})}, "not an HTTP method token", id="empty"),
        pytest.param({"strip_prefix": True, "rewrite": "/v2"}, "set one", id="strip-and-rewrite"),
        pytest.param({"rewrite": "v2"}, "rewrite 'v2' must start with '/'", id="rewrite-rel"),
        pytest.param({"rewrite": "/a b"}, "%XX escapes", id="rewrite-chars"),
        pytest.param({"rewrite": "/a%zz"}, "%XX escapes", id="rewrite-bad-escape"),
        pytest.param({"rewrite": "/a/%2e%2E"}, "'..' segment", id="rewrite-encoded-dots"),
        pytest.param({"host": "client"}, "host 'client' is not one of", id="host"),
        pytest.param({"key": ""}, "key must be a non-empty string", id="key"),
        pytest.param({"chain": ""}, "chain must be a non-empty string", id="chain"),
        pytest.param({"timeout": 0}, "timeout must be positive", id="timeout"),
        pytest.param({"idle_timeout": -1.5}, "idle_timeout must be positive", id="idle"),
        pytest.param(
            {"connect_timeout": float("inf")}, "connect_timeout must be positive", id="inf"
        ),
        pytest.param({"first_byte_timeout": True}, "number of seconds", id="bool-timeout"),
        pytest.param({"max_body": -1}, "max_body must be a number of bytes", id="max-body"),
        pytest.param({"websocket": "yes"}, "websocket must be True or False", id="websocket"),
    ],
)
def test_bad_declarations_are_refused_naming_the_route(
    fields: dict[str, Any], message: str
) -> None:
    values: dict[str, Any] = {"name": "r", "service": "svc", "prefix": "/api", **fields}
    with pytest.raises(pw.RegistrationError, match=message) as info:
        ProxyRoute(**values)
    if values["name"]:
        assert "proxy route 'r'" in str(info.value)


def test_every_reserved_prefix_is_refused_and_so_is_a_path_below_it() -> None:
    # Routes and proxy routes stay out of the same paths, the boards' included.
    assert set(PROXY_RESERVED_PREFIXES) == set(RESERVED_PREFIXES)
    assert {"/boards", "/ui"} <= set(PROXY_RESERVED_PREFIXES)
    for reserved in PROXY_RESERVED_PREFIXES:
        for prefix in (reserved, reserved + "/", reserved + "/x"):
            with pytest.raises(pw.RegistrationError, match="which the container serves"):
                route(prefix)
        route(reserved + "x")  # a segment boundary: /jobsx is not /jobs


# -- matching ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api", "/api/", "/api/x", "/api/x/y/", "/api//x"])
def test_a_prefix_covers_its_segment_and_below(path: str) -> None:
    assert route("/api").covers(path)
    assert route("/api/").covers(path)


@pytest.mark.parametrize("path", ["/apix", "/ap", "/", "/x/api", "/API", "api"])
def test_a_prefix_never_covers_across_a_segment_boundary(path: str) -> None:
    assert not route("/api").covers(path)


def test_the_root_prefix_covers_every_path() -> None:
    assert all(route("/").covers(p) for p in ("/", "/x", "/api/x", "//"))


def test_the_longest_prefix_wins() -> None:
    api, v1, root = route("/api", "api"), route("/api/v1", "v1"), route("/", "root")
    table = ProxyTable([api, v1, root])
    assert table.match("/api/v1/users", "GET") is v1
    assert table.match("/api/v1", "GET") is v1
    assert table.match("/api/v10", "GET") is api
    assert table.match("/api", "GET") is api
    assert table.match("/other", "GET") is root
    assert table.match("/", "GET") is root


def test_a_route_that_does_not_take_the_method_gives_way_to_a_shorter_prefix() -> None:
    admin = route("/api/admin", "admin", methods=frozenset({"DELETE"}))
    api = route("/api", "api", methods=frozenset({"GET", "POST"}))
    table = ProxyTable([admin, api])
    assert table.match("/api/admin/x", "DELETE") is admin
    assert table.match("/api/admin/x", "GET") is api
    assert table.match("/api/admin/x", "head") is api  # the method is compared upper-case
    assert table.match("/api/admin/x", "PUT") == ProxyMiss(("DELETE", "GET", "HEAD", "POST"))
    assert table.match("/api/x", "DELETE") == ProxyMiss(("GET", "HEAD", "POST"))
    assert table.match("/elsewhere", "DELETE") is None


def test_one_prefix_may_send_different_methods_to_different_routes() -> None:
    reads = route("/api", "reads", methods=frozenset({"GET"}))
    writes = route("/api/", "writes", methods=frozenset({"POST", "PUT"}))
    table = ProxyTable([reads, writes])
    assert table.match("/api/x", "GET") is reads
    assert table.match("/api/x", "PUT") is writes
    assert table.match("/api/x", "PATCH") == ProxyMiss(("GET", "HEAD", "POST", "PUT"))


@pytest.mark.parametrize("path", ["/jobs/1", "/healthz", "/metrics", "/boards/b/1", "/ui/jobs"])
def test_the_container_s_own_paths_are_never_proxied_even_under_the_root(path: str) -> None:
    table = ProxyTable([route("/", "root")])
    assert table.match(path, "GET") is None
    first = "/" + path.split("/")[1]
    assert table.match(first + "x", "GET") is not None  # only whole segments are reserved


def test_routes_added_one_by_one_are_checked_and_matched_alike() -> None:
    table = ProxyTable([route("/api", "api")])
    root = route("/", "root")
    assert table.add(root) is root
    assert table.match("/healthz", "GET") is None  # the root added later guards them too
    assert table.match("/x", "GET") is root
    with pytest.raises(pw.RegistrationError, match="clashes with proxy route 'api'"):
        table.add(route("/api/", "again"))
    assert list(table) == [table.get("api"), root]


def test_method_names_are_tokens() -> None:
    assert all(map(is_method, ["GET", "PROPFIND", "M-SEARCH", "x.y", "get"]))
    assert not any(map(is_method, ["", "GE T", "GET\r\n", "ÄÖ", "a/b"]))


def test_an_empty_table_matches_nothing() -> None:
    table = ProxyTable()
    assert not table
    assert len(table) == 0
    assert table.match("/api", "GET") is None


@pytest.mark.parametrize(
    ("first", "second", "both"),
    [
        ({}, {}, "any method"),
        ({"methods": frozenset({"GET"})}, {}, "any method"),
        ({"methods": frozenset({"GET", "PUT"})}, {"methods": frozenset({"put"})}, "PUT"),
        ({"methods": frozenset({"GET"})}, {"methods": frozenset({"HEAD"})}, "HEAD"),
    ],
)
def test_routes_a_method_could_reach_under_one_prefix_clash(
    first: dict[str, Any], second: dict[str, Any], both: str
) -> None:
    with pytest.raises(pw.RegistrationError, match="clashes with proxy route 'a'") as info:
        ProxyTable([route("/api", "a", **first), route("/api/", "b", **second)])
    assert f"both take {both} under /api" in str(info.value)


def test_names_are_unique_and_kept_in_order() -> None:
    with pytest.raises(pw.RegistrationError, match="a proxy route named 'a' is already"):
        ProxyTable([route("/x", "a"), route("/y", "a")])
    routes = [route("/b", "b"), route("/a", "a"), route("/a/b", "c")]
    table = ProxyTable(routes)
    assert list(table) == routes
    assert len(table) == 3
    assert table.get("c") is routes[2]
    with pytest.raises(pw.RegistrationError, match=r"unknown proxy route 'd' \(registered: b"):
        table.get("d")


@pytest.mark.parametrize(
    ("prefix", "path", "shadow"),
    [
        ("/api", "/api", "all"),
        ("/api", "/api/", "all"),
        ("/api/", "/api/users/{id}", "all"),
        ("/api", "/apix", None),
        ("/api/v1", "/api", None),
        ("/api", "/{section}/users", "some"),
        ("/api/v1", "/api/{version}/x", "some"),
        ("/api/v1", "/api/v2/{x}", None),
        ("/", "/orders", "all"),
        ("/", "/", "all"),
        ("/", "/{anything}", "some"),
        ("/", "/ui/report", None),  # the container's own: never proxied
    ],
)
def test_shadowing_says_how_a_prefix_covers_a_chain_route_s_path(
    prefix: str, path: str, shadow: str | None
) -> None:
    assert shadowing(prefix, path) == shadow


# -- targets -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "raw", "query", "target"),
    [
        ({}, b"/api/x", b"", b"/api/x"),
        ({}, b"/api/a%20b", b"q=1", b"/api/a%20b?q=1"),
        ({"strip_prefix": True}, b"/api/x/y", b"", b"/x/y"),
        ({"strip_prefix": True}, b"/api", b"", b"/"),
        ({"strip_prefix": True}, b"/api/", b"a", b"/?a"),
        ({"rewrite": "/v2"}, b"/api/x", b"", b"/v2/x"),
        ({"rewrite": "/v2/"}, b"/api", b"", b"/v2"),
        ({"rewrite": "/v2"}, b"/api/", b"", b"/v2/"),
        ({"rewrite": "/"}, b"/api/x", b"", b"/x"),
        ({"rewrite": "/a%20b"}, b"/api/x", b"", b"/a%20b/x"),
        ({"strip_prefix": True}, b"/%61pi/x%2Fy", b"", b"/x%2Fy"),  # the prefix encoded
        ({"strip_prefix": True}, b"/api/%2e%2ex", b"", b"/%2e%2ex"),  # '..x' is no dot segment
    ],
)
def test_the_target_maps_the_raw_prefix_and_keeps_the_rest(
    fields: dict[str, Any], raw: bytes, query: bytes, target: bytes
) -> None:
    assert route("/api", **fields).target(raw, query) == target


@pytest.mark.parametrize(
    ("prefix", "fields", "raw", "target"),
    [
        ("/", {"strip_prefix": True}, b"/x", b"/x"),
        ("/", {"rewrite": "/v2"}, b"/x", b"/v2/x"),
        ("/", {"rewrite": "/v2"}, b"/", b"/v2/"),
    ],
)
def test_the_root_prefix_maps_like_any_other(
    prefix: str, fields: dict[str, Any], raw: bytes, target: bytes
) -> None:
    assert route(prefix, **fields).target(raw, b"") == target


def test_the_query_goes_on_byte_for_byte() -> None:
    odd = b"a=%zz&&b=\xff;c=%2F?d#e+f"
    assert route(strip_prefix=True).target(b"/api/x", odd) == b"/x?" + odd


@pytest.mark.parametrize(
    "raw",
    [
        b"/api/../admin",
        b"/api/./x",
        b"/api/x/..",
        b"/api/%2e%2e/admin",
        b"/api/%2E/x",
        b"/api/a%2F..%2Fb",
    ],
)
@pytest.mark.parametrize("fields", [{}, {"strip_prefix": True}, {"rewrite": "/v2"}])
def test_dot_segments_are_refused(raw: bytes, fields: dict[str, Any]) -> None:
    with pytest.raises(BadTarget, match=r"'\.' or '\.\.' segment"):
        route(**fields).target(raw, b"")


def test_an_encoded_slash_right_after_the_prefix_is_refused_when_it_is_mapped() -> None:
    # "/api%2Fx" decodes to "/api/x", under /api; its raw rest does not start at a "/".
    with pytest.raises(BadTarget, match="not '/'"):
        route(strip_prefix=True).target(b"/api%2Fx", b"")
    assert route().target(b"/api%2Fx", b"") == b"/api%2Fx"  # unmapped: sent as it came


@pytest.mark.parametrize("raw", [b"/other/x", b"/ap", b"api/x", b"/apix"])
def test_a_raw_path_not_under_the_prefix_is_refused_when_mapped(raw: bytes) -> None:
    with pytest.raises(BadTarget):
        route(strip_prefix=True).target(raw, b"")


# -- properties ----------------------------------------------------------------------------

SEGMENT_CHARS = "abAB09-._~!$&'()*+,;=:@"
segments = st.text(SEGMENT_CHARS, min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))
prefixes = st.lists(st.sampled_from(["a", "b", "ab", "api", "v1"]), max_size=3).map(
    lambda parts: "/" + "/".join(parts)
)
paths = st.lists(st.sampled_from(["a", "b", "ab", "api", "v1", "x", ""]), max_size=5).map(
    lambda parts: "/" + "/".join(parts)
)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "BREW"])
method_sets = st.none() | st.frozensets(methods, min_size=1, max_size=3)


@given(prefix=prefixes, path=paths)
def test_a_prefix_covers_a_path_exactly_on_segment_boundaries(prefix: str, path: str) -> None:
    covered = prefix == "/" or path == prefix or path.startswith(prefix + "/")
    assert route(prefix).covers(path) == covered
    assert route(prefix).covers(prefix + "x") == (prefix == "/")  # "/apix" is not "/api"


@given(
    declared=st.lists(st.tuples(prefixes, method_sets), max_size=6),
    path=paths,
    method=methods,
)
def test_the_table_takes_the_longest_covering_prefix_that_takes_the_method(
    declared: list[tuple[str, frozenset[str] | None]], path: str, method: str
) -> None:
    routes = [route(p, f"r{i}", methods=m) for i, (p, m) in enumerate(declared)]
    try:
        table = ProxyTable(routes)
    except pw.RegistrationError:
        assume(False)
        return
    covering = sorted(
        (r for r in routes if r.covers(path)), key=lambda r: len(r.prefix.rstrip("/")), reverse=True
    )
    taking = [r for r in covering if r.takes(method)]
    found = table.match(path, method)
    if taking:
        assert found is taking[0]
        # No other route with a prefix as long takes it: the choice is never a tie.
        longest = len(taking[0].prefix.rstrip("/"))
        assert [r for r in taking if len(r.prefix.rstrip("/")) == longest] == [taking[0]]
    elif covering:
        allow = set().union(*(r.methods or () for r in covering))
        assert found == ProxyMiss(tuple(sorted(allow)))
    else:
        assert found is None


def encoded(text: str, picks: list[bool]) -> bytes:
    """``text`` with the characters ``picks`` marks percent-encoded (hex in either case)."""
    out = b""
    for i, char in enumerate(text.encode()):
        if picks and picks[i % len(picks)]:
            out += (b"%%%02X" if i % 2 else b"%%%02x") % char
        else:
            out += bytes([char])
    return out


raw_rests = st.lists(st.tuples(segments, st.lists(st.booleans(), max_size=4)), max_size=4).map(
    lambda parts: b"".join(b"/" + encoded(s, c) for s, c in parts)
)
queries = st.binary(max_size=12).filter(lambda q: b"#" not in q)


@given(
    prefix=prefixes,
    encode_prefix=st.lists(st.booleans(), max_size=4),
    rest=raw_rests,
    trailing=st.booleans(),
    query=queries,
    rewrite=st.sampled_from([None, "/", "/v2", "/a%2Fb"]),
)
def test_the_target_keeps_the_raw_rest_and_the_query(
    prefix: str,
    encode_prefix: list[bool],
    rest: bytes,
    trailing: bool,
    query: bytes,
    rewrite: str | None,
) -> None:
    rest = rest + (b"/" if trailing else b"")
    head = b"" if prefix == "/" else b"/" + encoded(prefix[1:], encode_prefix)
    raw = head + rest or b"/"
    assert unquote_to_bytes(raw).decode().startswith(prefix)  # the path as matched
    plain = route(prefix)
    assert plain.target(raw, query) == raw + (b"?" + query if query else b"")
    mapped = route(prefix, strip_prefix=rewrite is None, rewrite=rewrite)
    new_head = b"" if rewrite in (None, "/") else (rewrite or "").encode()
    path = new_head + raw[len(head) :] or b"/"
    assert mapped.target(raw, query) == path + (b"?" + query if query else b"")
