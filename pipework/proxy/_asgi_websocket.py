"""A websocket under a proxy route: authenticated, rate-limited and given a slot of its
service's key as a request is, then relayed to the service's for as long as it stays open.

A part of :class:`~._asgi.ProxyLayer` (a base it is made of), in a module of its own so the
layer reads in one sitting; the relay itself is :mod:`._websocket`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .._errors import PipeworkError
from .._http._auth import Identity, RouteAuth
from .._http._problems import Problem
from .._http._ratelimit import RateLimits
from .._metrics import Metrics
from ..dispatcher._admission import Admission
from ._access import access_logger, log_access
from ._exchange import correlation_id_of, sent_target, stream_timeouts
from ._forwarding import response_headers
from ._proxies import ProxySet
from ._relay import ASGIReceive, ASGISend
from ._route import BadTarget, ProxyRoute
from ._upstream import Upstream
from ._websocket import relay_websocket
from ._websocket_core import WebsocketOutcome

__all__ = ["WebsocketRoutes"]


class WebsocketRoutes:
    """The layer's :meth:`_serve_websocket`."""

    # Made by ProxyLayer.__init__.
    rate_limits: RateLimits | None
    pool: Admission
    metrics: Metrics
    access_log: bool
    # ProxyLayer's: the caller's identity, the head sent on, the set in use, the access
    # line's client fields.
    _authenticate: Callable[[RouteAuth, MutableMapping[str, Any]], Awaitable[Identity]]
    _head_out: Callable[
        [ProxyRoute, Upstream, MutableMapping[str, Any], str],
        tuple[bytes, list[tuple[bytes, bytes]]],
    ]
    _using: Callable[[ProxySet], contextlib.AbstractContextManager[None]]
    _who: Callable[[MutableMapping[str, Any]], dict[str, Any]]

    async def _serve_websocket(
        self,
        route: ProxyRoute,
        proxies: ProxySet,
        scope: MutableMapping[str, Any],
        receive: ASGIReceive,
        send: ASGISend,
    ) -> None:
        """Relay a websocket to the service's; the connection holds a slot of its key for
        as long as it stays open."""
        client = proxies.clients[route.service]
        correlation_id = correlation_id_of(scope)
        started = time.perf_counter()
        outcome: WebsocketOutcome | None = None
        # The service's call (a WebsocketCall: its module imports httpx, the proxy does not),
        # for the access line's host.
        connected: list[Any] = []
        try:
            auth = proxies.auth.get(route.name)
            if auth is not None:
                try:
                    await self._authenticate(auth, scope)
                except Problem as refused:  # refused before the handshake is accepted
                    await send({"type": "websocket.close", "code": 1008})
                    outcome = WebsocketOutcome(refused.status, detail=refused.detail)
                    return
            try:
                target = sent_target(route, scope)
            except BadTarget:
                await send({"type": "websocket.close", "code": 1008})  # not proxied
                outcome = WebsocketOutcome(403, detail="the path may not be proxied")
                return
            limits = self.rate_limits
            met = None if limits is None else limits.routes.get(route.name)
            if met:
                assert limits is not None
                too_many = await limits.check(met, scope)
                if too_many is not None:  # before the slot, as for a request
                    await send({"type": "websocket.close", "code": 1013})
                    outcome = WebsocketOutcome(too_many.status, detail=too_many.detail)
                    return
            host, forwarded = self._head_out(route, client, scope, correlation_id)
            timeouts = stream_timeouts(route, client)
            with self._using(proxies):
                refusal = client.client.refusal()
                if refusal is not None:  # no slot waited for, as for a request
                    raise refusal
                async with (
                    self.pool.slot(route.pool_key),
                    client.client.websocket(timeouts.connect) as call,
                ):
                    connected.append(call)
                    outcome = await relay_websocket(
                        scope,
                        receive,
                        send,
                        connect=call.connect,
                        target=target,
                        host=functools.partial(call.host, host),
                        headers=forwarded,
                        idle_timeout=route.idle_timeout,
                        handshake_timeout=timeouts.first_byte,
                        service=route.service,
                        correlation_id=correlation_id,
                        answer_filter=response_headers,
                        handshake_done=call.handshake_done,
                    )
        except* PipeworkError:  # the pool or the service's breaker refused, before the handshake
            await send({"type": "websocket.close", "code": 1013})
            outcome = WebsocketOutcome(
                503, detail="no slot for the service's key, or its breaker open"
            )
        finally:
            status = "none" if outcome is None or outcome.status is None else str(outcome.status)
            self.metrics.proxy_responses.labels(route.name, route.service, status).inc()
            duration = time.perf_counter() - started
            self.metrics.proxy_duration.labels(route.name, route.service).observe(duration)
            if self.access_log and access_logger.isEnabledFor(logging.INFO):
                log_access(
                    {
                        **self._who(scope),
                        "method": "GET",
                        "path": scope["path"],
                        "status": None if outcome is None else outcome.status,
                        "duration": round(duration, 6),
                        "correlation_id": correlation_id,
                        "route": route.name,
                        "service": route.service,
                        "host": connected[0].netloc if connected else None,
                        "close_code": None if outcome is None else outcome.close_code,
                    }
                )
