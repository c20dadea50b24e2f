"""The built-in HTTP backend pipe.

:class:`Backends` owns one client per service — a keep-alive pool over h11
(:mod:`._client`, :mod:`._pool`), over TLS for ``https://`` — opened and closed around the
code that runs the pipes::

    backends = Backends([Service("users", "http://users:8080", max_connections=16)])
    engine.registry.add_pipe(http_pipe("get_user", HttpCall.of("users", "/users/{id}",
                                                               into="user"), backends))
    async with backends, engine:
        ...

Every call goes to its service's configured host: the templates fill only the path, the
query, headers and body, and the finished URL is checked against the base URL before
anything is sent. Redirects are not followed and the environment's proxy settings are not
read, for the same reason.

Failures are translated here, at the boundary, the same for both clients (:func:`_failure`):
an unaccepted status, an answer that cannot be read or a broken connection is a
:class:`~pipework.BackendError` (502), no connection at all a
:class:`~pipework.BackendUnreachable`, running out of time a
:class:`~pipework.DeadlineExceeded` (504) — each saying what failed, where and what to do,
with the client's own exception as ``__cause__``. Neither client's exceptions go further.
A call to a service goes through its resilience core (several hosts,
balancing, ejection, the breaker, retries, hedging: docs/resilience.md); a call the core
refuses (the breaker open, every host drained) is :class:`~pipework.Overloaded` (503 with
``Retry-After``), nothing sent.
"""

from __future__ import annotations

import json
import logging
import traceback
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Final

import httpx
import trio

from .. import _tracing
from .._errors import BackendError, BackendUnreachable, DeadlineExceeded, RegistrationError
from .._logging import job_logger, log_job, mark_reported, note_upstream
from .._metrics import Metrics
from ..pipes._pipe import Context, Pipe
from ..pipes._state import raw_value
from ._answers import decode_answer, too_big, unaccepted
from ._client import ServiceClient
from ._client_tries import CallNote
from ._failures import (
    BadAnswer,
    CallTimeout,
    ConnectFailed,
    ConnectionBroken,
    Phase,
    TransportFailure,
)
from ._h1 import ACCEPT_ENCODING, BadEncoding, content_decoder
from ._hosts_core import ServiceStatistics
from ._http_spec import (
    HttpCall,
    Service,
    check_header_value,
    forwarded_headers,
    passed_headers,
    raw_body,
)
from ._http_template import TemplateError, render_body

__all__ = ["Backends", "http_pipe"]

_USER_AGENT: Final = "pipework"
_ACCEPT_ENCODING: Final = ACCEPT_ENCODING.decode()
#: How long after an httpx call's deadline the bound on the whole call ends it (seconds).
_BACKSTOP_GRACE: Final = 0.1


class Backends:
    """The HTTP clients of a set of services: ``async with backends:`` opens one client per
    service (connection limits and timeouts from its :class:`Service`) and closes them all
    on the way out. Pipes made by :func:`http_pipe` call through it while it is open.

    Every service is called through pipework's own keep-alive pool over h11
    (:mod:`._pool`, several times cheaper per call than httpx), over TLS for an
    ``https://`` one (its ``ca_bundle``, client certificate, ``server_name``, ``verify``).
    ``transport`` replaces the network for every service with an httpx transport
    (``httpx.MockTransport(handler)`` in tests): all calls then go through httpx and the
    services' connection limits do not apply, everything else does.
    """

    def __init__(
        self,
        services: Iterable[Service] | Mapping[str, Service],
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        items = services.values() if isinstance(services, Mapping) else services
        self.services: dict[str, Service] = {}
        for service in items:
            if service.name in self.services:
                raise RegistrationError(f"service {service.name!r} is declared twice")
            self.services[service.name] = service
        self.transport = transport
        self._clients: dict[str, httpx.AsyncClient] | None = None
        self._lean: dict[str, ServiceClient] = {}
        self._stack: AsyncExitStack | None = None
        self._health: set[trio.CancelScope] = set()  # of the running check_health tasks
        self._metrics: Metrics | None = None
        self._watched: dict[str, Callable[[], ServiceStatistics]] = {}

    @property
    def metrics(self) -> Metrics | None:
        """Where calls are counted (the engine's metrics); set before serving. The
        resilience state of each service is read from it at every scrape
        while these backends are open."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: Metrics | None) -> None:
        self._unwatch()
        self._metrics = metrics
        self._watch()

    def _watch(self) -> None:
        metrics = self._metrics
        if metrics is None:
            return
        for name, client in self._lean.items():
            read = self._watched[name] = _reader(client)
            metrics.watch_service(name, read)

    def _unwatch(self) -> None:
        metrics, watched, self._watched = self._metrics, self._watched, {}
        if metrics is not None:
            for name, read in watched.items():
                metrics.unwatch_service(name, read)

    async def __aenter__(self) -> Backends:
        if self._stack is not None:
            raise RuntimeError("these backends are already open")
        stack = AsyncExitStack()
        clients: dict[str, httpx.AsyncClient] = {}
        lean: dict[str, ServiceClient] = {}
        async with stack:
            for name, service in self.services.items():
                if self.transport is None:
                    lean[name] = ServiceClient(service, _USER_AGENT)
                    stack.push_async_callback(lean[name].aclose)
                    continue
                client = httpx.AsyncClient(
                    limits=service.limits(),
                    timeout=httpx.Timeout(service.timeout, connect=_connect(service)),
                    follow_redirects=False,
                    trust_env=False,
                    # What _send decodes, as the lean client asks for it.
                    headers={"User-Agent": _USER_AGENT, "Accept-Encoding": _ACCEPT_ENCODING},
                    transport=self.transport,
                )
                clients[name] = await stack.enter_async_context(client)
            self._stack = stack.pop_all()
        self._clients, self._lean = clients, lean
        self._watch()
        return self

    async def check_health(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the active health checks of every service with a ``health``
        table, and the re-resolution of the host names of those with ``resolve`` (one task
        each), until these backends close or :meth:`adopt` hands their services on. Start
        it in a nursery that outlives them (the gateway's, the test's): the backends own no
        task, since a reload closes them from another task than the one that opened them."""
        if self._stack is None:  # closed already (a reload's plan retired at once)
            task_status.started()
            return
        with trio.CancelScope() as scope:
            self._health.add(scope)
            try:
                async with trio.open_nursery() as nursery:
                    for client in self._lean.values():
                        if client.service.health is not None:
                            nursery.start_soon(client.check_health)
                        if client.service.resolve is not None:
                            nursery.start_soon(client.resolve_hosts)
                    task_status.started()
            finally:
                self._health.discard(scope)

    def adopt(self, previous: Backends | None) -> None:
        """Carry the resilience state of ``previous`` (the plan these backends replace)
        over: each service of both keeps its core -- the health, ejections, latencies,
        drains and breaker of hosts that did not change (docs/resilience.md) -- and the
        previous backends' health checks stop (these ones' take over). Call it at the swap,
        once these backends are open."""
        if previous is None:
            return
        for scope in list(previous._health):
            scope.cancel()
        for name, client in self._lean.items():
            old = previous._lean.get(name)
            if old is not None:
                client.adopt(old.core)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for scope in list(self._health):
            scope.cancel()  # the health checks end with the clients they use
        self._unwatch()
        stack, self._stack, self._clients, self._lean = self._stack, None, None, {}
        if stack is not None:
            with trio.CancelScope(shield=True):  # closing sockets is cleanup: let it finish
                await stack.aclose()

    # -- the operator's hand on the hosts (the admin API, wired by the registry) -------------

    def resilience(self) -> dict[str, ServiceStatistics | None]:
        """Every service's resilience state now, by name; None for a service whose calls
        do not go through a resilience core (every service, with a ``transport``)."""
        now = trio.current_time()
        return {
            name: None if (lean := self._lean.get(name)) is None else lean.core.statistics(now)
            for name in self.services
        }

    def refusing(self, service: str) -> bool:
        """Whether ``service`` refuses calls now (its breaker, or every host drained); never
        for a service without a resilience core."""
        lean = self._lean.get(service)
        return lean is not None and lean.core.refusing(trio.current_time())

    def drain(self, service: str, url: str) -> bool:
        """Drain host ``url`` of ``service`` (no new tries, those out finish); False when it
        was drained already. It stays drained across reloads that keep the host."""
        return self.lean(service).drain(url)

    def restore(self, service: str, url: str) -> bool:
        """Put host ``url`` of ``service`` back in rotation; False when it was not drained."""
        return self.lean(service).restore(url)

    def lean(self, name: str) -> ServiceClient:
        """The lean client of service ``name`` (proxy routes stream through it);
        RuntimeError while the backends are closed or when the service has none (every
        service, with a ``transport``)."""
        client = self._lean.get(name)
        if client is None:
            why = "they are not open" if self._stack is None else "the backends use a transport"
            raise RuntimeError(f"service {name!r} has no lean client: {why}")
        return client

    def client(self, name: str) -> httpx.AsyncClient:
        if self._clients is None:
            raise RuntimeError(
                "the backends are not open: run the engine inside `async with backends:`"
            )
        return self._clients[name]

    async def call(
        self,
        call: HttpCall,
        ctx: Context,
        *,
        trace: tuple[str | None, str | None] | None = None,
    ) -> Any:
        """Make ``call`` for the job behind ``ctx``; return the answer's body. ``trace``:
        the ``traceparent`` and ``tracestate`` to send instead of the job's (with tracing
        on, the call's own span's: see :meth:`_traced`)."""
        if trace is None and _tracing.ACTIVE.on:
            return await self._traced(call, ctx)
        started = trio.current_time()
        note = CallNote()
        try:
            answer = await self._call(call, ctx, trace, note)
        except BackendError as exc:
            if exc.status is not None:
                kind = "status"
            else:
                kind = "connect" if isinstance(exc, BackendUnreachable) else "broken"
            self._observe(call.service, started, kind)
            _log_failure(call.service, kind, ctx, started, exc, note)
            raise
        except DeadlineExceeded as exc:
            self._observe(call.service, started, "timeout")
            _log_failure(call.service, "timeout", ctx, started, exc, note)
            raise
        except BaseException as exc:
            # An any_of winner, a client that hung up, a job's deadline: the call ended
            # without an answer and is counted as such, never left out — also when the
            # cancellation arrives inside a group (httpx connecting raises one).
            if isinstance(exc, trio.Cancelled) or (
                isinstance(exc, BaseExceptionGroup) and exc.split(trio.Cancelled)[0] is not None
            ):
                self._observe(call.service, started, "cancelled")
            raise
        self._observe(call.service, started, None)
        note_upstream(ctx.correlation_id, call.service, note.host, note.retries)
        return answer

    async def _traced(self, call: HttpCall, ctx: Context) -> Any:
        """:meth:`call` in a client span of its own (the pipe's child): the backend gets
        its ``traceparent``; each try is an event on it (``_client_tries.py``)."""
        service = self.services[call.service]
        span = _tracing.ACTIVE.start(
            f"{call.method} {call.service}",
            "client",
            {
                "http.request.method": call.method,
                "server.address": service.url.host,
                "url.template": call.path.text,
                "pipework.service": call.service,
                "pipework.job_id": ctx.job_id,
                "pipework.pipe": ctx.pipe.name,
            },
        )
        error: BaseException | None = None
        try:
            return await self.call(call, ctx, trace=span.headers())
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else None  # a cancel is no failure
            if isinstance(exc, BackendError) and exc.status is not None:
                span.set("http.response.status_code", exc.status)
            raise
        finally:
            span.end(error)

    def _observe(self, service: str, started: float, error: str | None) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        if error is None:
            outcome = "ok"
        elif error in ("timeout", "cancelled"):
            outcome = error
        else:
            outcome = "error"
        metrics.observe(metrics.backend_latency, (service, outcome), trio.current_time() - started)
        metrics.backend_calls.labels(service, "error" if outcome == "timeout" else outcome).inc()
        if outcome not in ("ok", "cancelled"):
            metrics.backend_errors.labels(service, error).inc()

    async def _call(
        self,
        call: HttpCall,
        ctx: Context,
        trace: tuple[str | None, str | None] | None,
        note: CallNote,
    ) -> Any:
        """``trace``: the call's span's ``traceparent`` and ``tracestate``, sent in place of
        the job's (None: tracing off, the job's are sent); ``note`` is told where it went."""
        service = self.services[call.service]
        lean = self._lean.get(call.service)
        client = self.client(call.service) if lean is None else None
        # The client's timeouts, capped by the time the job has left. The job's deadline is
        # enforced by the engine's cancel scope around the pipe, which names the right scope
        # (pipe, stage or job); these add the service's own bound.
        started = trio.current_time()
        budget = min(service.timeout, ctx.remaining)
        deadline = started + budget
        if lean is not None:
            # The pool's one deadline covers the whole call, and its timeout names the phase.
            try:
                return await lean.call(
                    call, ctx.state, deadline, _trace_headers(service, ctx, trace), note
                )
            except TransportFailure as exc:
                raise _failure(service, ctx, budget, deadline, exc) from exc
        assert client is not None
        timeout = httpx.Timeout(budget, connect=min(_connect(service), budget))
        request = _build_request(client, service, call, ctx, timeout, trace)
        note.host = request.url.netloc.decode("ascii")
        # httpx's timeouts are per operation, so this scope bounds the whole call: a little
        # after the deadline, so that an operation that ran out says so itself (the
        # outermost of two scopes cancelled at once is the one that catches it).
        with trio.move_on_at(deadline + _BACKSTOP_GRACE) as scope:
            try:
                return await _send(client, service, call, request)
            except (BadEncoding, httpx.HTTPError) as exc:
                raise _failure(service, ctx, budget, deadline, exc) from exc
        assert scope.cancelled_caught
        raise _timed_out(service, ctx, "answer", budget, deadline)


def _reader(client: ServiceClient) -> Callable[[], ServiceStatistics]:
    """What the metrics read of a service at a scrape: its core's statistics (the core a
    reload handed over included)."""

    def read() -> ServiceStatistics:
        return client.core.statistics(trio.current_time())

    return read


def _log_failure(
    service: str,
    kind: str,
    ctx: Context,
    started: float,
    exc: BackendError | DeadlineExceeded,
    note: CallNote,
) -> None:
    """One WARNING line per failed call, naming the host it went to and the client's own
    exception (``cause``); the traceback (with the chain of causes) only when DEBUG is on.
    The job's lines that follow (its pipe's end, its own) are DEBUG (``mark_reported``)."""
    cause = exc.__cause__
    mark_reported(exc)
    note_upstream(ctx.correlation_id, service, note.host, note.retries)
    log_job(
        "backend call failed",
        logging.WARNING,
        exc if job_logger.isEnabledFor(logging.DEBUG) else None,
        service=service,
        kind=kind,
        status=exc.status if isinstance(exc, BackendError) else None,
        host=note.host,
        retries=note.retries or None,
        pipe=ctx.pipe.name,
        job_id=ctx.job_id,
        correlation_id=ctx.correlation_id,
        duration=round(trio.current_time() - started, 6),
        error=str(exc),
        cause=None if cause is None else f"{type(cause).__name__}: {cause}",
    )


def http_pipe(
    name: str,
    call: HttpCall,
    backends: Backends,
    *,
    key: str | None = None,
    timeout: float | None = None,
) -> Pipe:
    """A pipe that makes ``call`` through ``backends`` and writes the answer to
    ``state[call.into]``. Its admission key defaults to the service's name, so the
    service's pool weights apply to it."""
    if call.service not in backends.services:
        known = ", ".join(sorted(backends.services)) or "none"
        raise RegistrationError(
            f"pipe {name!r} calls unknown service {call.service!r} (known: {known})"
        )

    async def run(ctx: Context) -> None:
        answer = await backends.call(call, ctx)
        if call.into is not None:
            ctx.state[call.into] = answer

    run.__name__ = run.__qualname__ = name
    return Pipe(
        run, name, key if key is not None else call.service, timeout, request_use=call.request_use
    )


def _connect(service: Service) -> float:
    return service.timeout if service.connect_timeout is None else service.connect_timeout


def _trace_headers(
    service: Service, ctx: Context, trace: tuple[str | None, str | None] | None = None
) -> dict[str, str]:
    """One id finds the request in the backends' logs too; a client's trace goes on: the
    job's ``traceparent`` and ``tracestate``, or with tracing on the call's span's
    (``trace``), so the backend's span is its child. ``baggage`` as the request sent it."""
    headers = {}
    if service.request_id_header is not None:
        headers[service.request_id_header] = ctx.correlation_id
    traceparent, tracestate = (ctx.traceparent, ctx.tracestate) if trace is None else trace
    if traceparent is not None:
        headers["traceparent"] = traceparent
        if tracestate is not None:
            headers["tracestate"] = tracestate
    if ctx.baggage is not None:
        headers["baggage"] = ctx.baggage
    return headers


def _build_request(
    client: httpx.AsyncClient,
    service: Service,
    call: HttpCall,
    ctx: Context,
    timeout: httpx.Timeout,
    trace: tuple[str | None, str | None] | None = None,
) -> httpx.Request:
    state = ctx.state
    base = service.url
    url = base.copy_with(
        raw_path=base.raw_path.rstrip(b"/") + call.path.render_path(state).encode()
    )
    params: list[tuple[str, str | int | float | bool | None]] = []
    for name, template in call.query:
        params.extend((name, value) for value in template.render_query(state, name))
    headers = httpx.Headers(service.headers)
    if call.pass_headers:
        headers.update(passed_headers(state, call.pass_headers))
    if call.forward_headers is not None:
        headers.update(forwarded_headers(state, call.forward_headers))
    for name, template in call.headers:
        rendered = template.render_header(state, name)
        if rendered is not None:
            problem = check_header_value(name, rendered)
            if problem is not None:  # refused here, not by httpx as if the backend failed
                raise TemplateError(problem)
            headers[name] = rendered
    content: bytes | None = None
    if call.body is not None:
        try:
            content = json.dumps(
                render_body(call.body, state), separators=(",", ":"), allow_nan=False
            ).encode()
        except (TypeError, ValueError) as exc:
            raise TemplateError(f"the body cannot be sent as JSON: {exc}") from None
        headers.setdefault("Content-Type", "application/json")
    elif call.body_from is not None:
        content, content_type = raw_body(state, call.body_from)
        if content_type is not None:
            headers.setdefault("Content-Type", content_type)
    # Last, over the call's own headers, as the lean client puts them.
    headers.update(_trace_headers(service, ctx, trace))
    request = client.build_request(
        call.method, url, params=params, headers=headers, content=content, timeout=timeout
    )
    sent = request.url
    if (sent.scheme, sent.host, sent.port) != (base.scheme, base.host, base.port):
        # Unreachable by construction (values are percent-encoded); kept as the last guard.
        raise TemplateError(f"the call to service {service.name!r} would leave its host")
    return request


async def _send(
    client: httpx.AsyncClient, service: Service, call: HttpCall, request: httpx.Request
) -> Any:
    response = await client.send(request, stream=True)
    if response.status_code not in call.accept:
        await response.aclose()  # unread: httpx closes its connection
        raise unaccepted(service, call, response.status_code)
    if response.is_stream_consumed:
        # Read (and decoded) already, by a transport that had it whole (a test's).
        if len(response.content) > service.max_response_bytes:
            raise _too_big(service, response)
        return _decode(service, call, response, response.content)
    chunks = response.aiter_raw()
    try:
        body = await _read_body(service, response, chunks)
    except BaseException as exc:
        # The error may be kept (a failed job keeps its own for its retention), and with
        # it the frames it came through: not their locals, which hold what was read.
        traceback.clear_frames(exc.__traceback__)
        await _close_unread(response, chunks)
        raise
    finally:
        await response.aclose()
    return _decode(service, call, response, body)


async def _read_body(
    service: Service, response: httpx.Response, chunks: AsyncIterator[bytes]
) -> bytes:
    """The answer's body, decoded, of at most the service's ``max_response_bytes``: too
    big is raised at the first byte past it, as an answer may never end. It is decoded
    here, with the lean client's decoder: httpx's own decodes a whole chunk at once,
    however far past the limit it inflates; a body that does not decode raises its
    :class:`~._h1.BadEncoding`, as on the lean client."""
    limit = service.max_response_bytes
    decoder = content_decoder(response.headers.get("Content-Encoding"))
    declared = response.headers.get("Content-Length", "")
    if decoder is None and declared.isdigit() and int(declared) > limit:
        raise _too_big(service, response)
    body = bytearray()
    async for chunk in chunks:
        piece = chunk if decoder is None else decoder.feed(chunk, limit - len(body))
        if len(body) + len(piece) > limit:
            raise _too_big(service, response)
        body += piece
    if decoder is not None:
        tail = decoder.flush(limit - len(body))
        if len(body) + len(tail) > limit:
            raise _too_big(service, response)
        body += tail
    return bytes(body)


async def _close_unread(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """Close ``response`` before its body was read to the end: httpx closes its connection
    (it is never pooled again). Then run the body's iterator on: httpx's body generators
    nest, and each must end here (a read on the closed connection fails at once) rather
    than be left half-way for the garbage collector to finalize."""
    await response.aclose()
    try:
        async for _ in chunks:
            pass
    except httpx.StreamError:
        pass  # never started: it ends at once, the response being closed
    except httpx.HTTPError:
        pass


def _too_big(service: Service, response: httpx.Response) -> BackendError:
    return too_big(service, response.status_code)


def _decode(service: Service, call: HttpCall, response: httpx.Response, body: bytes) -> Any:
    if call.raw:
        return raw_value(response.headers.get("Content-Type"), body)
    content_type = response.headers.get("Content-Type", "")
    return decode_answer(service, response.status_code, content_type, body)


def _failure(
    service: Service,
    ctx: Context,
    budget: float,
    deadline: float,
    exc: TransportFailure | httpx.HTTPError,
) -> BackendError | DeadlineExceeded:
    """Pipework's error for a call that failed in either client (the lean one's
    :mod:`._failures`, or httpx's): what failed, where, and what to do."""
    if isinstance(exc, CallTimeout):
        return _timed_out(service, ctx, exc.phase, budget, deadline)
    if isinstance(exc, httpx.TimeoutException):
        if isinstance(exc, httpx.PoolTimeout):
            return _timed_out(service, ctx, "pool", budget, deadline)
        phase: Phase = "connect" if isinstance(exc, httpx.ConnectTimeout) else "answer"
        return _timed_out(service, ctx, phase, budget, deadline)
    name, at = service.name, f"(for {ctx.path})"
    if isinstance(exc, ConnectFailed | httpx.ConnectError):
        return BackendUnreachable(
            f"could not connect to service {name!r} {at}; nothing was sent: check that the "
            "service is up and reachable at its base_url",
            service=name,
        )
    if isinstance(exc, BadEncoding | httpx.DecodingError):
        what = (
            f"service {name!r} answered with a body that does not decode in its "
            f"Content-Encoding {at}; check how the service compresses its answers"
        )
    elif isinstance(exc, BadAnswer | httpx.RemoteProtocolError):
        # httpx (h11 under it) also says this of an answer the peer cut short by closing.
        what = (
            f"service {name!r} sent an invalid or incomplete HTTP answer {at}; check the "
            "service (and any proxy in front of it)"
        )
    elif isinstance(exc, ConnectionBroken | httpx.NetworkError):
        what = (
            f"the connection to service {name!r} broke before its answer was complete {at}; "
            "the service may have acted on the request: check its health and logs"
        )
    else:  # a request the client would not send, a proxy's error: unreachable in practice
        what = (
            f"the call to service {name!r} failed {at}: {type(exc).__name__}; the server "
            "log has the cause"
        )
    return BackendError(what, service=name)


def _timed_out(
    service: Service, ctx: Context, phase: Phase, budget: float, deadline: float
) -> DeadlineExceeded:
    name, where = service.name, ctx.path
    at = f"(for {where})"
    if phase == "pool":
        what = (
            f"no connection to service {name!r} came free within {budget:g}s {at}: all "
            f"{service.max_connections} of its max_connections were busy; raise them, or "
            "lower the limit of the service's key"
        )
    elif phase == "connect":
        seconds = min(_connect(service), budget)
        what = (
            f"could not connect to service {name!r} within {seconds:g}s {at}; check that "
            "the service is up and reachable at its base_url, or raise its connect_timeout"
        )
    else:
        what = (
            f"service {name!r} did not answer within {budget:g}s {at}; check why it is "
            "slow, or raise its timeout if it may take that long"
        )
    return DeadlineExceeded(what, scope="pipe", where=where, deadline=deadline)
