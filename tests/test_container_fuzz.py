"""Whatever a client sends, the container answers it: never a 500, every error a problem
document, no job for a request answered 4xx, and a normal request still served after.

The app is driven in process through ASGI (no sockets), with raw bytes for header names
and values, so the container sees inputs a real HTTP server might pass on or normalise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipework as pw
from pipework.container import Container, ContainerConfig

from .test_container_harness import HANG_GUARD, SECRET

TOKEN = "fuzz-admin-token"

_INTERESTING_HEADERS = [
    b"content-type",
    b"prefer",
    b"idempotency-key",
    b"authorization",
    b"x-request-id",
    b"x-job-token",
    b"accept",
    b"content-length",
]
_CONTENT_TYPES = [
    b"application/json",
    b"application/msgpack",
    b"application/json; charset=utf-16",
    b"application/vnd.api+json",
    b"text/plain",
    b";;",
    b"json",
    b"",
]
_PATHS = [
    "/sync",
    "/async",
    "/stream",
    "/auto",
    "/jobs/abc",
    "/jobs/abc/result",
    "/jobs/abc/signals/go",
    "/callbacks/abc/go",
    "/admin/pool",
    "/admin/pool/keys/users",
    "/admin/reload",
    "/healthz",
    "/metrics",
    "/nowhere",
]
_BODIES = [
    b"",
    b"{}",
    b"null",
    b"[]",
    b'{"a": 1}',
    b'{"n": 18446744073709551616}',
    b'{"s": "\\udc80"}',
    b"[" * 200 + b"]" * 200,
    b'{"limit": 1.5}',
    b'{"limit": true}',
    b"\x81\xa1a\x01",
    "{}".encode("utf-16"),
]

_text = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=12)
_escape = st.integers(0, 255).map(lambda n: f"%{n:02X}")
_segment = st.lists(st.one_of(_text, _escape), max_size=4).map("".join)


@st.composite
def requests(draw: st.DrawFn) -> dict[str, Any]:
    method = draw(
        st.one_of(
            st.sampled_from(["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]),
            st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ-", min_size=1, max_size=8),
        )
    )
    path = draw(
        st.one_of(
            st.sampled_from(_PATHS),
            st.tuples(st.sampled_from(_PATHS), _segment).map(lambda p: p[0] + p[1]),
            _segment.map(lambda s: "/" + s.replace("?", "").replace("#", "")),
        )
    )
    query = draw(st.one_of(st.just(b""), st.binary(max_size=24), _segment.map(str.encode)))
    names = st.one_of(st.sampled_from(_INTERESTING_HEADERS), st.binary(min_size=1, max_size=12))
    values = st.one_of(
        st.binary(max_size=24),
        st.sampled_from(_CONTENT_TYPES),
        st.sampled_from(
            [
                b"wait=\xb2",
                b"respond-async, wait=1",
                b"Bearer " + TOKEN.encode(),
                b"Bearer \xc3\xa9",
            ]
        ),
    )
    headers = draw(st.lists(st.tuples(names.map(bytes.lower), values), max_size=5))
    if draw(st.booleans()):
        headers.append((b"content-type", draw(st.sampled_from(_CONTENT_TYPES))))
    body = draw(st.one_of(st.sampled_from(_BODIES), st.binary(max_size=48)))
    return {"method": method, "path": path, "query": query, "headers": headers, "body": body}


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


async def call(app: Any, request: dict[str, Any]) -> Answer:
    raw_path = request["path"].encode("ascii")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        # As hypercorn makes it: the raw path percent-decoded (with U+FFFD for bad UTF-8).
        "path": unquote(raw_path.decode("ascii")),
        "raw_path": raw_path,
        "query_string": request["query"],
        "root_path": "",
        "headers": [(b"host", b"test"), *request["headers"]],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
        "extensions": {},
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    start: dict[str, Any] = {}
    body = bytearray()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))

    await app(scope, receive, send)
    return Answer(start["status"], dict(start.get("headers", [])), bytes(body))


def make_engine() -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry, pool=pw.WeightedPool(8))

    @engine.pipe
    async def echo(ctx: pw.Context) -> None:
        await ctx.emit({"n": 1})

    engine.chain("echo", echo)
    for mode in ("sync", "async", "stream", "auto"):
        registry.route(mode, path=f"/{mode}", chain="echo", mode=mode, sync_wait=1.0)
    return engine


async def drive(batch: list[dict[str, Any]]) -> None:
    config = ContainerConfig(
        callback_secret=SECRET, admin_token=TOKEN, readiness_timeout=1.0, shutdown_grace=0.5
    )
    engine = make_engine()
    with trio.fail_after(HANG_GUARD):
        async with engine:
            app = Container(engine, config=config).app
            for request in batch:
                before = len(await engine.store.list())
                answer = await call(app, request)
                after = len(await engine.store.list())
                shown = f"{request!r} -> {answer.status} {answer.body[:300]!r}"
                assert answer.status != 500, shown
                if answer.status >= 400 and request["method"] != "HEAD":
                    assert answer.headers[b"content-type"] == b"application/problem+json", shown
                    document = json.loads(answer.body)
                    assert document["status"] == answer.status, shown
                if 400 <= answer.status < 500:
                    assert after == before, shown
            normal = {
                "method": "POST",
                "path": "/sync",
                "query": b"x=1",
                "headers": [(b"content-type", b"application/json")],
                "body": b'{"a": 1}',
            }
            answer = await call(app, normal)
            assert answer.status == 200, answer.body
            assert json.loads(answer.body) == {"a": 1, "x": "1"}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(requests(), min_size=1, max_size=12))
def test_no_request_gets_a_500_or_starts_a_job_it_refuses(batch: list[dict[str, Any]]) -> None:
    trio.run(drive, batch)
