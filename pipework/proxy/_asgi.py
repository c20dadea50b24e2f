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
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network
from typing import Any, Final, Protocol

import trio

from .. import _tracing
from .._errors import DeadlineExceeded, PipeworkError
from .._http._auth import IDENTITY_STATE_KEY, Identity, RouteAuth, put_identity
from .._http._cors import CorsPolicy, PreflightRefused, header_pairs
from .._http._problems import Problem, problem_for_exception
from .._http._ratelimit import RateLimits
from .._http._request_ids import request_id
from .._metrics import Metrics
from ..backends._failures import CallTimeout, ConnectFailed, TransportFailure
from ..backends._stream import StreamTimeouts, UpstreamAnswer
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
from ._forwarding import Peer, request_headers, response_headers
from ._relay import (
    ASGIReceive,
    ASGISend,
    BodyTooLarge,
    ClientGone,
    Upload,
    send_problem,
    watch_disconnect,
)
from ._route import BadTarget, ProxyMiss, ProxyRoute, ProxyTable
from ._upstream import Upstream
from ._websocket import relay_websocket
from ._websocket_core import WebsocketOutcome

__all__ = ["ProxyLayer", "ProxySet"]

_log = logging.getLogger("pipework.proxy")

#: The app behind (Quart's): typed loosely, as each framework types its own messages.
ASGIApp = Callable[..., Awaitable[None]]

#: Idle time between two chunks when neither the route nor the service says (seconds).
DEFAULT_IDLE_TIMEOUT: Final = 60.0
#: Methods sent on with ``Content-Length: 0`` when the client sent no body: some servers
#: refuse them without a length (411).
_EMPTY_BODY_METHODS: Final = frozenset({"POST", "PUT", "PATCH"})


class ChainRunner(Protocol):
    """What runs a route's ``chain``/``after``: the engine (``Engine.run``)."""

    async def run(self, chain: str, state: dict[str, Any] | None = None, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class ProxySet:
    """The proxy routes in force and their services: swapped whole on reload. ``clients``
    maps a service's name to its :class:`Upstream`."""

    table: ProxyTable
    clients: dict[str, Upstream] = field(default_factory=dict)
    #: Who may call each route (by route name; absent: anyone), checked before a slot.
    auth: Mapping[str, RouteAuth] = field(default_factory=dict)
    #: Which other origins' pages may call each route (by route name; absent: the gateway
    #: leaves CORS, preflights included, to the service).
    cors: Mapping[str, CorsPolicy] = field(default_factory=dict)


@dataclass(slots=True)
class _Exchange:
    """One proxied request's bookkeeping, for its metrics and access log line."""

    route: ProxyRoute
    correlation_id: str
    method: str
    path: str
    started: float
    scope: MutableMapping[str, Any]
    status: int | None = None  # sent to the client; None: nothing was
    upstream: int | None = None  # the backend's own status
    sent: int = 0  # body bytes to the client
    upload: Upload | None = None
    host: str | None = None  # the service's host that answered (or failed last)
    retries: int = 0
    client_gone: bool = False
    # The answer's last message was handed to the server (the backend's, or a problem's).
    answered: bool = False
    identity: Identity | None = None  # who the route's auth says the caller is


class ProxyLayer:
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
                asked = _header(scope["headers"], b"access-control-request-method")
                if asked is not None and _header(scope["headers"], b"origin") is not None:
                    hit = proxies.table.match(scope["path"], asked.decode("latin-1").strip())
                    if isinstance(hit, ProxyRoute) and hit.name in proxies.cors:
                        return self._preflight(proxies.cors[hit.name], scope, send)
            hit = proxies.table.match(scope["path"], method)
            if hit is not None:
                if isinstance(hit, ProxyRoute) and hit.name in proxies.cors:
                    send = _with_cors(send, proxies.cors[hit.name], scope)
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
            if name.lower() in _PREFLIGHT_HEADERS
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
                send, problem, correlation_id=_correlation_id(scope), instance=scope["path"]
            )
            return
        pairs = [*header_pairs(found), (b"x-request-id", _correlation_id(scope).encode())]
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
        correlation_id = _correlation_id(scope)
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
                target = _target(route, scope)
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
            timeouts = _timeouts(route, client)
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

    async def _serve(
        self,
        hit: ProxyRoute | ProxyMiss,
        proxies: ProxySet,
        scope: MutableMapping[str, Any],
        receive: ASGIReceive,
        send: ASGISend,
    ) -> None:
        correlation_id = _correlation_id(scope)
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
        exchange = _Exchange(hit, correlation_id, scope["method"], path, time.perf_counter(), scope)
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
        ex: _Exchange,
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
        length, has_body = _body_framing(incoming, ex.method)
        if route.max_body is not None and length is not None and length > route.max_body:
            await self._refuse(ex, send, _too_large(BodyTooLarge(route.max_body)))
            return
        try:
            target = _target(route, scope)
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
            await self._refuse(ex, send, _failure(route, refusal))
            return
        if forwarded is None:
            _, forwarded = self._head_out(route, client, scope, ex.correlation_id)
        timeouts = _timeouts(route, client)
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
                        await self._refuse(ex, send, _too_large(_first(group)))
                except* (TransportFailure, PipeworkError) as group:
                    failure = _first(group)
                    if isinstance(failure, TransportFailure) and failure.host is not None:
                        ex.host, ex.retries = failure.host, failure.retries
                    if ex.status is None:
                        await self._refuse(ex, send, _failure(route, failure))
                    else:
                        _log_cut(ex, failure)
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
        """The ``Host`` and headers sent on (its target: :func:`_target`)."""
        kept = _header(scope["headers"], b"host") if route.host == "keep" else None
        host = kept or client.netloc
        forwarded = request_headers(
            scope["headers"],
            peer=Peer.from_scope(scope),
            trusted=self.trusted,
            host=host,
            request_id=correlation_id.encode(),
            request_id_header=_lower(client.request_id_header),
        )
        return host, forwarded

    async def _relay(
        self,
        ex: _Exchange,
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
        ex: _Exchange,
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
        ex: _Exchange,
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

    async def _answer(self, ex: _Exchange, answer: UpstreamAnswer, send: ASGISend) -> None:
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
        ex: _Exchange,
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
            "headers": _pairs(headers),
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
            _unpairs(edited.get("headers", request["headers"])),
        )

    async def _after(
        self,
        ex: _Exchange,
        chain: str,
        status: int,
        headers: list[tuple[bytes, bytes]],
        send: ASGISend,
    ) -> tuple[int, list[tuple[bytes, bytes]]] | None:
        response = {"status": status, "headers": _pairs(headers)}
        state = await self._run(ex, chain, {"response": response}, send)
        if state is None:
            return None
        edited = state.get("response", response)
        return int(edited.get("status", status)), _unpairs(edited.get("headers", []))

    async def _run(
        self, ex: _Exchange, chain: str, state: dict[str, Any], send: ASGISend
    ) -> dict[str, Any] | None:
        try:
            result = await self.chains.run(chain, state, correlation_id=ex.correlation_id)
        except Exception as exc:  # the job's own error, raised by Engine.run
            await self._refuse(ex, send, problem_for_exception(exc))
            return None
        return result if isinstance(result, dict) else state

    # -- answers and accounting ----------------------------------------------------------

    async def _refuse(self, ex: _Exchange, send: ASGISend, problem: Problem) -> None:
        ex.answered = True
        ex.status = await send_problem(
            send, problem, correlation_id=ex.correlation_id, instance=ex.path
        )

    def _account(self, ex: _Exchange) -> None:
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


_PREFLIGHT_HEADERS: Final = frozenset(
    {b"origin", b"access-control-request-method", b"access-control-request-headers"}
)


def _with_cors(send: ASGISend, cors: CorsPolicy, scope: MutableMapping[str, Any]) -> ASGISend:
    """``send`` adding the route's CORS headers to the answer's head (the service's own
    ``Access-Control-*`` headers are replaced: the route's policy decides)."""
    origin = _header(scope["headers"], b"origin")
    text = None if origin is None else origin.decode("latin-1")
    added = header_pairs(cors.response_headers(text))

    async def sending(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            kept = [
                (name, value)
                for name, value in message["headers"]
                if not name.lower().startswith(b"access-control-")
            ]
            message = {**message, "headers": [*kept, *added]}
        await send(message)

    return sending


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _target(route: ProxyRoute, scope: MutableMapping[str, Any]) -> bytes:
    """The target sent on; :class:`BadTarget` for a path that must not be (a dot segment
    would leave the route's prefix on the service)."""
    return route.target(scope.get("raw_path") or scope["path"].encode(), scope["query_string"])


def _lower(name: str | None) -> bytes | None:
    return None if name is None else name.lower().encode("latin-1")


def _correlation_id(scope: MutableMapping[str, Any]) -> str:
    given = _header(scope["headers"], b"x-request-id")
    return request_id(None if given is None else given.decode("latin-1"))


def _body_framing(headers: list[tuple[bytes, bytes]], method: str) -> tuple[int | None, bool]:
    """The request body's declared length and whether it has a body at all. The server
    (h11) has refused ambiguous framing already; the body is framed again on the way out."""
    declared = _header(headers, b"content-length")
    if declared is not None:
        return int(declared), True
    if _header(headers, b"transfer-encoding") is not None:
        return None, True
    # No framing is an empty body (RFC 9112 §6.3); one that usually has a body says so.
    return (0, True) if method in _EMPTY_BODY_METHODS else (None, False)


def _timeouts(route: ProxyRoute, service: Upstream) -> StreamTimeouts:
    connect = route.connect_timeout or service.connect_timeout or service.timeout
    first_byte = route.first_byte_timeout or service.timeout
    idle = route.idle_timeout or DEFAULT_IDLE_TIMEOUT
    return StreamTimeouts(connect=connect, first_byte=first_byte, idle=idle)


def _pairs(headers: list[tuple[bytes, bytes]]) -> list[list[str]]:
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]


def _unpairs(pairs: Any) -> list[tuple[bytes, bytes]]:
    return [(str(n).lower().encode("latin-1"), str(v).encode("latin-1")) for n, v in pairs]


def _first(group: BaseExceptionGroup[Any]) -> Any:
    """The first leaf of ``group``: the failure the answer names."""
    leaf: BaseException = group
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def _too_large(exc: BodyTooLarge) -> Problem:
    return Problem(
        413,
        "Content Too Large",
        f"{exc}; send a smaller body",
        slug="body-too-large",
    )


def _failure(route: ProxyRoute, exc: BaseException) -> Problem:
    """The problem for a failed exchange, before any byte of the answer was sent."""
    if isinstance(exc, PipeworkError):
        return problem_for_exception(exc)
    where = f"proxy route {route.name!r} to service {route.service!r}"
    if isinstance(exc, CallTimeout):
        return Problem(
            504,
            "Gateway Timeout",
            f"{where}: {exc}",
            slug="deadline-exceeded",
            service=route.service,
            phase=exc.phase,
        )
    what = "could not connect" if isinstance(exc, ConnectFailed) else "failed"
    return Problem(
        502,
        "Bad Gateway",
        f"{where}: the backend {what}: {exc}",
        slug="backend-failed",
        service=route.service,
    )


def _log_cut(ex: _Exchange, exc: BaseException) -> None:
    _log.warning(
        "proxy route %r: the answer from service %r was cut after %d bytes: %s",
        ex.route.name,
        ex.route.service,
        ex.sent,
        exc,
        extra={"correlation_id": ex.correlation_id, "route": ex.route.name},
    )
