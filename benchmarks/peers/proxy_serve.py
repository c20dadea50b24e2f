"""Serve one of the proxy comparison's Python gateways in its own process.

``python -m benchmarks.peers.proxy_serve KIND --a URL --b URL --bulk URL [--gc WHICH]``
serves on 127.0.0.1 (a free port), prints its base URL on stdout once it listens, and
serves until terminated; paths under ``/a``, ``/b`` and ``/bulk`` go to the three services
as they came. Logging is at WARNING (no access lines). KIND is:

- ``pipework``: :class:`pipework.Gateway` serving ``proxy.toml`` beside this file (what
  ``pipework serve proxy.toml --log-level WARNING`` runs), its base URLs replaced;
- ``starlette``: :mod:`.starlette_proxy` on uvicorn (one process, its pure-Python
  defaults made explicit: the asyncio loop and h11);

``--http1 lean|hypercorn`` (pipework only): who serves its cleartext HTTP/1.1
(``[server] http1_server``; default pipework's own server).

``--gc serving`` (the default): the garbage collector as ``pipework serve`` sets it, the
young threshold 50,000 (``[server] gc_threshold``) and the start-up heap frozen
(``gc_freeze``), for every kind; ``--gc interpreter``: the interpreter's own thresholds
(700) and nothing frozen, for every kind. So the gateways differ only in their code.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from .._serve import raise_open_files_limit
from .serve import (
    BACKLOG,
    _announce,
    _listen,
    collector_overrides,
    gc_threshold,
    set_collector,
)

GATEWAY_FILE = Path(__file__).with_name("proxy.toml")
#: The base URLs written in proxy.toml, by the route's first path segment.
FILE_URLS = {
    "a": "http://127.0.0.1:9101",
    "b": "http://127.0.0.1:9102",
    "bulk": "http://127.0.0.1:9103",
}


def gateway_text(urls: Mapping[str, str]) -> str:
    """proxy.toml with its base URLs replaced (``urls``: by first path segment)."""
    text = GATEWAY_FILE.read_text()
    for segment, old in FILE_URLS.items():
        if text.count(f'"{old}"') != 1:
            raise RuntimeError(f"{GATEWAY_FILE} should name {old} exactly once")
        text = text.replace(f'"{old}"', f'"{urls[segment]}"')
    return text


def serve_pipework(urls: Mapping[str, str], young: int | None, http1: str | None = None) -> None:
    import pipework as pw

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "proxy.toml")
        path.write_text(gateway_text(urls))
        # The container sets the collector while it serves (None: it leaves the
        # interpreter's); the command line has no option for it.
        overrides: dict[str, Any] = collector_overrides(young)
        if http1 is not None:
            overrides["http1_server"] = http1
        gateway = pw.Gateway(str(path), overrides=overrides)

        async def main() -> None:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address = await nursery.start(
                    lambda task_status: gateway.run(stop=stop, task_status=task_status)
                )
                _announce(address.port)

        trio.run(main)


def serve_starlette(urls: Mapping[str, str], young: int | None) -> None:
    import uvicorn

    from .starlette_proxy import create_app

    set_collector(young)
    sock = _listen(0, reuse_port=False)
    config = uvicorn.Config(
        create_app(urls),
        loop="asyncio",
        http="h11",
        lifespan="on",
        access_log=False,
        log_level="warning",
        backlog=BACKLOG,
    )
    _announce(sock.getsockname()[1])
    uvicorn.Server(config).run(sockets=[sock])


SERVERS: dict[str, Any] = {
    "pipework": serve_pipework,
    "starlette": serve_starlette,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers.proxy_serve", description=__doc__
    )
    parser.add_argument("kind", choices=sorted(SERVERS))
    parser.add_argument("--a", required=True, help="base URL of the fast service")
    parser.add_argument("--b", required=True, help="base URL of the service that may hang")
    parser.add_argument("--bulk", required=True, help="base URL of the bulk service")
    parser.add_argument("--gc", choices=["serving", "interpreter"], default="serving")
    parser.add_argument("--http1", choices=["lean", "hypercorn"], default=None)
    args = parser.parse_args(argv)
    if args.http1 is not None and args.kind != "pipework":
        parser.error("--http1 is pipework's option")
    raise_open_files_limit()
    logging.basicConfig(level=logging.WARNING)
    urls = {"a": args.a, "b": args.b, "bulk": args.bulk}
    if args.http1 is not None:
        serve_pipework(urls, gc_threshold(args.gc), args.http1)
    else:
        SERVERS[args.kind](urls, gc_threshold(args.gc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
