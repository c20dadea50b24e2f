"""The published comparison's gateways and backends (run by ``benchmarks/bench_peers.py``).

One two-route gateway, written three ways: ``gateway.toml`` (pipework),
:mod:`.starlette_gateway` (Starlette on uvicorn) and :mod:`.flask_gateway` (Flask on
waitress); :mod:`.serve` runs any of them in its own process and :mod:`.backend` is the
raw trio backend they call.
"""
