"""A keep-alive pool of HTTP/1.1 connections to one backend, on h11 (see :mod:`._h1`),
over TLS for an ``https://`` one (``ssl_context``).

What it promises:

- **A bounded pool.** At most ``max_connections`` are open or being opened at once. A
  call that finds none free waits its turn, first come first served, within its own
  timeout (then :class:`~._failures.CallTimeout`, phase ``pool``). A connection put back
  goes straight to the longest waiter, so a newcomer never overtakes one.
- **Reuse.** A connection whose exchange ended cleanly, and that neither side asked to
  close (``Connection: close``, HTTP/1.0, a body read to EOF), goes back idle and carries
  the next call. The most recently used idle connection is taken first (warm, least likely
  to have been closed by the peer); at most ``max_idle`` are kept.
- **Idle connections close.** One idle for ``idle_timeout`` seconds or more is closed when
  the pool is next used (a call or a put-back sweeps them) and at :meth:`aclose`. The pool
  runs no task of its own. One the peer closed while idle is noticed on checkout (its
  socket reads EOF) and replaced.
- **Timeouts.** One deadline, given with the call, covers waiting for a connection,
  connecting (with the TLS handshake) and the exchange; connecting is also bounded by
  ``connect_timeout``. Running out raises :class:`~._failures.CallTimeout` naming the
  phase it hit (``pool``, ``connect`` or ``answer``).
- **Clean cancellation.** A connection in use when its call is cancelled, times out or
  fails in any way is closed, never reused; a waiter that is cancelled after being handed
  a connection or a place passes it on.
- **One retry, for a stale connection only.** If a *reused* connection fails before any
  byte of the answer arrived (the peer closed it while idle — the race every keep-alive
  client has), an idempotent request (GET, HEAD, PUT, DELETE, OPTIONS) is sent once more on
  a fresh connection. A POST or PATCH is not: the backend may have acted on it. A failure
  after the first byte of the answer, or on a fresh connection, is never retried.
- **An answer too big stops there.** Past ``max_bytes`` of (decoded) body the exchange
  stops reading, at once, however much more the backend would send, and its connection is
  closed; :class:`~._h1.ResponseTooLarge` says so.
- **A failed call keeps nothing it read.** Its error may outlive it (a failed job keeps its
  own): neither the error's frames nor the closed connection hold the body read so far.

Failures are raised as the lean client's own exceptions (:mod:`._failures`), each with
what it came from as ``__cause__``: :class:`~._failures.ConnectFailed` (nothing was sent:
no connection, or a TLS handshake that failed -- a certificate not trusted, a name that
does not match, a client certificate refused),
:class:`~._failures.ConnectionBroken` (reset, or closed before the answer's end),
:class:`~._failures.BadAnswer` (not valid HTTP/1.1; :class:`~._h1.BadEncoding` for a body
that does not decode), :class:`~._failures.CallTimeout`. ``Backends`` translates them into
pipework's errors. :class:`~._h1.ResponseTooLarge` passes through.
"""

from __future__ import annotations

import ssl
import traceback
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final

import h11
import trio

from ._failures import (
    BadAnswer,
    CallTimeout,
    ConnectFailed,
    ConnectionBroken,
    Phase,
    TransportFailure,
)
from ._h1 import Answer, Connection, ResponseTooLarge, StaleConnection

__all__ = [
    "EXCHANGE_ERRORS",
    "IDEMPOTENT",
    "RAN_OUT",
    "Answer",
    "Pool",
    "PoolStatistics",
    "Progress",
    "ResponseTooLarge",
    "connect_failed",
    "failure",
]

#: Methods that may be sent again when a kept-alive connection turns out stale (RFC 9110
#: §9.2.2 idempotent methods).
IDEMPOTENT: Final = frozenset({b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"})

Connect = Callable[[str, int], Awaitable[trio.SocketStream]]

#: What had not happened when a call's deadline passed, by the phase it was in.
RAN_OUT: Final[dict[Phase, str]] = {
    "pool": "no connection came free",
    "connect": "no connection was made",
    "answer": "no whole answer came",
    "idle": "the body stalled",
}

#: What an exchange on a connection raises when it fails (see :func:`failure`).
EXCHANGE_ERRORS: Final = (
    StaleConnection,
    h11.ProtocolError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    OSError,
)


class Progress:
    """Where a call is: the phase its deadline names if it passes now."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase: Phase = "pool"


class PoolStatistics:
    """A snapshot of a pool: connections open (in use or idle), idle, and waiting calls."""

    __slots__ = ("idle", "open", "waiting")

    def __init__(self, open: int, idle: int, waiting: int) -> None:
        self.open = open
        self.idle = idle
        self.waiting = waiting

    def __repr__(self) -> str:
        return f"PoolStatistics(open={self.open}, idle={self.idle}, waiting={self.waiting})"


class _Waiter:
    __slots__ = ("connection", "event", "granted")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.granted = False  # a place (or a connection) was handed to this waiter
        self.connection: Connection | None = None


class Pool:
    """Keep-alive HTTP/1.1 connections to ``host:port`` (see the module's docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int = 10,
        max_idle: int | None = None,
        idle_timeout: float = 5.0,
        connect_timeout: float = 10.0,
        connect: Connect | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.max_idle = max_connections if max_idle is None else min(max_idle, max_connections)
        self.idle_timeout = idle_timeout
        self.connect_timeout = connect_timeout
        self._connect_to: Connect = connect if connect is not None else _open_tcp
        #: TLS over each connection (an ``https://`` backend), checking ``server_name``
        #: (the host's, unless given) in its certificate.
        self.ssl_context = ssl_context
        self.server_name = host if server_name is None else server_name
        self._open = 0  # connections open, being opened, or places handed to a waiter
        self._idle: deque[Connection] = deque()  # oldest put-back on the left
        self._waiters: deque[_Waiter] = deque()
        self._closed = False

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self._open, len(self._idle), len(self._waiters))

    async def request(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None = None,
        *,
        deadline: float,
        max_bytes: int,
    ) -> Answer:
        """Send a request and return its whole answer (see the module's docstring for the
        rules), by ``deadline`` (trio time). ``headers`` must include ``Host``."""
        retry = method in IDEMPOTENT
        progress = Progress()
        with trio.CancelScope(deadline=deadline) as scope:
            while True:
                connection = await self.acquire(progress)
                progress.phase = "answer"
                reused = connection.exchanges > 0
                done = False
                try:
                    try:
                        answer = await connection.exchange(
                            method, target, headers, body, max_bytes=max_bytes
                        )
                    except BaseException as exc:
                        # The error may be kept (a failed job keeps its own for its
                        # retention), and with it the frames it came through: not their
                        # locals, which hold what the exchange read (the body so far).
                        traceback.clear_frames(exc.__traceback__)
                        raise
                    done = True
                except EXCHANGE_ERRORS as exc:
                    if isinstance(exc, StaleConnection) and reused and retry:
                        retry = False
                        continue  # the finally below closed it; one more try, fresh
                    raise failure(exc, self.where, connection) from exc
                finally:
                    self.release(connection, reusable=done and connection.reusable)
                return answer
        assert scope.cancelled_caught
        raise CallTimeout(
            f"{self.where}: {RAN_OUT[progress.phase]} by the call's deadline",
            phase=progress.phase,
        )

    @property
    def where(self) -> str:
        """``host:port``, as the pool's errors name it."""
        return f"{self.host}:{self.port}"

    async def acquire(
        self, progress: Progress, *, connect_timeout: float | None = None
    ) -> Connection:
        """A connection for one exchange: an idle one, or a new one once a place is free
        (first come first served), connected within ``connect_timeout`` (None: the pool's).
        ``progress.phase`` says which it is waiting for. Give it back with :meth:`release`."""
        progress.phase = "pool"
        connection = await self._checkout()
        if connection is None:  # a place to open one
            progress.phase = "connect"
            connection = await self._new_connection(connect_timeout)
        return connection

    def release(self, connection: Connection, *, reusable: bool) -> None:
        """Give back a connection from :meth:`acquire`: ``reusable`` only if its exchange
        ended cleanly (:attr:`Connection.reusable`) — else it is closed."""
        self._checkin(connection, reusable=reusable)

    async def aclose(self) -> None:
        """Close every idle connection and refuse new calls; connections in use close
        when their calls end."""
        self._closed = True
        while self._idle:
            self._drop(self._idle.pop())
        await trio.lowlevel.checkpoint()

    # -- the bookkeeping (no I/O but closing sockets) ------------------------------------

    async def _checkout(self) -> Connection | None:
        """An idle connection, or None with a place reserved to open a new one."""
        if self._closed:
            raise ConnectFailed(f"the pool of connections to {self.where} is closed")
        # A cancellation is taken before anything is taken from the pool; the schedule
        # point after it is shielded, so that what was taken is never lost to one.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._expire()
        idle = self._idle
        while idle:
            connection = idle.pop()
            if not connection.readable():
                # No schedule point here: the exchange's first write, at once, is one.
                return connection
            self._drop(connection)  # the peer closed it while idle
        if self._open < self.max_connections:
            self._open += 1
            await trio.lowlevel.cancel_shielded_checkpoint()
            return None
        waiter = _Waiter()
        self._waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if not waiter.granted:
                self._waiters.remove(waiter)
            elif waiter.connection is not None:
                self._checkin(waiter.connection, reusable=True)
            else:
                self._open -= 1
                self._hand_on()
            raise
        return waiter.connection

    async def _new_connection(self, within: float | None) -> Connection:
        within = self.connect_timeout if within is None else within
        stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
        try:
            with trio.move_on_after(within) as scope:
                stream = await self._connect_to(self.host, self.port)
                if self.ssl_context is not None:  # the handshake is part of connecting
                    stream = await self.handshake(stream, self.ssl_context)
        except BaseException as exc:
            self._open -= 1
            self._hand_on()
            if isinstance(exc, OSError | trio.BrokenResourceError):
                raise connect_failed(self.where, exc) from exc
            raise
        if scope.cancelled_caught:
            self._open -= 1
            self._hand_on()
            raise CallTimeout(
                f"could not connect to {self.where} within {within:g}s",
                phase="connect",
            )
        return Connection(stream)

    async def handshake(
        self, stream: trio.SocketStream, context: ssl.SSLContext
    ) -> trio.SSLStream[trio.SocketStream]:
        """TLS over ``stream``; closed if the handshake fails or is cancelled. A failed
        handshake raises ``trio.BrokenResourceError`` (the ``ssl`` error as its cause)."""
        tls = trio.SSLStream(
            stream, context, server_hostname=self.server_name, https_compatible=True
        )
        try:
            await tls.do_handshake()
        except BaseException:
            stream.socket.close()
            raise
        return tls

    def _checkin(self, connection: Connection, *, reusable: bool) -> None:
        """Put a connection back after a call: to the longest waiter, idle, or closed."""
        if not reusable or self._closed:
            self._drop(connection)
            return
        waiters = self._waiters
        if waiters:
            waiter = waiters.popleft()
            waiter.granted = True
            waiter.connection = connection
            waiter.event.set()
            return
        if len(self._idle) >= self.max_idle or self.idle_timeout <= 0:
            self._drop(connection)
            return
        connection.idle_since = trio.current_time()
        self._idle.append(connection)
        self._expire()

    def _drop(self, connection: Connection) -> None:
        connection.close()
        self._open -= 1
        self._hand_on()

    def _hand_on(self) -> None:
        """A place came free: give it to the longest waiter, who opens a connection."""
        if self._waiters and self._open < self.max_connections:
            waiter = self._waiters.popleft()
            waiter.granted = True
            self._open += 1
            waiter.event.set()

    def _expire(self) -> None:
        idle = self._idle
        if not idle:
            return
        horizon = trio.current_time() - self.idle_timeout
        while idle and idle[0].idle_since <= horizon:
            self._drop(idle.popleft())


def failure(exc: BaseException, where: str, connection: Connection) -> TransportFailure:
    """The lean client's exception for one of :data:`EXCHANGE_ERRORS` raised by an exchange
    with ``where`` on ``connection`` (raise it ``from`` the original)."""
    if isinstance(exc, StaleConnection):
        return ConnectionBroken(f"the connection to {where} failed before an answer ({exc})")
    if isinstance(exc, h11.RemoteProtocolError):
        if connection.peer_closed:  # cut short, not malformed
            return ConnectionBroken(
                f"{where} closed the connection before the answer's end ({exc})"
            )
        return BadAnswer(f"{where} sent an invalid answer: {exc}")
    if isinstance(exc, h11.LocalProtocolError):  # unreachable: requests are checked first
        return TransportFailure(f"the request could not be sent: {exc}")
    return ConnectionBroken(f"the connection to {where} broke mid-answer: {exc!r}")


def connect_failed(where: str, exc: OSError | trio.BrokenResourceError) -> ConnectFailed:
    """The failure of a connection not made to ``where`` (raise it ``from`` ``exc``): no
    socket (``OSError``), or a TLS handshake that failed (``trio.BrokenResourceError``
    from the ``ssl`` error; an ``ssl.SSLError`` is an ``OSError`` too). Nothing was sent
    either way: the core may try another host."""
    if isinstance(exc, trio.BrokenResourceError | ssl.SSLError):
        cause = exc if isinstance(exc, ssl.SSLError) else (exc.__cause__ or exc)
        return ConnectFailed(f"could not connect to {where}: the TLS handshake failed: {cause}")
    return ConnectFailed(f"could not connect to {where}: {exc}")


async def _open_tcp(host: str, port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream(host, port)
