"""The lean client of one ``http://`` or ``https://`` service: an :class:`HttpCall`
rendered straight to h11's request parts and sent through a keep-alive
:class:`~._pool.Pool` per host (TLS under it for ``https://``), each try chosen, retried or
hedged by the service's resilience core (:mod:`._hosts_core`).

It builds the same request the httpx path builds (same target, query encoding, headers and
JSON body; ``Accept-Encoding: gzip, deflate``) without httpx's request and URL models,
which cost more than the exchange itself, and reads the answer with the same rules: the
status checked against ``accept``, ``max_response_bytes`` counted on the decoded body,
JSON parsed, other text decoded with its charset (or, for a raw call, its bytes kept with
their content type). What fails is raised as the same
:class:`~pipework.BackendError` texts, or as the lean client's own exceptions
(:mod:`._failures`) for the caller to translate.

**The driver of the resilience core.** A call begins with :meth:`ServiceCore.begin`: a
refusal (the breaker open, every host drained) raises :class:`~pipework.Overloaded` (503
with ``Retry-After``) before anything is sent. Each try goes to the host the core picks,
through that host's own pool (``Host.tag`` holds it, as a :class:`HostLink`), by the try's
deadline; its outcome -- an answer's status, or a :class:`Failure` for what the pool
raised -- goes back to :meth:`Call.finish`, whose verdict answers, retries after a pause
(inside the call's deadline) or drops it. With hedging, the tries of a call run in a
nursery: a hedge starts when :meth:`Call.hedge_at` comes, the first try whose outcome is
the call's answer cancels the others (their connections are closed, never reused: the
pool's cancellation rule). The call's result is its answering try's: the answer decoded,
or that try's failure raised as it came from the pool.

**A streamed exchange** (:meth:`ServiceClient.stream`, for proxy routes) goes through the
same core, with three differences: a try ends at the answer's head (its status is the
outcome; the body is the caller's to relay), a try is retried only while nothing of the
request's body was read (a failed connection always qualifies: nothing was sent), and it
never hedges.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any, Final
from urllib.parse import urlencode

import httpx
import trio

from .. import _tracing
from .._errors import BackendError, Overloaded
from ..pipes._state import raw_value
from ._balance_core import Host
from ._call_core import Attempt, Call, Refusal, Verdict
from ._failures import CallTimeout, ConnectFailed, ConnectionBroken, TransportFailure
from ._h1 import ACCEPT_ENCODING, Answer, StaleConnection
from ._hosts_core import (
    BreakerChanged,
    HealthChanged,
    HostEjected,
    HostReturned,
    ServiceCore,
)
from ._http_spec import (
    HttpCall,
    Service,
    check_header_value,
    forwarded_headers,
    passed_headers,
    raw_body,
)
from ._http_template import TemplateError, render_body
from ._outlier_core import Failure, Outcome
from ._pool import Pool, ResponseTooLarge, connect_failed
from ._resilience_spec import HostSpec
from ._resolve import resolved_hosts, same_names
from ._stream import Handshake, StreamTimeouts, UpstreamAnswer, open_stream

__all__ = [
    "HostLink",
    "ServiceClient",
    "WebsocketCall",
    "decode_answer",
    "failure_of",
    "refused",
    "too_big",
    "unaccepted",
]

_log = logging.getLogger("pipework.backends")

#: A health check's answer is read only to its status; a body past this is not read.
_CHECK_MAX_BYTES: Final = 64 * 1024

_DEFAULTS: Final = (
    ("accept", "Accept", "*/*"),
    ("accept-encoding", "Accept-Encoding", ACCEPT_ENCODING.decode()),
)


class HostLink:
    """What the client keeps for one host (its ``Host.tag``): the pool of connections to
    it and the ``Host`` header its requests carry."""

    __slots__ = ("netloc", "pool", "url")

    def __init__(self, url: str, pool: Pool, netloc: bytes) -> None:
        self.url = url
        self.pool = pool
        self.netloc = netloc


@dataclass(slots=True)
class _Try:
    """How one try ended, as the call may use it: an answer, the status of one too big, or
    the pool's failure."""

    outcome: Outcome
    answer: Answer | None = None
    failure: TransportFailure | None = None
    host: str | None = None  # the host it went to (its Host), for the logs


@dataclass(slots=True)
class CallNote:
    """Where a call went, for the logs: the host of its answering try (its ``Host``; None
    before any try) and how many times it was retried. Filled by :meth:`ServiceClient.call`."""

    host: str | None = None
    retries: int = 0


class _Watched:
    """A streamed request's body, noting whether anything was asked of it: once it was,
    the request cannot be sent again (what was read is gone)."""

    __slots__ = ("_body", "read")

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self._body = body
        self.read = False

    def __aiter__(self) -> _Watched:
        return self

    async def __anext__(self) -> bytes:
        self.read = True  # from the asking: a piece cut off by a cancellation is lost too
        return await self._body.__anext__()


class ServiceClient:
    """Calls to one ``http://`` or ``https://`` service: a pool per host, each sized by its
    :class:`Service`, and the service's resilience core choosing the hosts. ``pool``
    replaces the pool of a one-host service (tests); ``core`` is one a reload carries over
    (:meth:`ServiceCore.reconfigure` is applied to it); ``rng`` seeds a new core."""

    def __init__(
        self,
        service: Service,
        user_agent: str,
        pool: Pool | None = None,
        *,
        core: ServiceCore | None = None,
        rng: random.Random | None = None,
    ) -> None:
        url = service.url
        if url.scheme not in ("http", "https"):
            raise ValueError(f"the lean client speaks http and https, not {url.scheme}")
        if pool is not None and len(service.endpoints) > 1:
            raise ValueError("a pool may be given only for a service of one host")
        self.service = service
        #: Every host's connections share it (None for http://); TlsFileError here.
        self.ssl_context = service.ssl_context()
        if core is None:
            core = ServiceCore(service.name, service.resilience, rng=rng)
        else:
            core.reconfigure(service.resilience, trio.current_time())
        self.core = core
        self._links: dict[str, HostLink] = {}
        self._checks: dict[str, Pool] = {}  # each host's health-check connection
        self._closed = False
        for host in core.hosts:
            host.tag = self._link(host, pool)
        self._base = url.raw_path.rstrip(b"/").decode("ascii")
        self._raw_base = self._base.encode("ascii")
        self._host = url.netloc
        # Service headers over the client's own, as httpx merges them; lower name -> pair.
        base: dict[str, tuple[str, str]] = {"user-agent": ("User-Agent", user_agent)}
        for name, value in service.headers.items():
            base[name.lower()] = (name, value)
        self._headers = base

    @property
    def pool(self) -> Pool:
        """The first host's pool (the only one of a service with a ``base_url``)."""
        return self._link(self.core.hosts[0]).pool

    @property
    def links(self) -> Mapping[str, HostLink]:
        """Each host's pool, by the host's URL."""
        return self._links

    def _link(self, host: Host, pool: Pool | None = None) -> HostLink:
        """The host's link, made on first use: a core carried over by a reload may pick a
        host this client's plan did not have, for the tries of the calls still on it."""
        link = self._links.get(host.url)
        if link is None:
            service = self.service
            url = httpx.URL(host.url)
            if pool is None:
                pool = Pool(
                    url.host,
                    _port(url),
                    max_connections=service.max_connections,
                    max_idle=service.max_keepalive,
                    idle_timeout=service.keepalive_expiry,
                    connect_timeout=(
                        service.timeout
                        if service.connect_timeout is None
                        else service.connect_timeout
                    ),
                    ssl_context=self.ssl_context,
                    server_name=self._server_name(host.spec),
                )
            authority = host.spec.authority
            netloc = url.netloc if authority is None else authority.encode("ascii")
            link = self._links[host.url] = HostLink(host.url, pool, netloc)
        return link

    def _server_name(self, spec: HostSpec) -> str:
        """The name a host's certificate is checked against (and sent as SNI): the
        service's ``server_name``, else the name the host was given by -- its address
        found by ``resolve`` still goes by the name (``authority``)."""
        if self.service.server_name is not None:
            return self.service.server_name
        if spec.authority is not None:
            return httpx.URL(f"//{spec.authority}").host
        return httpx.URL(spec.url).host

    def adopt(self, core: ServiceCore) -> None:
        """Take over ``core`` (the previous plan's, on a reload) with this client's settings:
        hosts that stay keep what they learnt (:meth:`ServiceCore.reconfigure`), and the
        addresses found for host names that stay are kept until they are resolved again."""
        resilience = self.service.resilience
        if self.service.resolve is not None and same_names(core.resilience.hosts, resilience.hosts):
            resilience = replace(resilience, hosts=core.resilience.hosts)
        core.reconfigure(resilience, trio.current_time())
        self.core = core
        for host in core.hosts:
            host.tag = self._link(host)

    async def resolve_hosts(self) -> None:
        """Every ``resolve`` seconds, the hosts given by name become their addresses,
        forever (cancel to stop). A name that does not resolve keeps the hosts there are."""
        every = self.service.resolve
        failing = False
        while every is not None and not self._closed:
            try:
                hosts = await resolved_hosts(self.service.endpoints)
            except OSError as exc:
                if not failing:  # once per run of failures: each try would say the same
                    _log.warning(
                        "service %r: its host names did not resolve (%s); its hosts stay %s",
                        self.service.name,
                        exc,
                        ", ".join(h.url for h in self.core.hosts),
                    )
                failing = True
            else:
                failing = False
                if hosts != self.core.resilience.hosts:
                    self.core.reconfigure(
                        replace(self.core.resilience, hosts=hosts), trio.current_time()
                    )
                    for host in self.core.hosts:
                        host.tag = self._link(host)
                    _log.info(
                        "service %r: hosts %s",
                        self.service.name,
                        ", ".join(h.url for h in self.core.hosts),
                    )
            await trio.sleep(every)

    # -- the operator's hand (the admin API) -------------------------------------------------

    def drain(self, url: str) -> bool:
        """Take host ``url`` out of rotation: no new tries go to it, those out finish.
        False when it was drained already; KeyError for a host the service does not have."""
        host = self.core.host(url)
        changed = not host.draining
        self.core.drain(url, trio.current_time())
        name = self.service.name
        if changed:
            _log.info(
                "service %r: host %s drained; %d tries out finish", name, url, host.outstanding
            )
        if all(h.draining for h in self.core.hosts):
            _log.warning(
                "service %r: every host is drained; its calls are refused until one is restored",
                name,
            )
        self.report()  # the breaker opens if the hosts left are all out
        return changed

    def restore(self, url: str) -> bool:
        """Put a drained host back in rotation (its health and ejection still apply).
        False when it was not drained; KeyError for a host the service does not have."""
        host = self.core.host(url)
        changed = host.draining
        self.core.restore(url, trio.current_time())
        if changed:
            _log.info("service %r: host %s restored", self.service.name, url)
        self.report()
        return changed

    async def aclose(self) -> None:
        self._closed = True
        for link in list(self._links.values()):
            await link.pool.aclose()
        for pool in list(self._checks.values()):
            await pool.aclose()

    # -- active health checks --------------------------------------------------------------

    async def check_health(self) -> None:
        """Check every host of the service every ``health.interval``, forever (cancel to
        stop): ``GET health.path`` on a connection of its own -- never queued behind the
        traffic, never counted as a try -- passes with an expected status within
        ``health.timeout``. Each result goes to :meth:`ServiceCore.health_check`."""
        while not self._closed:
            spec = self.core.resilience.health
            if spec is None:
                return
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for host in self.core.hosts:
                    nursery.start_soon(self._check, host.url)
            await trio.sleep_until(started + spec.interval)

    async def _check(self, url: str) -> None:
        spec = self.core.resilience.health
        if spec is None:
            return
        parsed = httpx.URL(url)
        pool = self._checks.get(url)
        if pool is None:
            try:
                host = self.core.host(url).spec
            except KeyError:  # removed by a reload before this check began
                return
            pool = self._checks[url] = Pool(
                parsed.host,
                _port(parsed),
                max_connections=1,
                connect_timeout=spec.timeout,
                ssl_context=self.ssl_context,
                server_name=self._server_name(host),
            )
        headers = [
            (b"Host", link.netloc if (link := self._links.get(url)) else parsed.netloc),
            (b"User-Agent", self._headers["user-agent"][1].encode()),
        ]
        # After the host's path prefix, as the calls' paths (docs/configuration.md).
        target = parsed.raw_path.rstrip(b"/") + spec.path.encode()
        try:
            answer = await pool.request(
                b"GET",
                target,
                headers,
                deadline=trio.current_time() + spec.timeout,
                max_bytes=_CHECK_MAX_BYTES,
            )
        except ResponseTooLarge as exc:
            passed = exc.status in spec.expected_statuses
        except TransportFailure:
            passed = False
        else:
            passed = answer.status in spec.expected_statuses
        with suppress(KeyError):  # removed by a reload while it was checked
            self.core.health_check(url, trio.current_time(), passed=passed)
        self.report()

    def refusal(self) -> Overloaded | None:
        """The error of a call the service's core refuses now (counted, and the breaker's
        change logged, as :meth:`call`'s refusal is), or None, nothing changed, when it
        would take one: a proxied request asks before it waits for its slot of the pool
        key, so one that can only be refused takes none."""
        refusal = self.core.refuse(trio.current_time())
        if refusal is None:
            return None
        self.report()
        return refused(self.service, refusal)

    def stream(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes] | None,
        *,
        length: int | None,
        timeouts: StreamTimeouts,
        deadline: float = math.inf,
    ) -> AbstractAsyncContextManager[UpstreamAnswer]:
        """A streamed exchange with the service (:mod:`._stream`): ``headers`` are sent as
        they are (but for framing), with the service's ``Host`` unless they hold one; an
        origin-form ``target`` (``/path?query``) goes under the service's base path. The
        service's own headers (``headers``, ``User-Agent``) are not added: a streamed
        request is passed through, not made.

        It goes through the service's core as a call does (:meth:`_streamed`): refused
        with :class:`~pipework.Overloaded` by an open breaker, sent to the host the core
        picks -- with that host's ``Host`` where ``headers`` carry the service's own --
        and retried by the core's rules while nothing of ``body`` was read."""
        if target.startswith(b"/"):
            target = self._raw_base + target
        return self._streamed(method, target, headers, body, length, timeouts, deadline)

    @asynccontextmanager
    async def _streamed(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes] | None,
        length: int | None,
        timeouts: StreamTimeouts,
        deadline: float,
    ) -> AsyncIterator[UpstreamAnswer]:
        """The core's loop for one streamed exchange. A try ends at the answer's head: its
        status is the try's outcome (a retried one's exchange is closed unread), and the
        answering try's host counts it as outstanding until the exchange ends. No hedging:
        the answer is read by the caller, inside this context, as it streams."""
        core = self.core
        now = trio.current_time()
        begun = core.begin(now, method=method.decode("latin-1"), deadline=deadline, hedge=False)
        if isinstance(begun, Refusal):
            self.report()
            raise refused(self.service, begun)
        sent = None if body is None else _Watched(body)
        per_try = core.resilience.retry.per_try_timeout
        if per_try is not None and per_try < timeouts.first_byte:
            # A try's own timeout runs from the request's end, as the first byte's does.
            timeouts = replace(timeouts, first_byte=per_try)
        retries = 0
        try:
            attempt = begun.attempt(trio.current_time())
            while True:
                if attempt is None:  # every host drained meanwhile
                    drained = ConnectFailed(f"service {self.service.name!r} has no host to call")
                    drained.retries = retries
                    raise drained
                link = self._link(attempt.host)
                exchange = AsyncExitStack()
                answer: UpstreamAnswer | None = None
                failure: TransportFailure | None = None
                # A request that cannot be sent at all raises here, before any I/O: no
                # host's fault (the try ends as cancelled).
                opened = open_stream(
                    link.pool,
                    method,
                    target,
                    self._host_headers(headers, link),
                    sent,
                    host=link.netloc,
                    length=length,
                    timeouts=timeouts,
                    deadline=deadline,
                )
                try:
                    answer = await exchange.enter_async_context(opened)
                except TransportFailure as exc:
                    failure = exc
                if sent is not None and sent.read:
                    begun.sent()
                if failure is not None:
                    outcome = Outcome.failed(failure_of(failure))
                else:
                    assert answer is not None
                    outcome = Outcome.answer(answer.status)
                verdict = begun.finish(attempt, trio.current_time(), outcome, hold=True)
                if verdict.action == "answer":
                    break
                assert verdict.action == "retry", verdict
                retries += 1
                await exchange.aclose()  # a retried answer is not relayed: it ends unread
                with trio.move_on_at(begun.deadline):
                    await trio.sleep(verdict.delay)
                attempt = begun.attempt(trio.current_time())
            host = link.netloc.decode("latin-1")
            if failure is not None:
                failure.host, failure.retries = host, retries
                raise failure
            assert answer is not None
            answer.host, answer.retries = host, retries
            async with exchange:
                yield answer
        finally:
            begun.end(trio.current_time())
            self.report()

    @asynccontextmanager
    async def websocket(self, connect_timeout: float) -> AsyncIterator[WebsocketCall]:
        """A proxied websocket as a call of the service's core: refused with
        :class:`~pipework.Overloaded` by an open breaker, else a :class:`WebsocketCall`
        for the relay (its connection, ``Host`` and handshake), ended with the context."""
        begun = self.core.begin(trio.current_time(), method="GET", hedge=False)
        if isinstance(begun, Refusal):
            self.report()
            raise refused(self.service, begun)
        try:
            yield WebsocketCall(self, begun, connect_timeout)
        finally:
            begun.end(trio.current_time())
            self.report()

    def _host_headers(
        self, headers: list[tuple[bytes, bytes]], link: HostLink
    ) -> list[tuple[bytes, bytes]]:
        """``headers`` with the service's own ``Host`` (its first host's) changed to
        ``link``'s: each host of a service gets its own name, as a call's does. A ``Host``
        the caller chose (the client's, kept) goes as it is."""
        own = self._host
        if link.netloc == own:
            return headers
        return [
            (name, self.host_for(value, link)) if name.lower() == b"host" else (name, value)
            for name, value in headers
        ]

    def host_for(self, host: bytes, link: HostLink) -> bytes:
        """The ``Host`` to send ``link``'s host for a request that carries ``host``: its own
        name for the service's (its first host's), else ``host`` as it is."""
        return link.netloc if host == self._host else host

    def prepare(
        self,
        call: HttpCall,
        state: Mapping[str, Any],
        extra: Mapping[str, str] | None = None,
    ) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None]:
        """The request's method, target, headers and body, from ``state``; ``extra`` headers
        (the request id, ``traceparent``) go last. Raises :class:`TemplateError` for what the
        state cannot fill (nothing is sent)."""
        target = self._base + call.path.render_path(state)
        pairs: list[tuple[str, str]] = []
        for name, template in call.query:
            pairs.extend((name, value) for value in template.render_query(state, name))
        if pairs:
            target += "?" + urlencode(pairs)
        headers = dict(self._headers)
        if call.pass_headers:
            for name, value in passed_headers(state, call.pass_headers).items():
                headers[name] = (name, value)  # lower-case already
        if call.forward_headers is not None:
            for name, value in forwarded_headers(state, call.forward_headers).items():
                headers[name.lower()] = (name, value)
        for name, template in call.headers:
            rendered = template.render_header(state, name)
            if rendered is not None:
                problem = check_header_value(name, rendered)
                if problem is not None:
                    raise TemplateError(problem)
                headers[name.lower()] = (name, rendered)
        body: bytes | None = None
        if call.body is not None:
            try:
                body = json.dumps(
                    render_body(call.body, state), separators=(",", ":"), allow_nan=False
                ).encode()
            except (TypeError, ValueError) as exc:
                raise TemplateError(f"the body cannot be sent as JSON: {exc}") from None
            headers.setdefault("content-type", ("Content-Type", "application/json"))
        elif call.body_from is not None:
            body, content_type = raw_body(state, call.body_from)
            if content_type is not None:
                headers.setdefault("content-type", ("Content-Type", content_type))
        if extra:
            for name, value in extra.items():
                headers[name.lower()] = (name, value)
        for lowered, name, value in _DEFAULTS:
            headers.setdefault(lowered, (name, value))
        wire = [(b"Host", self._host)]
        wire += [(name.encode(), value.encode()) for name, value in headers.values()]
        if body is not None:
            wire.append((b"Content-Length", str(len(body)).encode()))
        elif call.method in ("POST", "PUT", "PATCH"):
            wire.append((b"Content-Length", b"0"))
        return call.method.encode(), target.encode("ascii"), wire, body

    async def call(
        self,
        call: HttpCall,
        state: Mapping[str, Any],
        deadline: float,
        extra: Mapping[str, str] | None = None,
        note: CallNote | None = None,
    ) -> Any:
        """Make ``call`` by ``deadline`` (trio time); return the answer's body, decoded.
        Raises :class:`~pipework.Overloaded` when the core refuses the call, the
        answering try's failure (:mod:`._failures`) when it had no answer. ``note`` is
        told the answering try's host and the retries."""
        request = self.prepare(call, state, extra)
        core = self.core
        begun = core.begin(trio.current_time(), method=call.method, deadline=deadline)
        if isinstance(begun, Refusal):
            self.report()
            raise refused(self.service, begun)
        note = note or CallNote()
        try:
            done = await self._drive(begun, request, note)
        finally:
            begun.end(trio.current_time())
            self.report()
        note.host = done.host
        return self._result(call, done)

    def report(self) -> None:
        """Log what changed in the service's core: a host ejected or back, a health
        change, the breaker moving (one line each, on the ``pipework.backends`` logger)."""
        name = self.service.name
        for event in self.core.pop_events():
            if isinstance(event, HostEjected):
                _log.warning(
                    "service %r: host %s ejected (%s), ejection %d, for %.3g s",
                    name,
                    event.url,
                    event.rule,
                    event.ejections,
                    max(0.0, event.until - trio.current_time()),
                )
            elif isinstance(event, HostReturned):
                _log.info("service %r: host %s is back from its ejection", name, event.url)
            elif isinstance(event, HealthChanged):
                level = logging.INFO if event.healthy else logging.WARNING
                health = "healthy" if event.healthy else "unhealthy"
                _log.log(level, "service %r: host %s is %s", name, event.url, health)
            elif isinstance(event, BreakerChanged):
                level = logging.INFO if event.state == "closed" else logging.WARNING
                _log.log(
                    level,
                    "service %r: circuit breaker %s%s",
                    name,
                    event.state,
                    "" if event.reason is None else f" ({event.reason})",
                )

    async def _drive(
        self,
        call: Call,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None],
        note: CallNote,
    ) -> _Try:
        """The core's loop for one call: tries until one is the call's answer (``note``
        counts the retries)."""
        attempt = call.attempt(trio.current_time())
        while True:
            if attempt is None:  # every host drained meanwhile
                return _Try(
                    Outcome.failed(Failure.CONNECT),
                    failure=ConnectFailed(f"service {self.service.name!r} has no host to call"),
                )
            if call.hedge_at() is None:
                done = await self._try(attempt, request)
                verdict = call.finish(attempt, trio.current_time(), done.outcome)
                if _tracing.ACTIVE.on:
                    _traced_try(attempt, done.outcome, verdict)
            else:
                verdict, done = await self._hedged(call, attempt, request)
            if verdict.action == "answer":
                if _tracing.ACTIVE.on and done.outcome.status is not None:
                    _tracing.ACTIVE.annotate("http.response.status_code", done.outcome.status)
                return done
            # "retry" (a "drop" leaves no try out here: only a try still out drops one)
            assert verdict.action == "retry", verdict
            note.retries += 1
            with trio.move_on_at(call.deadline):
                await trio.sleep(verdict.delay)
            attempt = call.attempt(trio.current_time())

    async def _hedged(
        self,
        call: Call,
        first: Attempt,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None],
    ) -> tuple[Verdict, _Try]:
        """``first`` and the hedges beside it, until one try's verdict is not a drop."""
        decided: list[tuple[Verdict, _Try]] = []

        async def run(attempt: Attempt, scope: trio.CancelScope) -> None:
            try:
                done = await self._try(attempt, request)
            except BaseException:
                if not attempt.done:  # cancelled: another try answered, or the call ended
                    verdict = call.finish(attempt, trio.current_time(), Outcome.cancel())
                    if _tracing.ACTIVE.on:
                        _traced_try(attempt, Outcome.cancel(), verdict)
                raise
            verdict = call.finish(attempt, trio.current_time(), done.outcome)
            if _tracing.ACTIVE.on:
                _traced_try(attempt, done.outcome, verdict)
            if verdict.action != "drop":
                decided.append((verdict, done))
                scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, first, nursery.cancel_scope)
                while (at := call.hedge_at()) is not None:
                    await trio.sleep_until(at)
                    hedge = call.hedge(trio.current_time())
                    if hedge is not None:
                        nursery.start_soon(run, hedge, nursery.cancel_scope)
                # No more hedges: the tries out decide.
        except BaseExceptionGroup as group:
            # The boundary: a cancellation goes on as trio raised it (the scope that
            # cancelled finds it in the group); one error alone goes on as itself, so the
            # caller sees the same errors with a hedge as without.
            _, others = group.split(trio.Cancelled)
            if others is not None:
                leaves = list(_leaves(others))
                if len(leaves) == 1 and isinstance(leaves[0], Exception):
                    raise leaves[0] from None
            raise
        assert decided, "a call's last try out always decides"
        return decided[0]

    async def _try(
        self,
        attempt: Attempt,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None],
    ) -> _Try:
        """One try, on its host's pool, by its deadline."""
        method, target, headers, body = request
        if self._closed:
            closed = ConnectFailed(f"the client of service {self.service.name!r} is closed")
            return _Try(Outcome.failed(Failure.CONNECT), failure=closed)
        link = self._link(attempt.host)
        host = link.netloc.decode("latin-1")
        wire = [(b"Host", link.netloc), *headers[1:]]  # the first is the Host header
        try:
            answer = await link.pool.request(
                method,
                target,
                wire,
                body,
                deadline=attempt.deadline,
                max_bytes=self.service.max_response_bytes,
            )
        except ResponseTooLarge as exc:
            return _Try(Outcome.answer(exc.status), host=host)
        except TransportFailure as exc:
            return _Try(Outcome.failed(failure_of(exc)), failure=exc, host=host)
        return _Try(Outcome.answer(answer.status), answer=answer, host=host)

    def _result(self, call: HttpCall, done: _Try) -> Any:
        if done.failure is not None:
            raise done.failure
        status = done.outcome.status
        assert status is not None
        if status not in call.accept:
            raise unaccepted(self.service, call, status)
        if done.answer is None:
            raise too_big(self.service, status)
        return _decode(self.service, call, done.answer)


class WebsocketCall:
    """One proxied websocket through its service's core (:meth:`ServiceClient.websocket`):
    :meth:`connect` opens a connection to the host the core picks -- another one after a
    connection not made, by the core's rules -- :meth:`host` names that host,
    :meth:`handshake_done` counts the try's outcome (the handshake's answer; the host
    counts the websocket as outstanding while it stays open). Nothing is tried again once
    connected: the handshake's answer is the client's."""

    __slots__ = ("_attempt", "_call", "_client", "_link", "_timeout")

    def __init__(self, client: ServiceClient, call: Call, connect_timeout: float) -> None:
        self._client = client
        self._call = call
        self._timeout = connect_timeout
        self._attempt: Attempt | None = None  # the connected try, until its handshake ended
        self._link: HostLink | None = None

    async def connect(self) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]:
        """A new connection (never the keep-alive pool's: it becomes the websocket's), TLS
        for an ``https://`` service (the handshake within the connect timeout). Raises
        :class:`~._failures.ConnectFailed`, or ``trio.TooSlowError`` when the connect
        timeout ran out, for the last try the core allowed."""
        call, client = self._call, self._client
        attempt = call.attempt(trio.current_time())
        while True:
            if attempt is None:  # every host drained meanwhile
                raise ConnectFailed(f"service {client.service.name!r} has no host to call")
            link = client._link(attempt.host)
            pool = link.pool
            failure: OSError | trio.TooSlowError | trio.BrokenResourceError
            stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
            try:
                with trio.fail_after(self._timeout):
                    stream = await trio.open_tcp_stream(pool.host, pool.port)
                    if pool.ssl_context is not None:
                        stream = await pool.handshake(stream, pool.ssl_context)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                failure = exc
            else:
                call.sent()  # the handshake goes out: it is not sent again
                self._attempt, self._link = attempt, link
                return stream
            verdict = call.finish(attempt, trio.current_time(), Outcome.failed(Failure.CONNECT))
            if verdict.action != "retry":
                if isinstance(failure, trio.TooSlowError):
                    raise failure
                raise connect_failed(pool.where, failure) from failure
            with trio.move_on_at(call.deadline):
                await trio.sleep(verdict.delay)
            attempt = call.attempt(trio.current_time())

    @property
    def netloc(self) -> str | None:
        """The host it connected to (its ``Host``), for the logs; None before."""
        return None if self._link is None else self._link.netloc.decode("latin-1")

    def host(self, given: bytes) -> bytes:
        """The ``Host`` for the connected host, of a request that carries ``given``."""
        assert self._link is not None, "connect first"
        return self._client.host_for(given, self._link)

    def handshake_done(self, handshake: Handshake) -> None:
        """The try's outcome: the handshake's answer, or how it failed."""
        attempt, self._attempt = self._attempt, None
        if attempt is None:  # it never connected: the core has counted its tries
            return
        outcome: Outcome
        if handshake.status is not None:
            outcome = Outcome.answer(handshake.status)
        elif handshake.phase is None:  # refused before the backend was asked
            outcome = Outcome.cancel()
        elif handshake.timed_out:
            outcome = Outcome.failed(Failure.TIMEOUT)
        else:
            outcome = Outcome.failed(Failure.BROKEN)
        self._call.finish(attempt, trio.current_time(), outcome, hold=True)


def _port(url: httpx.URL) -> int:
    if url.port is not None:
        return url.port
    return 443 if url.scheme == "https" else 80


def _traced_try(attempt: Attempt, outcome: Outcome, verdict: Verdict) -> None:
    """A try's end as an event on the call's span (the current one; a hedge's task has a
    copy of its context): its kind (first, retry, hedge), host, outcome and what the call
    does next."""
    attributes: dict[str, _tracing.Attribute] = {
        "pipework.try": attempt.kind,
        "server.address": attempt.host.url,
        "pipework.verdict": verdict.action,
        "pipework.reason": verdict.reason,
    }
    if outcome.status is not None:
        attributes["http.response.status_code"] = outcome.status
    elif outcome.failure is not None:
        attributes["error.type"] = outcome.failure.value
    else:
        attributes["pipework.cancelled"] = True
    if verdict.action == "retry":
        attributes["pipework.retry_delay"] = verdict.delay
    _tracing.ACTIVE.event("try", attributes)


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def failure_of(exc: TransportFailure) -> Failure:
    """What a pool's failure says about the host (see :class:`Failure`)."""
    if isinstance(exc, ConnectFailed):
        return Failure.CONNECT
    if isinstance(exc, CallTimeout):
        return Failure.CONNECT if exc.phase == "connect" else Failure.TIMEOUT
    if isinstance(exc, ConnectionBroken) and isinstance(exc.__cause__, StaleConnection):
        return Failure.RESET  # closed before any byte of the answer
    return Failure.BROKEN


def refused(service: Service, refusal: Refusal) -> Overloaded:
    """The error of a call the service's core refused: 503 with ``Retry-After``."""
    return Overloaded(
        f"{refusal.message} (retry after {refusal.retry_after:g} s)",
        reason=refusal.reason,
        retry_after=refusal.retry_after,
        service=service.name,
    )


def _decode(service: Service, call: HttpCall, answer: Answer) -> Any:
    content_type = answer.header(b"content-type")
    if call.raw:
        return raw_value(
            None if content_type is None else content_type.decode("latin-1"), answer.body
        )
    text = "" if content_type is None else content_type.decode("latin-1")
    return decode_answer(service, answer.status, text, answer.body)


def unaccepted(service: Service, call: HttpCall, status: int) -> BackendError:
    return BackendError(
        f"service {service.name!r} answered HTTP {status}; "
        f"the pipe accepts {call.describe_accept()}",
        service=service.name,
        status=status,
    )


def too_big(service: Service, status: int) -> BackendError:
    return BackendError(
        f"service {service.name!r} answered with more than {service.max_response_bytes} "
        "bytes (its max_response_bytes)",
        service=service.name,
        status=status,
    )


def decode_answer(service: Service, status: int, content_type: str, body: bytes) -> Any:
    """An answer's body as the pipe keeps it: None when empty, parsed JSON for a JSON media
    type, else text in the charset the Content-Type names (UTF-8 if none or unknown)."""
    if not body:
        return None
    media, _, params = content_type.partition(";")
    media = media.strip().lower()
    if media == "application/json" or media.endswith("+json"):
        try:
            return json.loads(body)
        except ValueError:
            raise BackendError(
                f"service {service.name!r} answered with invalid JSON",
                service=service.name,
                status=status,
            ) from None
    charset = "utf-8"
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip(' "'):
            charset = value.strip(' "')
            break
    try:
        return body.decode(charset, errors="replace")
    except LookupError:
        return body.decode("utf-8", errors="replace")
