"""Serve one of the peers' gateways in its own process.

``python -m benchmarks.peers.serve KIND --a URL --b URL [--port P] [--reuse-port]
[--threads N] [--workers N] [--one-core]`` serves on 127.0.0.1 (port 0: a free one), prints its base
URL on stdout once it listens, and serves until terminated. Logging is at WARNING for
every kind, so no gateway writes an access line per request. KIND is:

- ``pipework``: :mod:`pipework.Gateway` serving ``gateway.toml`` beside this file (the
  same as ``pipework serve gateway.toml --log-level WARNING``), its two base URLs
  replaced by ``--a`` and ``--b``; with ``--workers N``, that very command with
  ``--workers N`` in a child process (N worker processes on one listening socket,
  supervised by the command's own process);
- ``starlette``: :mod:`.starlette_gateway` on uvicorn (one process, its pure-Python
  defaults made explicit: the asyncio loop and h11);
- ``flask``: :mod:`.flask_gateway` on waitress with ``--threads`` threads (its
  ``connection_limit`` raised from 100 to 1,000, so that every client connects and the
  thread pool alone decides who is served). With ``--one-core`` the process is pinned to
  one CPU (``os.sched_setaffinity``): on two idle cores its threads otherwise contend for
  the GIL across cores and serve a tenth as much (docs/benchmarks.md, bench_peers).

``--gc serving`` (the default): every kind runs with the garbage collector as ``pipework
serve`` sets it (the young threshold 50,000, ``[server] gc_threshold``, and the start-up heap
frozen, ``gc_freeze``), set in the Starlette and Flask processes too, so the gateways differ
only in their code; ``--gc interpreter``: every kind with the interpreter's own thresholds
(700) and nothing frozen (not with pipework's ``--workers``, whose command line has no such
option).

``--reuse-port`` binds with ``SO_REUSEPORT``, so that several processes serve one port
(the kernel spreads new connections across them): start the first with port 0 and the
others on the port it printed. For pipework this sets hypercorn's ``Config.workers``
class attribute, the only switch hypercorn has for ``SO_REUSEPORT`` (its trio ``serve``
otherwise ignores ``workers``, with a warning silenced here), since ``pipework serve``
has no option for it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import trio

from .._serve import raise_open_files_limit

HOST = "127.0.0.1"
GATEWAY_FILE = Path(__file__).with_name("gateway.toml")
#: The base URLs written in gateway.toml, which ``--a`` and ``--b`` replace.
FILE_URLS = ("http://127.0.0.1:9101", "http://127.0.0.1:9102")
BACKLOG = 4096


def gateway_text(a_url: str, b_url: str) -> str:
    """gateway.toml with its two base URLs replaced."""
    text = GATEWAY_FILE.read_text()
    for old, new in zip(FILE_URLS, (a_url, b_url), strict=True):
        if text.count(f'"{old}"') != 1:
            raise RuntimeError(f"{GATEWAY_FILE} should name {old} exactly once")
        text = text.replace(f'"{old}"', f'"{new}"')
    return text


def _listen(port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((HOST, port))
    sock.listen(BACKLOG)
    return sock


def _announce(port: int) -> None:
    print(f"http://{HOST}:{port}", flush=True)


def gc_threshold(which: str) -> int | None:
    """The young threshold for ``--gc WHICH`` (None: the interpreter's own)."""
    from pipework.container._collector import SERVING_GC_THRESHOLD

    return SERVING_GC_THRESHOLD if which == "serving" else None


def set_collector(young: int | None) -> None:
    """Set this process's collector as ``pipework serve`` sets its own: the young threshold
    ``young`` and the heap frozen as it is now, start-up done (None: leave the
    interpreter's collector alone, as pipework's ``--gc interpreter`` does)."""
    if young is not None:
        gc.set_threshold(young, *gc.get_threshold()[1:])
        gc.freeze()


def collector_overrides(young: int | None) -> dict[str, Any]:
    """pipework's file settings for the same collector: ``[server] gc_threshold`` and
    ``gc_freeze`` (both off with None)."""
    return {"gc_threshold": young, "gc_freeze": young is not None}


def serve_pipework(a_url: str, b_url: str, port: int, reuse_port: bool, young: int | None) -> None:
    import hypercorn.config

    import pipework as pw

    if reuse_port:
        hypercorn.config.Config.workers = 2  # any value above 1 sets SO_REUSEPORT
        warnings.filterwarnings("ignore", "The config `workers` has no affect")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "gateway.toml")
        path.write_text(gateway_text(a_url, b_url))
        # The container sets the collector while it serves (None: it leaves the
        # interpreter's); the command line has no option for it.
        gateway = pw.Gateway(str(path), overrides=collector_overrides(young))

        async def main() -> None:
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address = await nursery.start(
                    lambda task_status: gateway.run(
                        host=HOST, port=port, stop=stop, task_status=task_status
                    )
                )
                _announce(address.port)

        trio.run(main)


def serve_pipework_workers(a_url: str, b_url: str, port: int, workers: int) -> None:
    """``pipework serve FILE --workers N`` as a child process, until terminated."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "gateway.toml")
        path.write_text(gateway_text(a_url, b_url))
        command = [sys.executable, "-m", "pipework", "serve", str(path), "--host", HOST]
        command += ["--port", str(port), "--workers", str(workers), "--log-level", "WARNING"]
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM))
        assert child.stderr is not None
        for line in child.stderr:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
            if line.startswith(b"pipework serving on "):
                _announce(int(line.split()[3].rsplit(b":", 1)[1]))
                break
        # Keep the pipe drained: a worker blocked on a full stderr would stall its requests.
        copier = threading.Thread(
            target=shutil.copyfileobj, args=(child.stderr, sys.stderr.buffer), daemon=True
        )
        copier.start()
        child.wait()


def serve_starlette(a_url: str, b_url: str, port: int, reuse_port: bool, young: int | None) -> None:
    import uvicorn

    from .starlette_gateway import create_app

    set_collector(young)
    sock = _listen(port, reuse_port)
    config = uvicorn.Config(
        create_app(a_url, b_url),
        loop="asyncio",
        http="h11",
        lifespan="on",
        access_log=False,
        log_level="warning",
        backlog=BACKLOG,
    )
    _announce(sock.getsockname()[1])
    uvicorn.Server(config).run(sockets=[sock])


def serve_flask(
    a_url: str, b_url: str, port: int, reuse_port: bool, threads: int, young: int | None
) -> None:
    import waitress

    from .flask_gateway import create_app

    set_collector(young)
    sock = _listen(port, reuse_port)
    server = waitress.create_server(
        create_app(a_url, b_url),
        sockets=[sock],
        threads=threads,
        connection_limit=1000,
        backlog=BACKLOG,
    )
    _announce(sock.getsockname()[1])
    server.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers.serve", description=__doc__)
    parser.add_argument("kind", choices=["pipework", "starlette", "flask"])
    parser.add_argument("--a", required=True, help="base URL of the fast service")
    parser.add_argument("--b", required=True, help="base URL of the service that may hang")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reuse-port", action="store_true")
    parser.add_argument("--threads", type=int, default=4, help="flask: waitress's threads")
    parser.add_argument("--workers", type=int, default=1, help="pipework: serve --workers N")
    parser.add_argument("--one-core", action="store_true", help="flask: pin to one CPU")
    parser.add_argument(
        "--gc",
        choices=["serving", "interpreter"],
        default="serving",
        help="the garbage collector's thresholds, for every kind: pipework's serving ones "
        "(young 50,000) or the interpreter's (700)",
    )
    args = parser.parse_args(argv)
    young = gc_threshold(args.gc)
    raise_open_files_limit()
    if args.one_core:
        if args.kind != "flask":
            parser.error("--one-core is for flask")
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    logging.basicConfig(level=logging.WARNING)
    if args.kind == "pipework" and args.workers > 1:
        if young is None:
            parser.error("--gc interpreter is not for pipework's --workers")
        serve_pipework_workers(args.a, args.b, args.port, args.workers)
    elif args.kind == "pipework":
        serve_pipework(args.a, args.b, args.port, args.reuse_port, young)
    elif args.kind == "starlette":
        serve_starlette(args.a, args.b, args.port, args.reuse_port, young)
    else:
        serve_flask(args.a, args.b, args.port, args.reuse_port, args.threads, young)
    return 0


if __name__ == "__main__":
    sys.exit(main())
