"""The gateways of the published comparison (benchmarks/peers) build and answer, so the
benchmark cannot rot unnoticed: each runs in its own process against the raw trio backends,
on real sockets, and answers one request per route (no load, no timing)."""

from __future__ import annotations

import json

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
