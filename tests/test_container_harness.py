"""Shared helpers for the container tests: a real server on a free port, real clients.

Every container test runs hypercorn on a real socket through ``Container.serve`` and
talks to it with httpx or, where a test needs to see (or cut) the connection itself, with
a small h11 client over a bare trio socket. This module holds no tests of its own.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import h11
import httpx
import trio

import pipework as pw
from pipework.container import BoundAddress, Container, ContainerConfig

# Every test that waits on the network is bounded by this: a hang must fail, not stall.
HANG_GUARD = 10.0
SECRET = "test-callback-secret-0123456789"


@dataclass
class Served:
    container: Container
    address: BoundAddress
    client: httpx.AsyncClient
    stop: trio.Event

    @property
    def engine(self) -> pw.Engine:
        return self.container.engine


@asynccontextmanager
async def serving(
    engine: pw.Engine,
    *,
    config: ContainerConfig | None = None,
    routes: Sequence[pw.Route] | None = None,
    hypercorn_options: Mapping[str, object] | None = None,
) -> AsyncIterator[Served]:
    """Run ``engine`` and serve it for the body of the ``async with``; then shut down
    gracefully and wait for the server and the engine to stop."""
    config = config or ContainerConfig(callback_secret=SECRET, shutdown_grace=1.0)
    stop = trio.Event()
    async with engine:
        container = Container(engine, routes, config)
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(
                    container.serve, shutdown_trigger=stop, hypercorn_options=hypercorn_options
                )
            )
            try:
                async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as client:
                    yield Served(container, address, client, stop)
            finally:
                stop.set()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_no_content(response: httpx.Response) -> None:
    """A 204 has no body, so nothing describes one: no Content-Type, and no Content-Length
    (RFC 9110 §8.6: a server MUST NOT send it on a 204)."""
    assert response.content == b""
    assert "content-type" not in response.headers, response.headers
    assert "content-length" not in response.headers, response.headers


def assert_problem(
    response: httpx.Response, status: int, slug: str | None = None
) -> dict[str, Any]:
    """Check ``response`` is an RFC 9457 problem with ``status``; return its body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    expected_type = "about:blank" if slug is None else f"urn:pipework:problem:{slug}"
    assert body["type"] == expected_type, body
    assert body["title"]
    assert body["instance"].startswith("/")
    assert body["correlation_id"] == response.headers["x-request-id"]
    return body


def assert_raw_problem(
    answer: tuple[h11.Response, bytes], status: int, slug: str | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """``assert_problem`` for a response read with :class:`RawClient`: its body, and its
    headers by lowercase name."""
    response, data = answer
    headers = {name.decode().lower(): value.decode("latin-1") for name, value in response.headers}
    assert response.status_code == status, data
    assert headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(data)
    assert body["status"] == status
    expected_type = "about:blank" if slug is None else f"urn:pipework:problem:{slug}"
    assert body["type"] == expected_type, body
    assert body["title"]
    assert body["detail"]
    return body, headers


def sse_events(text: str) -> list[tuple[str, Any]]:
    """Parse a server-sent event stream into (event, decoded JSON data) pairs."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields["event"], json.loads(fields["data"])))
    return events


async def receive_response(
    conn: h11.Connection, stream: trio.abc.ReceiveStream
) -> tuple[h11.Response, bytes]:
    """One whole response read off ``stream`` through ``conn``."""
    response: h11.Response | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some()))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return response, bytes(body)
        else:
            raise AssertionError(f"unexpected h11 event {event!r}")


class RawClient:
    """HTTP/1.1 over a bare trio socket, parsed with h11: a test controls the connection
    (and can cut it) and can open thousands without a client library's pool."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(our_role=h11.CLIENT)

    async def send(
        self,
        method: str,
        target: str,
        *,
        body: bytes = b"",
        headers: Sequence[tuple[str | bytes, str | bytes]] = (),
    ) -> None:
        """Header values given as bytes go on the wire as they are (httpx would refuse
        bytes outside ASCII)."""
        fields = [
            (_raw(name), _raw(value))
            for name, value in [("Host", "test"), ("Content-Length", str(len(body))), *headers]
        ]
        data = self.conn.send(h11.Request(method=method, target=target, headers=fields))
        data += self.conn.send(h11.Data(data=body)) if body else b""
        data += self.conn.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    async def receive(self) -> tuple[h11.Response, bytes]:
        return await receive_response(self.conn, self.stream)

    async def receive_until(self, marker: bytes) -> bytes:
        """Raw bytes up to and including ``marker`` (for a response still streaming)."""
        data = bytearray()
        while marker not in data:
            chunk = await self.stream.receive_some()
            assert chunk, f"connection closed before {marker!r}"
            data += chunk
        return bytes(data)


def _raw(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("ascii")


@asynccontextmanager
async def raw_client(address: BoundAddress) -> AsyncIterator[RawClient]:
    async with await trio.open_tcp_stream(address.host, address.port) as stream:
        yield RawClient(stream)
