"""The peers' two-route gateway as most Python users would write it: Starlette on uvicorn,
one shared ``httpx.AsyncClient`` for every backend, and no bulkheads (httpx's default pool
of 100 connections is shared by both routes)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

#: The same per-call time limit as the pipework gateway's services.
TIMEOUT = 5.0


def create_app(a_url: str, b_url: str) -> Starlette:
    client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal client
        async with httpx.AsyncClient(timeout=TIMEOUT) as opened:
            client = opened
            yield

    async def call(url: str) -> JSONResponse:
        assert client is not None
        try:
            answer = await client.get(url)
            answer.raise_for_status()
        except httpx.TimeoutException:
            return JSONResponse({"error": "backend timed out"}, status_code=504)
        except httpx.HTTPError:
            return JSONResponse({"error": "backend failed"}, status_code=502)
        return JSONResponse(answer.json())

    async def route_a(request: Request) -> JSONResponse:
        return await call(f"{a_url}/a")

    async def route_b(request: Request) -> JSONResponse:
        return await call(f"{b_url}/b")

    return Starlette(routes=[Route("/a", route_a), Route("/b", route_b)], lifespan=lifespan)
