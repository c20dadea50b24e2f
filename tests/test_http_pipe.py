"""The built-in HTTP pipe, end to end: a gateway file and a real Engine, calling either an
``httpx.MockTransport`` that records each request (for how requests are built) or a real
backend server on a free port (for timeouts, refused connections and answers on the wire).
Templates are also tested on their own, without I/O."""

from __future__ import annotations

import functools
import gzip
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import trio
from quart import Response, request
from quart_trio import QuartTrio

import pipework as pw
from pipework import (
    Backends,
    HttpCall,
    Service,
    TemplateError,
    WeightedPool,
    build_registry,
    http_pipe,
    loads_config,
)
from pipework.backends._http_template import Template, TemplateSyntaxError
from pipework.container import serve

from ._endless_backend import endless_backend, retained
from .test_container_harness import assert_problem, serving

HANG_GUARD = 10.0
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@dataclass
class Backend:
    url: str
    hostport: str
    seen: list[dict[str, Any]]
    transport: httpx.AsyncBaseTransport | None = None  # None: a real server at url


def make_backend(release: trio.Event, seen: list[dict[str, Any]]) -> QuartTrio:
    app = QuartTrio("backend")

    @app.route("/status/<int:code>", methods=METHODS)
    async def status(code: int) -> Response:
        return Response(json.dumps({"status": code}), status=code, content_type="application/json")

    @app.route("/slow")
    async def slow() -> str:
        await release.wait()  # the fixture releases it at teardown; the client gives up first
        return "late"

    @app.route("/text")
    async def text() -> Response:
        return Response("plain words", content_type="text/plain; charset=utf-8")

    @app.route("/big")
    async def big() -> Response:
        return Response(b"x" * 5000, content_type="application/octet-stream")

    @app.route("/big-gzip")
    async def big_gzip() -> Response:
        # Small on the wire, 5000 bytes once decoded: the limit counts decoded bytes.
        headers = {"Content-Encoding": "gzip"}
        return Response(gzip.compress(b"x" * 5000), headers=headers, content_type="text/plain")

    @app.route("/big-chunked")
    async def big_chunked() -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(5):
                yield b"x" * 1000

        return Response(chunks(), content_type="text/plain")  # no Content-Length

    @app.route("/bad-json")
    async def bad_json() -> Response:
        return Response("{not json", content_type="application/json")

    @app.route("/", defaults={"rest": ""}, methods=METHODS)
    @app.route("/<path:rest>", methods=METHODS)
    async def echo(rest: str) -> Response:
        data = await request.get_data()
        record = {
            "method": request.method,
            "raw_path": request.scope["raw_path"].decode("ascii"),
            "query": request.scope["query_string"].decode("ascii"),
            "args": {k: request.args.getlist(k) for k in request.args},
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body": json.loads(data) if data else None,
        }
        seen.append(record)
        return Response(json.dumps(record), content_type="application/json")

    return app


@pytest.fixture
async def backend(nursery: trio.Nursery) -> AsyncIterator[Backend]:
    release, stop = trio.Event(), trio.Event()
    seen: list[dict[str, Any]] = []
    address = await nursery.start(
        functools.partial(
            serve, make_backend(release, seen), port=0, shutdown_trigger=stop, graceful_timeout=1
        )
    )
    yield Backend(address.url, f"{address.host}:{address.port}", seen)
    release.set()
    stop.set()


def echo_transport(seen: list[dict[str, Any]]) -> httpx.MockTransport:
    """Answers every request with a record of it, as the real backend's echo route does."""

    async def handle(request: httpx.Request) -> httpx.Response:
        data = await request.aread()
        raw_path, _, query = request.url.raw_path.partition(b"?")
        params = request.url.params
        record = {
            "method": request.method,
            "raw_path": raw_path.decode("ascii"),
            "query": query.decode("ascii"),
            "args": {k: params.get_list(k) for k in params},
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "body": json.loads(data) if data else None,
        }
        seen.append(record)
        return httpx.Response(200, json=record)

    return httpx.MockTransport(handle)


@pytest.fixture
def mock_backend() -> Backend:
    seen: list[dict[str, Any]] = []
    return Backend("http://api.test:8080", "api.test:8080", seen, echo_transport(seen))


def gateway(url: str, pipes: str, *, service: str = "", chain: str = '["call"]') -> str:
    return f"""
[pool]
max_workers = 8

[services.api]
base_url = "{url}"
timeout = 5
{service}

{pipes}

[routes.go]
path = "/go"
chain = {chain}
"""


async def run(
    text: str,
    state: dict[str, Any],
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    **kwargs: Any,
) -> Any:
    config = loads_config(text)
    backends = config.backends(transport=transport)
    engine = pw.Engine(
        registry=build_registry(config, backends),
        pool=WeightedPool.from_config(config.pool_config()),
    )
    with trio.fail_after(HANG_GUARD):
        async with backends, engine:
            try:
                return await engine.run("go", state, **kwargs)
            except pw.PipeworkError as exc:
                failure = exc  # raised outside the engine's nursery, not in a group
    raise failure


# -- a call, end to end ----------------------------------------------------------------


async def test_path_query_headers_and_body_are_filled_from_state(mock_backend: Backend) -> None:
    text = gateway(
        mock_backend.url + "/base",
        """
[pipes.call]
service = "api"
method = "POST"
path = "/items/{item.id}/notes/{note}"
query = { q = "{term}", tags = "{tags}", fixed = 1, cursor = "{cursor}" }
headers = { X-User = "{user.name}", X-Fixed = "v" }
body = { item = "{item}", label = "note: {note}", n = 3, list = ["{term}", 2] }
into = "echo"
""",
    )
    state = {
        "item": {"id": 42, "name": "lamp"},
        "note": "a b/c?d#e",
        "term": "x&y=z",
        "tags": ["red", "blue"],
        "cursor": None,
        "user": {"name": "ada"},
    }
    result = await run(text, state, transport=mock_backend.transport)
    echo = result["echo"]
    assert echo["method"] == "POST"
    assert echo["raw_path"] == "/base/items/42/notes/a%20b%2Fc%3Fd%23e"
    assert echo["args"] == {"q": ["x&y=z"], "tags": ["red", "blue"], "fixed": ["1"]}
    assert echo["headers"]["x-user"] == "ada"
    assert echo["headers"]["x-fixed"] == "v"
    assert echo["headers"]["content-type"] == "application/json"
    assert echo["headers"]["host"] == mock_backend.hostport
    assert echo["body"] == {
        "item": {"id": 42, "name": "lamp"},
        "label": "note: a b/c?d#e",
        "n": 3,
        "list": ["x&y=z", 2],
    }


async def test_text_answers_are_kept_as_text_and_into_false_keeps_nothing(
    backend: Backend,
) -> None:
    pipes = """
[pipes.call]
service = "api"
path = "/text"
into = "words"

[pipes.quiet]
service = "api"
path = "/anything"
into = false
"""
    result = await run(gateway(backend.url, pipes, chain='["call", "quiet"]'), {})
    assert result == {"words": "plain words"}
    assert len(backend.seen) == 1


async def test_unaccepted_status_is_a_backend_error_with_the_status(backend: Backend) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/status/503"'
    with pytest.raises(pw.BackendError) as info:
        await run(gateway(backend.url, pipes), {})
    assert info.value.status == 503
    assert info.value.service == "api"
    assert info.value.http_status == 502
    assert str(info.value) == "service 'api' answered HTTP 503; the pipe accepts 2xx"


async def test_accepted_statuses_are_parsed_like_any_answer(backend: Backend) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/status/404"\naccept = ["2xx", 404]'
    assert await run(gateway(backend.url, pipes), {}) == {"call": {"status": 404}}


async def test_a_refused_connection_is_a_backend_error_without_status() -> None:
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pipes = '[pipes.call]\nservice = "api"\npath = "/"'
    with pytest.raises(pw.BackendUnreachable) as info:
        await run(gateway(f"http://127.0.0.1:{port}", pipes), {})
    assert info.value.status is None
    assert info.value.http_status == 502
    assert str(info.value) == (
        "could not connect to service 'api' (for chain 'go' > pipe 'call'); nothing was "
        "sent: check that the service is up and reachable at its base_url"
    )


async def test_a_slow_service_times_out_at_its_own_timeout(backend: Backend) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/slow"'
    text = gateway(backend.url, pipes).replace("timeout = 5", "timeout = 0.2")
    with pytest.raises(pw.DeadlineExceeded) as info:
        await run(text, {})
    assert info.value.scope == "pipe"
    assert info.value.http_status == 504
    assert str(info.value) == (
        "service 'api' did not answer within 0.2s (for chain 'go' > pipe 'call'); check why "
        "it is slow, or raise its timeout if it may take that long"
    )


async def test_the_jobs_deadline_caps_a_slower_service_timeout(backend: Backend) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/slow"'
    with pytest.raises(pw.DeadlineExceeded) as info:
        await run(gateway(backend.url, pipes), {}, timeout=0.2)
    assert info.value.scope == "job"


async def test_a_pipe_timeout_caps_the_call(backend: Backend) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/slow"\ntimeout = 0.2'
    with pytest.raises(pw.DeadlineExceeded) as info:
        await run(gateway(backend.url, pipes), {})
    assert info.value.scope == "pipe"
    assert "chain 'go' > pipe 'call'" in str(info.value)


async def test_hop_by_hop_headers_are_never_forwarded(mock_backend: Backend) -> None:
    pipes = """
[pipes.call]
service = "api"
path = "/h"
forward_headers = "incoming"
into = "echo"
"""
    incoming = {
        "X-Trace": "t-1",
        "Connection": "close, X-Secret",
        "X-Secret": "named by Connection",
        "Keep-Alive": "timeout=5",
        "Proxy-Authorization": "Basic eA==",
        "Proxy-Foo": "bar",
        "TE": "trailers",
        "Trailer": "X-Checksum",
        "Transfer-Encoding": "chunked",
        "Upgrade": "h2c",
        "Host": "evil.example",
        "Content-Length": "999",
    }
    service = 'headers = { X-Gateway = "pw" }'
    echo = (
        await run(
            gateway(mock_backend.url, pipes, service=service),
            {"incoming": incoming},
            transport=mock_backend.transport,
        )
    )["echo"]
    headers = echo["headers"]
    assert headers["x-trace"] == "t-1"
    assert headers["x-gateway"] == "pw"
    assert headers["host"] == mock_backend.hostport
    assert headers.get("connection") != "close, X-Secret"  # httpx's own keep-alive only
    for name in (
        "x-secret",
        "keep-alive",
        "proxy-authorization",
        "proxy-foo",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ):
        assert name not in headers, name


@pytest.mark.parametrize(
    "value",
    ["//evil.example/x", "http://evil.example/", "@evil.example", "../../admin", "%2e%2e", "a\\b"],
)
async def test_state_values_cannot_change_the_host_or_escape_the_segment(
    mock_backend: Backend, value: str
) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/users/{id}/profile"\ninto = "echo"'
    echo = (
        await run(
            gateway(mock_backend.url + "/api", pipes),
            {"id": value},
            transport=mock_backend.transport,
        )
    )["echo"]
    assert echo["headers"]["host"] == mock_backend.hostport
    assert echo["raw_path"] == f"/api/users/{quote(value, safe='')}/profile"
    assert "/" not in quote(value, safe="")


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"id": ".."}, "path placeholder {id} may not be '..'"),
        ({"id": "."}, "path placeholder {id} may not be '.'"),
        ({"id": ""}, "path placeholder {id} may not be ''"),
        ({}, "state has no id"),
        ({"id": {"a": 1}}, "path: state value id is a dict"),
    ],
)
async def test_unsafe_or_missing_path_values_are_refused_before_sending(
    mock_backend: Backend, state: dict[str, Any], message: str
) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/users/{id}"'
    with pytest.raises(TemplateError) as info:
        await run(gateway(mock_backend.url, pipes), state, transport=mock_backend.transport)
    assert str(info.value).startswith(message)
    assert info.value.http_status == 400
    assert mock_backend.seen == []


async def test_header_injection_is_refused(mock_backend: Backend) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/"\nheaders = { X-Name = "{name}" }'
    with pytest.raises(TemplateError, match="may not hold control characters"):
        await run(
            gateway(mock_backend.url, pipes),
            {"name": "ada\r\nX-Admin: yes"},
            transport=mock_backend.transport,
        )
    assert mock_backend.seen == []


@pytest.mark.parametrize("path", ["/big", "/big-gzip", "/big-chunked"])
async def test_answers_beyond_max_response_bytes_are_refused(backend: Backend, path: str) -> None:
    pipes = f'[pipes.call]\nservice = "api"\npath = "{path}"'
    text = gateway(backend.url, pipes, service="max_response_bytes = 1000")
    with pytest.raises(pw.BackendError, match="more than 1000 bytes"):
        await run(text, {})


@pytest.mark.parametrize("client", ["lean", "httpx"])
async def test_endless_answers_at_once_through_a_route_are_502s_that_keep_nothing(
    client: str,
) -> None:
    """Twelve requests at once to a route whose backend's answer never ends: each is a
    502 (too big) as soon as ``max_response_bytes`` is read — not a 504 at the service's
    timeout, which is far beyond this test's guard — every backend connection is closed,
    and the failed jobs, kept for their retention with their errors, hold none of what
    was read."""
    limit = 1 << 20
    at_once = 12
    with trio.fail_after(HANG_GUARD):
        async with endless_backend() as (endless, port):
            text = f"""
[pool]
max_workers = {at_once}

[services.api]
base_url = "http://127.0.0.1:{port}"
timeout = 1000
max_connections = {at_once}
max_response_bytes = {limit}

[pipes.call]
service = "api"
path = "/endless"

[routes.go]
method = "GET"
path = "/go"
chain = ["call"]
"""
            config = loads_config(text)
            backends = config.backends(
                transport=httpx.AsyncHTTPTransport() if client == "httpx" else None
            )
            engine = pw.Engine(
                registry=build_registry(config, backends),
                pool=WeightedPool.from_config(config.pool_config()),
            )
            answers: list[httpx.Response] = []
            async with backends, serving(engine) as served:
                # One first, so that what the first call sets up for good is not counted.
                answers.append(await served.client.get("/go"))
                with retained() as alive:

                    async def go() -> None:
                        answers.append(await served.client.get("/go"))

                    async with trio.open_nursery() as nursery:
                        for _ in range(at_once):
                            nursery.start_soon(go)
                    await endless.wait_ended(1 + at_once)
                    kept = alive()
                # The failed jobs are kept, each with its error.
                jobs = await engine.store.list()
                assert len(jobs) == 1 + at_once
                assert all(isinstance(job.exception, pw.BackendError) for job in jobs)
    assert len(answers) == 1 + at_once
    for answer in answers:
        body = assert_problem(answer, 502, "backend-failed")
        assert body["detail"].endswith(f"more than {limit} bytes (its max_response_bytes)")
    assert endless.accepted == endless.hung_up == 1 + at_once
    # Far less than a body per failed job (what is left: their records, the log lines).
    assert kept < at_once * limit // 4, f"{at_once} failed jobs keep {kept} bytes alive"


async def test_invalid_json_is_a_backend_error(backend: Backend) -> None:
    pipes = '[pipes.call]\nservice = "api"\npath = "/bad-json"'
    with pytest.raises(pw.BackendError, match="invalid JSON"):
        await run(gateway(backend.url, pipes), {})


async def test_pipes_without_open_backends_say_how_to_open_them() -> None:
    backends = Backends([Service("api", "http://127.0.0.1:9")])
    engine = pw.Engine()
    engine.registry.add_pipe(http_pipe("call", HttpCall.of("api", "/"), backends))
    engine.chain("go", "call")
    with trio.fail_after(HANG_GUARD):
        async with engine:
            with pytest.raises(RuntimeError, match="inside `async with backends:`"):
                await engine.run("go")


def test_http_pipe_admission_key_defaults_to_the_service() -> None:
    backends = Backends([Service("api", "http://127.0.0.1:9")])
    assert http_pipe("a", HttpCall.of("api", "/"), backends).key == "api"
    assert http_pipe("b", HttpCall.of("api", "/"), backends, key="other").key == "other"
    with pytest.raises(pw.RegistrationError, match="unknown service 'nope'"):
        http_pipe("c", HttpCall.of("nope", "/"), backends)


def test_connection_limits_follow_the_service() -> None:
    limits = Service("api", "http://h", max_connections=12, max_keepalive=4).limits()
    assert (limits.max_connections, limits.max_keepalive_connections) == (12, 4)
    assert Service("api", "http://h", max_connections=3).limits().max_keepalive_connections == 3


# -- templates, without I/O ----------------------------------------------------------------


def test_template_parts_and_literal_braces() -> None:
    template = Template.parse("a{{b}}{c.d.0}e")
    assert template.parts == ("a{b}", ("c", "d", "0"), "e")
    assert template.fields == ("c.d.0",)
    assert template.render({"c": {"d": ["x"]}}) == "a{b}xe"
    assert Template.parse("{x}").whole == ("x",)
    assert Template.parse("{x}!").whole is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("/a/{b", "unclosed '{' at position 3"),
        ("/a}", "single '}' at position 2; write '}}' for a literal brace"),
        ("/{a-b}", "placeholder {a-b} must name a state key"),
        ("a/{b}", "path 'a/{b}' must start with '/'"),
        ("/a//b", "path '/a//b' may not hold '//', '.' or '..' segments"),
        ("/a/../b", "path '/a/../b' may not hold '//', '.' or '..' segments"),
        ("/a?x=1", "path '/a?x=1' may hold only URL path characters"),
        ("/a%zz", "path '/a%zz' may hold only URL path characters"),
    ],
)
def test_path_template_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(TemplateSyntaxError) as info:
        Template.parse_path(text)
    assert str(info.value).startswith(message)


def test_path_values_are_one_encoded_segment_each() -> None:
    template = Template.parse_path("/u/{a}/{b}.json")
    assert template.render_path({"a": "x/y?z#w:1%", "b": 7}) == "/u/x%2Fy%3Fz%23w%3A1%25/7.json"
    assert template.render_path({"a": True, "b": 1.5}) == "/u/true/1.5.json"
