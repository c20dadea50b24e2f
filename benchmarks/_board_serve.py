"""A push-board server in its own process: ``python -m benchmarks._board_serve KIND``.

- ``pipework``: an engine and its container with a public board ``bench`` (write token
  ``bench``, a 10 ms batch window, room for 20,000 followers);
- ``bare``: a bare quart-trio app with ``GET /sse`` (an SSE stream sending ``hello`` and
  then every broadcast) and ``POST /publish`` (broadcast the body to every stream), on the
  same server function with the same options.

``--gc serving`` (the default): the garbage collector's young threshold is the one a
container serves with (``pipework.container._collector``), for both kinds, so the two
differ only in their code; ``--gc interpreter``: the interpreter's own thresholds, for both.

Prints its base URL once it listens, then serves until killed.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import AsyncIterator

import trio
from quart import Response, request
from quart_trio import QuartTrio

import pipework as pw
from pipework.board import BoardSettings, BoardSpec
from pipework.container._collector import SERVING_GC_THRESHOLD, tuned_collector
from pipework.container._server import serve

from ._serve import HYPERCORN_OPTIONS, raise_open_files_limit

LIMIT = 20_000


class _Broadcast:
    def __init__(self) -> None:
        self.event = trio.Event()
        self.data = b""


def bare_app() -> QuartTrio:
    app = QuartTrio(__name__)
    state = _Broadcast()

    @app.route("/sse")
    async def sse() -> Response:
        async def body() -> AsyncIterator[bytes]:
            yield b"event: hello\ndata: {}\n\n"
            while True:
                await state.event.wait()
                yield b"event: update\ndata: " + state.data + b"\n\n"

        response = Response(body(), content_type="text/event-stream")
        response.timeout = None
        return response

    @app.route("/publish", methods=["POST"])
    async def publish() -> Response:
        body = await request.get_data()
        state.data = body if isinstance(body, bytes) else body.encode()
        old, state.event = state.event, trio.Event()
        old.set()
        return Response(b"", status=204)

    return app


async def _serve(kind: str, gc_threshold: int | None) -> None:
    if kind == "pipework":
        engine = pw.Engine(registry=pw.Registry())
        settings = BoardSettings(
            window=0.01, max_followers=LIMIT, max_per_resource=LIMIT, max_queue=16
        )
        spec = BoardSpec("bench", settings, write_token="bench", public_read=True)
        config = pw.ContainerConfig(gc_threshold=gc_threshold)
        container = pw.Container(engine, config=config, boards=[spec])
        async with engine, trio.open_nursery() as nursery:
            address = await nursery.start(
                functools.partial(container.serve, hypercorn_options=HYPERCORN_OPTIONS)
            )
            print(address.url, flush=True)
    else:
        with tuned_collector(gc_threshold):
            async with trio.open_nursery() as nursery:
                address = await nursery.start(
                    functools.partial(serve, bare_app(), hypercorn_options=HYPERCORN_OPTIONS)
                )
                print(address.url, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._board_serve")
    parser.add_argument("kind", choices=["pipework", "bare"])
    parser.add_argument("--gc", choices=["serving", "interpreter"], default="serving")
    args = parser.parse_args(argv)
    raise_open_files_limit()
    trio.run(_serve, args.kind, SERVING_GC_THRESHOLD if args.gc == "serving" else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
