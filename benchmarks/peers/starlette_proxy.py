"""A reverse proxy as a Python user would write one by hand: Starlette on uvicorn and one
shared ``httpx.AsyncClient``, streaming both ways (the request's body is sent on while it
arrives, the answer relayed while it arrives), no bulkheads.

Every request whose first path segment names a service goes to that service as it came
(method, path, query, body), without the hop-by-hop headers and ``Host``; the answer comes
back without its hop-by-hop headers. A timeout is a 504, another transport failure a 502.
The client's pool keeps as many connections alive as it may open (httpx's default keeps 20
of its 100), so that no connection is closed after each use under a few dozen clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

#: The same per-call time limit as the other gateways' (each read, here).
TIMEOUT = 5.0
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def create_app(services: Mapping[str, str]) -> Starlette:
    """``services``: a path's first segment -> the base URL of the service it goes to."""
    client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal client
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as opened:
            client = opened
            yield

    async def proxy(request: Request) -> Response:
        assert client is not None
        path = request.url.path
        base = services.get(path.split("/", 2)[1])
        if base is None:
            return JSONResponse({"error": f"{path} is not proxied"}, status_code=404)
        query = request.url.query
        url = base + path + (f"?{query}" if query else "")
        headers = [
            (name, value)
            for name, value in request.headers.raw
            if name not in HOP_BY_HOP and name != b"host"
        ]
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        outgoing = client.build_request(
            request.method, url, headers=headers, content=request.stream() if has_body else None
        )
        try:
            answer = await client.send(outgoing, stream=True)
        except httpx.TimeoutException:
            return JSONResponse({"error": "backend timed out"}, status_code=504)
        except httpx.HTTPError:
            return JSONResponse({"error": "backend failed"}, status_code=502)
        response = StreamingResponse(
            answer.aiter_raw(),
            status_code=answer.status_code,
            background=BackgroundTask(answer.aclose),
        )
        response.raw_headers = [
            (name, value) for name, value in answer.headers.raw if name.lower() not in HOP_BY_HOP
        ]
        return response

    routes = [Route("/{path:path}", proxy, methods=METHODS)]
    return Starlette(routes=routes, lifespan=lifespan)
