"""pipework's own HTTP/1.1 server for cleartext connections, on trio and h11.

hypercorn's HTTP/1.1 path costs a refused proxy request about half its CPU: a task for the
app beside the connection's reading task, a memory channel between them, an idle timer
task restarted on every request, and a write for the answer's head apart from its body
(docs/design.md, "A lean serving path"). This server does the same work with less:

- one task per connection, which reads a request's head, calls the app, and writes what
  it sends; the answer's head and its first body message go out in one write;
- no idle timer task: the wait for the next request is bounded by a cancel scope
  (``keep_alive_timeout``), which a graceful shutdown cancels at once;
- ``receive`` reads the request's body from the socket as the app asks for it
  (backpressure: nothing is read ahead), answers ``Expect: 100-continue`` on the app's
  first ask, then watches the socket for the client's hang-up (``http.disconnect``);
  bytes a client sends early (a pipelined request) are kept for the next request, up to
  ``h11_max_incomplete_size``, and bytes after a request that closes its connection are
  dropped unread, as :mod:`._hypercorn_h11` does for hypercorn;
- the framing refusals and problem answers of :mod:`._framing`, shared with the
  hypercorn path: a connection whose head h11 or RFC 9112 refuses is answered with a
  problem and closed; every status line has its reason phrase;
- a connection's failure is its own: logged once, that connection closed, never the
  server's end.

What it does not speak itself it hands off, with the bytes it read replayed first: a
request with ``Upgrade: websocket`` or ``Upgrade: h2c``, or HTTP/2's prior-knowledge
preface, makes its connection hypercorn's (its trio ``TCPServer``, with pipework's fixes),
so websockets and h2c are served exactly as without this server. TLS connections never
come here (:func:`._server.serve` gives them to hypercorn entirely, for ALPN and h2).

It reads its settings from the same :class:`hypercorn.config.Config` the hypercorn path
uses, and runs the app's lifespan with hypercorn's own ``Lifespan``, so both paths start,
shut down and time out alike.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Final

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ASGIFramework, ConnectionState
from hypercorn.utils import parse_socket_addr

from .._http._problems import Problem
from ..dispatcher._boundary import split_outside
from . import _framing, _h1_core

__all__ = ["serve_h1"]

_READ: Final = 64 * 1024

# Each close takes microseconds; the bound only matters if a peer stops reading.
_CLOSE_TIMEOUT: Final = 5.0

#: A body the app left unread is read and dropped up to this many bytes, so that the
#: connection can carry the next request (hypercorn reads it regardless of the app).
_DRAIN_LIMIT: Final = 64 * 1024

#: Closing a connection while the client still sends (a body the app refused unread,
#: bytes after a closing request) is a lingering close: the server's side is shut, then
#: what arrives is read and dropped until the client closes, for up to _LINGER seconds
#: and _LINGER_QUIET between reads. Closing with unread bytes would send a reset, and a
#: reset can destroy the answer before the client has read it.
_LINGER: Final = 10.0
_LINGER_QUIET: Final = 2.0

#: What ends a connection because of its peer (gone, reset, too slow): nothing to log.
_PEER_ENDED: Final = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.TooSlowError,
    OSError,
)

_log = logging.getLogger("pipework.container")

_Message = MutableMapping[str, Any]


class _Replay(trio.abc.HalfCloseableStream):
    """A connection's socket stream with the bytes already read from it served first: how
    a connection is handed to hypercorn. It has the ``socket`` hypercorn's ``TCPServer``
    reads addresses from, and no ``do_handshake``, so hypercorn treats it as cleartext."""

    def __init__(self, stream: trio.SocketStream, data: bytes) -> None:
        self.stream = stream
        self.socket = stream.socket
        self._data = data

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._data:
            await trio.lowlevel.checkpoint()
            data, self._data = self._data, b""
            return data
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Server:
    """What every connection shares: the app, the settings read once from the config,
    the lifespan's state, and the connections waiting for their next request (which a
    graceful shutdown closes)."""

    def __init__(self, app: ASGIFramework, config: Config) -> None:
        self.app = app
        self.wrapped = ASGIWrapper(app)
        self.config = config
        self.state: dict[str, Any] = {}
        self.keep_alive_timeout = float(config.keep_alive_timeout)
        self.max_requests = int(config.keep_alive_max_requests)
        self.read_timeout = config.read_timeout
        self.root_path = config.root_path
        self.server_names = list(config.server_names)
        self.raw_headers = bool(config.h11_pass_raw_headers)
        self.max_head = int(config.h11_max_incomplete_size)
        self.date = bool(config.include_date_header)
        self.server_header = bool(config.include_server_header)
        self.access_logger = config.log.access_logger
        self.closing = False
        self.idle: set[_Connection] = set()
        # What hypercorn's TCPServer needs for a connection handed to it; ``terminated``
        # is how a graceful shutdown reaches it.
        self.context = WorkerContext(None)

    async def begin_closing(self) -> None:
        """Graceful shutdown: connections waiting for a request close now, the others
        after their answer in flight."""
        self.closing = True
        for connection in list(self.idle):
            connection.close_idle()
        await self.context.terminated.set()


class _Connection:
    """One client connection, served in its task."""

    __slots__ = (
        "address",
        "client",
        "h11",
        "idle_scope",
        "linger",
        "peer",
        "record",
        "send_lock",
        "served",
        "server",
        "stream",
        "write_failed",
    )

    def __init__(self, server: _Server, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=server.max_head)
        self.send_lock = trio.Lock()
        self.served = 0
        self.idle_scope: trio.CancelScope | None = None
        # The bytes read since this request's head began (for a hand-off), or None.
        self.record: list[bytes] | None = []
        self.write_failed = False
        self.linger = False  # whether the client may still be sending when we close
        sock = stream.socket
        try:
            self.client = parse_socket_addr(sock.family, sock.getpeername())
            self.address = parse_socket_addr(sock.family, sock.getsockname())
        except OSError:  # the client is gone already: its first read will say so
            self.client = self.address = None
        client = self.client
        self.peer = "an unknown peer" if client is None else f"{client[0]}:{client[1]}"

    # -- reading -------------------------------------------------------------------------

    async def receive(self) -> bytes:
        """The next bytes from the client; empty at its end (or a broken connection)."""
        timeout = self.server.read_timeout
        try:
            if timeout is None:
                return await self.stream.receive_some(_READ)
            with trio.fail_after(timeout or math.inf):
                return await self.stream.receive_some(_READ)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def next_event(self) -> Any:
        h = self.h11
        while True:
            event = h.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await self.receive()
            if self.record is not None:
                self.record.append(data)
            h.receive_data(data)

    # -- writing -------------------------------------------------------------------------

    async def write(self, data: bytes) -> bool:
        """Send ``data``; False if the client is gone (the app is not told by an error,
        as with hypercorn: it learns of it through ``http.disconnect``)."""
        if self.write_failed:
            return False
        try:
            async with self.send_lock:
                await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.write_failed = True
            return False
        return True

    async def send_problem(self, problem: Problem) -> None:
        """Answer with ``problem``; the connection ends after it. Framed whole before the
        write: another task may try to answer meanwhile, and h11 refuses the second."""
        headers, body = _framing.encode(problem, close=True)
        headers += _h1_core.server_headers(self.server.date, self.server.server_header)
        status = problem.status
        h = self.h11
        try:
            data = h.send(
                h11.Response(status_code=status, headers=headers, reason=_framing.reason(status))
            )
            data = (data or b"") + (h.send(h11.Data(data=body)) or b"")
            data += h.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError:
            return  # an answer is under way already: it is the one the client gets
        await self.write(data)

    async def close(self) -> None:
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            try:
                await self.stream.send_eof()
            except (trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError):
                self.linger = False
            except OSError:
                self.linger = False  # not connected any more
        if self.linger:
            # Not shielded: a graceful shutdown's deadline ends it like any other wait.
            with trio.move_on_after(_LINGER):
                while True:
                    with trio.move_on_after(_LINGER_QUIET):
                        if await self.receive():
                            continue
                    break
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    def close_idle(self) -> None:
        if self.idle_scope is not None:
            self.idle_scope.cancel()

    # -- the connection's life -----------------------------------------------------------

    async def run(self) -> None:
        server = self.server
        h = self.h11
        while not server.closing:
            with trio.CancelScope(deadline=trio.current_time() + server.keep_alive_timeout) as idle:
                self.idle_scope = idle
                server.idle.add(self)
                try:
                    event = await self.next_event()
                except h11.RemoteProtocolError as error:
                    if h.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                        await self.send_problem(
                            _framing.problem_for(error.error_status_hint, error)
                        )
                        self.linger = True
                    return
                finally:
                    server.idle.discard(self)
                    self.idle_scope = None
            if idle.cancelled_caught or not isinstance(event, h11.Request):
                return  # idle too long, shutting down, or the client's end
            if _h1_core.handoff(event) is not None:
                await self.hand_off()
                return
            self.record = None
            if not await self.serve_request(event):
                # Answered, and the client may be sending still (unless it is gone).
                self.linger = h.their_state is not h11.CLOSED and not self.write_failed
                return
            h.start_next_cycle()
            pending = h.trailing_data[0]
            self.record = [pending] if pending else []

    async def hand_off(self) -> None:
        """Make this connection hypercorn's, from the first byte of this request on."""
        server = self.server
        data = b"".join(self.record or ())
        self.record = None
        replay = _Replay(self.stream, data)
        state = ConnectionState(server.state.copy())
        await TCPServer(server.wrapped, server.config, server.context, state, replay)  # type: ignore[arg-type]  # a cleartext stream, as hypercorn's duck typing allows

    async def serve_request(self, request: h11.Request) -> bool:
        """Serve one request; whether the connection can carry another."""
        server = self.server
        problem = _framing.refusal(request.method, request.http_version, list(request.headers))
        if problem is None and not _h1_core.server_name_allowed(server.server_names, request):
            problem = _framing.problem_for(404)
        if problem is not None:
            await self.send_problem(problem)
            return False
        self.served += 1
        scope = _h1_core.http_scope(
            request,
            scheme="http",
            client=self.client,
            server=self.address,
            root_path=server.root_path,
            state=server.state,
            raw_headers=server.raw_headers,
        )
        exchange = _Exchange(self, scope)
        try:
            await server.app(scope, exchange.receive, exchange.send)  # type: ignore[arg-type]  # ASGI's typed dicts
        except BaseException as escaped:
            outside, errors = split_outside(escaped)
            if errors is not None:
                await server.config.log.exception("Error in ASGI Framework", exc_info=errors)
            if outside is not None:
                raise outside from None
        if not exchange.started and not exchange.answered and not exchange.gone:
            # The app ended without answering.
            exchange.answered = True
            await self.send_problem(_framing.problem_for(500))
            await exchange.log_access(500)
            return False
        h = self.h11
        keep = (
            exchange.ended
            and not exchange.gone
            and not exchange.answered
            and not self.write_failed
            and h.our_state is h11.DONE
            and not server.closing
        )
        if keep and h.their_state is h11.SEND_BODY:
            keep = await self.drain_body()
        return keep and h.their_state is h11.DONE

    async def drain_body(self) -> bool:
        """Read and drop what is left of a request body the app did not read (often
        nothing but its end: a request without a body whose app never asked), up to
        :data:`_DRAIN_LIMIT` bytes; whether it ended."""
        h = self.h11
        dropped = 0
        with trio.move_on_after(self.server.keep_alive_timeout):
            try:
                while dropped <= _DRAIN_LIMIT:
                    event = h.next_event()
                    if event is h11.NEED_DATA:
                        data = await self.receive()
                        if not data:
                            return False
                        h.receive_data(data)
                    elif type(event) is h11.Data:
                        dropped += len(event.data)
                    else:
                        return type(event) is h11.EndOfMessage
            except h11.RemoteProtocolError:
                return False
        return False


class _Exchange:
    """One request on a connection: the ASGI ``receive`` and ``send`` its app gets."""

    __slots__ = (
        "answered",
        "body_done",
        "conn",
        "ended",
        "gone",
        "head",
        "method",
        "scope",
        "start_time",
        "started",
        "suppress",
        "watch",
    )

    def __init__(self, conn: _Connection, scope: dict[str, Any]) -> None:
        self.conn = conn
        self.scope = scope
        self.method: str = scope["method"]
        self.start_time = time.time()
        self.head: tuple[int, Any] | None = None
        self.suppress = False
        self.body_done = False
        self.started = False  # the answer's head went out
        self.ended = False  # the whole answer went out
        self.gone = False  # the client hung up
        self.answered = False  # the server answered for the app (a problem)
        self.watch: trio.CancelScope | None = None

    async def receive(self) -> _Message:
        conn = self.conn
        h = conn.h11
        if not self.body_done and not self.gone and not self.answered:
            if h.they_are_waiting_for_100_continue:
                await conn.write(h.send(_h1_core.informational(100)) or b"")
            try:
                event = await conn.next_event()
            except h11.RemoteProtocolError as error:
                # The body's framing is broken: answered here, unless the app's answer
                # is under way (then it ends first, and the connection after it).
                if not self.started:
                    self.answered = True
                    await conn.send_problem(_framing.problem_for(error.error_status_hint, error))
                self.gone = True
                return {"type": "http.disconnect"}
            except trio.TooSlowError:
                # read_timeout: hypercorn ends the connection, and the app hears of it as
                # a hang-up.
                self.gone = True
                return {"type": "http.disconnect"}
            if type(event) is h11.Data:
                return {"type": "http.request", "body": bytes(event.data), "more_body": True}
            if type(event) is h11.EndOfMessage:
                self.body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            self.gone = True
            return {"type": "http.disconnect"}
        await self._watch_hang_up()
        return {"type": "http.disconnect"}

    async def _watch_hang_up(self) -> None:
        """Return when the client hangs up or the answer has ended (hypercorn too tells the
        app ``http.disconnect`` then). Bytes sent early are h11's to keep for the next
        request, up to the head limit; beyond it reading waits for the answer's end."""
        conn = self.conn
        h = conn.h11
        limit = conn.server.max_head
        kept = 0
        with trio.CancelScope() as self.watch:
            while not self.ended and not self.gone and not self.answered:
                if kept > limit:
                    await trio.sleep_forever()
                try:
                    data = await conn.receive()
                except trio.TooSlowError:  # read_timeout, as above
                    data = b""
                if not data:
                    self.gone = True
                    break
                if h.their_state is h11.DONE:  # not MUST_CLOSE nor ERROR: dropped unread
                    h.receive_data(data)
                    kept += len(data)
        self.watch = None

    async def send(self, message: _Message) -> None:
        kind = message["type"]
        if self.answered:
            return  # the server answered for the app; the app's answer has no place
        if kind == "http.response.start" and self.head is None:
            status = int(message["status"])
            headers = message.get("headers", ())
            self.head = (status, headers)
            self.suppress = _h1_core.suppress_body(self.method, status)
            if not self.suppress and not _h1_core.has_length(headers):
                # A streamed answer (server-sent events, a relayed download): its head
                # goes now, as the client may wait on it before the first piece exists.
                data = self._head_bytes()
                if not self.gone:
                    await self.conn.write(data)
            return
        if kind != "http.response.body" or self.head is None or self.ended:
            raise RuntimeError(
                f"unexpected ASGI message {kind!r} "
                f"({'after the answer ended' if self.ended else 'in this state'})"
            )
        conn = self.conn
        h = conn.h11
        data = b"" if self.started else self._head_bytes()
        body = message.get("body", b"")
        if body and not self.suppress:
            data += h.send(h11.Data(data=body)) or b""
        if not message.get("more_body", False):
            data += h.send(h11.EndOfMessage()) or b""
            self.ended = True
        if data and not self.gone:
            await conn.write(data)
        if self.ended:
            # Only now: the app may end its request on the disconnect this wakes, and
            # must not cancel its own last write.
            if self.watch is not None:
                self.watch.cancel()
            await self.log_access(self.head[0])

    def _head_bytes(self) -> bytes:
        """The answer's head, framed (the answer has started once this returns)."""
        assert self.head is not None  # called after http.response.start
        conn = self.conn
        server = conn.server
        status, headers = self.head
        close = conn.served >= server.max_requests or server.closing
        head = _h1_core.response_head(
            status, headers, close=close, date=server.date, server=server.server_header
        )
        data = conn.h11.send(head) or b""
        self.started = True
        return data

    async def log_access(self, status: int) -> None:
        if self.conn.server.access_logger is not None:
            response = {"status": status, "headers": []}
            took = time.time() - self.start_time
            await self.conn.server.config.log.access(self.scope, response, took)  # type: ignore[arg-type]  # hypercorn's typed dicts


def _listeners(config: Config) -> list[trio.SocketListener]:
    sockets = config.create_sockets()
    listeners = []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    return listeners


async def serve_h1(
    app: ASGIFramework,
    config: Config,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the one cleartext address ``config.bind`` names, as hypercorn's
    ``serve`` would: the app's lifespan startup first, ``task_status.started((host,
    port))`` once listening, and when ``shutdown_trigger`` returns, a graceful shutdown
    (stop accepting at once, close idle connections, let answers in flight end for up to
    ``graceful_timeout`` seconds, cancel the rest), then the app's lifespan shutdown."""
    server = _Server(app, config)
    lifespan = Lifespan(server.wrapped, config, server.state)

    async def handle(stream: trio.SocketStream) -> None:
        connection = _Connection(server, stream)
        try:
            await connection.run()
        except BaseException as escaped:
            outside, errors = split_outside(escaped)
            if errors is not None:
                errors = _not_peer(errors)
            if errors is not None:
                _log.error(
                    "a connection from %s failed in the server; closed that connection only",
                    connection.peer,
                    exc_info=errors,
                )
            if outside is not None:
                raise outside from None
        finally:
            await connection.close()

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            listeners = _listeners(config)
            if len(listeners) != 1:
                raise RuntimeError(f"expected one address to listen on, got {len(listeners)}")
            sock = listeners[0].socket
            host, port = sock.getsockname()[:2]
            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(
                        functools.partial(
                            trio.serve_listeners, handle, listeners, handler_nursery=connections
                        )
                    )
                    task_status.started((str(host), int(port)))
                    if shutdown_trigger is None:
                        await trio.sleep_forever()
                    await shutdown_trigger()
                    # Stop accepting at once: the listening socket closes, the port is free.
                    accepting.cancel_scope.cancel()
            finally:
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
                with trio.CancelScope(shield=True):
                    await server.begin_closing()
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def _not_peer(errors: BaseException) -> BaseException | None:
    """``errors`` without what a peer's going away raises (nothing to log)."""
    if isinstance(errors, BaseExceptionGroup):
        return errors.split(_PEER_ENDED)[1]
    return None if isinstance(errors, _PEER_ENDED) else errors
