"""The gateway ``tests/test_server_fuzz.py`` serves with ``pipework serve``: every route
kind, a job that waits for a callback, a board, the admin API, and proxy routes. Its pipes
never fail, so any 5xx the fuzz test sees came from the server, not from a pipe; the proxy
routes' backends fail only on the paths meant to, so a proxy route's 502 or 504 comes
from there.

The backends run in a process of their own (``python -m tests._socket_fuzz_gateway
ECHO_FD BROKEN_FD``, on two listening sockets the test bound): ``echo``
(tests/_proxy_backend.py under pipework's server: echoes, streamed downloads and uploads,
websockets, ``/hang`` which never answers; never a 5xx) and ``broken``, which closes every
connection as soon as a request's head arrives.
"""

from __future__ import annotations

import functools
import socket
import sys
from typing import Any, cast

import trio

import pipework as pw
from pipework.container import serve

from ._proxy_backend import Backend

GATEWAY = """
[server]
host = "127.0.0.1"
port = 0
max_body = 65536
default_timeout = 30
shutdown_grace = 1
admin_token_env = "FUZZ_ADMIN_TOKEN"
callback_secret_env = "FUZZ_CALLBACK_SECRET"

[pool]
max_workers = 32

[pipes.echo]
python = "tests._socket_fuzz_gateway:echo"

[pipes.chunks]
python = "tests._socket_fuzz_gateway:chunks"

[pipes.hand_out_callback]
python = "tests._socket_fuzz_gateway:hand_out_callback"

[pipes.wait_for_go]
python = "tests._socket_fuzz_gateway:wait_for_go"

[routes.sync]
path = "/sync"
chain = ["echo"]

[routes.read]
method = "GET"
path = "/items/{item}"
chain = ["echo"]

[routes.put]
method = "PUT"
path = "/items/{item}"
chain = ["echo"]

[routes.async]
path = "/async"
mode = "async"
chain = ["echo"]

[routes.stream]
path = "/stream"
mode = "stream"
chain = ["chunks"]

[routes.auto]
path = "/auto"
mode = "auto"
sync_wait = 1
chain = ["echo"]

[routes.wait]
path = "/wait"
mode = "async"
timeout = 3600
chain = ["hand_out_callback", "wait_for_go", "echo"]

[boards.notes]
public_read = true
write_token_env = "FUZZ_BOARD_TOKEN"
keepalive = 1
long_poll = 1
"""

# Proxy routes, to the backends' addresses (``gateway_file``): every request under
# /proxy to echo; /hang to echo's /hang, which never answers (a 504 after its first-byte
# timeout); /broken to the backend that hangs up (a 502).
PROXY = """
[services.echo]
base_url = "ECHO_URL"
timeout = 10
limit = 8

[services.broken]
base_url = "BROKEN_URL"
timeout = 10
limit = 4

[routes.proxy]
proxy = "echo"
prefix = "/proxy"
strip_prefix = true
max_body = 65536

[routes.proxy_hang]
proxy = "echo"
prefix = "/hang"
first_byte_timeout = 0.2

[routes.proxy_broken]
proxy = "broken"
prefix = "/broken"
"""

#: The prefixes of the proxy routes: a 502, 503 or 504 for a path under them is the
#: backend's failure (or the pool's refusal of its slot), told as a problem.
PROXY_PREFIXES = ("/proxy", "/hang", "/broken")


def gateway_file(echo_url: str, broken_url: str) -> str:
    """The gateway's file, its proxy routes to the backends at these URLs."""
    return GATEWAY + PROXY.replace("ECHO_URL", echo_url).replace("BROKEN_URL", broken_url)


ADMIN_TOKEN = "fuzz-admin-token-0123456789"
BOARD_TOKEN = "fuzz-board-token-0123456789"
CALLBACK_SECRET = "fuzz-callback-secret-0123456789"
ENVIRONMENT = {
    "FUZZ_ADMIN_TOKEN": ADMIN_TOKEN,
    "FUZZ_BOARD_TOKEN": BOARD_TOKEN,
    "FUZZ_CALLBACK_SECRET": CALLBACK_SECRET,
}


async def echo(ctx: pw.Context) -> None:
    ctx.state["echoed"] = True


async def chunks(ctx: pw.Context) -> None:
    for n in range(3):
        await ctx.emit({"n": n})


async def hand_out_callback(ctx: pw.Context) -> None:
    await ctx.progress(0, 1, ctx.callback_url("go", ttl=3600))


async def wait_for_go(ctx: pw.Context) -> None:
    await ctx.suspend("go", timeout=3600)


# -- the backends (``python -m tests._socket_fuzz_gateway ECHO_FD BROKEN_FD``) ----------

#: What the backends' process prints once it serves.
BACKENDS_READY = "fuzz backends serving"


async def _hang_up(stream: trio.SocketStream) -> None:
    """The broken backend: reads a request's head, then closes the connection."""
    async with stream:
        seen = b""
        while b"\r\n\r\n" not in seen:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return
            seen += chunk


async def serve_backends(echo_fd: int, broken_fd: int) -> None:
    """Serve the backends on two listening sockets the process inherited (bound by the
    test, so that the gateway's file can name them before this process has started)."""
    backend = Backend()
    app = cast(Any, backend.app)  # an ASGI app, typed loosely as each framework's are
    broken = trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=broken_fd)))
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, app, fd=echo_fd))
        nursery.start_soon(trio.serve_listeners, _hang_up, [broken])
        print(BACKENDS_READY, flush=True)


if __name__ == "__main__":
    trio.run(serve_backends, int(sys.argv[1]), int(sys.argv[2]))
