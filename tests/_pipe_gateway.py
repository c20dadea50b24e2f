"""A gateway from a file, served for the tests of what HTTP pipes send, with its pipes
calling through either backend client: the lean one, or httpx (over the network all the
same)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import httpx
import trio

import pipework as pw
from pipework import WeightedPool, build_registry, loads_config

from ._recording_backend import Received, RecordingBackend
from .test_container_harness import Served, serving

__all__ = [
    "CLIENTS",
    "ECHO_PIPE",
    "GO_ROUTE",
    "HANG_GUARD",
    "TRACEPARENT",
    "call_once",
    "gateway",
    "one_pipe",
    "served_gateway",
]

HANG_GUARD = 10.0
CLIENTS = ["lean", "httpx"]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def gateway(url: str, pipes: str, routes: str) -> str:
    return f"""
[pool]
max_workers = 8

[services.api]
base_url = "{url}"
timeout = 5
headers = {{ X-Service = "service", X-Key = "service" }}

{pipes}

{routes}
"""


@asynccontextmanager
async def served_gateway(client: str, text: str) -> AsyncIterator[tuple[Served, pw.GatewayConfig]]:
    """The gateway ``text`` declares, served; its HTTP pipes call through ``client``."""
    config = loads_config(text)
    backends = config.backends(transport=httpx.AsyncHTTPTransport() if client == "httpx" else None)
    engine = pw.Engine(
        registry=build_registry(config, backends),
        pool=WeightedPool.from_config(config.pool_config()),
    )
    async with backends, serving(engine) as served:
        yield served, config


async def call_once(
    client: str,
    text: str,
    backend: RecordingBackend,
    headers: Sequence[tuple[str, str]],
    path: str = "/go",
) -> tuple[httpx.Response, list[Received]]:
    with trio.fail_after(HANG_GUARD):
        async with served_gateway(client, text) as (served, _):
            answer = await served.client.get(path, headers=list(headers))
    return answer, backend.received


ECHO_PIPE = """
[pipes.call]
service = "api"
path = "/echo"
into = "echo"
{extra}
"""
GO_ROUTE = """
[routes.go]
method = "GET"
path = "/go"
chain = {chain}
result = "echo"
"""


def one_pipe(url: str, extra: str, chain: str = '["call"]') -> str:
    return gateway(url, ECHO_PIPE.format(extra=extra), GO_ROUTE.format(chain=chain))
