"""Serve the resilience benchmark's pipework gateway in its own process.

``python -m benchmarks.resilience.serve pipework --host URL --host URL --host URL [--hedge]
[--degrade URL] [--gc WHICH]`` serves ``gateway.toml`` beside this file with
:class:`pipework.Gateway` (what ``pipework serve gateway.toml --log-level WARNING`` runs) on
127.0.0.1 (a free port), its three hosts replaced by the ``--host`` URLs, prints its base URL
on stdout once it listens, and serves until terminated. ``--hedge`` adds hedged calls to the
service (``[services.replicas.hedge]``, :data:`HEDGE`). ``--degrade URL`` adds service B at
URL, route D whose ``all_of`` has an optional branch on it, and a route that holds B's
slots (:data:`DEGRADE`). ``--gc`` as for the peers' gateways (:mod:`benchmarks.peers.serve`):
pipework's serving thresholds by default.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import trio

from .._serve import raise_open_files_limit
from ..peers.serve import _announce, collector_overrides, gc_threshold

GATEWAY_FILE = Path(__file__).with_name("gateway.toml")
#: The hosts written in gateway.toml, which ``--host`` replaces in order.
FILE_HOSTS = ("http://127.0.0.1:9201", "http://127.0.0.1:9202", "http://127.0.0.1:9203")
#: The hedging scenario's table: a second try to another host once a call has waited the
#: service's p95 (of its last 200 answers), at most one per call.
HEDGE = """
[services.replicas.hedge]
delay = "p95"
max_extra = 1
"""
#: B's limit in the pool: the calls to B that may run at once, which the holding route's
#: calls take when the benchmark saturates B. As many as the load's connections, so that
#: route D alone (B free) always finds a slot of B.
B_LIMIT = 16
#: The degradation scenario's tables (``{b}``: B's URL): service B, limited to
#: :data:`B_LIMIT` slots; route D, whose ``all_of`` calls the replicas and B, B's branch
#: optional (a page that can be shown without it); and the other work that saturates B,
#: route ``/hold``'s calls, which hold a slot of B each for as long as B takes to answer.
DEGRADE = f"""
[services.b]
base_url = "{{b}}"
limit = {B_LIMIT}
timeout = 120

[pipes.call_b]
service = "b"
path = "/b"
into = "b"
optional = true
timeout = 1

[routes.d]
method = "GET"
path = "/d"
chain = [{{{{ all_of = ["call_replicas", "call_b"] }}}}]
result = "a"

[pipes.hold_b]
service = "b"
path = "/hold"
into = false

[routes.hold]
method = "GET"
path = "/hold"
chain = ["hold_b"]
timeout = 120
"""


#: The environment variable gateway.toml's ``admin_token_env`` names: the benchmark reads
#: the breaker's state through the admin API with it.
ADMIN_TOKEN_ENV: Final = "PIPEWORK_BENCH_ADMIN_TOKEN"


def admin_token() -> str:
    """The admin API's bearer token: this process's, made on first use and put in its
    environment, so that the gateway it starts reads the same."""
    return os.environ.setdefault(ADMIN_TOKEN_ENV, secrets.token_urlsafe(16))


def gateway_text(hosts: Sequence[str], *, hedge: bool = False, degrade: str | None = None) -> str:
    """gateway.toml with its hosts replaced (and the hedge table added with ``hedge``, the
    degradation scenario's tables with ``degrade``, B's URL)."""
    if len(hosts) != len(FILE_HOSTS):
        raise ValueError(f"{len(FILE_HOSTS)} hosts are needed, got {len(hosts)}")
    text = GATEWAY_FILE.read_text()
    for old, new in zip(FILE_HOSTS, hosts, strict=True):
        if text.count(f'"{old}"') != 1:
            raise RuntimeError(f"{GATEWAY_FILE} should name {old} exactly once")
        text = text.replace(f'"{old}"', f'"{new}"')
    text += HEDGE if hedge else ""
    return text + DEGRADE.format(b=degrade) if degrade is not None else text


def serve_pipework(
    hosts: Sequence[str], hedge: bool, degrade: str | None, young: int | None
) -> None:
    import pipework as pw

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "gateway.toml")
        path.write_text(gateway_text(hosts, hedge=hedge, degrade=degrade))
        # The container sets the collector while it serves (None: it leaves the
        # interpreter's); the command line has no option for it.
        gateway = pw.Gateway(str(path), overrides=collector_overrides(young))

        async def main() -> None:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address = await nursery.start(
                    lambda task_status: gateway.run(stop=stop, task_status=task_status)
                )
                _announce(address.port)

        trio.run(main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resilience.serve", description=__doc__
    )
    parser.add_argument("kind", choices=["pipework"], help="the gateway (pipework only)")
    parser.add_argument("--host", action="append", required=True, help="a replica's base URL")
    parser.add_argument("--hedge", action="store_true", help="hedge the calls")
    parser.add_argument("--degrade", metavar="URL", help="add service B at URL, and route D")
    parser.add_argument("--gc", choices=["serving", "interpreter"], default="serving")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    logging.basicConfig(level=logging.WARNING)
    serve_pipework(args.host, args.hedge, args.degrade, gc_threshold(args.gc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
