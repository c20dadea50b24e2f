"""The proxy comparison's gateways (benchmarks/bench_proxy.py, benchmarks/peers) build and
pass requests through, so the benchmark cannot rot unnoticed: each runs in its own process
(nginx and HAProxy from their generated configurations) against the raw trio backends, on
real sockets, and passes a small GET and ten streamed downloads and uploads at once,
measured as the benchmark measures them (no load, no timing)."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from benchmarks import _load, bench_proxy
from benchmarks.peers import proxy_serve

SIZE = 1 << 20


def test_the_gateway_file_names_each_backend_once() -> None:
    urls = {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2", "bulk": "http://127.0.0.1:3"}
    text = proxy_serve.gateway_text(urls)
    for url in urls.values():
        assert text.count(f'"{url}"') == 1


def test_every_gateway_passes_small_and_streamed_requests(tmp_path: Path) -> None:
    upload = tmp_path / "upload.bin"
    upload.write_bytes(b"x" * SIZE)
    with bench_proxy.started(bench_proxy.GATEWAYS) as (_, _, servers):
        assert set(servers) == {gateway.name for gateway in bench_proxy.GATEWAYS}
        for name, served in servers.items():
            request = _load.get_request("/a")
            status, body = trio.run(_load.call, served.host, served.port, request)
            assert (name, status, json.loads(body)) == (name, 200, {"service": "A", "ok": True})
            for direction in ("down", "up"):
                run = trio.run(bench_proxy.streams, served, direction, SIZE, upload)
                assert (name, direction, run.failed, run.ok, run.moved) == (
                    name,
                    direction,
                    [],
                    bench_proxy.STREAMS,
                    bench_proxy.STREAMS * SIZE,
                )
                assert run.rss_peak_kb >= run.rss_before_kb > 0
