"""The streamed exchange: a request's body sent while it arrives and the answer's body read
while the caller relays it, on a connection of the lean keep-alive pool (:mod:`._pool`).

    timeouts = StreamTimeouts(connect=5, first_byte=30, idle=60)
    async with client.stream(b"PUT", b"/x", headers, body, length=None, timeouts=timeouts) as a:
        ...a.status, a.headers...
        async for piece in a.body():
            ...
        ...a.trailers...

What it promises, on top of the pool's own (a bounded pool, waiters first come first served,
idle connections closed):

- **It frames the request itself.** Framing headers in the caller's ``headers``
  (``Content-Length``, ``Transfer-Encoding``) are dropped; the request is sent with
  ``Content-Length`` when its length is known, chunked when a body comes without one, with
  neither when there is no body. ``Host`` is the service's unless ``headers`` hold one. So
  no request can leave a kept-alive connection out of step with the backend. A body that
  gives more or fewer bytes than its declared length raises ``ValueError`` and the
  connection is closed short of the request's end: the backend never gets a whole request
  from it (the piece that completes the length is held until the body is known to end).
- **Both ways at once.** A task sends the body while the answer's head is awaited, and goes
  on while the answer's body is read (a backend may stream its answer as it reads). An
  answer that comes early and refuses (a status of 400 or more) or says it closes the
  connection stops the sending at once: the rest of the body is never pulled, and the
  connection is closed after the exchange.
- **Back-pressure, bounded memory.** The socket is read only when the consumer of
  :meth:`UpstreamAnswer.body` asks for the next piece (at most 64 KiB at a time), and the
  caller's ``body`` is pulled only once the socket took the piece before. An exchange holds
  one piece each way, whatever the bodies' sizes.
- **Timeouts** raise :class:`~._failures.CallTimeout`: getting a connection (waiting for a
  free one, phase ``pool``, then connecting, phase ``connect``) within ``timeouts.connect``
  together; the answer's head within ``timeouts.first_byte`` of the request's end (phase
  ``answer``); and, once under way, each wait on the socket — for the next piece of the
  answer, or for the socket to take the next piece of the request — within
  ``timeouts.idle`` (phase ``idle``). Waits on the caller (its ``body``, or its reading of
  the answer) are the caller's to bound. ``deadline`` (trio time) bounds everything,
  the caller's code inside the ``async with`` included (phase: where it was).
- **Reuse only of what ended cleanly.** The connection goes back to the pool only if the
  request was sent whole, the answer read to its end (h11 DONE on both sides, and neither
  asked to close) and the ``async with`` ended without an exception. An answer left
  unread, an error, a timeout or a cancellation closes it — never returned, its place in
  the pool freed at once. (An answer whose end was already received is read on to it: a
  ``HEAD`` or ``204`` needs no loop over its empty body.)
- **One retry, for a stale connection only**, as the pool's: a reused connection that
  fails before any byte of the answer, for an idempotent method, and only if nothing was
  taken from ``body`` yet (what was taken cannot be sent again).
- **Answers as HTTP/1.1 has them**: informational (1xx) answers skipped, but a ``101`` is
  refused (:class:`~._failures.BadAnswer`: upgrades are not streamed here); ``HEAD``,
  ``204`` and ``304`` without a body; ``Content-Length``, chunked (trailers in
  :attr:`UpstreamAnswer.trailers` once the body is read), or a body to the end of the
  connection (HTTP/1.0 style; never reused). The body is passed on as it came (no content
  decoding).

Failures are the lean client's own (:mod:`._failures`), as the pool raises them; an
exception (``Exception``) raised by the caller's ``body`` is raised by the exchange, as it
was, where the caller waits on it (for the head, or the next piece of the body) — if the
caller reads the answer to its end first, only the connection's reuse is lost.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Final

import h11
import trio

from ._failures import CallTimeout, TransportFailure
from ._h1 import Connection, StaleConnection, first_header
from ._pool import EXCHANGE_ERRORS, IDEMPOTENT, RAN_OUT, Pool, Progress, failure

__all__ = ["Handshake", "StreamTimeouts", "UpstreamAnswer", "open_stream"]

#: Request headers the exchange never sends from the caller's list: it frames the body.
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})


@dataclass(frozen=True, slots=True)
class StreamTimeouts:
    """The time limits of a streamed exchange, in seconds (``math.inf`` for none):
    ``connect`` to get a connection (a free one, or a new one connected), ``first_byte``
    from the request's end to the answer's head, ``idle`` for each wait on the socket once
    the exchange is under way."""

    connect: float
    first_byte: float
    idle: float

    def __post_init__(self) -> None:
        for name in ("connect", "first_byte", "idle"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"StreamTimeouts.{name} must be a positive number, got {value}")


@dataclass(frozen=True, slots=True)
class Handshake:
    """How a proxied websocket's handshake with its backend ended: the answer's ``status``
    (101, or a refusal's), or none -- failed or ``timed_out`` in ``phase`` (``connect`` or
    ``handshake``; None: refused before the backend was asked)."""

    status: int | None
    phase: str | None = None
    timed_out: bool = False


class UpstreamAnswer:
    """An answer as it arrives: its head at once, its body from :meth:`body`, its trailers
    once the body was read to the end. Valid inside the ``async with`` that made it."""

    __slots__ = (
        "_body",
        "headers",
        "host",
        "http_version",
        "reason",
        "retries",
        "status",
        "trailers",
    )

    def __init__(self, response: h11.Response, body: AsyncIterator[bytes]) -> None:
        self.status: int = response.status_code
        self.reason: bytes = response.reason
        #: As received (names lower-cased by h11), framing headers included.
        self.headers: list[tuple[bytes, bytes]] = list(response.headers)
        self.http_version: bytes = response.http_version
        #: The chunked body's trailer fields, set when :meth:`body` ends (else empty).
        self.trailers: list[tuple[bytes, bytes]] = []
        self._body = body
        #: Set by the service's client: the host that answered (its ``Host``) and how many
        #: tries before it were retried, for the access log.
        self.host: str | None = None
        self.retries = 0

    def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (each piece at most 64 KiB), as sent (no content
        decoding). Each wait for the next piece is bounded by the idle timeout. One
        iterator per answer: calling this again goes on where it stopped."""
        return self._body

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""
        return first_header(self.headers, name)

    def __repr__(self) -> str:
        return f"UpstreamAnswer(status={self.status}, reason={self.reason!r})"


def open_stream(
    pool: Pool,
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    body: AsyncIterator[bytes] | None,
    *,
    host: bytes,
    length: int | None,
    timeouts: StreamTimeouts,
    deadline: float = math.inf,
) -> AbstractAsyncContextManager[UpstreamAnswer]:
    """Send ``method target`` with ``headers`` (``host`` as ``Host`` unless they hold one)
    and ``body`` (``length`` bytes, or unknown: chunked) to ``pool``'s backend; the context
    is the answer (see the module's docstring). Raises ``ValueError`` at once for a length
    that cannot be, and :class:`~._failures.TransportFailure` for a request h11 would not
    send (nothing is sent)."""
    if length is not None and length < 0:
        raise ValueError(f"a request body's length cannot be negative, got {length}")
    if body is None and length:
        raise ValueError(f"a request without a body cannot have a length of {length} bytes")
    if length == 0:
        body = None  # nothing to pull: Content-Length: 0
    request = _request(method, target, headers, host, length, chunked=body is not None)
    return _streamed(_Exchange(pool, request, body, length, timeouts), deadline)


def _request(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    host: bytes,
    length: int | None,
    *,
    chunked: bool,
) -> h11.Request:
    wire: list[tuple[bytes, bytes]] = []
    has_host = False
    for name, value in headers:
        lowered = name.lower()
        if lowered in _FRAMING:
            continue
        has_host = has_host or lowered == b"host"
        wire.append((name, value))
    if not has_host:
        wire.insert(0, (b"Host", host))
    if length is not None:
        wire.append((b"Content-Length", b"%d" % length))
    elif chunked:
        wire.append((b"Transfer-Encoding", b"chunked"))
    try:
        return h11.Request(method=method, target=target, headers=wire)
    except h11.LocalProtocolError as exc:
        raise TransportFailure(
            f"the request cannot be sent as HTTP/1.1 ({exc}); nothing was sent"
        ) from exc


@asynccontextmanager
async def _streamed(exchange: _Exchange, deadline: float) -> AsyncIterator[UpstreamAnswer]:
    clean = False
    with trio.CancelScope(deadline=deadline) as overall:
        escaped: BaseException | None = None
        try:
            # The sender needs a task; a request without a body needs none.
            tasks: AbstractAsyncContextManager[trio.Nursery | None] = (
                trio.open_nursery() if exchange.sends_body else nullcontext(None)
            )
            async with tasks as nursery:
                answer = await exchange.begin(nursery)
                yield answer
                exchange.stop_sending()  # the caller is done: the rest of the body is not
                clean = True
        except BaseExceptionGroup as group:
            # Only the caller's code and this task raise here (the sender keeps its own
            # errors for this task to raise): one exception, passed on as it was raised.
            escaped = _one(group)
        finally:
            exchange.release(clean=clean)
        if escaped is not None:
            raise escaped
    if overall.cancelled_caught:
        phase = exchange.progress.phase
        raise CallTimeout(
            f"{exchange.pool.where}: {RAN_OUT[phase]} by the exchange's deadline", phase=phase
        )


def _one(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception a nursery wrapped: the one that is not a cancellation, if any."""
    errors = [exc for exc in group.exceptions if not isinstance(exc, trio.Cancelled)]
    if len(errors) > 1:  # pragma: no cover - one task raises; kept whole if ever not
        return group
    return errors[0] if errors else group.exceptions[0]


class _Body:
    """The answer's body as an iterator (a class, not an async generator: one left
    half-way holds no frame for the garbage collector to finalize)."""

    __slots__ = ("_exchange",)

    def __init__(self, exchange: _Exchange) -> None:
        self._exchange = exchange

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        return await self._exchange.next_piece()


class _Exchange:
    """One streamed exchange: the main task begins it and reads the answer; the sender
    task (with a body) sends the request's body. They share the connection (one sends,
    one receives: a trio stream allows that) and tell each other through these fields."""

    __slots__ = (
        "_answer",
        "_body",
        "_ended",
        "_failure",
        "_head_wait",
        "_length",
        "_pulled",
        "_request",
        "_sender",
        "_sent",
        "_wait",
        "connection",
        "pool",
        "progress",
        "timeouts",
    )

    def __init__(
        self,
        pool: Pool,
        request: h11.Request,
        body: AsyncIterator[bytes] | None,
        length: int | None,
        timeouts: StreamTimeouts,
    ) -> None:
        self.pool = pool
        self.timeouts = timeouts
        self.progress = Progress()
        self.connection: Connection | None = None
        self._request = request
        self._body = body
        self._length = length
        self._answer: UpstreamAnswer | None = None
        self._sender: trio.CancelScope | None = None  # the sender's, while it may run
        self._pulled = False  # something was taken from the caller's body
        self._sent = False  # the request went out whole
        self._failure: BaseException | None = None  # the sender's, for this task to raise
        self._wait: trio.CancelScope | None = None  # this task's wait on the socket
        self._head_wait: trio.CancelScope | None = None  # the same, while it waits for the head
        self._ended = False  # the answer was read to its end

    @property
    def sends_body(self) -> bool:
        return self._body is not None

    # -- the main task ---------------------------------------------------------------------

    async def begin(self, nursery: trio.Nursery | None) -> UpstreamAnswer:
        """Get a connection, send the request's head, start the sender and wait for the
        answer's head, with the pool's one retry of a stale connection."""
        retry = self._request.method in IDEMPOTENT
        pool = self.pool
        while True:
            with trio.move_on_after(self.timeouts.connect) as getting:
                # One limit for both: waiting for a free connection and connecting.
                self.connection = await pool.acquire(self.progress, connect_timeout=math.inf)
            connection = self.connection
            if connection is None:
                assert getting.cancelled_caught
                raise self._no_connection()
            self.progress.phase = "answer"
            reused = connection.exchanges > 0
            try:
                response = await self._head(connection, nursery)
            except EXCHANGE_ERRORS as exc:
                stale = isinstance(exc, StaleConnection) and reused and retry
                if stale and not self._pulled:
                    retry = False
                    self.stop_sending()  # it never ran: it will not touch the connection
                    self.connection = None
                    pool.release(connection, reusable=False)
                    continue  # one more try, fresh
                raise failure(exc, pool.where, connection) from exc
            if not self._sent and (response.status_code >= 400 or _closes(response)):
                # Refused, or the backend hangs up after this answer: whatever more it
                # would be sent is not wanted (RFC 9112 §9.5).
                self.stop_sending()
            self._answer = UpstreamAnswer(response, _Body(self))
            return self._answer

    async def _head(self, connection: Connection, nursery: trio.Nursery | None) -> h11.Response:
        await connection.send_request(self._request, end=nursery is None)
        with trio.CancelScope() as wait:
            self._wait = self._head_wait = wait
            if nursery is None:
                self._sent = True
                self._request_sent()
            else:
                self._sender = trio.CancelScope()
                nursery.start_soon(self._send_body, connection, self._sender)
            try:
                return await connection.read_head()
            finally:
                self._wait = self._head_wait = None
        self._raise_failure()
        raise CallTimeout(
            f"{self.pool.where} sent no answer within {self.timeouts.first_byte:g}s "
            "of the request's end",
            phase="answer",
        )

    async def next_piece(self) -> bytes:
        """The next piece of the answer's body; StopAsyncIteration after its end."""
        if self._ended:
            raise StopAsyncIteration
        self._raise_failure()
        connection = self.connection
        if connection is None:
            raise trio.ClosedResourceError(
                "the exchange is over: its answer's body is read inside its `async with`"
            )
        with trio.CancelScope(deadline=trio.current_time() + self.timeouts.idle) as wait:
            self._wait = wait
            try:
                event = await connection.next_event()
            except EXCHANGE_ERRORS as exc:
                raise failure(exc, self.pool.where, connection) from exc
            finally:
                self._wait = None
            if isinstance(event, h11.Data):
                return bytes(event.data)
            self._ended = True
            if self._answer is not None:
                self._answer.trailers = list(event.headers)
            raise StopAsyncIteration
        self._raise_failure()
        raise CallTimeout(
            f"{self.pool.where} sent nothing more of its answer's body for "
            f"{self.timeouts.idle:g}s (the idle timeout)",
            phase="idle",
        )

    def stop_sending(self) -> None:
        """Send no more of the request (its connection will not be reused)."""
        if self._sender is not None:
            self._sender.cancel()

    def release(self, *, clean: bool) -> None:
        """Give the connection back: for reuse only if the exchange ended ``clean`` (no
        exception) with both messages whole, else closed."""
        connection, self.connection = self.connection, None
        if connection is None:
            return
        if clean and not self._ended and self._failure is None:
            self._ended = connection.drain_buffered()
        reusable = clean and self._ended and self._failure is None and connection.reusable
        if reusable:
            connection.exchanges += 1
        self.pool.release(connection, reusable=reusable)

    def _no_connection(self) -> CallTimeout:
        phase, limit = self.progress.phase, self.timeouts.connect
        if phase == "pool":
            what = f"no connection to {self.pool.where} came free within {limit:g}s"
        else:
            what = f"could not connect to {self.pool.where} within {limit:g}s"
        return CallTimeout(what, phase=phase)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # -- the sender task -------------------------------------------------------------------

    async def _send_body(self, connection: Connection, scope: trio.CancelScope) -> None:
        body = self._body
        assert body is not None
        with scope:
            try:
                # Stopped before it ran (a stale connection retried): take nothing.
                await trio.lowlevel.checkpoint_if_cancelled()
                self._pulled = True
                await self._send_pieces(connection, body)
            finally:
                if scope is self._sender:  # not one stopped for a retry
                    self._request_sent()

    async def _send_pieces(self, connection: Connection, body: AsyncIterator[bytes]) -> None:
        length, size = self._length, 0
        # The piece that completes a declared length goes out only once the body is known
        # to end there: a body that runs over must not leave a whole request behind.
        held: bytes | None = None
        while True:
            try:
                piece = await body.__anext__()
            except StopAsyncIteration:
                break
            except Exception as exc:  # the caller's: raised in the main task, as it was
                self._fail(exc)
                return
            if not piece:
                continue
            size += len(piece)
            if length is not None and size >= length:
                if size > length:
                    self._fail(_length_error(f"gave more than the {length} bytes"))
                    return
                held = piece
            elif not await self._send(connection, piece):
                return
        if length is not None and size < length:
            self._fail(_length_error(f"ended after {size} of the {length} bytes"))
        elif (held is None or await self._send(connection, held)) and await self._send(
            connection, None
        ):
            self._sent = True

    async def _send(self, connection: Connection, piece: bytes | None) -> bool:
        """Send a piece of the body (None: its end) within the idle timeout; False if the
        request cannot go on. A broken connection is left for the main task to find: the
        backend may have answered before it closed."""
        with trio.move_on_after(self.timeouts.idle):
            try:
                if piece is None:
                    await connection.send_end()
                else:
                    await connection.send_data(piece)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return False
            return True
        self._fail(
            CallTimeout(
                f"{self.pool.where} took nothing more of the request's body for "
                f"{self.timeouts.idle:g}s (the idle timeout)",
                phase="idle",
            )
        )
        return False

    def _request_sent(self) -> None:
        """The request went out as far as it will: the wait for the head is bounded from
        now on (it was not while the body was going out)."""
        wait = self._head_wait
        if wait is not None:
            wait.deadline = min(wait.deadline, trio.current_time() + self.timeouts.first_byte)

    def _fail(self, exc: BaseException) -> None:
        """The sender cannot go on because of ``exc``: the main task raises it from its
        current wait (or its next)."""
        if self._failure is None:
            self._failure = exc
        if self._wait is not None:
            self._wait.cancel()


def _length_error(what: str) -> ValueError:
    return ValueError(
        f"the request's body {what} its length said: it was not sent whole (the "
        "connection was closed)"
    )


def _closes(response: h11.Response) -> bool:
    """Whether the answer says its connection closes after it."""
    if response.http_version < b"1.1":
        return True
    for name, value in response.headers:
        if name == b"connection" and any(
            token.strip() == b"close" for token in value.lower().split(b",")
        ):
            return True
    return False
