"""What an HTTP pipe passes on of its job's request: the headers its ``pass_headers`` names
(``Authorization`` and ``Cookie`` only by name, never hop-by-hop or framing ones).

End to end: a gateway file served on a free port, called with a real client, calling a
real backend that records what it received, through either backend client (the lean one,
and httpx); then the policy's rules on their own, without I/O, and the file's problems."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import trio

import pipework as pw
from pipework import Gateway, HttpCall, loads_config
from pipework._headers import passed, passes

from ._pipe_gateway import (
    CLIENTS,
    ECHO_PIPE,
    GO_ROUTE,
    HANG_GUARD,
    TRACEPARENT,
    call_once,
    gateway,
    one_pipe,
    served_gateway,
)
from ._recording_backend import recording_backend
from .test_container_harness import assert_problem, serving

CLIENT_HEADERS = [
    ("X-Tenant", "acme"),
    ("Authorization", "Bearer client-token"),
    ("Cookie", "session=s1"),
    ("X-Other", "other"),
    ("Accept-Language", "fr"),
    ("X-Forwarded-For", "203.0.113.9"),
    ("Accept-Encoding", "br"),
    ("Content-Type", "text/x-client"),
    ("Connection", "x-hop"),
    ("X-Hop", "named by Connection"),
]


# -- pass_headers, end to end --------------------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
async def test_named_headers_are_passed_and_no_others(client: str) -> None:
    async with recording_backend() as backend:
        text = one_pipe(backend.url, 'pass_headers = ["x-tenant", "Authorization", "X-Hop"]')
        answer, [seen] = await call_once(client, text, backend, CLIENT_HEADERS)
    assert answer.status_code == 200, answer.text
    assert seen.values("x-tenant") == ["acme"]
    assert seen.values("authorization") == ["Bearer client-token"]
    assert seen.names().isdisjoint(
        {"cookie", "x-other", "accept-language", "x-forwarded-for", "x-hop"}
    ), seen.headers
    # What the client said of its own exchange with the gateway stays there.
    assert seen.values("accept-encoding") == ["gzip, deflate"]
    assert seen.values("content-type") == []
    assert seen.values("x-service") == ["service"]


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_wildcard_passes_every_end_to_end_header_but_credentials(client: str) -> None:
    async with recording_backend() as backend:
        text = one_pipe(backend.url, 'pass_headers = ["*"]')
        answer, [seen] = await call_once(client, text, backend, CLIENT_HEADERS)
    assert answer.status_code == 200, answer.text
    assert seen.values("x-tenant") == ["acme"]
    assert seen.values("x-other") == ["other"]
    assert seen.values("accept-language") == ["fr"]
    never = {"authorization", "cookie", "x-forwarded-for", "x-hop"}
    assert seen.names().isdisjoint(never), seen.headers
    assert seen.values("connection") in ([], ["keep-alive"])  # httpx's own, if any
    assert seen.values("accept-encoding") == ["gzip, deflate"]
    assert seen.values("content-type") == []
    assert seen.values("host") == [backend.url.removeprefix("http://")]


@pytest.mark.parametrize("client", CLIENTS)
async def test_credentials_pass_beside_a_wildcard_only_when_named(client: str) -> None:
    async with recording_backend() as backend:
        text = one_pipe(backend.url, 'pass_headers = ["*", "Cookie"]')
        headers = [*CLIENT_HEADERS, ("Cookie", "theme=dark")]
        answer, [seen] = await call_once(client, text, backend, headers)
    assert answer.status_code == 200, answer.text
    # Two Cookie lines are one when passed on, as RFC 6265 joins them.
    assert seen.values("cookie") == ["session=s1; theme=dark"]
    assert seen.values("authorization") == []
    assert seen.values("x-other") == ["other"]


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_header_in_several_lines_is_passed_as_one(client: str) -> None:
    async with recording_backend() as backend:
        text = one_pipe(backend.url, 'pass_headers = ["X-Tenant"]')
        headers = [("X-Tenant", "a"), ("X-Other", "x"), ("x-tenant", "b")]
        answer, [seen] = await call_once(client, text, backend, headers)
    assert answer.status_code == 200, answer.text
    assert seen.values("x-tenant") == ["a, b"]


@pytest.mark.parametrize("client", CLIENTS)
async def test_headers_meet_in_order_each_over_the_ones_before(client: str) -> None:
    """The service's, then passed, then forwarded, then the pipe's own ``headers``, then
    the request id and trace context, which nothing overrides."""
    async with recording_backend() as backend:
        pipes = """
[pipes.prepare]
python = "tests.test_pipe_headers:forward_some"

[pipes.call]
service = "api"
path = "/echo"
into = "echo"
pass_headers = ["X-Key", "X-Service", "X-Forward", "X-Own", "X-Request-ID"]
forward_headers = "forward"
headers = { X-Own = "pipe", X-Request-ID = "from-the-pipe" }
"""
        text = gateway(backend.url, pipes, GO_ROUTE.format(chain='["prepare", "call"]'))
        headers = [
            ("X-Key", "client"),
            ("X-Forward", "client"),
            ("X-Own", "client"),
            ("X-Request-ID", "req-7"),
            ("traceparent", TRACEPARENT),
        ]
        answer, [seen] = await call_once(client, text, backend, headers)
    assert answer.status_code == 200, answer.text
    assert seen.values("x-service") == ["service"]  # the service's: the client sent none
    assert seen.values("x-key") == ["client"]  # passed, over the service's
    assert seen.values("x-forward") == ["forwarded"]  # forwarded, over passed
    assert seen.values("x-own") == ["pipe"]  # the pipe's own, over all
    assert seen.values("x-request-id") == ["req-7"]  # the request's id, whatever the rest
    assert seen.values("traceparent") == [TRACEPARENT]


async def forward_some(ctx: pw.Context) -> None:
    ctx.state["forward"] = {"X-Forward": "forwarded"}


@pytest.mark.parametrize("client", CLIENTS)
async def test_only_the_pipes_that_name_a_header_pass_it(client: str) -> None:
    """The job records the request's headers for the chain, but a pipe passes only the
    ones it names; one nested in a stage counts too."""
    async with recording_backend() as backend:
        pipes = """
[pipes.call]
service = "api"
path = "/echo"
into = "echo"
pass_headers = ["X-Tenant"]

[pipes.plain]
service = "api"
path = "/echo"
into = "plain"
"""
        chain = '[{ all_of = ["call", "plain"] }]'
        text = gateway(backend.url, pipes, GO_ROUTE.format(chain=chain))
        answer, seen = await call_once(client, text, backend, CLIENT_HEADERS)
    assert answer.status_code == 200, answer.text
    assert sorted(s.values("x-tenant") for s in seen) == [[], ["acme"]]


async def test_the_job_records_only_the_headers_its_pipes_may_pass() -> None:
    """Nothing for a chain that passes none; for one that does, the headers it may pass,
    as ``[name, value]`` pairs in their order (credentials only when named)."""
    async with recording_backend() as backend:
        pipes = """
[pipes.call]
service = "api"
path = "/echo"
into = "echo"
pass_headers = ["*", "Authorization"]

[pipes.plain]
service = "api"
path = "/echo"
into = "echo"
"""
        routes = """
[routes.passing]
method = "GET"
path = "/passing"
chain = ["call"]

[routes.plain]
method = "GET"
path = "/plain"
chain = ["plain"]
"""
        with trio.fail_after(HANG_GUARD):
            async with served_gateway("lean", gateway(backend.url, pipes, routes)) as (
                served,
                config,
            ):
                passing = await served.client.get("/passing", headers=CLIENT_HEADERS)
                plain = await served.client.get("/plain", headers=CLIENT_HEADERS)
    # A route answering its whole state answers the record too: the file says so.
    [warning] = [w for w in config.warnings if "whole state" in w.message]
    assert warning.path == "routes.passing"
    assert warning.message.startswith("this route answers the whole state")
    assert passing.status_code == plain.status_code == 200
    assert plain.json() == {"echo": {"ok": True}}
    assert passing.json()["request"] == {
        "headers": [
            ["accept", "*/*"],  # the test client's own
            ["user-agent", f"python-httpx/{httpx.__version__}"],
            ["x-tenant", "acme"],
            ["authorization", "Bearer client-token"],
            ["x-other", "other"],
            ["accept-language", "fr"],
        ]
    }


async def test_a_request_may_not_set_the_record_itself() -> None:
    async with recording_backend() as backend:
        text = gateway(
            backend.url,
            ECHO_PIPE.format(extra='pass_headers = ["X-Tenant"]'),
            GO_ROUTE.format(chain='["call"]').replace('"GET"', '"POST"'),
        )
        with trio.fail_after(HANG_GUARD):
            async with served_gateway("lean", text) as (served, _):
                forged = {"request": {"headers": [["x-tenant", "forged"]]}}
                answer = await served.client.post("/go", json=forged)
                query = await served.client.post("/go?request=x", json={})
    body = assert_problem(answer, 400, "conflicting-input")
    assert "'request' holds what this route keeps of the request" in body["detail"]
    assert_problem(query, 400, "conflicting-input")
    assert backend.received == []


async def test_a_recorded_header_state_cannot_carry_is_refused_not_sent() -> None:
    """A pipe may edit the record; a value no header can carry is the job's mistake (400),
    never sent."""
    async with recording_backend() as backend:
        pipes = """
[pipes.edit]
python = "tests.test_pipe_headers:break_a_header"

[pipes.call]
service = "api"
path = "/echo"
into = "echo"
pass_headers = ["X-Tenant"]
"""
        text = gateway(backend.url, pipes, GO_ROUTE.format(chain='["edit", "call"]'))
        answer, seen = await call_once("lean", text, backend, [("X-Tenant", "acme")])
    body = assert_problem(answer, 400, "backend-request-refused")
    assert "header 'x-tenant' may not hold control characters" in body["detail"]
    assert seen == []


async def break_a_header(ctx: pw.Context) -> None:
    ctx.state["request"]["headers"] = [["x-tenant", "a\r\nX-Injected: 1"]]


async def test_a_proxy_routes_chain_passes_the_headers_it_names(tmp_path: Path) -> None:
    """A proxy route's chain runs on the request's head, whose headers are the record's: a
    pipe there (say, asking an auth service) passes the ones it names, as on any route."""
    async with recording_backend() as backend:
        pipes = """
[pipes.check]
service = "api"
path = "/echo"
into = false
pass_headers = ["Authorization"]

[routes.proxied]
proxy = "api"
prefix = "/p"
chain = ["check"]
"""
        path = tmp_path / "gateway.toml"
        path.write_text(gateway(backend.url, pipes, ""))
        gw, stop = Gateway(str(path)), trio.Event()
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(functools.partial(gw.run, port=0, stop=stop))
                async with httpx.AsyncClient(base_url=address.url) as client:
                    answer = await client.get("/p/echo", headers=CLIENT_HEADERS)
                stop.set()
    assert answer.status_code == 200, answer.text
    check, proxied = backend.received
    assert check.values("authorization") == ["Bearer client-token"]
    assert check.names().isdisjoint({"cookie", "x-tenant", "x-other"})
    assert proxied.values("cookie") == ["session=s1"]  # the proxy step passes them all


async def test_a_wildcard_passes_no_trace_field_of_the_clients_own() -> None:
    """The checked trace context goes on; ``"*"`` adds no unchecked copy of it."""
    async with recording_backend() as backend:
        headers = [("traceparent", "garbage"), ("baggage", "bad value"), ("X-Tenant", "a")]
        text = one_pipe(backend.url, 'pass_headers = ["*"]')
        answer, [seen] = await call_once("lean", text, backend, headers)
    assert answer.status_code == 200, answer.text
    assert seen.values("x-tenant") == ["a"]
    assert seen.names().isdisjoint({"traceparent", "baggage"})


# -- the rules, without I/O ------------------------------------------------------------------


def test_which_names_pass() -> None:
    named = frozenset({"x-tenant", "authorization"})
    assert passes("x-tenant", named)
    assert passes("authorization", named)
    assert not passes("cookie", named)
    assert not passes("x-other", named)
    every = frozenset({"*"})
    assert passes("x-other", every)
    for never in ("authorization", "cookie", "forwarded", "x-forwarded-for", "via"):
        assert not passes(never, every)
        assert passes(never, every | {never})
    for framing in ("host", "content-length", "transfer-encoding", "connection", "te"):
        assert not passes(framing, every | {framing})
    for carried in ("traceparent", "tracestate", "baggage"):
        assert not passes(carried, every | {carried})
    assert not passes("proxy-anything", every)


def test_passed_drops_what_connection_names_and_keeps_the_order() -> None:
    headers = [
        ("X-B", "1"),
        ("Connection", "keep-alive, X-Secret"),
        ("X-Secret", "hop"),
        ("X-A", "2"),
        ("x-b", "3"),
    ]
    assert passed(headers, frozenset({"*"})) == [("x-b", "1"), ("x-a", "2"), ("x-b", "3")]
    assert passed(headers, frozenset({"x-secret"})) == []


def test_calls_refuse_header_names_they_may_never_pass() -> None:
    with pytest.raises(pw.RegistrationError, match="list of header names, not one"):
        HttpCall.of("api", "/", pass_headers="X-Tenant")
    with pytest.raises(pw.RegistrationError, match="'Host' frames the client's request"):
        HttpCall.of("api", "/", pass_headers=["Host"])
    call = HttpCall.of("api", "/", pass_headers=["X-Tenant", "*"])
    assert call.pass_headers == frozenset({"x-tenant", "*"})
    assert call.request_use == pw.RequestUse(frozenset({"x-tenant", "*"}))
    assert HttpCall.of("api", "/").request_use is None


# -- the file's problems -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path", "message"),
    [
        ('"X-Tenant"', "pipes.call.pass_headers", "expected an array of header names"),
        ("[1]", "pipes.call.pass_headers[0]", "expected a header name, got an integer"),
        ('["X Tenant"]', "pipes.call.pass_headers[0]", "'X Tenant' is not a valid header name"),
        ('["ok", "Host"]', "pipes.call.pass_headers[1]", "'Host' frames the client's request"),
        ('["Content-Length"]', "pipes.call.pass_headers[0]", "frames the client's request"),
        ('["Transfer-Encoding"]', "pipes.call.pass_headers[0]", "is a hop-by-hop header"),
        ('["Proxy-Authorization"]', "pipes.call.pass_headers[0]", "is a hop-by-hop header"),
        ('["traceparent"]', "pipes.call.pass_headers[0]", "every backend call carries"),
        ('["Baggage"]', "pipes.call.pass_headers[0]", "every backend call carries"),
        ('["Accept-Encoding"]', "pipes.call.pass_headers[0]", "decodes answers itself"),
        ('["Content-Type"]', "pipes.call.pass_headers[0]", "comes with the pipe's body"),
    ],
)
def test_pass_headers_problems_name_their_key_path(value: str, path: str, message: str) -> None:
    text = one_pipe("http://127.0.0.1:9", f"pass_headers = {value}")
    with pytest.raises(pw.ConfigError) as info:
        loads_config(text)
    [problem] = info.value.problems
    assert problem.path == path
    assert message in problem.message


def test_a_header_named_twice_is_a_warning() -> None:
    config = loads_config(one_pipe("http://127.0.0.1:9", 'pass_headers = ["X-A", "x-a"]'))
    [warning] = [w for w in config.warnings if w.path.startswith("pipes.")]
    assert warning.path == "pipes.call.pass_headers[1]"
    assert "named twice" in warning.message


async def test_a_python_pipe_reads_the_headers_it_says_it_needs() -> None:
    async def check(ctx: pw.Context) -> None:
        ctx.state["seen"] = ctx.state["request"]["headers"]

    registry = pw.Registry()
    use = pw.RequestUse(frozenset({"authorization"}))
    registry.add_pipe(pw.Pipe(check, "check", request_use=use))
    registry.chain("checked", "check", result="seen")
    registry.route("checked", method="GET", path="/checked", chain="checked")
    with trio.fail_after(HANG_GUARD):
        async with serving(pw.Engine(registry=registry)) as served:
            answer = await served.client.get("/checked", headers=CLIENT_HEADERS)
    assert answer.json() == [["authorization", "Bearer client-token"]]


async def test_an_idempotent_repeat_must_pass_the_same_headers() -> None:
    """What a route keeps of its request is part of the request: the same key with another
    X-Tenant is another request (422), never the first tenant's job."""
    async with recording_backend() as backend:
        text = one_pipe(backend.url, 'pass_headers = ["X-Tenant"]')
        with trio.fail_after(HANG_GUARD):
            async with served_gateway("lean", text) as (served, _):
                key = {"Idempotency-Key": "k-1"}
                first = await served.client.get("/go", headers={**key, "X-Tenant": "a"})
                again = await served.client.get("/go", headers={**key, "X-Tenant": "a"})
                other = await served.client.get("/go", headers={**key, "X-Tenant": "b"})
    assert first.status_code == again.status_code == 200
    assert first.headers["X-Job-Id"] == again.headers["X-Job-Id"]
    assert_problem(other, 422, "idempotency-key-reused")
    assert len(backend.received) == 1
