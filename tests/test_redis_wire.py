"""The Redis store's own RESP connection, without a Redis: replies written by a reference
encoder reach the reader split at any byte, in order, one per command; an error reply is a
value in its place; a connection cut mid-batch closes and says so. Every test runs with
both readers: hiredis's C reader and the Python one used without it."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from pipework.redis import _wire
from pipework.redis._wire import Connection, ConnectionLost, ReplyError, encode, new_reader

#: Which reader a test's connection uses: hiredis's (C) or the Python one.
READERS = pytest.mark.parametrize("c_reader", [True, False], ids=["hiredis", "python"])


def _written(reply: Any, *, simple: bool = False) -> bytes:
    """RESP2 as a server writes it; ``simple`` writes a byte string as a simple string."""
    if reply is None:
        return b"$-1\r\n"
    if isinstance(reply, ReplyError):
        return b"-%b\r\n" % str(reply).encode()
    if isinstance(reply, int):
        return b":%d\r\n" % reply
    if isinstance(reply, bytes):
        if simple:
            return b"+%b\r\n" % reply
        return b"$%d\r\n%b\r\n" % (len(reply), reply)
    return b"*%d\r\n%b" % (len(reply), b"".join(_written(item) for item in reply))


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, ReplyError):
        return isinstance(got, ReplyError) and str(got) == str(want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(_same, got, want))
    return type(got) is type(want) and got == want


_replies: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.integers(-(2**63), 2**63 - 1)
    | st.binary(max_size=64)  # bulk strings may hold CRLF
    | st.builds(ReplyError, st.sampled_from(["NOSCRIPT x", "BUSYGROUP y", "ERR z"])),
    lambda inner: st.lists(inner, max_size=5),
    max_leaves=20,
)


def _pair(c_reader: bool) -> tuple[Connection, trio.abc.Stream]:
    client_side, server_side = trio.testing.memory_stream_pair()
    return Connection(client_side, new_reader(c_reader)), server_side


def test_the_c_reader_is_installed_with_the_test_extra() -> None:
    # The tests' installs (make test, CI) have hiredis: the C reader is the one tested and
    # benchmarked, and a connection takes it by default.
    assert _wire.C_READER is not None
    by_default = Connection(trio.testing.memory_stream_pair()[0])
    assert type(by_default._reader) is _wire.C_READER


@READERS
@given(
    replies=st.lists(_replies, min_size=1, max_size=8),
    cuts=st.lists(st.integers(1, 200), max_size=10),
)
def test_replies_split_at_any_byte_come_back_whole_and_in_order(
    c_reader: bool, replies: list[Any], cuts: list[int]
) -> None:
    async def main() -> None:
        connection, server = _pair(c_reader)
        data = b"".join(_written(r) for r in replies)
        commands = [["PING"]] * len(replies)
        got: list[Any] = []

        async def client() -> None:
            got.extend(await connection.call(commands))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            sent = b""
            while len(sent) < sum(len(encode(c)) for c in commands):
                sent += await server.receive_some()
            assert sent == b"".join(encode(c) for c in commands)  # one write per batch
            pos = 0
            for cut in cuts:  # the replies arrive in pieces, cut anywhere
                await server.send_all(data[pos : pos + cut])
                pos += cut
                await trio.testing.wait_all_tasks_blocked()
            await server.send_all(data[pos:])
        assert len(got) == len(replies)
        assert all(map(_same, got, replies))
        assert not connection.closed

    trio.run(main)


@READERS
async def test_simple_strings_and_the_next_batch_on_the_same_connection(
    c_reader: bool,
) -> None:
    connection, server = _pair(c_reader)
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            await server.receive_some()
            # The second batch's reply arrives with the first: it waits in the buffer.
            await server.send_all(_written(b"OK", simple=True) + b":7\r\n")

        nursery.start_soon(serve)
        assert await connection.call([["SET", "k", "v"]]) == [b"OK"]
    assert await connection.read(1) == [7]


@READERS
async def test_a_connection_cut_mid_reply_closes_and_says_so(
    c_reader: bool,
) -> None:
    connection, server = _pair(c_reader)
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            await server.receive_some()
            await server.send_all(b"$10\r\nabc")
            await server.aclose()

        nursery.start_soon(serve)
        with pytest.raises(ConnectionLost, match="closed the connection"):
            await connection.call([["GET", "k"]])
    assert connection.closed
    with pytest.raises(ConnectionLost, match="is closed"):
        await connection.call([["GET", "k"]])


@READERS
async def test_a_reply_it_cannot_read_closes_the_connection(
    c_reader: bool,
) -> None:
    connection, server = _pair(c_reader)
    async with trio.open_nursery() as nursery:

        async def serve() -> None:
            await server.receive_some()
            await server.send_all(b"x1\r\n")  # no RESP type starts with "x"

        nursery.start_soon(serve)
        with pytest.raises(ConnectionLost, match="cannot read"):
            await connection.call([["HELLO", "3"]])
    assert connection.closed


@READERS
async def test_a_batch_cancelled_before_its_replies_closes_the_connection(
    c_reader: bool,
    autojump_clock: trio.testing.MockClock,
) -> None:
    connection, server = _pair(c_reader)
    with trio.move_on_after(1):  # the reply never comes; the scope ends the wait
        await connection.call([["BLPOP", "k", "0"]])
    assert connection.closed  # a late reply can never answer the next batch
    assert await server.receive_some() == encode(["BLPOP", "k", "0"])


def test_arguments_are_encoded_as_bulk_strings() -> None:
    assert encode(["SET", b"k\r\n", 5, 1.5]) == (
        b"*4\r\n$3\r\nSET\r\n$3\r\nk\r\n\r\n$1\r\n5\r\n$3\r\n1.5\r\n"
    )
