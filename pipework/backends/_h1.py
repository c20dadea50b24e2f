"""One HTTP/1.1 client connection: an h11 state machine over a trio stream (a socket, or
TLS over one for an ``https://`` backend).

h11 does the protocol (framing, chunked bodies, keep-alive rules, ``Connection: close``);
this module only moves bytes between it and the socket, and answers one question the pool
asks after every exchange: may this connection carry another request? It never decides
about timeouts or limits — the pool (:mod:`._pool`) does, around it.

A connection is used for one exchange at a time. If an exchange does not finish — the
caller was cancelled, the peer broke the framing, the body was too big — the connection is
closed, never reused: h11 would refuse a second request anyway, and a half-read answer on
the wire would be taken for the next one. Nor is one whose peer sent more than its answer
(bytes after the answer's end, received with it): they too would be read as the next
answer. A closed connection keeps nothing it read.

The content decoder (:func:`content_decoder`) is shared with the httpx path, so both
clients stop decoding at the same byte.
"""

from __future__ import annotations

import select
import zlib
from typing import Final

import h11
import trio

from ._failures import BadAnswer

__all__ = [
    "ACCEPT_ENCODING",
    "Answer",
    "BadEncoding",
    "Connection",
    "Decoder",
    "ResponseTooLarge",
    "StaleConnection",
    "content_decoder",
    "first_header",
]

_READ_SIZE: Final = 64 * 1024
# The largest head (status line and headers) accepted from a backend.
_MAX_HEAD: Final = 64 * 1024


class ResponseTooLarge(Exception):
    """The answer's (decoded) body is longer than the caller allowed."""

    def __init__(self, status: int) -> None:
        super().__init__(f"the answer (HTTP {status}) is longer than allowed")
        self.status = status


class BadEncoding(BadAnswer):
    """The answer's body does not decode in the content coding it declared."""


class StaleConnection(Exception):
    """A kept-alive connection failed before any byte of the answer arrived: the peer had
    closed it (or reset it) while it sat idle. Nothing of the request can have been acted
    on in a way the client could see, but the backend may still have received it."""


class Answer:
    """A whole answer: status, headers (names lower-cased, as h11 gives them) and body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""
        return first_header(self.headers, name)


class Connection:
    """An HTTP/1.1 connection to one backend. ``exchange`` sends a request and reads its
    whole answer; afterwards ``reusable`` says whether another request may follow."""

    __slots__ = ("_h11", "_socket", "_stream", "exchanges", "idle_since")

    def __init__(self, stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]) -> None:
        self._stream = stream
        # The socket under it: an https backend's connection is TLS over it.
        transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        self._socket = transport.socket
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD)
        #: Exchanges completed on this connection.
        self.exchanges = 0
        #: When it was last put back idle (trio time).
        self.idle_since = 0.0

    @property
    def reusable(self) -> bool:
        h = self._h11
        # Bytes received past the answer's end (a body sent with an answer to HEAD, or
        # past a declared length) would be read as the next request's answer: a
        # connection out of step with its backend, whoever sends the next request.
        return h.our_state is h11.DONE and h.their_state is h11.DONE and not h.trailing_data[0]

    def readable(self) -> bool:
        """Whether the idle connection has something to read: the peer closed it (EOF) or
        sent bytes nobody asked for. Either way it must not carry another request. Over
        TLS, what a server sends once the handshake is done (TLS 1.3 session tickets) has
        been read with the first answer, so an idle connection's bytes are these too."""
        try:
            ready, _, _ = select.select([self._socket.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True  # already closed
        return bool(ready)

    @property
    def peer_closed(self) -> bool:
        """Whether the peer's end of the connection was read: an answer that h11 finds
        incomplete after that was cut short by the peer, not malformed."""
        return self._h11.trailing_data[1]

    def close(self) -> None:
        """Close the socket now (no checkpoint): safe in cleanup and in cancelled code.
        The h11 state goes too, with whatever it buffered: a failed call's error may keep
        this object alive (a failed job keeps its error for its retention)."""
        self._socket.close()  # TLS too: no close_notify, as for a connection cut short
        self._h11 = h11.Connection(h11.CLIENT)  # empty, and never reusable

    async def exchange(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        *,
        max_bytes: int,
    ) -> Answer:
        """Send one request and read its answer to the end. Raises
        :class:`StaleConnection` if the connection failed before any byte of the answer
        arrived, :class:`ResponseTooLarge` past ``max_bytes`` of decoded body (as soon as
        it is past: the rest is never read), :class:`BadEncoding` for a body that does not
        decode, ``h11.RemoteProtocolError`` for an answer that is malformed or was cut short
        (:attr:`peer_closed` says which), ``trio.BrokenResourceError`` / ``OSError`` for a
        connection broken mid-answer. After anything but a normal return the connection is
        not reusable: close it."""
        await self.send_request(h11.Request(method=method, target=target, headers=headers), body)
        event = await self.read_head()
        status = event.status_code
        response_headers = list(event.headers)

        declared = first_header(response_headers, b"content-length")
        decoder = content_decoder(first_header(response_headers, b"content-encoding"))
        # A declared length says it at once (a compressed body's says nothing of this).
        too_long = declared is not None and declared.isdigit() and int(declared) > max_bytes
        if decoder is None and too_long:
            raise ResponseTooLarge(status)
        parts: list[bytes] = []
        size = 0
        while isinstance(piece_event := await self.next_event(), h11.Data):
            piece = bytes(piece_event.data)
            if decoder is not None:
                piece = decoder.feed(piece, max_bytes - size)
            size += len(piece)
            if size > max_bytes:
                raise ResponseTooLarge(status)
            parts.append(piece)
        if decoder is not None:
            tail = decoder.flush(max_bytes - size)
            size += len(tail)
            if size > max_bytes:
                raise ResponseTooLarge(status)
            parts.append(tail)
        self.exchanges += 1
        return Answer(status, response_headers, b"".join(parts))

    # -- the parts of an exchange, shared with the streamed one (:mod:`._stream`) ----------

    async def send_request(
        self, request: h11.Request, body: bytes | None = None, *, end: bool = True
    ) -> None:
        """Send a request's head, with ``body`` and the request's end (unless ``end`` is
        false: the body follows with :meth:`send_data` and :meth:`send_end`). Raises
        :class:`StaleConnection` if the socket fails: nothing of the answer can have come."""
        h = self._h11
        if h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()  # a kept-alive connection's next exchange
        data = h.send(request)
        if body:
            data += h.send(h11.Data(data=body))
        if end:
            data += h.send(h11.EndOfMessage())
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise StaleConnection(f"sending failed: {exc!r}") from exc

    async def send_data(self, data: bytes) -> None:
        """Send a piece of the request's body, framed (a chunk, or bytes of its length)."""
        pieces = self._h11.send_with_data_passthrough(h11.Data(data=data)) or ()
        if len(data) <= _READ_SIZE:  # one write; a big piece is not copied to join its frame
            await self._stream.send_all(b"".join(pieces))
            return
        for piece in pieces:
            await self._stream.send_all(piece)

    async def send_end(self) -> None:
        """Send the request's end (the last chunk, for a chunked body)."""
        data = self._h11.send(h11.EndOfMessage())
        if data:
            await self._stream.send_all(data)

    async def read_head(self) -> h11.Response:
        """Read the answer's head, skipping informational (1xx) answers. Raises
        :class:`StaleConnection` if the connection failed before any byte of it arrived,
        ``h11.RemoteProtocolError`` for a ``101 Switching Protocols`` (an upgrade is never
        asked for here) or a malformed head."""
        h = self._h11
        got_bytes = False
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                try:
                    chunk = await self._stream.receive_some(_READ_SIZE)
                except (trio.BrokenResourceError, OSError) as exc:
                    if not got_bytes:
                        raise StaleConnection(f"receiving failed: {exc!r}") from exc
                    raise
                if not chunk and not got_bytes:
                    raise StaleConnection("the peer closed the connection before answering")
                got_bytes = True
                h.receive_data(bytes(chunk))  # typed bytes | bytearray over TLS; bytes here
                continue
            if isinstance(event, h11.Response):
                return event
            if not isinstance(
                event, h11.InformationalResponse
            ):  # pragma: no cover - h11 raises first
                raise h11.RemoteProtocolError(f"unexpected {event!r} before an answer")
            if event.status_code == 101:
                raise h11.RemoteProtocolError("an answer switched protocols (101) uninvited")

    async def next_event(self) -> h11.Data | h11.EndOfMessage:
        """The next piece of the answer's body, or its end (with any trailers), reading
        from the socket only when h11 has nothing whole buffered."""
        h = self._h11
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                h.receive_data(bytes(await self._stream.receive_some(_READ_SIZE)))
                continue
            if isinstance(event, h11.Data | h11.EndOfMessage):
                return event
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__} in an answer")

    def drain_buffered(self) -> bool:
        """Read on through what was already received of the answer, without waiting: True
        if its end was there (the rest of a body nobody asked for is dropped)."""
        h = self._h11
        try:
            while (event := h.next_event()) is not h11.NEED_DATA:
                if isinstance(event, h11.EndOfMessage):
                    return True
                if not isinstance(event, h11.Data):
                    return False
        except h11.RemoteProtocolError:
            return False
        return False


def first_header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case) in ``headers``, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


#: What the client says it can decode, sent with every request (by both clients).
ACCEPT_ENCODING: Final = b"gzip, deflate"


class Decoder:
    """Undoes a ``gzip`` or ``deflate`` content coding, never producing more than asked
    for at a time (a small compressed body cannot balloon past the caller's limit)."""

    __slots__ = ("_first", "_z")

    def __init__(self, gzip: bool) -> None:
        self._z = zlib.decompressobj(zlib.MAX_WBITS | 16 if gzip else zlib.MAX_WBITS)
        self._first = not gzip  # deflate: zlib-wrapped, or raw as some servers send it

    def feed(self, data: bytes, room: int) -> bytes:
        """Decode ``data``: at most ``room + 1`` bytes come out, so more than ``room``
        means the body is too big (the rest is left undecoded)."""
        limit = max(room, 0) + 1
        try:
            if self._first:
                self._first = False
                try:
                    return self._z.decompress(data, limit)
                except zlib.error:
                    self._z = zlib.decompressobj(-zlib.MAX_WBITS)
            return self._z.decompress(data, limit)
        except zlib.error as exc:
            raise BadEncoding(f"the answer's body does not decode: {exc}") from None

    def flush(self, room: int) -> bytes:
        try:
            return self._z.flush()[: max(room, 0) + 1]
        except zlib.error as exc:  # pragma: no cover - flush reports no errors in practice
            raise BadEncoding(f"the answer's body does not decode: {exc}") from None


def content_decoder(coding: bytes | str | None) -> Decoder | None:
    """The decoder of a ``Content-Encoding``, or None to take the body as it came."""
    if coding is None:
        return None
    name = (coding.encode("latin-1") if isinstance(coding, str) else coding).strip().lower()
    if name in (b"gzip", b"x-gzip"):
        return Decoder(gzip=True)
    if name == b"deflate":
        return Decoder(gzip=False)
    return None  # identity, or a coding nobody asked for: passed on as it came (as httpx)
