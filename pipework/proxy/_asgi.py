"""Proxy routes, served in front of Quart: a request under a proxy route's prefix goes to
its service as it came, and the answer comes back as it came, streamed both ways.

:class:`ProxyLayer` is an ASGI app around the container's own: a path under no proxy prefix
goes on to Quart untouched; one under a prefix never builds Quart's request objects. What a
proxied request passes through, in order:

1. its id (``X-Request-ID``, the client's when well-formed) and its deadline (the route's
   ``timeout``; none by default, the idle timeout bounds a stalled stream);
2. a declared ``Content-Length`` above ``max_body`` is a 413 before anything else;
3. the route's ``chain`` (if any) on the request's head, which may edit the headers and
   the target, or refuse (its error's status and problem);
4. the service's resilience core asked whether it refuses calls now (its breaker open,
   every host drained): if so, a 503 with ``Retry-After`` at once, no slot waited for and
   nothing of the body read;
5. a slot of the service's pool key, held until the answer's last byte: a refusal is a 503
   with ``Retry-After``, as for any route;
6. the exchange (:meth:`Upstream.client.stream`) through the service's resilience core: a
   host picked for the request, a refusal by a breaker that opened meanwhile a 503 with
   ``Retry-After``, a try retried by the service's rules while nothing of the body was
   read; the body sent while it arrives, the answer's head awaited, its latency (retries
   included) recorded for the key's adaptive limit;
7. the ``after`` chain (if any) on the answer's head (status and headers);
8. the answer relayed while it arrives; a client that goes away cancels the exchange.

Before the answer's head is sent, a failure is a problem answer (502 for the backend, 504
for a timeout, 413, 503); after it, the connection is closed mid-body, which is how HTTP
tells a client that an answer was cut short.

The layer is made of bases in modules of their own, so each reads in one sitting: the
route's chains (steps 3 and 7) and steps 5 to 8 are :mod:`._asgi_service`'s, a websocket
is :mod:`._asgi_websocket`'s, and one request's record and the small rules it goes by are
in :mod:`._exchange`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, MutableMapping
from ipaddress import IPv4Network, IPv6Network
from typing import Any

import trio

from .. import _tracing
from .._errors import DeadlineExceeded, PipeworkError
from .._http._auth import Identity, RouteAuth, put_identity
from .._http._cors import CorsPolicy, PreflightRefused, header_pairs
from .._http._problems import Problem, problem_for_exception
from .._http._ratelimit import RateLimits
from .._metrics import Metrics
from ..backends._failures import TransportFailure
from ..dispatcher._admission import Admission
from ._access import (
    ALWAYS_REDACTED,
    DEFAULT_REDACTED,
    access_logger,
    client_address,
    header,
    log_access,
    redacted_query,
    trace_id,
)
from ._asgi_service import ChainRunner, ServiceExchange
from ._asgi_websocket import WebsocketRoutes
from ._exchange import (
    PREFLIGHT_HEADERS,
    Exchange,
    body_framing,
    correlation_id_of,
    failure_problem,
    first_leaf,
    log_cut,
    lower_name,
    raw_header,
    sent_target,
    stream_timeouts,
    too_large,
    with_cors,
)
from ._forwarding import Peer, request_headers
from ._proxies import ProxySet
from ._relay import (
    ASGIReceive,
    ASGISend,
    BodyTooLarge,
    ClientGone,
    Upload,
    send_problem,
    watch_disconnect,
)
from ._route import BadTarget, ProxyMiss, ProxyRoute
from ._upstream import Upstream

__all__ = ["ProxyLayer"]

#: The app behind (Quart's): typed loosely, as each framework types its own messages.
ASGIApp = Callable[..., Awaitable[None]]


class ProxyLayer(WebsocketRoutes, ServiceExchange):
    """The ASGI app: proxy routes here, every other request to ``app``."""

    def __init__(
        self,
        app: ASGIApp,
        proxies: ProxySet,
        *,
        pool: Admission,
        chains: ChainRunner,
        metrics: Metrics,
        trusted: tuple[IPv4Network | IPv6Network, ...] = (),
        access_log: bool = True,
        redact: Collection[str] = frozenset(DEFAULT_REDACTED),
        rate_limits: RateLimits | None = None,
    ) -> None:
        self.app = app
        #: The rate limits in force (None: none); the container swaps them at a reload.
        self.rate_limits = rate_limits
        self.proxies = proxies
        self.pool = pool
        self.chains = chains
        self.metrics = metrics
        self.trusted = trusted
        self.access_log = access_log
        #: Query parameters whose values the access log hides (lower-case names).
        self.redact = frozenset(name.lower() for name in redact) | ALWAYS_REDACTED
        # Exchanges under way by the set they started with (its id): a replaced set's
        # clients close once its count is back to zero.
        self._users: dict[int, int] = {}
        self._released: dict[int, trio.Event] = {}

    def set_proxies(self, proxies: ProxySet) -> None:
        """Swap the routes and their clients in one step (a reload); exchanges under way
        keep the set they started with."""
        self.proxies = proxies

    async def wait_released(self, proxies: ProxySet) -> None:
        """Return once no exchange uses ``proxies`` (a replaced set: its clients may then
        close)."""
        while self._users.get(id(proxies)):
            event = self._released.setdefault(id(proxies), trio.Event())
            await event.wait()

    @contextlib.contextmanager
    def _using(self, proxies: ProxySet) -> Iterator[None]:
        key = id(proxies)
        self._users[key] = self._users.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._users[key] = self._users[key] - 1
            if not left:
                del self._users[key]
                event = self._released.pop(key, None)
                if event is not None:
                    event.set()

    def __call__(
        self, scope: MutableMapping[str, Any], receive: ASGIReceive, send: ASGISend
    ) -> Awaitable[None]:
        kind = scope["type"]
        proxies = self.proxies
        if proxies.table and kind == "http":
            method = scope["method"]
            if method == "OPTIONS" and proxies.cors:
                asked = raw_header(scope["headers"], b"access-control-request-method")
                if asked is not None and raw_header(scope["headers"], b"origin") is not None:
                    hit = proxies.table.match(scope["path"], asked.decode("latin-1").strip())
                    if isinstance(hit, ProxyRoute) and hit.name in proxies.cors:
                        return self._preflight(proxies.cors[hit.name], scope, send)
            hit = proxies.table.match(scope["path"], method)
            if hit is not None:
                if isinstance(hit, ProxyRoute) and hit.name in proxies.cors:
                    send = with_cors(send, proxies.cors[hit.name], scope)
                return self._serve(hit, proxies, scope, receive, send)
        elif proxies.table and kind == "websocket":
            hit = proxies.table.match(scope["path"], "GET")
            if isinstance(hit, ProxyRoute) and hit.websocket:
                return self._serve_websocket(hit, proxies, scope, receive, send)
        return self.app(scope, receive, send)

    async def _preflight(
        self, cors: CorsPolicy, scope: MutableMapping[str, Any], send: ASGISend
    ) -> None:
        """A CORS preflight on a route with a policy: answered here, without the service,
        a slot or authentication (a preflight carries no credentials)."""
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope["headers"]
            if name.lower() in PREFLIGHT_HEADERS
        }
        try:
            found = cors.preflight(
                headers["origin"],
                headers["access-control-request-method"],
                headers.get("access-control-request-headers"),
            )
        except PreflightRefused as exc:
            problem = Problem(
                403, "Forbidden", str(exc), slug="cors-refused", headers={"Vary": "Origin"}
            )
            await send_problem(
                send, problem, correlation_id=correlation_id_of(scope), instance=scope["path"]
            )
            return
        pairs = [*header_pairs(found), (b"x-request-id", correlation_id_of(scope).encode())]
        await send({"type": "http.response.start", "status": 204, "headers": pairs})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _authenticate(self, auth: RouteAuth, scope: MutableMapping[str, Any]) -> Identity:
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in reversed(scope["headers"])  # the first of a name wins
        }
        identity = await auth.authenticate(headers)
        put_identity(scope, identity)
        return identity

    async def _serve(
        self,
        hit: ProxyRoute | ProxyMiss,
        proxies: ProxySet,
        scope: MutableMapping[str, Any],
        receive: ASGIReceive,
        send: ASGISend,
    ) -> None:
        correlation_id = correlation_id_of(scope)
        path = scope["path"]
        if isinstance(hit, ProxyMiss):
            allow = ", ".join(sorted(hit.allow))
            problem = Problem(
                405,
                "Method Not Allowed",
                f"{scope['method']} is not proxied on {path}; allowed: {allow}",
                headers={"Allow": allow},
            )
            started = time.perf_counter()
            await send_problem(send, problem, correlation_id=correlation_id, instance=path)
            if self.access_log and access_logger.isEnabledFor(logging.INFO):
                log_access(
                    {
                        **self._who(scope),
                        "method": scope["method"],
                        "path": path,
                        "status": 405,
                        "duration": round(time.perf_counter() - started, 6),
                        "correlation_id": correlation_id,
                    }
                )
            return
        exchange = Exchange(hit, correlation_id, scope["method"], path, time.perf_counter(), scope)
        tracing = _tracing.ACTIVE
        if tracing.on:  # the request's server span, named by its route
            tracing.rename(f"{scope['method']} {hit.prefix}")
            tracing.annotate("http.route", hit.prefix)
            tracing.annotate("pipework.route", hit.name)
            tracing.annotate("pipework.service", hit.service)
        try:
            with self._using(proxies):
                await self._exchange(exchange, proxies, scope, receive, send)
        finally:
            self._account(exchange)

    async def _exchange(
        self,
        ex: Exchange,
        proxies: ProxySet,
        scope: MutableMapping[str, Any],
        receive: ASGIReceive,
        send: ASGISend,
    ) -> None:
        route = ex.route
        auth = proxies.auth.get(route.name)
        if auth is not None:  # first: its identity keys the limits
            try:
                ex.identity = await self._authenticate(auth, scope)
            except Problem as refused:
                await self._refuse(ex, send, refused)
                return
        limits = self.rate_limits
        if limits is not None:
            # Before the body, the chain, the service and a slot.
            met = limits.routes.get(route.name)
            if met:
                too_many = await limits.check(met, scope)
                if too_many is not None:
                    await self._refuse(ex, send, too_many)
                    return
        client = proxies.clients[route.service]
        deadline = math.inf if route.timeout is None else trio.current_time() + route.timeout
        incoming: list[tuple[bytes, bytes]] = scope["headers"]
        length, has_body = body_framing(incoming, ex.method)
        if route.max_body is not None and length is not None and length > route.max_body:
            await self._refuse(ex, send, too_large(BodyTooLarge(route.max_body)))
            return
        try:
            target = sent_target(route, scope)
        except BadTarget as exc:
            problem = Problem(400, "Bad Request", str(exc), slug="malformed-request")
            await self._refuse(ex, send, problem)
            return
        forwarded = None
        if route.chain is not None:
            _, forwarded = self._head_out(route, client, scope, ex.correlation_id)
            edited = await self._before(ex, route.chain, scope, target, forwarded, send)
            if edited is None:
                return
            target, forwarded = edited
        upload = ex.upload = Upload(receive, route.max_body) if has_body else None
        refusal = client.client.refusal()
        if refusal is not None:
            # The service refuses calls now (its breaker open, every host drained): the
            # same answer its call would get, before a slot of the key is waited for or
            # anything of the body read (docs/resilience.md).
            await self._refuse(ex, send, failure_problem(route, refusal))
            return
        if forwarded is None:
            _, forwarded = self._head_out(route, client, scope, ex.correlation_id)
        timeouts = stream_timeouts(route, client)
        with trio.CancelScope(deadline=deadline) as deadline_scope:
            async with trio.open_nursery() as nursery:

                def gone() -> None:
                    # Once the answer's last message is handed over, the server reports
                    # the stream's end as a disconnect: that is no client going away.
                    if not ex.answered:
                        ex.client_gone = True
                        nursery.cancel_scope.cancel()

                nursery.start_soon(watch_disconnect, receive, upload, gone)
                try:
                    await self._relay(
                        ex, client, target, forwarded, upload, length, timeouts, deadline, send
                    )
                except* ClientGone:
                    ex.client_gone = True
                except* BodyTooLarge as group:
                    if ex.status is None:
                        await self._refuse(ex, send, too_large(first_leaf(group)))
                except* (TransportFailure, PipeworkError) as group:
                    failure = first_leaf(group)
                    if isinstance(failure, TransportFailure) and failure.host is not None:
                        ex.host, ex.retries = failure.host, failure.retries
                    if ex.status is None:
                        await self._refuse(ex, send, failure_problem(route, failure))
                    else:
                        log_cut(ex, failure)
                nursery.cancel_scope.cancel()
        if deadline_scope.cancelled_caught and ex.status is None and not ex.client_gone:
            problem = problem_for_exception(
                DeadlineExceeded(
                    f"proxy route {route.name!r}: the exchange with service {route.service!r} "
                    f"did not end within the route's timeout={route.timeout:g}s",
                    scope="job",
                )
            )
            await self._refuse(ex, send, problem)

    def _head_out(
        self,
        route: ProxyRoute,
        client: Upstream,
        scope: MutableMapping[str, Any],
        correlation_id: str,
    ) -> tuple[bytes, list[tuple[bytes, bytes]]]:
        """The ``Host`` and headers sent on (its target: :func:`sent_target`)."""
        kept = raw_header(scope["headers"], b"host") if route.host == "keep" else None
        host = kept or client.netloc
        forwarded = request_headers(
            scope["headers"],
            peer=Peer.from_scope(scope),
            trusted=self.trusted,
            host=host,
            request_id=correlation_id.encode(),
            request_id_header=lower_name(client.request_id_header),
        )
        return host, forwarded

    # -- answers and accounting ----------------------------------------------------------

    async def _refuse(self, ex: Exchange, send: ASGISend, problem: Problem) -> None:
        ex.answered = True
        ex.status = await send_problem(
            send, problem, correlation_id=ex.correlation_id, instance=ex.path
        )

    def _account(self, ex: Exchange) -> None:
        route = ex.route
        status = "none" if ex.status is None else str(ex.status)
        duration = time.perf_counter() - ex.started
        metrics = self.metrics
        metrics.proxy_responses.labels(route.name, route.service, status).inc()
        metrics.proxy_duration.labels(route.name, route.service).observe(duration)
        metrics.proxy_bytes.labels(route.name, "down").inc(ex.sent)
        if ex.upload is not None:
            metrics.proxy_bytes.labels(route.name, "up").inc(ex.upload.received)
        if self.access_log and access_logger.isEnabledFor(logging.INFO):
            scope = ex.scope
            log_access(
                {
                    **self._who(scope),
                    "method": ex.method,
                    "path": ex.path,
                    "status": ex.status,
                    "duration": round(duration, 6),
                    "bytes_in": None if ex.upload is None else ex.upload.received,
                    "bytes_out": ex.sent,
                    "correlation_id": ex.correlation_id,
                    "route": route.name,
                    "service": route.service,
                    "host": ex.host,
                    "retries": ex.retries,
                    "upstream_status": ex.upstream,
                    "client_gone": ex.client_gone,
                }
            )

    def _who(self, scope: MutableMapping[str, Any]) -> dict[str, Any]:
        """The access line's fields about the client and its request's target."""
        headers = scope["headers"]
        peer = scope.get("client")
        return {
            "client": client_address(None if peer is None else peer[0], headers, self.trusted),
            "query": redacted_query(scope.get("query_string", b""), self.redact),
            "user_agent": header(headers, b"user-agent"),
            "trace_id": trace_id(headers),
        }


# -- small rules -------------------------------------------------------------------------
