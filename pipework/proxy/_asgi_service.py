"""The exchange with the service, once a proxied request is let through: a slot of its
key, the stream to the service (in a client span when tracing is on), the route's ``chain``
on the request's head and ``after`` on the answer's, and the answer relayed as it arrives.

A part of :class:`~._asgi.ProxyLayer` (a base it is made of), in a module of its own so the
layer reads in one sitting; what comes before (authentication, limits, the body's size, the
service's refusal, the deadline) and the accounting after stay in :mod:`._asgi`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import trio

from .. import _tracing
from .._http._auth import IDENTITY_STATE_KEY
from .._http._problems import Problem, problem_for_exception
from ..backends._failures import TransportFailure
from ..backends._stream import StreamTimeouts, UpstreamAnswer
from ..dispatcher._admission import Admission
from ._exchange import Exchange, from_pairs, to_pairs
from ._forwarding import response_headers
from ._relay import ASGISend, Upload
from ._upstream import Upstream

__all__ = ["ChainRunner", "ServiceExchange"]


class ChainRunner(Protocol):
    """What runs a route's ``chain``/``after``: the engine (``Engine.run``)."""

    async def run(self, chain: str, state: dict[str, Any] | None = None, **kwargs: Any) -> Any: ...


class ServiceExchange:
    """The layer's exchange under its slot and the route's chains."""

    # Made by ProxyLayer.__init__.
    pool: Admission
    chains: ChainRunner
    # ProxyLayer's: a problem answered in place of the service's answer.
    _refuse: Callable[[Exchange, ASGISend, Problem], Awaitable[None]]

    async def _relay(
        self,
        ex: Exchange,
        client: Upstream,
        target: bytes,
        forwarded: list[tuple[bytes, bytes]],
        upload: Upload | None,
        length: int | None,
        timeouts: StreamTimeouts,
        deadline: float,
        send: ASGISend,
    ) -> None:
        route = ex.route
        key = route.pool_key
        tracing = _tracing.ACTIVE
        if tracing.on:
            tracing.event("slot wait", {"pipework.key": key})
        # The wait for a slot ends at the deadline or the key's own wait timeout.
        async with self.pool.slot(key, deadline=deadline):
            if tracing.on:
                tracing.event("slot granted", {"pipework.key": key})
                await self._traced(ex, client, target, forwarded, upload, length, timeouts, send)
            else:
                await self._stream(ex, client, target, forwarded, upload, length, timeouts, send)

    async def _stream(
        self,
        ex: Exchange,
        client: Upstream,
        target: bytes,
        forwarded: list[tuple[bytes, bytes]],
        upload: Upload | None,
        length: int | None,
        timeouts: StreamTimeouts,
        send: ASGISend,
    ) -> None:
        """The exchange with the service, under the key's slot: its answer relayed."""
        key = ex.route.pool_key
        asked = trio.current_time()
        stream = client.client.stream(
            ex.method.encode(), target, forwarded, upload, length=length, timeouts=timeouts
        )
        try:
            async with stream as answer:
                ex.upstream = answer.status
                ex.host, ex.retries = answer.host, answer.retries
                latency = trio.current_time() - asked
                self.pool.record(key, ok=answer.status < 500, latency=latency)
                await self._answer(ex, answer, send)
        except TransportFailure:
            self.pool.record(key, ok=False, latency=trio.current_time() - asked)
            raise

    async def _traced(
        self,
        ex: Exchange,
        client: Upstream,
        target: bytes,
        forwarded: list[tuple[bytes, bytes]],
        upload: Upload | None,
        length: int | None,
        timeouts: StreamTimeouts,
        send: ASGISend,
    ) -> None:
        """The exchange under its slot, with tracing on: in a client span (the server
        span's child) whose ``traceparent`` and ``tracestate`` the service gets in place
        of the client's."""
        route = ex.route
        span = _tracing.ACTIVE.start(
            f"{ex.method} {route.service}",
            "client",
            {
                "http.request.method": ex.method,
                "pipework.service": route.service,
                "pipework.route": route.name,
            },
        )
        error: BaseException | None = None
        try:
            traceparent, tracestate = span.headers()
            forwarded = [
                (name, value)
                for name, value in forwarded
                if name.lower() not in (b"traceparent", b"tracestate")
            ]
            if traceparent is not None:
                forwarded.append((b"traceparent", traceparent.encode()))
                if tracestate is not None:
                    forwarded.append((b"tracestate", tracestate.encode()))
            await self._stream(ex, client, target, forwarded, upload, length, timeouts, send)
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else None  # a cancel is no failure
            raise
        finally:
            if ex.upstream is not None:
                span.set("http.response.status_code", ex.upstream)
            span.end(error)

    async def _answer(self, ex: Exchange, answer: UpstreamAnswer, send: ASGISend) -> None:
        status, headers = answer.status, response_headers(answer.headers)
        if ex.route.after is not None:
            edited = await self._after(ex, ex.route.after, status, headers, send)
            if edited is None:
                return
            status, headers = edited
        headers.append((b"x-request-id", ex.correlation_id.encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        ex.status = status
        async for chunk in answer.body():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            ex.sent += len(chunk)
        ex.answered = True  # before the last message: the server reports the end meanwhile
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- the route's chains --------------------------------------------------------------

    async def _before(
        self,
        ex: Exchange,
        chain: str,
        scope: MutableMapping[str, Any],
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        send: ASGISend,
    ) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
        """Run ``chain`` on the request's head: the target and headers it leaves, or None
        when it refused (answered)."""
        request = {
            "method": ex.method,
            "path": ex.path,
            "target": target.decode("latin-1"),
            "headers": to_pairs(headers),
            "client": None if scope.get("client") is None else scope["client"][0],
        }
        start: dict[str, Any] = {"request": request}
        if ex.identity is not None:  # the route's chain sees who the caller is
            start[IDENTITY_STATE_KEY] = ex.identity.state()
        state = await self._run(ex, chain, start, send)
        if state is None:
            return None
        edited = state.get("request", request)
        return (
            str(edited.get("target", request["target"])).encode("latin-1"),
            from_pairs(edited.get("headers", request["headers"])),
        )

    async def _after(
        self,
        ex: Exchange,
        chain: str,
        status: int,
        headers: list[tuple[bytes, bytes]],
        send: ASGISend,
    ) -> tuple[int, list[tuple[bytes, bytes]]] | None:
        response = {"status": status, "headers": to_pairs(headers)}
        state = await self._run(ex, chain, {"response": response}, send)
        if state is None:
            return None
        edited = state.get("response", response)
        return int(edited.get("status", status)), from_pairs(edited.get("headers", []))

    async def _run(
        self, ex: Exchange, chain: str, state: dict[str, Any], send: ASGISend
    ) -> dict[str, Any] | None:
        try:
            result = await self.chains.run(chain, state, correlation_id=ex.correlation_id)
        except Exception as exc:  # the job's own error, raised by Engine.run
            await self._refuse(ex, send, problem_for_exception(exc))
            return None
        return result if isinstance(result, dict) else state
