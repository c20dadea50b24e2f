"""The published comparisons' gateways and backends (run by ``benchmarks/bench_peers.py``
and ``benchmarks/bench_proxy.py``).

bench_peers: one two-route gateway, written three ways: ``gateway.toml`` (pipework),
:mod:`.starlette_gateway` (Starlette on uvicorn) and :mod:`.flask_gateway` (Flask on
waitress); :mod:`.serve` runs any of them in its own process and :mod:`.backend` is the
raw trio backend they call.

bench_proxy: three routes passed through as they came, by ``proxy.toml`` (pipework's proxy
routes), :mod:`.starlette_proxy` (Starlette + httpx on uvicorn) and nginx and HAProxy
(:mod:`.native`); :mod:`.proxy_serve` runs the Python ones (pipework on either of its
HTTP/1.1 servers); :mod:`.bulk_backend` sends and swallows the large bodies.
"""
