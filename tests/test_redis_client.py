"""pipework's own Redis client (pipework/redis/_wire.py and _client.py) next to a general
one, coredis, on the same server: replies of every type and error replies read alike (by
both readers, hiredis's and the Python one), pub/sub messages heard alike, and connections
Redis kills (CLIENT KILL) made again by both. Then what the shared client promises beyond:
a caller cancelled while it waits leaves the connection in step, its call never sent if it
had not gone; a round trip past its time fails, and the next one reconnects."""

from __future__ import annotations

import functools
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import coredis
import coredis.exceptions
import pytest
import trio
import trio.testing
from coredis.commands.request import CommandRequest

from pipework.redis._client import Client, Subscription
from pipework.redis._wire import Arg, Connection, ConnectionLost, ReplyError, new_reader

from ._redis import RedisServer

READERS = pytest.mark.parametrize("c_reader", [True, False], ids=["hiredis", "python"])


def _prefix() -> str:
    return f"c{secrets.token_hex(6)}"


async def _connection(server: RedisServer, c_reader: bool = True) -> Connection:
    """A connection of pipework's own, reading replies with the reader asked for."""
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    return Connection(stream, new_reader(c_reader))


@asynccontextmanager
async def _general(server: RedisServer) -> AsyncIterator[coredis.Redis[bytes]]:
    client: coredis.Redis[bytes] = coredis.Redis.from_url(server.url)
    async with client:
        yield client


async def _raw(client: coredis.Redis[bytes], command: list[Arg]) -> Any:
    """The command sent by coredis as it is, and its reply as coredis reads it (an error
    reply as the exception coredis raises)."""
    name, *args = command
    request: CommandRequest[Any] = CommandRequest(
        str(name).encode(), *args, execution_parameters={}
    )
    try:
        return await client.execute_command(request)
    except coredis.exceptions.RedisError as exc:
        return exc


async def _outcome(reply: Any) -> Any:
    """A reply of coredis's pipeline, or the error it raises for it."""
    try:
        return await reply
    except coredis.exceptions.RedisError as exc:
        return exc


def _as_arrays(value: Any) -> Any:
    """coredis speaks RESP3, whose maps and sets are RESP2's flat arrays (a set's order is
    the server's, so both sides are compared sorted)."""
    if isinstance(value, dict):
        return [item for pair in value.items() for item in map(_as_arrays, pair)]
    if isinstance(value, set):
        return sorted(value)
    if isinstance(value, list):
        return [_as_arrays(item) for item in value]
    return value


def _commands(p: str) -> list[list[Arg]]:
    """A reply of every type: simple strings, bulk strings (empty, binary, CRLF inside,
    large), nil, integers (negative, 64-bit), arrays (empty, nested, with nil), maps, sets,
    a stream's entries, a script's table."""
    return [
        ["PING"],
        ["SET", f"{p}:s", "v"],
        ["GET", f"{p}:s"],
        ["GET", f"{p}:missing"],
        ["TYPE", f"{p}:s"],
        ["GETRANGE", f"{p}:s", 5, 9],
        ["SET", f"{p}:bin", bytes(range(256)) + b"\r\n$3\r\n*-1\r\n"],
        ["GET", f"{p}:bin"],
        ["SET", f"{p}:big", b"x\r\n" * 100_000],
        ["GET", f"{p}:big"],
        ["SET", f"{p}:n", 9223372036854775806],
        ["INCRBY", f"{p}:n", 1],
        ["INCRBY", f"{p}:n", -(2**63) + 1],
        ["DECRBY", f"{p}:n", 2**62],
        ["HSET", f"{p}:h", "a", "1", "b", ""],
        ["HGETALL", f"{p}:h"],
        ["HMGET", f"{p}:h", "a", "missing", "b"],
        ["SADD", f"{p}:set", "x", "y", "z"],
        ["SMEMBERS", f"{p}:set"],
        ["RPUSH", f"{p}:l", "1", "2", "3"],
        ["LRANGE", f"{p}:l", 0, -1],
        ["LRANGE", f"{p}:none", 0, -1],
        ["XADD", f"{p}:x", "1-1", "f", "v", "g", ""],
        ["XADD", f"{p}:x", "2-1", "f", "w"],
        ["XRANGE", f"{p}:x", "-", "+"],
        ["EVAL", "return {1, {2, 'x', {}}, false, 'y', -3}", 0],
        ["EVAL", "return redis.status_reply('FINE')", 0],
        ["EXISTS", f"{p}:s", f"{p}:missing", f"{p}:h"],
        ["DEL", f"{p}:s", f"{p}:missing"],
    ]


def _errors(p: str) -> list[list[Arg]]:
    """Error replies of several codes, each made on a key of the client's own."""
    return [
        ["SET", f"{p}:s", "v"],
        ["INCR", f"{p}:s"],  # ERR
        ["LPUSH", f"{p}:s", "a"],  # WRONGTYPE
        ["EVALSHA", "0" * 40, 0],  # NOSCRIPT
        ["XREADGROUP", "GROUP", "g", "c", "STREAMS", f"{p}:none", ">"],  # NOGROUP
        ["NOSUCHCOMMAND", "x"],
        ["GET"],  # the wrong number of arguments
        ["EVAL", "return redis.error_reply('MYCODE said no')", 0],
        ["SET", f"{p}:n", 9223372036854775807],
        ["INCR", f"{p}:n"],  # overflow
        ["PING"],  # answered in its place after all of them
    ]


@READERS
async def test_replies_of_every_type_read_as_a_general_client_reads_them(
    redis_server: RedisServer, c_reader: bool
) -> None:
    ours, theirs = _prefix(), _prefix()
    connection = await _connection(redis_server, c_reader)
    try:
        async with _general(redis_server) as general:
            with trio.fail_after(30):
                got = await connection.call(_commands(ours))  # one batch
                expected = [await _raw(general, command) for command in _commands(theirs)]
    finally:
        await connection.aclose()
    assert len(got) == len(expected)
    for command, mine, general_reply in zip(_commands(ours), got, expected, strict=True):
        if isinstance(general_reply, set):
            mine = sorted(mine)
        assert mine == _as_arrays(general_reply), command


@READERS
async def test_error_replies_read_as_a_general_client_reads_them(
    redis_server: RedisServer, c_reader: bool
) -> None:
    """Each error reply is a value in its place (the next reply is the next command's);
    its code and text are what coredis raises."""
    ours, theirs = _prefix(), _prefix()
    connection = await _connection(redis_server, c_reader)
    try:
        async with _general(redis_server) as general:
            with trio.fail_after(30):
                got = await connection.call(_errors(ours))
                expected = [await _raw(general, command) for command in _errors(theirs)]
    finally:
        await connection.aclose()
    codes = []
    for command, mine, general_reply in zip(_errors(ours), got, expected, strict=True):
        if not isinstance(general_reply, Exception):
            assert mine == general_reply, command
            continue
        assert isinstance(mine, ReplyError), command
        codes.append(mine.code)
        # coredis names the code by its exception's class and keeps the rest of the text
        # (which may name the key, under that client's prefix).
        text = str(general_reply).replace(theirs, ours)
        assert text in (str(mine), str(mine).partition(" ")[2]), command
    assert codes == ["ERR", "WRONGTYPE", "NOSCRIPT", "NOGROUP", "ERR", "ERR", "MYCODE", "ERR"]
    assert got[-1] == b"PONG"


async def test_an_error_in_a_pipeline_stays_in_its_place_as_with_a_general_client(
    redis_server: RedisServer,
) -> None:
    p = _prefix()
    client = Client(redis_server.url)
    try:
        async with _general(redis_server) as general:
            with trio.fail_after(30):
                mine = await client.pipeline(
                    [["SET", f"{p}:a", "v"], ["INCR", f"{p}:a"], ["GET", f"{p}:a"]]
                )
                async with general.pipeline(transaction=False, raise_on_error=False) as pipe:
                    queued = [pipe.set(f"{p}:b", "v"), pipe.incr(f"{p}:b"), pipe.get(f"{p}:b")]
                theirs = [await _outcome(reply) for reply in queued]
    finally:
        await client.aclose()
    assert mine[0] == b"OK"
    assert theirs[0] is True  # (coredis turns OK into True)
    assert isinstance(mine[1], ReplyError)
    assert isinstance(theirs[1], coredis.exceptions.ResponseError)
    assert str(theirs[1]) == str(mine[1]).partition(" ")[2]
    assert mine[2] == theirs[2] == b"v"


# -- pub/sub -----------------------------------------------------------------------------


class _Heard:
    """What a subscription of pipework's own hears, and when it is made and dropped."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes]] = []
        self.made = 0
        self.drops = 0
        self.changed = trio.Event()

    def message(self, channel: bytes, data: bytes) -> None:
        self.messages.append((channel, data))
        self._tell()

    def live(self) -> None:
        self.made += 1
        self._tell()

    def dropped(self) -> None:
        self.drops += 1
        self._tell()

    def _tell(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self.changed.wait()


@asynccontextmanager
async def _subscribed(
    server: RedisServer, channels: list[str]
) -> AsyncIterator[tuple[Subscription, _Heard]]:
    subscription = Subscription(server.url, channels, what="the test's subscription", retry=0.05)
    heard = _Heard()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(
                subscription.run, heard.message, live=heard.live, dropped=heard.dropped
            )
        )
        yield subscription, heard
        nursery.cancel_scope.cancel()


async def _general_messages(pubsub: Any, count: int) -> list[tuple[bytes, bytes]]:
    """The next ``count`` messages coredis's subscription received. Read with get_message:
    coredis's iterator ends when it finds the subscription unconfirmed, which it is for a
    while after a reconnect even once Redis counts it subscribed again."""
    got: list[tuple[bytes, bytes]] = []
    while len(got) < count:
        message = await pubsub.get_message()
        if message is not None:  # (None: a confirmation, ignored)
            got.append((message["channel"], message["data"]))
    return got


async def test_pubsub_messages_are_heard_as_a_general_client_hears_them(
    redis_server: RedisServer,
) -> None:
    p = _prefix()
    first, second = f"{p}:a", f"{p}:b"
    payloads = [b"", b"x", b"\r\n", bytes(range(256)), b"*1\r\n$-1\r\n", b"y" * 100_000]
    publisher = Client(redis_server.url)
    try:
        async with (
            _general(redis_server) as general,
            general.pubsub(channels=[first], ignore_subscribe_messages=True) as pubsub,
            _subscribed(redis_server, [first]) as (subscription, heard),
        ):
            with trio.fail_after(30):
                for data in payloads:
                    # Both subscriptions are made before their run or context reports it.
                    assert await publisher.call("PUBLISH", first, data) == 2
                theirs = await _general_messages(pubsub, len(payloads))
                await heard.until(lambda: len(heard.messages) == len(payloads))
                assert heard.messages == theirs == [(first.encode(), d) for d in payloads]
                # A channel added later is heard from when each says it is subscribed.
                await subscription.subscribe(second)
                await pubsub.subscribe(second)
                assert await publisher.call("PUBLISH", second, b"later") == 2
                assert await _general_messages(pubsub, 1) == [(second.encode(), b"later")]
                await heard.until(lambda: len(heard.messages) > len(payloads))
                assert heard.messages[-1] == (second.encode(), b"later")
                # And one let go of is not heard any more (once Redis has taken it).
                await subscription.unsubscribe(first)
                await pubsub.unsubscribe(first)
                # (Redis has no event to wait on: asked again until both have gone.)
                while (await publisher.call("PUBSUB", "NUMSUB", first))[1] != 0:  # noqa: ASYNC110 - Redis
                    await trio.sleep(0.01)
                assert (heard.made, heard.drops) == (1, 0)
    finally:
        await publisher.aclose()


async def test_a_killed_subscription_is_made_again_as_a_general_client_makes_it(
    redis_server: RedisServer,
) -> None:
    """CLIENT KILL ends both subscriptions; each connects again and subscribes to every
    channel it had, also one added after it started; the owner of pipework's is told of
    the drop and of the subscription made again (what was published meanwhile is lost)."""
    p = _prefix()
    channel, added = f"{p}:a", f"{p}:b"
    publisher = Client(redis_server.url)
    try:
        async with (
            _general(redis_server) as general,
            general.pubsub(channels=[channel], ignore_subscribe_messages=True) as pubsub,
            _subscribed(redis_server, [channel]) as (subscription, heard),
        ):
            with trio.fail_after(30):
                await subscription.subscribe(added)
                assert await publisher.call("CLIENT", "KILL", "TYPE", "pubsub") >= 2
                await heard.until(lambda: heard.made == 2)
                assert heard.drops == 1
                assert await publisher.call("PUBLISH", added, b"back") == 1
                # (coredis's subscription is coming back: asked until it is.)
                while await publisher.call("PUBLISH", channel, b"back") < 2:  # noqa: ASYNC110 - Redis has no event
                    await trio.sleep(0.01)
                assert await _general_messages(pubsub, 1) == [(channel.encode(), b"back")]
                await heard.until(lambda: len(heard.messages) >= 2)
                assert heard.messages[:2] == [
                    (added.encode(), b"back"),
                    (channel.encode(), b"back"),
                ]
    finally:
        await publisher.aclose()


async def test_a_subscription_that_cannot_connect_at_first_raises() -> None:
    subscription = Subscription("redis://127.0.0.1:1/0", ["x"], what="the test's subscription")
    with trio.fail_after(30), pytest.raises(OSError, match="onnect"):
        await subscription.run(lambda channel, data: None)


# -- a connection killed -------------------------------------------------------------------


@pytest.mark.parametrize("resend_stale", [False, True])
async def test_a_killed_connection_is_made_again(
    redis_server: RedisServer, resend_stale: bool
) -> None:
    """Redis drops the connection while it is idle: the next round trip finds out. coredis
    sends the command again on a new connection; pipework's client does so only if told its
    commands may run twice (``resend_stale``), else it fails the call (it may have run) and
    the next one connects again. The store's connection fails its batch and closes."""
    p = _prefix()
    client = Client(redis_server.url, resend_stale=resend_stale)
    store_connection = await _connection(redis_server)
    killer = Client(redis_server.url)
    try:
        async with _general(redis_server) as general:
            with trio.fail_after(30):
                await general.set(f"{p}:k", "v")
                ids = [
                    await client.call("CLIENT", "ID"),
                    (await store_connection.call([["CLIENT", "ID"]]))[0],
                    await general.client_id(),
                ]
                for identifier in ids:
                    assert await killer.call("CLIENT", "KILL", "ID", identifier) == 1
                assert await general.get(f"{p}:k") == b"v"
                if resend_stale:
                    assert await client.call("GET", f"{p}:k") == b"v"
                else:
                    with pytest.raises(ConnectionLost, match="cannot be reached"):
                        await client.call("GET", f"{p}:k")
                    assert await client.call("GET", f"{p}:k") == b"v"
                with pytest.raises(ConnectionLost):
                    await store_connection.call([["GET", f"{p}:k"]])
                assert store_connection.closed
    finally:
        await client.aclose()
        await killer.aclose()
        await store_connection.aclose()


# -- the shared client's own promises ------------------------------------------------------


async def test_calls_made_while_one_is_on_its_way_go_together_in_the_next_batch(
    redis_server: RedisServer,
) -> None:
    p = _prefix()
    client = Client(redis_server.url)
    pusher = await _connection(redis_server)
    answers: dict[int, Any] = {}
    batches: list[list[Any]] = []

    async def call(n: int, *command: Arg) -> None:
        answers[n] = await client.call(*command)

    try:
        with trio.fail_after(30):
            await client.call("PING")  # its connection, opened
            connection = client._connection
            assert connection is not None
            real_call = connection.call

            async def counted(commands: Any) -> list[Any]:
                batches.append([command[0] for command in commands])
                return await real_call(commands)

            connection.call = counted  # type: ignore[method-assign]  # counts its batches
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 0, "BLPOP", f"{p}:q", 0)  # on its way until pushed
                await trio.testing.wait_all_tasks_blocked()
                for n in range(1, 6):
                    nursery.start_soon(call, n, "INCR", f"{p}:n")
                await trio.testing.wait_all_tasks_blocked()
                await pusher.call([["RPUSH", f"{p}:q", "x"]])
    finally:
        await client.aclose()
        await pusher.aclose()
    assert batches == [["BLPOP"], ["INCR"] * 5]
    assert answers[0] == [f"{p}:q".encode(), b"x"]
    assert sorted(answers[n] for n in range(1, 6)) == [1, 2, 3, 4, 5]


async def test_a_caller_cancelled_while_it_waits_leaves_the_connection_in_step(
    redis_server: RedisServer,
) -> None:
    """Cancelled before its call went, the call is never sent; cancelled while it is on its
    way, its answer goes to nobody; the caller sending a batch waits for it (shielded).
    Every other caller gets its own answer, and so does the next call."""
    p = _prefix()
    client = Client(redis_server.url)
    pusher = await _connection(redis_server)
    answers: dict[str, Any] = {}
    scopes = {name: trio.CancelScope() for name in ("first", "unsent", "on its way")}

    async def call(name: str, *command: Arg) -> None:
        with scopes.get(name, trio.CancelScope()):
            answers[name] = await client.call(*command)

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "first", "BLPOP", f"{p}:q1", 0)
                await trio.testing.wait_all_tasks_blocked()
                # Three wait for the first's answer; the first of them sends them all next.
                nursery.start_soon(call, "second", "BLPOP", f"{p}:q2", 0)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, "on its way", "GET", f"{p}:k")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(call, "unsent", "SET", f"{p}:unsent", "1")
                await trio.testing.wait_all_tasks_blocked()
                scopes["unsent"].cancel()
                scopes["first"].cancel()  # it sends the batch: it stays for the answer
                await trio.testing.wait_all_tasks_blocked()
                await pusher.call([["RPUSH", f"{p}:q1", "a"], ["SET", f"{p}:k", "mine"]])
                await trio.testing.wait_all_tasks_blocked()  # "second" sends the next batch
                scopes["on its way"].cancel()  # its GET waits behind "second"'s BLPOP
                await trio.testing.wait_all_tasks_blocked()
                assert "on its way" not in answers
                await pusher.call([["RPUSH", f"{p}:q2", "b"], ["SET", f"{p}:k", "next"]])
            with pytest.raises(ReplyError, match="WRONGTYPE"):
                await client.call("LPUSH", f"{p}:k", "x")  # the next call's own answer
            assert await client.call("GET", f"{p}:k") == b"next"
            assert await client.call("GET", f"{p}:unsent") is None  # never sent
    finally:
        await client.aclose()
        await pusher.aclose()
    assert answers == {"first": [f"{p}:q1".encode(), b"a"], "second": [f"{p}:q2".encode(), b"b"]}
    assert not scopes["first"].cancelled_caught


async def test_every_caller_of_a_batch_hears_that_redis_refused_the_connection(
    redis_server: RedisServer,
) -> None:
    """A password the server does not take: the connection is refused when it is opened,
    and each caller of the batch gets the refusal (none is left waiting)."""
    client = Client(f"redis://:wrong@127.0.0.1:{redis_server.port}/0")
    refusals: list[str] = []

    async def call(n: int) -> None:
        with pytest.raises(ReplyError) as refused:
            await client.call("GET", f"k{n}")
        refusals.append(refused.value.code)

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for n in range(3):  # the first sends alone, the two others together
                    nursery.start_soon(call, n)
    finally:
        await client.aclose()
    assert refusals == ["ERR"] * 3


async def test_a_round_trip_past_its_time_fails_its_calls_and_the_next_one_reconnects(
    redis_server: RedisServer, mock_clock: trio.testing.MockClock
) -> None:
    p = _prefix()
    client = Client(redis_server.url, timeout=10)
    failures: list[BaseException] = []

    async def call(*command: Arg) -> None:
        try:
            await client.call(*command)
        except ConnectionLost as exc:
            failures.append(exc)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "BLPOP", f"{p}:never", 0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(call, "GET", f"{p}:k")
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(10)  # the BLPOP's batch has had its time
        assert len(failures) == 1
        assert "no answer within 10s" in str(failures[0])
        # The GET went in the next batch, on a new connection.
        assert await client.call("SET", f"{p}:k", "v") == b"OK"
    finally:
        await client.aclose()
