"""Serve bench_edge's gateway in its own process.

``python -m benchmarks._edge_serve pipework --backend URL --jwks PATH`` writes the gateway
file :func:`gateway_text` declares (its service at ``URL``, its JWT auth verifying with the
JWKS file at ``PATH``), serves it with
:class:`pipework.Gateway` on 127.0.0.1 (a free port, no access log, logging at WARNING),
prints its base URL on stdout once it listens, and serves until terminated.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import trio

from ._serve import raise_open_files_limit
from .peers.serve import _announce

#: The same proxy route, bare and behind the edge's policies. ``/plain`` has none;
#: ``/limited`` meets a per-client rate limit so large it is never reached (the cost of
#: deciding it is what is measured); ``/limited-jwt`` the same limit after a JWT check.
ROUTES: dict[str, str] = {
    "plain": "",
    "limited": 'rate_limits = ["never-reached"]',
    "limited-jwt": 'rate_limits = ["never-reached"]\nauth = "bench"',
}
ISSUER = "https://issuer.bench.example"
AUDIENCE = "bench"


def gateway_text(backend: str, jwks: str) -> str:
    routes = "".join(
        f"""
[routes.{name}]
proxy = "backend"
prefix = "/{name}"
strip_prefix = true
{policy}
"""
        for name, policy in ROUTES.items()
    )
    return f"""
[auth.bench]
type = "jwt"
jwks_file = "{jwks}"
algorithms = ["ES256"]
issuer = "{ISSUER}"
audience = "{AUDIENCE}"

[services.backend]
base_url = "{backend}"
timeout = 5
reserve = 32

[rate_limits.never-reached]
rate = 1000000
burst = 1000000000
key = "client"
{routes}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._edge_serve")
    parser.add_argument("kind", choices=["pipework"])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--jwks", required=True)
    args = parser.parse_args(argv)
    raise_open_files_limit()
    logging.basicConfig(level=logging.WARNING)
    import pipework as pw

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "edge.toml")
        path.write_text(gateway_text(args.backend, args.jwks))
        gateway = pw.Gateway(str(path), overrides={"access_log": False})

        async def serve() -> None:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address = await nursery.start(
                    lambda task_status: gateway.run(port=0, stop=stop, task_status=task_status)
                )
                _announce(address.port)

        trio.run(serve)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
