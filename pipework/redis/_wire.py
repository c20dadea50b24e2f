"""A lean Redis connection, the one every Redis part of pipework speaks through (the job
store and event queue directly, the relay and the backplane through :mod:`._client`):
commands go out as RESP in one write per batch and their replies are read back in order,
with nothing per command but its bytes. A general client's per-command objects (a request,
its timeout scope, its reply callback) cost ≈ 100 µs of CPU each, more than a whole job on
the memory store; here a pipelined command costs a few µs.

One connection carries one batch at a time: its user sends a batch and reads every reply
before the next one goes (the store's calls and the queue's loops take turns). A batch cut
short — a timeout, a cancellation, a broken socket — closes the connection, so no reply is
ever read by the wrong caller; the next batch opens a new one.

**Sentinel.** A URL ``redis+sentinel://[user:password@]HOST:PORT[,HOST:PORT...]/MASTER[/DB]``
names Sentinels and the name they monitor the primary by, not the primary itself: every
connection asks the Sentinels in turn (``SENTINEL get-master-addr-by-name``), connects to
the address the first that knows it answers, and checks with ``ROLE`` that it is the
primary (a failover under way may name one not yet promoted). Every part reconnects after
a connection is lost, and so asks again: after a failover it reaches the new primary (the
Sentinels' reconfiguration closes the old one's connections). A reply ``READONLY`` (the
server became a replica while the connection stayed) closes the connection after its
batch, so the next batch connects again, through Sentinel; the command was not run.

Replies are RESP2: bulk and simple strings as bytes, integers as int, nil as None, arrays as
lists, and an error reply as a :class:`ReplyError` value in its place (each caller of a
batch gets its own reply, error or not). They are read by hiredis's C reader when it is
installed (``pip install 'pipework[redis]'``): parsing replies in Python took about a
twentieth of the process's CPU per job on Redis. Without it a Python reader with the same
interface does the same.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Any, Final
from urllib.parse import unquote, urlsplit

import trio

from .._logging import Outage, outage

__all__ = [
    "C_READER",
    "NOT_NOW",
    "UNREACHABLE",
    "Arg",
    "Command",
    "Connection",
    "ConnectionLost",
    "ReplyError",
    "SentinelTarget",
    "encode",
    "encode_args",
    "new_reader",
    "public_url",
    "redis_outage",
    "sentinel_target",
]

_CRLF: Final = b"\r\n"
_READ_SIZE: Final = 1 << 16


class ReplyError(Exception):
    """An error reply from Redis (``NOSCRIPT ...``, ``NOGROUP ...``, ``WRONGTYPE ...``)."""

    @property
    def code(self) -> str:
        return str(self).split(" ", 1)[0]


class ConnectionLost(OSError):
    """The connection closed, or was closed, before every reply of a batch arrived."""


#: What a lost or refused connection raises (a batch cut short, a refused connect).
UNREACHABLE: Final = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)

#: Error replies of a server that cannot take the command now, whatever it is: loading its
#: data after a restart, a replica (after a failover), a script running too long, out of
#: memory, unable to persist. Retried as a server away is.
NOT_NOW: Final = frozenset({"LOADING", "MASTERDOWN", "READONLY", "BUSY", "OOM", "MISCONF"})

SENTINEL_SCHEME: Final = "redis+sentinel"
#: How long one Sentinel may take to connect and answer before the next is asked.
SENTINEL_TIMEOUT: Final = 2.0


class SentinelTarget:
    """What a ``redis+sentinel://`` URL names: the Sentinels' addresses, the primary's name,
    and the credentials and database for the primary (``userinfo``: ``user:password@`` as
    written, or empty)."""

    __slots__ = ("db", "master", "sentinels", "userinfo")

    def __init__(
        self, sentinels: list[tuple[str, int]], master: str, db: str, userinfo: str
    ) -> None:
        self.sentinels = sentinels
        self.master = master
        self.db = db
        self.userinfo = userinfo


def sentinel_target(url: str) -> SentinelTarget:
    """Parse a ``redis+sentinel://`` URL; ValueError saying what is wrong with it."""
    scheme, sep, rest = url.partition("://")
    if scheme != SENTINEL_SCHEME or not sep:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    sentinels: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected HOST:PORT for each Sentinel, got {item!r}")
        sentinels.append((host.strip("[]"), int(port)))
    master, _, db = path.strip("/").partition("/")
    if not master:
        raise ValueError("the path must name the primary as Sentinel knows it: /MASTER[/DB]")
    if db and not db.isdigit():
        raise ValueError(f"the database after the primary's name must be a number, got {db!r}")
    return SentinelTarget(sentinels, unquote(master), db, userinfo + at)


def redis_outage(url: str) -> Outage:
    """The outage record of the Redis at ``url`` (one per server, whatever uses it)."""
    return outage(f"Redis at {public_url(url)}", "pipework.redis")


def public_url(url: str) -> str:
    """The URL without its password, for messages."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"


class _Incomplete(Exception):
    """Not enough bytes yet for the next reply."""


#: A command argument: bytes as they are, the others as their text.
Arg = bytes | str | int | float
#: A command: its arguments, or the command already encoded (:func:`encode`).
Command = Sequence[Arg] | bytes


def encode(command: Sequence[Arg]) -> bytes:
    """One command as a RESP array of bulk strings."""
    return b"*%d\r\n%b" % (len(command), encode_args(command))


def encode_args(args: Sequence[Arg]) -> bytes:
    """Arguments as RESP bulk strings, without the array's header: a caller that sends the
    same arguments often encodes them once (see :data:`Command`)."""
    parts: list[bytes] = []
    append = parts.append
    for arg in args:
        if type(arg) is str:
            data = arg.encode()
        elif isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, int):
            data = b"%d" % arg
        else:
            data = str(arg).encode()
        append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def _parse(buf: bytes, pos: int) -> tuple[Any, int]:
    """The reply starting at ``pos`` and where the next one starts; _Incomplete if the
    buffer holds only part of it."""
    end = buf.find(_CRLF, pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    if kind == 36:  # $ bulk string
        size = int(buf[pos + 1 : end])
        if size < 0:
            return None, end + 2
        start = end + 2
        stop = start + size
        if stop + 2 > len(buf):
            raise _Incomplete
        return buf[start:stop], stop + 2
    if kind == 42:  # * array
        count = int(buf[pos + 1 : end])
        pos = end + 2
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == 58:  # : integer
        return int(buf[pos + 1 : end]), end + 2
    if kind == 43:  # + simple string
        return buf[pos + 1 : end], end + 2
    if kind == 45:  # - error
        return ReplyError(buf[pos + 1 : end].decode(errors="replace")), end + 2
    raise _Unreadable(f"type byte {kind!r}")


class _Reader:
    """Replies from bytes fed in pieces, with hiredis.Reader's interface: ``gets()`` is the
    next whole reply, or False until enough bytes have come."""

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0

    def feed(self, data: bytes | bytearray) -> None:
        self._buf = self._buf[self._pos :] + data
        self._pos = 0

    def gets(self) -> Any:
        try:
            reply, self._pos = _parse(self._buf, self._pos)
        except _Incomplete:
            return False
        return reply


class _Unreadable(ConnectionLost):
    """A reply in no form this client reads (hiredis raises it by this class)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Redis sent a reply this client cannot read ({message})")


def _c_reader_class() -> Any:
    try:
        from hiredis import Reader
    except ImportError:  # the optional C reader; the Python one above reads the same
        return None
    return Reader


#: hiredis's reader class, None when it is not installed.
C_READER: Final[Any] = _c_reader_class()


def new_reader(c_reader: bool = True) -> Any:
    """A reply reader: hiredis's if it is installed and ``c_reader``, else the Python one."""
    if c_reader and C_READER is not None:
        return C_READER(protocolError=_Unreadable, replyError=ReplyError)
    return _Reader()


class Connection:
    """One socket to Redis; open with :meth:`open`, then :meth:`call` batches on it.
    ``reader``: what reads the replies (:func:`new_reader`'s by default)."""

    def __init__(self, stream: trio.abc.Stream, reader: Any = None) -> None:
        self._stream: trio.abc.Stream | None = stream
        self._reader = new_reader() if reader is None else reader
        self._replica = False  # a reply said READONLY: closed once the batch is read

    @property
    def closed(self) -> bool:
        return self._stream is None

    @classmethod
    async def open(cls, url: str) -> Connection:
        """Connect to ``url`` (``redis://[user:password@]host[:port][/db]``, ``rediss://``
        for TLS, ``unix:///path?db=N``, or ``redis+sentinel://`` for the primary Sentinel
        names), authenticate and select the database. A failure to connect starts the
        server's outage (if it was reached before); a connection made ends it
        (:func:`redis_outage`)."""
        try:
            connection = await cls._open(url)
        except UNREACHABLE as exc:
            redis_outage(url).failed(exc, "connections")
            raise
        redis_outage(url).recovered()
        return connection

    @classmethod
    async def _open(cls, url: str) -> Connection:
        if url.startswith(SENTINEL_SCHEME + "://"):
            return await cls._open_primary(url)
        parts = urlsplit(url)
        query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
        db = query.get("db", "")
        stream: trio.abc.Stream
        if parts.scheme == "unix":
            stream = await trio.open_unix_socket(parts.path)
        elif parts.scheme in ("redis", "rediss"):
            host, port = parts.hostname or "localhost", parts.port or 6379
            if parts.scheme == "rediss":
                stream = await trio.open_ssl_over_tcp_stream(
                    host, port, ssl_context=ssl.create_default_context()
                )
            else:
                stream = await trio.open_tcp_stream(host, port)
            db = parts.path.strip("/") or db
        else:
            raise ValueError(f"not a Redis URL (redis://, rediss:// or unix://): {url!r}")
        connection = cls(stream)
        hello: list[list[Arg]] = []
        if parts.password is not None:
            user = [unquote(parts.username)] if parts.username else []
            hello.append(["AUTH", *user, unquote(parts.password)])
        if db not in ("", "0"):
            hello.append(["SELECT", int(db)])
        if hello:
            refused = [r for r in await connection.call(hello) if isinstance(r, ReplyError)]
            if refused:
                await connection.aclose()
                raise refused[0]
        return connection

    @classmethod
    async def _open_primary(cls, url: str) -> Connection:
        """The primary Sentinel names (see the module), checked with ``ROLE``."""
        target = sentinel_target(url)
        said: list[str] = []
        for host, port in target.sentinels:
            try:
                with trio.fail_after(SENTINEL_TIMEOUT):
                    asking = cls(await trio.open_tcp_stream(host, port))
                    try:
                        (reply,) = await asking.call(
                            [["SENTINEL", "get-master-addr-by-name", target.master]]
                        )
                    finally:
                        await asking.aclose()
            except (*UNREACHABLE, trio.TooSlowError) as exc:
                said.append(f"{host}:{port}: {exc or 'no answer'}")
                continue
            if isinstance(reply, list) and len(reply) == 2:
                primary = f"{reply[0].decode()}:{int(reply[1])}"
                break
            said.append(f"{host}:{port}: {reply or 'does not know it'}")
        else:
            raise ConnectionLost(
                f"no Sentinel named the primary {target.master!r} ({'; '.join(said)})"
            )
        connection = await cls.open(f"redis://{target.userinfo}{primary}/{target.db}")
        try:
            (role,) = await connection.call([["ROLE"]])
        except BaseException:
            await connection.aclose()
            raise
        if isinstance(role, list) and role and role[0] == b"master":
            return connection
        await connection.aclose()
        raise ConnectionLost(
            f"Sentinel named {primary} as the primary {target.master!r}, which is not "
            f"(a failover under way?); the next connection asks again"
        )

    async def aclose(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await trio.aclose_forcefully(stream)

    async def call(self, commands: Sequence[Command]) -> list[Any]:
        """Send the commands in one write and return their replies, in order."""
        await self.send(commands)
        return await self.read(len(commands))

    async def send(self, commands: Sequence[Command]) -> None:
        stream = self._usable()
        data = b"".join([c if type(c) is bytes else encode(c) for c in commands])
        try:
            await stream.send_all(data)
        except BaseException as exc:
            await self.aclose()  # a write cut short leaves the protocol state unknown
            if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError):
                raise ConnectionLost(f"the connection to Redis broke ({exc})") from exc
            raise

    async def read(self, count: int) -> list[Any]:
        """The next ``count`` replies."""
        replies: list[Any] = []
        reader = self._reader
        try:
            while len(replies) < count:
                reply = reader.gets()
                if reply is False:  # no whole reply buffered: more bytes
                    reader.feed(await self._receive())
                else:
                    replies.append(reply)
                    if isinstance(reply, ReplyError) and reply.code == "READONLY":
                        self._replica = True
        except BaseException as exc:
            await self.aclose()  # replies left unread would answer the next batch
            if isinstance(exc, trio.BrokenResourceError | trio.ClosedResourceError):
                raise ConnectionLost(f"the connection to Redis broke ({exc})") from exc
            raise
        if self._replica:  # the server became a replica: reconnect (through Sentinel)
            await self.aclose()
        return replies

    async def _receive(self) -> bytes | bytearray:
        data = await self._usable().receive_some(_READ_SIZE)
        if not data:
            raise ConnectionLost("Redis closed the connection")
        return data

    def _usable(self) -> trio.abc.Stream:
        if self._stream is None:
            raise ConnectionLost("the connection to Redis is closed")
        return self._stream
