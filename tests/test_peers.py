"""The gateways of the published comparison (benchmarks/peers) build and answer, so the
benchmark cannot rot unnoticed: each runs in its own process against the raw trio backends,
on real sockets, and answers one request per route (no load, no timing)."""

from __future__ import annotations

import json
import socket
import struct

import trio

from benchmarks import _load, bench_peers
from benchmarks.peers import serve


def test_the_gateway_file_names_both_backends_once() -> None:
    text = serve.gateway_text("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert '"http://127.0.0.1:1"' in text
    assert '"http://127.0.0.1:2"' in text


def test_every_peer_answers_both_routes() -> None:
    with bench_peers.started(bench_peers.PEERS) as (_, _, peers):
        for name, served in peers.items():
            for route, service in (("/a", "A"), ("/b", "B")):
                request = _load.get_request(route)
                status, body = trio.run(_load.call, served.host, served.port, request)
                assert (name, status, json.loads(body)) == (
                    name,
                    200,
                    {"service": service, "ok": True},
                )


async def waiting(backend: _load.Server) -> int:
    """How many requests the backend holds now."""
    return int(json.loads((await bench_peers._get(backend, "/_stats"))[1])["waiting"])


def test_a_hanging_backend_outlives_a_caller_that_resets_its_connection() -> None:
    # HAProxy resets its connection to a server that timed out (bench_proxy's hang scenario).
    async def main(backend: _load.Server) -> None:
        await bench_peers.set_mode(backend, "hang")
        stream = await trio.open_tcp_stream(backend.host, backend.port)
        await stream.send_all(_load.get_request("/b"))
        while await waiting(backend) < 1:  # noqa: ASYNC110 - another process: no event to wait on
            await trio.sleep(0.05)
        # Closing with a zero linger time sends a reset instead of a FIN.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()
        while await waiting(backend) > 0:  # noqa: ASYNC110 - another process: no event to wait on
            await trio.sleep(0.05)
        await bench_peers.set_mode(backend, "fast")
        assert await bench_peers._get(backend, "/b") == (200, b'{"service": "B", "ok": true}')

    with _load.server("B", module=bench_peers.BACKEND) as backend:
        trio.run(main, backend)
