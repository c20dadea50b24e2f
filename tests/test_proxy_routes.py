"""Proxy routes, served by a gateway from its file, against a real backend (hypercorn) and a
real client (httpx; curl for a streamed upload): what passes through, what is added and
removed, streaming both ways with bounded memory, hang-ups, timeouts, the pool's slot, the
route's chains, websockets and server-sent events."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from wsproto.events import BytesMessage, TextMessage

from pipework import Context, Gateway, WeightedPool
from pipework.container import BoundAddress

from ._proxy_backend import PATTERN, Backend, running_backend
from ._proxy_gateway import API, gateway, gateway_file
from ._raw_http import split_answers
from .test_proxy_websocket import Client

MB = 1024 * 1024


def rss() -> int:
    """This process's resident memory now, in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@asynccontextmanager
async def proxied(
    tmp_path: Path, routes: str = API, *, service: str = "", server: str = ""
) -> AsyncIterator[tuple[Backend, Gateway, httpx.AsyncClient]]:
    async with running_backend() as backend:
        text = gateway_file(backend, routes, service=service, server=server)
        async with (
            gateway(tmp_path, text) as (gw, address),
            httpx.AsyncClient(base_url=address.url, timeout=60) as client,
        ):
            yield backend, gw, client


def weighted_pool(gw: Gateway) -> WeightedPool:
    assert gw.engine is not None
    assert isinstance(gw.engine.pool, WeightedPool)
    return gw.engine.pool


def headers_of(seen: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, value in seen["headers"]:
        out.setdefault(name, []).append(value)
    return out


async def test_a_request_and_its_answer_pass_through_as_they_came(tmp_path: Path) -> None:
    body = bytes(range(256)) * 40
    async with proxied(tmp_path) as (backend, _, client):
        answer = await client.put(
            "/api/echo/a%2Fb?z=1&a=%20&a=2",
            content=body,
            headers={
                "Content-Type": "image/png",
                "Authorization": "Bearer secret",
                "Cookie": "session=abc",
                "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "tracestate": "vendor=opaque",
                "baggage": "user=7",
                "X-Custom": "kept",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "named by Connection",
                "Keep-Alive": "timeout=5",
                "X-Forwarded-For": "203.0.113.9",
            },
        )
    assert answer.status_code == 200, answer.text
    seen = answer.json()
    assert seen["method"] == "PUT"
    assert seen["raw_path"] == "/echo/a%2Fb"  # the prefix stripped, encoding kept
    assert seen["query"] == "z=1&a=%20&a=2"  # byte for byte
    assert seen["length"] == len(body)
    assert seen["sha256"] == hashlib.sha256(body).hexdigest()
    sent = headers_of(seen)
    for name, value in [
        ("content-type", "image/png"),
        ("authorization", "Bearer secret"),
        ("cookie", "session=abc"),
        ("tracestate", "vendor=opaque"),
        ("baggage", "user=7"),
        ("x-custom", "kept"),
    ]:
        assert sent[name] == [value], name
    assert sent["traceparent"][0].startswith("00-0af7651916cd43dd8448eb211c80319c-")
    for hop in ("x-hop", "keep-alive", "transfer-encoding"):
        assert hop not in sent, hop
    assert sent.get("connection", ["keep-alive"]) == ["keep-alive"]  # the proxy's own, if any
    assert sent["content-length"] == [str(len(body))]  # framed again by the proxy
    # The client is not a trusted proxy: what it claimed is replaced, not appended to.
    assert sent["x-forwarded-for"] == ["127.0.0.1"]
    assert sent["x-forwarded-proto"] == ["http"]
    assert sent["forwarded"][0].startswith("for=127.0.0.1")
    assert sent["via"][-1].endswith("pipework")
    assert sent["host"] == [f"127.0.0.1:{backend.port}"]  # the service's, by default
    assert sent["x-request-id"] == [answer.headers["x-request-id"]]
    # The answer: status, headers and body as the backend sent them, hop-by-hop removed.
    assert answer.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
    assert answer.headers["x-backend"] == "echo"
    assert "x-backend-hop" not in answer.headers
    assert answer.headers["via"].endswith("pipework")


async def test_a_trusted_proxy_is_appended_to_and_host_can_be_kept(tmp_path: Path) -> None:
    routes = API + 'host = "keep"\n'
    server = 'trusted_proxies = ["127.0.0.0/8"]'
    async with proxied(tmp_path, routes, server=server) as (_, _, client):
        answer = await client.get(
            "/api/echo",
            headers={"X-Forwarded-For": "203.0.113.9", "Host": "shop.example"},
        )
    sent = headers_of(answer.json())
    assert sent["x-forwarded-for"] == ["203.0.113.9, 127.0.0.1"]
    assert sent["host"] == ["shop.example"]


async def test_methods_prefix_and_rewrite(tmp_path: Path) -> None:
    routes = """
[routes.v2]
proxy = "echo"
prefix = "/v2/"
rewrite = "/echo/version-2"
methods = ["GET", "POST"]

[routes.whole]
proxy = "echo"
prefix = "/echo"
"""
    async with proxied(tmp_path, routes) as (_, _, client):
        assert (await client.get("/v2/x")).json()["raw_path"] == "/echo/version-2/x"
        assert (await client.get("/echo/y")).json()["raw_path"] == "/echo/y"
        refused = await client.delete("/v2/x")
        assert refused.status_code == 405
        assert refused.headers["allow"] == "GET, HEAD, POST"  # HEAD goes with GET
        assert refused.headers["content-type"] == "application/problem+json"
        # Never across a segment boundary, and the container's own paths stay its own.
        assert (await client.get("/v2x")).status_code == 404
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.head("/echo/z")).status_code == 200


# 1 GB through the gateway: a minute or more when the machine is busy.
@pytest.mark.hang_guard(real_seconds=300)
async def test_a_large_download_streams_with_flat_memory(tmp_path: Path) -> None:
    total = 1024 * MB
    async with proxied(tmp_path) as (backend, _, client):
        before, peak, got = rss(), 0, 0
        digest = hashlib.sha256()
        async with client.stream("GET", f"/api/download?n={total}") as answer:
            assert answer.status_code == 200
            assert answer.headers["content-length"] == str(total)
            async for chunk in answer.aiter_raw():
                if got % (16 * MB) < len(chunk):
                    peak = max(peak, rss() - before)
                    digest.update(chunk)
                got += len(chunk)
        assert got == total
        assert backend.sent == total
    assert peak < 48 * MB, f"memory grew by {peak / MB:.1f} MB while relaying 1 GB"


# 1 GB through the gateway: a minute or more when the machine is busy.
@pytest.mark.hang_guard(real_seconds=300)
async def test_a_large_upload_streams_with_flat_memory(tmp_path: Path) -> None:
    total = 1024 * MB
    digest = hashlib.sha256()
    piece = b"%x\r\n%b\r\n" % (len(PATTERN), PATTERN)  # one chunk of the chunked body
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, API)) as (_, address),
    ):
        before, peak, sent = rss(), 0, 0
        # A raw client: the upload is sent chunk by chunk as the gateway takes it.
        async with await trio.open_tcp_stream(address.host, address.port) as stream:
            head = b"POST /api/upload HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
            await stream.send_all(head)
            while sent < total:
                await stream.send_all(piece)
                digest.update(PATTERN)
                sent += len(PATTERN)
                if sent % (16 * MB) == 0:
                    peak = max(peak, rss() - before)
            await stream.send_all(b"0\r\n\r\n")
            seen = bytearray()
            answers: list[Any] = []
            while not answers:
                chunk = await stream.receive_some(65536)
                assert chunk, "the gateway closed the connection before answering"
                seen += chunk
                answers, _ = split_answers(bytes(seen))
    assert answers[0].status == 200, answers[0].body
    assert answers[0].json() == {"length": total, "sha256": digest.hexdigest()}
    assert backend.received == total
    assert peak < 48 * MB, f"memory grew by {peak / MB:.1f} MB while relaying 1 GB"


async def raw_get(address: BoundAddress, target: str) -> trio.SocketStream:
    """A connection that sent ``GET target`` and read nothing yet: for tests that read an
    answer in part (httpx's stream helpers leave generators behind when left early)."""
    stream = await trio.open_tcp_stream(address.host, address.port)
    await stream.send_all(f"GET {target} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    return stream


async def read_until(stream: trio.SocketStream, marker: bytes, seen: bytearray) -> None:
    while marker not in seen:
        chunk = await stream.receive_some(65536)
        assert chunk, f"the connection ended before {marker!r}"
        seen += chunk


async def test_a_slow_client_slows_the_backend_not_the_gateways_memory(tmp_path: Path) -> None:
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, API)) as (_, address),
    ):
        stream = await raw_get(address, f"/api/download?n={4096 * MB}&chunked=1")
        async with stream:
            await read_until(stream, b"\r\n\r\n", bytearray())
            # Nothing reads: every task ends up blocked, the backend in its send,
            # because socket buffers filled up; the gateway holds a few chunks.
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert backend.sent < 64 * MB, backend.sent


async def test_a_client_that_hangs_up_mid_stream_frees_the_backend_and_the_slot(
    tmp_path: Path,
) -> None:
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, API)) as (gw, address),
    ):
        stream = await raw_get(address, f"/api/download?n={4096 * MB}")
        async with stream:
            await read_until(stream, b"\r\n\r\n", bytearray())
        # The connection is closed with most of the answer unread.
        with trio.fail_after(30):
            await backend.gone.wait()
            pool = weighted_pool(gw)
            while pool.statistics().keys["echo"].in_use:
                await trio.testing.wait_all_tasks_blocked()


#: A route to a service nothing listens for (the discard port): each call is a 502.
UNREACHABLE = """
[services.nowhere]
base_url = "http://127.0.0.1:9"
timeout = 5

[routes.nowhere]
proxy = "nowhere"
prefix = "/nowhere"
"""


def _access_records(caplog: pytest.LogCaptureFixture) -> list[tuple[Any, Any, Any]]:
    return [
        (getattr(r, "path", None), getattr(r, "status", None), getattr(r, "client_gone", None))
        for r in caplog.records
        if r.name == "pipework.access"
    ]


async def test_an_answer_sent_whole_is_not_logged_as_a_hang_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The server reports the stream's end to the app as a disconnect once the answer went
    # out: that is no client going away, for the backend's answers nor the gateway's own.
    caplog.set_level(logging.INFO, logger="pipework.access")
    async with proxied(tmp_path, API + "max_body = 10\n" + UNREACHABLE) as (_, _, client):
        assert (await client.get("/api/echo/x")).status_code == 200
        assert (await client.get(f"/api/download?n={MB}")).content == (PATTERN * 16)
        assert (await client.put("/api/upload", content=b"x" * 11)).status_code == 413
        assert (await client.get("/nowhere/x")).status_code == 502
    # The gateway has stopped: every exchange has ended and been logged.
    assert _access_records(caplog) == [
        ("/api/echo/x", 200, False),
        ("/api/download", 200, False),
        ("/api/upload", 413, False),
        ("/nowhere/x", 502, False),
    ]


async def test_a_client_that_hangs_up_mid_answer_is_logged_as_gone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pipework.access")
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, API)) as (_, address),
    ):
        stream = await raw_get(address, f"/api/download?n={4096 * MB}")
        async with stream:
            await read_until(stream, b"\r\n\r\n", bytearray())
        with trio.fail_after(30):
            await backend.gone.wait()
    assert _access_records(caplog) == [("/api/download", 200, True)]


async def test_curl_streams_an_upload(tmp_path: Path) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.fail("curl is not installed: apt-get install curl")
    total = 64 * MB
    source = tmp_path / "upload.bin"
    with source.open("wb") as f:
        for _ in range(total // len(PATTERN)):
            f.write(PATTERN)
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, API)) as (_, address),
    ):
        done = await trio.run_process(
            [curl, "-sS", "-T", str(source), f"{address.url}/api/upload"],
            capture_stdout=True,
            capture_stderr=True,
        )
    answer = json.loads(done.stdout)
    assert answer == {"length": total, "sha256": hashlib.sha256(source.read_bytes()).hexdigest()}


async def test_backend_failures_are_problems(tmp_path: Path) -> None:
    routes = API + "first_byte_timeout = 0.5\n"
    async with proxied(tmp_path, routes) as (_, _, client):
        slow = await client.get("/api/hang")
        assert slow.status_code == 504, slow.text
        assert slow.json()["type"] == "urn:pipework:problem:deadline-exceeded"
        assert "echo" in slow.json()["detail"]
    closed = """
[services.nobody]
base_url = "http://127.0.0.1:9"
timeout = 2

[routes.nobody]
proxy = "nobody"
prefix = "/nobody"
"""
    async with proxied(tmp_path, closed) as (_, _, client):
        refused = await client.get("/nobody/x")
        assert refused.status_code == 502, refused.text
        assert refused.json()["type"] == "urn:pipework:problem:backend-failed"


async def test_a_proxied_call_holds_a_slot_of_its_services_key(tmp_path: Path) -> None:
    service = "limit = 1\nwait_timeout = 0.2\n"
    async with proxied(tmp_path, service=service) as (backend, _, client):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.get, "/api/hang")
            await backend.hung.wait()  # it holds the service's one slot
            refused = await client.get("/api/echo")
            assert refused.status_code == 503, refused.text
            assert "retry-after" in refused.headers
            nursery.cancel_scope.cancel()
        metrics = (await client.get("/metrics")).text
    assert 'pipework_proxy_responses_total{route="api",service="echo",status="503"} 1.0' in (
        metrics
    )


async def test_a_body_over_max_body_is_refused(tmp_path: Path) -> None:
    routes = API + "max_body = 1000\n"
    async with proxied(tmp_path, routes) as (_, _, client):
        declared = await client.post("/api/upload", content=b"x" * 1001)
        assert declared.status_code == 413
        assert declared.json()["type"] == "urn:pipework:problem:body-too-large"

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(4):
                yield b"y" * 600

        chunked = await client.post("/api/echo", content=chunks())
        assert chunked.status_code == 413
        assert (await client.post("/api/upload", content=b"x" * 1000)).status_code == 200


async def test_server_sent_events_are_relayed_as_they_come(tmp_path: Path) -> None:
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, API)) as (_, address),
    ):
        stream = await raw_get(address, "/api/sse")
        async with stream:
            seen = bytearray()
            await read_until(stream, b"\r\n\r\n", seen)
            assert b"content-type: text/event-stream" in seen.lower()
            for n in range(3):
                backend.release()  # the next event exists only once the last arrived
                await read_until(stream, f"id: {n}\ndata: event {n}\n\n".encode(), seen)


async def test_the_routes_chains_run_on_the_heads(tmp_path: Path) -> None:
    routes = (
        API
        + """chain = ["check"]
after = ["stamp"]

[pipes.check]
python = "tests.test_proxy_routes:check_request"

[pipes.stamp]
python = "tests.test_proxy_routes:stamp_answer"
"""
    )
    async with proxied(tmp_path, routes) as (_, _, client):
        refused = await client.get("/api/echo", headers={"X-Key": "wrong"})
        assert refused.status_code == 403, refused.text
        fine = await client.get("/api/echo", headers={"X-Key": "right"})
        assert fine.status_code == 200, fine.text
        sent = headers_of(fine.json())
        assert sent["x-checked"] == ["yes"]
        assert "x-key" not in sent
        assert fine.headers["x-stamped"] == "200"


class Forbidden(Exception):
    http_status = 403


async def check_request(ctx: Context) -> None:
    state = ctx.state
    headers = state["request"]["headers"]
    keys = [value for name, value in headers if name == "x-key"]
    if keys != ["right"]:
        raise Forbidden("the X-Key header is wrong")
    state["request"]["headers"] = [[n, v] for n, v in headers if n != "x-key"] + [
        ["x-checked", "yes"]
    ]


async def stamp_answer(ctx: Context) -> None:
    response = ctx.state["response"]
    response["headers"].append(["x-stamped", str(response["status"])])


async def test_a_websocket_under_a_proxy_prefix_is_relayed(tmp_path: Path) -> None:
    async with (
        running_backend() as backend,
        gateway(tmp_path, gateway_file(backend, API)) as (gw, address),
        Client.opening(address, "/api/chat") as ws,
    ):
        await ws.accepted()
        await ws.say(TextMessage("hello"), BytesMessage(b"\x00\x01"))
        assert await ws.message() == "hello"
        assert await ws.message() == b"\x00\x01"
        assert weighted_pool(gw).statistics().keys["echo"].in_use == 1  # its slot
        await ws.say(TextMessage("close 4002"))
        closed = await ws.closed()
        assert (closed.code, closed.reason) == (4002, "backend says")
