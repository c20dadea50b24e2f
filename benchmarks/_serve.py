"""One benchmark server in its own process, so it does not share a GIL with the load.

``python -m benchmarks._serve KIND`` serves on a free port of 127.0.0.1, prints its base URL
on stdout once it listens, and serves until killed. KIND is:

- ``pipework``: an engine and its container (hypercorn's trio worker), with a 1-pipe sync
  route ``POST /echo`` and a sync route ``POST /park`` whose first pipe suspends for signal
  ``go`` (the request parks holding no worker) and whose second answers; with
  ``--backend URL`` also a sync route ``POST /call`` whose one pipe is the built-in HTTP
  pipe calling ``GET URL/x`` (the answer is the route's); with ``--trace-to URL``, tracing
  on (the SDK, every trace sampled, spans batched and exported over OTLP/HTTP to
  ``URL/v1/traces``);
- ``bare``: the bare quart-trio app of :mod:`benchmarks._bare_app` on the same server
  function with the same options and the same garbage-collector threshold a container
  serves with (``ContainerConfig.gc_threshold``), so the two differ only in their code;
- ``raw``: a raw trio-socket HTTP responder (the load generator's ceiling).
- ``raw-tls``: the same behind TLS (``--cert``, ``--key``), for the clients' https cost.

Every kind answers ``n * 2`` to a body ``{"n": n}``. The pipework and bare servers also
serve ``GET /_bench/parked`` and ``POST /_bench/release`` for the parking scenario.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import ssl
import sys
from contextlib import AsyncExitStack

import trio
from quart import Response

import pipework as pw
from pipework import _tracing
from pipework.__main__ import configure_logging
from pipework.backends._http_template import Template
from pipework.container._collector import SERVING_GC_THRESHOLD, tuned_collector
from pipework.container._server import BoundAddress, serve

from ._bare_app import create_bare_app, raw_responder

#: Enough for every connection of the parking scenario to wait in the accept queue.
HYPERCORN_OPTIONS = {"backlog": 4096}
#: Far beyond the scenario's own length: the parked jobs must not reach their deadline.
PARK_TIMEOUT = 900.0


def raise_open_files_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns the new limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def _backend_route(engine: pw.Engine, registry: pw.Registry, url: str) -> pw.Backends:
    backends = pw.Backends([pw.Service("backend", url, timeout=5.0, max_connections=64)])
    backends.metrics = engine.metrics
    call = pw.HttpCall("backend", Template.parse("/x"), into="x")
    registry.add_pipe(pw.http_pipe("call_backend", call, backends))
    engine.chain("call", "call_backend", result="x")
    registry.route("call", path="/call", chain="call")
    return backends


def _pipework_container(
    parked_capacity: int, backend: str | None = None
) -> tuple[pw.Container, pw.Backends | None]:
    # Releasing the parked jobs resumes them all at once: they queue for the 64 workers,
    # for longer than the pool's default wait timeout (10 s) when there are thousands.
    weights = pw.Weights(max_waiting=parked_capacity, wait_timeout=PARK_TIMEOUT)
    registry = pw.Registry()
    engine = pw.Engine(
        registry=registry,
        pool=pw.WeightedPool(64, default=weights),
        queue_capacity=2 * parked_capacity,
    )

    @engine.pipe
    async def echo(ctx: pw.Context) -> None:
        await trio.lowlevel.checkpoint()
        ctx.state["answer"] = ctx.state["n"] * 2

    @engine.pipe
    async def wait_for_go(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    @engine.pipe
    async def answer(ctx: pw.Context) -> None:
        ctx.state["answer"] = ctx.state["n"] * 2

    engine.chain("echo", echo, result="answer")
    engine.chain("park", wait_for_go, answer, result="answer")
    registry.route("echo", path="/echo", chain="echo")
    registry.route("park", path="/park", chain="park", timeout=PARK_TIMEOUT)
    backends = None if backend is None else _backend_route(engine, registry, backend)
    container = pw.Container(engine, config=pw.ContainerConfig(gc_threshold=SERVING_GC_THRESHOLD))

    async def parked() -> Response:
        suspended = await engine.store.list(pw.Status.SUSPENDED)
        body = {"parked": container.parking.parked, "suspended": len(suspended)}
        return Response(json.dumps(body), content_type="application/json")

    async def release() -> Response:
        suspended = await engine.store.list(pw.Status.SUSPENDED)
        for job in suspended:
            await engine.signal(job.id, "go")
        return Response(json.dumps({"released": len(suspended)}), content_type="application/json")

    container.app.add_url_rule("/_bench/parked", "bench_parked", parked, methods=["GET"])
    container.app.add_url_rule("/_bench/release", "bench_release", release, methods=["POST"])
    return container, backends


def _announce(address: BoundAddress) -> None:
    print(address.url, flush=True)


async def _serve_pipework(parked_capacity: int, backend: str | None, trace_to: str | None) -> None:
    if trace_to is not None:  # before the container is built: its ASGI layer comes with it
        from pipework._tracing_otel import build

        _tracing.install(build(endpoint=f"{trace_to}/v1/traces", sample_ratio=1.0))
    container, backends = _pipework_container(parked_capacity, backend)
    async with AsyncExitStack() as stack:
        if backends is not None:
            await stack.enter_async_context(backends)
        await stack.enter_async_context(container.engine)
        nursery = await stack.enter_async_context(trio.open_nursery())
        address = await nursery.start(
            functools.partial(container.serve, hypercorn_options=HYPERCORN_OPTIONS)
        )
        _announce(address)


async def _serve_bare() -> None:
    with tuned_collector(SERVING_GC_THRESHOLD):
        async with trio.open_nursery() as nursery:
            address = await nursery.start(
                functools.partial(serve, create_bare_app(), hypercorn_options=HYPERCORN_OPTIONS)
            )
            _announce(address)


async def _serve_raw(cert: str | None = None, key: str | None = None) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
    host, port = listeners[0].socket.getsockname()[:2]
    async with trio.open_nursery() as nursery:
        if cert is not None and key is not None:  # raw-tls: the same responder behind TLS
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(cert, key)
            secure = [trio.SSLListener(listener, context) for listener in listeners]
            nursery.start_soon(trio.serve_listeners, raw_responder(), secure)
        else:
            nursery.start_soon(trio.serve_listeners, raw_responder(), listeners)
        _announce(BoundAddress(host, port))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._serve", description=__doc__)
    parser.add_argument("kind", choices=["pipework", "bare", "raw", "raw-tls"])
    parser.add_argument("--cert", help="raw-tls: the server's certificate (PEM)")
    parser.add_argument("--key", help="raw-tls: its key (PEM)")
    parser.add_argument("--parked", type=int, default=20_000, help="parked jobs to allow")
    parser.add_argument("--backend", help="pipework: serve POST /call, calling GET BACKEND/x")
    parser.add_argument(
        "--log",
        choices=["text", "json"],
        help="pipework: log as `pipework serve` does by default (INFO, the access log on) "
        "to stderr, in this format; without it nothing is logged",
    )
    parser.add_argument("--trace-to", help="pipework: tracing on, exported to this OTLP URL")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    if args.log is not None:
        configure_logging(args.log, "INFO")
    if args.kind == "pipework":
        trio.run(_serve_pipework, args.parked, args.backend, args.trace_to)
    elif args.kind == "bare":
        trio.run(_serve_bare)
    elif args.kind == "raw-tls":
        trio.run(_serve_raw, args.cert, args.key)
    else:
        trio.run(_serve_raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
