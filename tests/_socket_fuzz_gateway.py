"""The gateway ``tests/test_server_fuzz.py`` serves with ``pipework serve``: every route
kind, a job that waits for a callback, a board, the admin API. Its pipes never fail, so
any 5xx the fuzz test sees came from the server, not from a pipe."""

from __future__ import annotations

import pipework as pw

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
