"""A service client's proxied exchanges, for proxy routes: a streamed request
(:meth:`ProxyCalls.stream`) and a websocket (:meth:`ProxyCalls.websocket`, a
:class:`WebsocketCall`), each a call of the service's core.

A streamed exchange goes through the same core as a call (:mod:`._client_tries`), with
three differences: a try ends at the answer's head (its status is the outcome; the body is
the caller's to relay), a try is retried only while nothing of the request's body was read
(a failed connection always qualifies: nothing was sent), and it never hedges. A websocket
is tried again only while no connection was made: the handshake's answer is the client's.

Separate from the calls of HTTP pipes: the proxy passes requests through rather than making
them, and relays the answers as they stream.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import replace

import trio

from .._errors import Overloaded
from ._answers import failure_of, refused
from ._call_core import Attempt, Call, Refusal
from ._client_hosts import ClientHosts, HostLink
from ._failures import ConnectFailed, TransportFailure
from ._outlier_core import Failure, Outcome
from ._pool import connect_failed
from ._stream import Handshake, StreamTimeouts, UpstreamAnswer, open_stream

__all__ = ["ProxyCalls", "WebsocketCall"]


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


class ProxyCalls(ClientHosts):
    """The proxied exchanges of a :class:`ClientHosts`' service (see the module)."""

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


class WebsocketCall:
    """One proxied websocket through its service's core (:meth:`ProxyCalls.websocket`):
    :meth:`connect` opens a connection to the host the core picks -- another one after a
    connection not made, by the core's rules -- :meth:`host` names that host,
    :meth:`handshake_done` counts the try's outcome (the handshake's answer; the host
    counts the websocket as outstanding while it stays open). Nothing is tried again once
    connected: the handshake's answer is the client's."""

    __slots__ = ("_attempt", "_call", "_client", "_link", "_timeout")

    def __init__(self, client: ClientHosts, call: Call, connect_timeout: float) -> None:
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
