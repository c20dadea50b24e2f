"""Raw bodies through composed routes: a route with ``body = "raw"`` keeps the request's
body as it came (bytes and content type), an HTTP pipe with ``body_from`` sends such a
body instead of JSON, one with ``raw = true`` keeps its answer's bytes and content type,
and a route whose result is such a value answers with those bytes.

End to end, byte for byte: a gateway file served on a free port, a real client, and a
real backend that records what it received and answers binary bodies, through either
backend client (the lean one, and httpx); then on the Redis store, and the file's
problems."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

import pipework as pw
from pipework import Gateway, HttpCall, loads_config
from pipework._cli_config import check
from pipework.container import BoundAddress

from ._pipe_gateway import served_gateway
from ._recording_backend import BINARY, BINARY_TYPE, recording_backend
from ._redis import RedisServer
from .test_container_harness import assert_problem

HANG_GUARD = 10.0
CLIENTS = ["lean", "httpx"]
#: A request body no JSON could carry: every byte value, CRLFs and NULs included.
UPLOAD = bytes(reversed(range(256))) * 500 + b"\r\n\r\n\x00end"
UPLOAD_TYPE = "application/x-thing; version=2"


def gateway(url: str, body: str) -> str:
    return f"""
[pool]
max_workers = 8

[services.api]
base_url = "{url}"
timeout = 5

{body}
"""


UPLOAD_ROUTE = """
[pipes.send]
service = "api"
method = "PUT"
path = "/echo"
body_from = "request"
into = "sent"

[routes.upload]
method = "POST"
path = "/upload"
body = "raw"
max_body = 200000
chain = ["send"]
result = "sent"
"""

MIRROR_ROUTE = """
[pipes.mirror]
service = "api"
method = "POST"
path = "/mirror"
body_from = "request"
raw = true
into = "back"

[routes.mirror]
method = "POST"
path = "/mirror"
body = "raw"
chain = ["mirror"]
result = "back"
"""


def download_route(path: str) -> str:
    return f"""
[pipes.fetch]
service = "api"
path = "{path}"
raw = true
into = "picture"

[routes.picture]
method = "GET"
path = "/picture"
chain = ["fetch"]
result = "picture"
"""


# -- the request's body to a backend -------------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_raw_request_body_reaches_the_backend_byte_for_byte(client: str) -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            recording_backend() as backend,
            served_gateway(client, gateway(backend.url, UPLOAD_ROUTE)) as (served, _),
        ):
            answer = await served.client.post(
                "/upload", content=UPLOAD, headers={"Content-Type": UPLOAD_TYPE}
            )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"ok": True}
    [seen] = backend.received
    assert seen.method == "PUT"
    assert seen.body == UPLOAD
    assert seen.values("content-type") == [UPLOAD_TYPE]
    assert seen.values("content-length") == [str(len(UPLOAD))]


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_raw_body_without_a_type_is_sent_without_one(client: str) -> None:
    """And a JSON body on a raw route is kept as bytes too, never parsed."""
    with trio.fail_after(HANG_GUARD):
        async with (
            recording_backend() as backend,
            served_gateway(client, gateway(backend.url, UPLOAD_ROUTE)) as (served, _),
        ):
            untyped = await served.client.post("/upload", content=b"\x00\x01")
            json_body = await served.client.post("/upload", json={"a": [1, 2]})
    assert untyped.status_code == json_body.status_code == 200
    first, second = backend.received
    assert (first.body, first.values("content-type")) == (b"\x00\x01", [])
    assert (second.body, second.values("content-type")) == (b'{"a":[1,2]}', ["application/json"])


async def test_a_raw_route_refuses_what_it_cannot_keep_as_it_came() -> None:
    """An encoded body (kept and passed on with its type alone, it would be mislabelled) is
    a 415, a body over the route's max_body a 413: neither reaches the backend."""
    with trio.fail_after(HANG_GUARD):
        async with (
            recording_backend() as backend,
            served_gateway("lean", gateway(backend.url, UPLOAD_ROUTE)) as (served, _),
        ):
            encoded = await served.client.post(
                "/upload", content=b"x", headers={"Content-Encoding": "gzip"}
            )
            identity = await served.client.post(
                "/upload", content=b"x", headers={"Content-Encoding": "identity"}
            )
            big = await served.client.post("/upload", content=b"x" * 200001)
    body = assert_problem(encoded, 415, "unsupported-media-type")
    assert "the request body is gzip-encoded" in body["detail"]
    assert identity.status_code == 200
    assert_problem(big, 413, "body-too-large")
    assert [seen.body for seen in backend.received] == [b"x"]


# -- an answer's bytes back to the client ----------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/binary", BINARY_TYPE),
        ("/binary-gzip", BINARY_TYPE),  # kept decoded, as every answer is
        ("/untyped", "application/octet-stream"),
    ],
)
async def test_a_raw_answer_goes_back_byte_for_byte_with_its_type(
    client: str, path: str, content_type: str
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with recording_backend() as backend:
            text = gateway(backend.url, download_route(path))
            async with served_gateway(client, text) as (served, _):
                # Whatever the client prefers: the bytes are the answer.
                answer = await served.client.get(
                    "/picture", headers={"Accept": "application/msgpack"}
                )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == content_type
    assert answer.headers.get("content-encoding") is None
    assert answer.content == BINARY


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_raw_body_goes_there_and_back_unchanged(client: str) -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            recording_backend() as backend,
            served_gateway(client, gateway(backend.url, MIRROR_ROUTE)) as (served, _),
        ):
            answer = await served.client.post(
                "/mirror", content=UPLOAD, headers={"Content-Type": UPLOAD_TYPE}
            )
    assert answer.status_code == 200
    assert answer.headers["content-type"] == UPLOAD_TYPE
    assert answer.content == UPLOAD


async def test_the_job_api_answers_a_raw_result_as_its_bytes() -> None:
    """An async route's result, read later: the same bytes and type."""
    route = MIRROR_ROUTE.replace('result = "back"', 'result = "back"\nmode = "async"')
    with trio.fail_after(HANG_GUARD):
        async with (
            recording_backend() as backend,
            served_gateway("lean", gateway(backend.url, route)) as (served, _),
        ):
            accepted = await served.client.post(
                "/mirror", content=b"\xffraw\x00", headers={"Content-Type": "x/y"}
            )
            assert accepted.status_code == 202
            job_id, token = accepted.json()["id"], accepted.json()["token"]
            auth = {"Authorization": f"Bearer {token}"}
            await served.engine.wait(job_id)
            result = await served.client.get(f"/jobs/{job_id}/result", headers=auth)
    assert result.status_code == 200
    assert (result.headers["content-type"], result.content) == ("x/y", b"\xffraw\x00")


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_raw_answer_can_be_sent_on_by_the_next_pipe(client: str) -> None:
    """``body_from`` names any state key holding a raw value: one pipe's answer is the
    next one's body, bytes and type."""
    pipes = """
[pipes.fetch]
service = "api"
path = "/binary"
raw = true
into = "picture"

[pipes.store]
service = "api"
method = "POST"
path = "/echo"
body_from = "picture"
into = "stored"

[routes.copy]
method = "POST"
path = "/copy"
chain = ["fetch", "store"]
result = "stored"
"""
    with trio.fail_after(HANG_GUARD):
        async with (
            recording_backend() as backend,
            served_gateway(client, gateway(backend.url, pipes)) as (served, _),
        ):
            answer = await served.client.post("/copy")
    assert answer.status_code == 200, answer.text
    [seen] = backend.received
    assert (seen.body, seen.values("content-type")) == (BINARY, [BINARY_TYPE])


async def test_a_body_from_that_holds_no_raw_value_is_refused_not_sent() -> None:
    pipes = """
[pipes.store]
service = "api"
method = "POST"
path = "/echo"
body_from = "picture"

[routes.copy]
method = "POST"
path = "/copy"
chain = ["store"]
result = "store"
"""
    with trio.fail_after(HANG_GUARD):
        async with (
            recording_backend() as backend,
            served_gateway("lean", gateway(backend.url, pipes)) as (served, _),
        ):
            missing = await served.client.post("/copy", json={})
            text = await served.client.post("/copy", json={"picture": "not bytes"})
    assert (
        "state has no 'picture'"
        in assert_problem(missing, 400, "backend-request-refused")["detail"]
    )
    detail = assert_problem(text, 400, "backend-request-refused")["detail"]
    assert "state value 'picture' is not a raw body" in detail
    assert backend.received == []


# -- on the Redis store ----------------------------------------------------------------------


async def test_bytes_in_state_survive_the_redis_store(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The job's state holds the request's body and the answer as bytes: Redis keeps them
    as msgpack's bin, and they come back bytes, byte for byte."""
    with trio.fail_after(HANG_GUARD):
        async with recording_backend() as backend:
            path = tmp_path / "gateway.toml"
            prefix = f"raw-{hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]}"
            store = f'[store]\nbackend = "redis"\nurl = "{redis_server.url}"\nprefix = "{prefix}"\n'
            path.write_text(store + gateway(backend.url, MIRROR_ROUTE))
            async with gateway_served(Gateway(str(path))) as (gateway_, client):
                answer = await client.post(
                    "/mirror", content=UPLOAD, headers={"Content-Type": UPLOAD_TYPE}
                )
                assert gateway_.engine is not None
                job = await gateway_.engine.store.get(answer.headers["X-Job-Id"])
    assert answer.status_code == 200
    assert (answer.headers["content-type"], answer.content) == (UPLOAD_TYPE, UPLOAD)
    kept = {"content_type": UPLOAD_TYPE, "data": UPLOAD}
    assert job.state["request"] == {"body": kept}
    assert job.state["back"] == kept
    assert type(job.state["back"]["data"]) is bytes


@asynccontextmanager
async def gateway_served(gateway: Gateway) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(gateway.run, port=0, stop=stop)
        )
        try:
            async with httpx.AsyncClient(base_url=address.url) as client:
                yield gateway, client
        finally:
            stop.set()


# -- Python, and the file's problems -----------------------------------------------------------


def test_a_route_whose_pipes_send_the_body_must_keep_it() -> None:
    backends = pw.Backends([pw.Service("api", "http://127.0.0.1:9")])
    registry = pw.Registry()
    registry.add_pipe(
        pw.http_pipe("send", HttpCall.of("api", "/", method="POST", body_from="request"), backends)
    )
    registry.chain("upload", "send")
    with pytest.raises(pw.RegistrationError, match="declare the route with body='raw'"):
        registry.route("upload", path="/upload", chain="upload")
    assert registry.route("raw", path="/raw", chain="upload", body="raw").body == "raw"
    with pytest.raises(pw.RegistrationError, match="JSON body or a raw one"):
        HttpCall.of("api", "/", body={"a": 1}, body_from="request")


def test_the_files_raw_body_problems_name_their_key_paths() -> None:
    text = """
[services.api]
base_url = "http://127.0.0.1:9"

[pipes.both]
service = "api"
method = "POST"
path = "/a"
body = { a = 1 }
body_from = "request"

[pipes.nothing]
service = "api"
path = "/a"
raw = true
into = false

[pipes.send]
service = "api"
method = "POST"
path = "/a"
body_from = "request"

[routes.json]
path = "/json"
chain = ["send"]
result = "send"

[routes.odd]
path = "/odd"
body = "bytes"
chain = ["nothing"]

[routes.named]
path = "/named/{request}"
body = "raw"
chain = ["send"]
result = "send"

[routes.proxied]
proxy = "api"
prefix = "/p"
chain = ["send"]

[routes.proxied_raw]
proxy = "api"
prefix = "/q"
body = "raw"
"""
    lines = text.splitlines()

    def line(table: str, key: str | None = None) -> int:
        """The line of ``key`` in ``[table]`` (of the table itself when None)."""
        at = lines.index(f"[{table}]")
        if key is None:
            return at + 1
        return next(i for i in range(at, len(lines)) if lines[i].startswith(f"{key} =")) + 1

    with pytest.raises(pw.ConfigError) as info:
        loads_config(text)
    problems = [(p.path, p.line, p.message) for p in info.value.problems if p.severity == "error"]
    assert problems == [
        (
            "pipes.both.body_from",
            line("pipes.both", "body_from"),
            "set body (a JSON body) or body_from (a raw one: the request's, or a state key's), "
            "not both",
        ),
        (
            "pipes.nothing.raw",
            line("pipes.nothing", "raw"),
            "raw = true keeps the answer's bytes, but into = false keeps nothing",
        ),
        (
            "routes.json.chain",
            line("routes.json", "chain"),
            "pipe 'send' sends the request's body as it came (body_from = \"request\"); set "
            'body = "raw" on this route to keep it',
        ),
        (
            "routes.odd.body",
            line("routes.odd", "body"),
            "unknown value 'bytes'; expected one of: object, raw",
        ),
        (
            "routes.named.path",
            line("routes.named", "path"),
            "path parameter {request} would take the state key where this route keeps what "
            "its pipes read of the request; rename it",
        ),
        (
            "routes.proxied",
            line("routes.proxied"),
            "pipe 'send' sends the request's body (body_from = \"request\"), but a proxy "
            "route's chains run on the request's head: its body streams to the service",
        ),
        (
            "routes.proxied_raw.body",
            line("routes.proxied_raw", "body"),
            "a chain route's key, not a proxy route's: a proxy route passes any body on as it "
            "comes",
        ),
    ]


def test_pipework_check_reports_them_with_their_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gateway.toml"
    text = gateway("http://127.0.0.1:9", UPLOAD_ROUTE.replace('body = "raw"\n', ""))
    text += '\n[pipes.tenant]\nservice = "api"\npath = "/t"\npass_headers = ["Host"]\n'
    path.write_text(text)
    lines = text.splitlines()
    chain, passing = lines.index('chain = ["send"]') + 1, lines.index('pass_headers = ["Host"]') + 1
    assert check(path) == 1
    out = capsys.readouterr().err.splitlines()
    assert out[0] == f"{path}: 2 errors"
    assert sorted(line.strip() for line in out[1:]) == [
        f"{path}:{chain}: error: routes.upload.chain: pipe 'send' sends the request's body as "
        'it came (body_from = "request"); set body = "raw" on this route to keep it',
        f"{path}:{passing}: error: pipes.tenant.pass_headers[0]: 'Host' frames the client's "
        "request to the gateway; it is never passed on",
    ]
