"""The push board over real sockets: SSE, long-poll and websocket followers, reconnects with
Last-Event-ID, deletes that close followers, who may write and read, follower limits, jobs
followed by id, and memory after many follow/disconnect cycles."""

from __future__ import annotations

import functools
import gc
import json
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import h11
import httpx
import pytest
import trio
import wsproto
import wsproto.events

import pipework as pw
from pipework.board import Boards, BoardSettings, BoardSpec
from pipework.container import BoundAddress, Container, ContainerConfig

from .test_container_harness import (
    HANG_GUARD,
    SECRET,
    Served,
    assert_no_content,
    assert_problem,
    assert_raw_problem,
    bearer,
    raw_client,
)

WRITE = "write-token-0123456789"
READ = "read-token-0123456789"


def specs(**overrides: Any) -> list[BoardSpec]:
    settings = BoardSettings(window=0.01, **overrides)
    return [
        BoardSpec("orders", settings, write_token=WRITE, read_token=READ, keepalive=0.2),
        BoardSpec("news", settings, write_token=WRITE, public_read=True, keepalive=0.2),
        BoardSpec("closed", settings, public_read=True),
    ]


@asynccontextmanager
async def serving(
    engine: pw.Engine | None = None, boards: Sequence[BoardSpec] | None = None
) -> AsyncIterator[Served]:
    engine = engine or pw.Engine(registry=pw.Registry())
    config = ContainerConfig(callback_secret=SECRET, shutdown_grace=0.5)
    stop = trio.Event()
    async with engine:
        container = Container(engine, None, config, boards=specs() if boards is None else boards)
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(container.serve, shutdown_trigger=stop)
            )
            try:
                async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as client:
                    yield Served(container, address, client, stop)
            finally:
                stop.set()


async def create(served: Served, board: str, data: Any) -> str:
    response = await served.client.post(f"/boards/{board}", json=data, headers=bearer(WRITE))
    assert response.status_code == 201, response.text
    body = response.json()
    assert response.headers["location"] == f"/boards/{board}/{body['id']}"
    assert body["data"] == data
    return str(body["id"])


async def put(served: Served, board: str, resource: str, data: Any) -> str:
    response = await served.client.put(
        f"/boards/{board}/{resource}", json=data, headers=bearer(WRITE)
    )
    assert response.status_code == 200, response.text
    return str(response.json()["version"])


async def flushed(boards: Boards, *names: str) -> None:
    """Until each board named has published every change written to it (its batch flushed):
    a write after this starts a batch of its own."""
    while True:
        stats = boards.statistics()
        if all(stats[n].published + stats[n].coalesced == stats[n].changes for n in names):
            return
        await trio.sleep(0.005)  # the boards have no event to wait on


async def following(served: Served, board: str, count: int) -> None:
    """Until ``count`` followers (streams or long-polls) follow the board."""
    boards = served.container.boards
    while boards.statistics()[board].followers < count:  # noqa: ASYNC110 - no event either
        await trio.sleep(0.005)


class SseReader:
    """An SSE response read off a bare socket through h11, event by event: (id, event,
    payload) triples; comments are kept in ``comments``."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(our_role=h11.CLIENT)
        self.buffer = ""
        self.comments: list[str] = []
        self.ended = False

    async def open(self, path: str, headers: dict[str, str]) -> h11.Response:
        fields = [("Host", "test"), *headers.items()]
        await self.stream.send_all(
            self.conn.send(h11.Request(method="GET", target=path, headers=fields))
            + self.conn.send(h11.EndOfMessage())
        )
        while True:
            event = await self._event()
            if isinstance(event, h11.Response):
                return event

    async def _event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(bytes(await self.stream.receive_some()))

    async def block(self) -> str:
        while "\n\n" not in self.buffer:
            if self.ended:
                raise EOFError("the stream ended")
            event = await self._event()
            if isinstance(event, h11.Data):
                self.buffer += bytes(event.data).decode()
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                self.ended = True
        block, _, self.buffer = self.buffer.partition("\n\n")
        return block

    async def next(self) -> tuple[str | None, str, Any]:
        while True:
            block = await self.block()
            fields = {}
            for line in block.split("\n"):
                if line.startswith(":"):
                    self.comments.append(line)
                    continue
                name, _, value = line.partition(": ")
                fields[name] = value
            if "event" in fields:
                return fields.get("id"), fields["event"], json.loads(fields["data"])


@asynccontextmanager
async def follow_sse(
    served: Served, path: str, headers: dict[str, str] | None = None
) -> AsyncIterator[tuple[h11.Response, SseReader]]:
    headers = {"Accept": "text/event-stream", **(headers or {})}
    address = served.address
    async with await trio.open_tcp_stream(address.host, address.port) as stream:
        reader = SseReader(stream)
        response = await reader.open(path, headers)
        yield response, reader


async def test_an_sse_follower_gets_the_state_then_every_change_then_the_delete() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "orders", {"n": 0})
            await flushed(served.container.boards, "orders")
            path = f"/boards/orders/{resource}"
            async with follow_sse(served, path, bearer(READ)) as (response, events):
                assert response.status_code == 200
                assert dict(response.headers)[b"content-type"].startswith(b"text/event-stream")
                first = await events.next()
                assert first[1:] == (
                    "update",
                    {"id": resource, "event": "update", "version": first[0], "data": {"n": 0}},
                )
                version = await put(served, "orders", resource, {"n": 1})
                event_id, kind, body = await events.next()
                assert (event_id, kind, body["data"]) == (version, "update", {"n": 1})
                deleted = await served.client.delete(path, headers=bearer(WRITE))
                assert deleted.status_code == 204
                assert_no_content(deleted)
                assert (await events.next())[1] == "delete"
                with pytest.raises(EOFError):
                    await events.next()  # a delete closes its followers
            assert_problem(
                await served.client.get(path, headers=bearer(READ)), 404, "resource-not-found"
            )


async def test_sse_sends_keep_alive_comments_while_idle() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", "hello")
            async with follow_sse(served, f"/boards/news/{resource}") as (_, events):
                await events.next()
                assert [await events.block(), await events.block()] == [": keep-alive"] * 2


async def test_a_reconnect_with_last_event_id_gets_exactly_what_it_missed() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", 0)
            path = f"/boards/news/{resource}"
            async with follow_sse(served, path) as (_, events):
                last_id, _, _ = await events.next()
            missed = []
            for n in (1, 2, 3):
                missed.append(await put(served, "news", resource, n))
                await flushed(served.container.boards, "news")  # each its own batch
            headers = {"Last-Event-ID": str(last_id)}
            async with follow_sse(served, path, headers) as (_, events):
                got = [await events.next() for _ in missed]
                assert [(i, k, b["data"]) for i, k, b in got] == [
                    (v, "update", n) for v, n in zip(missed, (1, 2, 3), strict=True)
                ]
                with trio.move_on_after(0.3):
                    extra = await events.next()
                    raise AssertionError(f"got more than it missed: {extra}")
            # A position from another process (epoch) is answered with a resync.
            async with follow_sse(served, path, {"Last-Event-ID": "1-1"}) as (_, events):
                _, kind, body = await events.next()
                assert (kind, body["data"]) == ("resync", 3)


async def test_long_poll_answers_at_once_when_behind_else_at_the_next_change() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", "a")
            path = f"/boards/news/{resource}"
            await flushed(served.container.boards, "news")
            start = (await served.client.get(path)).json()["version"]
            for state in "bc":
                await put(served, "news", resource, state)
                await flushed(served.container.boards, "news")  # each its own batch
            behind = (await served.client.get(path, params={"since": start})).json()
            assert [e["data"] for e in behind["events"]] == ["b", "c"]  # several at once
            position = behind["position"]

            async def change_later() -> None:
                await following(served, "news", 1)  # the long-poll waits
                await put(served, "news", resource, "d")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(change_later)
                waited = await served.client.get(path, params={"since": position, "wait": 5})
            assert [e["data"] for e in waited.json()["events"]] == ["d"]
            idle = await served.client.get(
                path, params={"since": waited.json()["position"], "wait": 0.1}
            )
            assert idle.json()["events"] == []
            assert_problem(await served.client.get(path, params={"since": "x"}), 400)


async def test_a_long_poll_from_the_callers_own_write_waits_for_news() -> None:
    """``GET ?since=V`` right after the caller's own ``PUT`` answered V, before the board's
    batch flushed: answered with every event after V (none, here), not with V at the
    flush."""
    slow = [BoardSpec("news", BoardSettings(window=0.3), write_token=WRITE, public_read=True)]
    with trio.fail_after(HANG_GUARD):
        async with serving(boards=slow) as served:
            resource = await create(served, "news", "a")
            written = await put(served, "news", resource, "b")
            path = f"/boards/news/{resource}"
            polled = await served.client.get(path, params={"since": written, "wait": 1})
            assert polled.json() == {"events": [], "position": written}


async def test_a_websocket_follower_gets_changes_and_is_closed_by_the_delete() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", 1)
            await flushed(served.container.boards, "news")
            address = served.address
            stream = await trio.open_tcp_stream(address.host, address.port)
            async with stream:
                ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
                await stream.send_all(
                    ws.send(wsproto.events.Request(host="test", target=f"/boards/news/{resource}"))
                )
                messages: list[Any] = []
                send, receive = trio.open_memory_channel[Any](10)
                closed = False

                async def pump() -> None:
                    nonlocal closed
                    async with send:
                        while not closed:
                            data = await stream.receive_some()
                            if not data:
                                return
                            ws.receive_data(data)
                            for event in ws.events():
                                if isinstance(event, wsproto.events.TextMessage):
                                    await send.send(json.loads(event.data))
                                elif isinstance(event, wsproto.events.CloseConnection):
                                    await stream.send_all(ws.send(event.response()))
                                    closed = True

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(pump)
                    messages.append(await receive.receive())
                    await put(served, "news", resource, 2)
                    messages.append(await receive.receive())
                    await served.client.delete(f"/boards/news/{resource}", headers=bearer(WRITE))
                    messages.append(await receive.receive())
                assert [(m["event"], m["data"]) for m in messages] == [
                    ("update", 1),
                    ("update", 2),
                    ("delete", None),
                ]
                assert closed


def client_frame(opcode: int, payload: bytes, *, fin: bool = True, masked: bool = True) -> bytes:
    """One websocket frame as a client sends it (RFC 6455 §5.2), built by hand so that it
    can break the rules; ``payload`` under 126 bytes."""
    head = bytes([(0x80 if fin else 0) | opcode, (0x80 if masked else 0) | len(payload)])
    if not masked:
        return head + payload
    key = b"\x1f\x2e\x3d\x4c"
    return head + key + bytes(byte ^ key[i % 4] for i, byte in enumerate(payload))


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        pytest.param(client_frame(0x1, b"\xff\xfe"), 1007, id="text-not-utf8"),
        pytest.param(client_frame(0x1, b"hi", masked=False), 1002, id="unmasked"),
        pytest.param(client_frame(0x3, b""), 1002, id="reserved-opcode"),
        pytest.param(client_frame(0x9, b"", fin=False), 1002, id="fragmented-ping"),
    ],
)
async def test_a_websocket_protocol_error_is_answered_with_a_close_frame(
    frame: bytes, code: int
) -> None:
    """RFC 6455 §7.1.7: the server fails the connection with a close frame that says why
    (§7.4.1), then closes the TCP connection; a bare close would read as a network failure."""
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", 1)
            address = served.address
            async with await trio.open_tcp_stream(address.host, address.port) as stream:
                ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
                await stream.send_all(
                    ws.send(wsproto.events.Request(host="test", target=f"/boards/news/{resource}"))
                )
                received: list[wsproto.events.Event] = []
                while not any(isinstance(e, wsproto.events.AcceptConnection) for e in received):
                    ws.receive_data(await stream.receive_some())
                    received.extend(ws.events())
                await stream.send_all(frame)
                while data := await stream.receive_some():
                    ws.receive_data(data)
                    received.extend(ws.events())
                closes = [e for e in received if isinstance(e, wsproto.events.CloseConnection)]
                assert [close.code for close in closes] == [code], received


async def open_websocket(
    served: Served, target: str, after_request: bytes = b""
) -> tuple[trio.SocketStream, wsproto.WSConnection, list[wsproto.events.Event]]:
    """Send a websocket handshake (and ``after_request`` in the same write, before any
    answer); read until the server accepts or refuses it."""
    address = served.address
    stream = await trio.open_tcp_stream(address.host, address.port)
    ws = wsproto.WSConnection(wsproto.ConnectionType.CLIENT)
    await stream.send_all(
        ws.send(wsproto.events.Request(host="test", target=target)) + after_request
    )
    received: list[wsproto.events.Event] = []
    while not any(
        isinstance(e, wsproto.events.AcceptConnection)
        or (isinstance(e, wsproto.events.RejectData) and e.body_finished)
        for e in received
    ):
        data = await stream.receive_some()
        assert data, f"the server closed the connection after {received}"
        ws.receive_data(data)
        received.extend(ws.events())
    return stream, ws, received


@pytest.mark.parametrize(
    ("target", "status", "slug"),
    [
        pytest.param("/boards/news/nope", 404, "resource-not-found", id="unknown-resource"),
        pytest.param("/boards/orders/nope", 401, "board-token", id="no-token"),
        pytest.param("/boards/nope/x", 404, "board-not-found", id="unknown-board"),
    ],
)
async def test_a_refused_websocket_is_answered_with_its_problem(
    target: str, status: int, slug: str
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            stream, _, received = await open_websocket(served, target)
            await stream.aclose()
    (reject,) = [e for e in received if isinstance(e, wsproto.events.RejectConnection)]
    body = b"".join(e.data for e in received if isinstance(e, wsproto.events.RejectData))
    assert reject.status_code == status
    assert (b"content-type", b"application/problem+json") in reject.headers
    problem = json.loads(body)
    assert problem["type"] == f"urn:pipework:problem:{slug}"
    assert problem["instance"] == target


async def test_frames_sent_before_the_handshake_answer_are_read_after_it() -> None:
    """A client that does not wait for the 101 (RFC 6455 §4.1 says it must) gets its frames
    read once the follow is accepted, in order; the server lives on (hypercorn answered such
    a frame with a 400 that raced the 101 and took the whole server down)."""
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", 1)
            early = client_frame(0x9, b"one") + client_frame(0x9, b"two")
            stream, ws, received = await open_websocket(
                served, f"/boards/news/{resource}", after_request=early
            )
            async with stream:
                while sum(isinstance(e, wsproto.events.Pong) for e in received) < 2:
                    ws.receive_data(await stream.receive_some())
                    received.extend(ws.events())
                await stream.send_all(client_frame(0x1, b"hi", masked=False))
                while data := await stream.receive_some():
                    ws.receive_data(data)
                    received.extend(ws.events())
            pongs = [e.payload for e in received if isinstance(e, wsproto.events.Pong)]
            closes = [e.code for e in received if isinstance(e, wsproto.events.CloseConnection)]
            assert (pongs, closes) == ([b"one", b"two"], [1002])
            assert (await served.client.get("/healthz")).status_code == 200


async def test_a_frame_sent_before_a_refusal_is_dropped_with_the_connection() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            stream, _, received = await open_websocket(
                served, "/boards/news/nope", after_request=client_frame(0x9, b"x")
            )
            async with stream:
                assert await stream.receive_some() == b""  # closed after the answer
            (reject,) = [e for e in received if isinstance(e, wsproto.events.RejectConnection)]
            assert reject.status_code == 404
            assert (await served.client.get("/healthz")).status_code == 200


async def test_who_may_write_and_read() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            client = served.client
            assert_problem(await client.post("/boards/orders", json=1), 401, "board-token")
            assert_problem(
                await client.post("/boards/orders", json=1, headers=bearer(READ)),
                401,
                "board-token",
            )
            # No write token configured: no anonymous writes, whatever is sent.
            assert_problem(
                await client.post("/boards/closed", json=1, headers=bearer(WRITE)),
                403,
                "board-read-only",
            )
            assert_problem(await client.post("/boards/nope", json=1), 404, "board-not-found")
            assert_problem(await client.get("/boards/jobs/x"), 404, "board-not-found")
            resource = await create(served, "orders", {"secret": True})
            path = f"/boards/orders/{resource}"
            assert_problem(await client.get(path), 401, "board-token")
            assert (await client.get(path, headers=bearer(READ))).json()["data"] == {"secret": True}
            assert (await client.get(path, params={"token": READ})).status_code == 200
            news = await create(served, "news", "public")
            assert (await client.get(f"/boards/news/{news}")).json()["data"] == "public"
            assert_problem(await client.put(f"/boards/news/{news}", json=1), 401, "board-token")
            assert_problem(
                await client.put("/boards/news/nope", json=1, headers=bearer(WRITE)),
                404,
                "resource-not-found",
            )


#: Bearer credentials no token can be: a character outside ASCII (é as UTF-8 on the
#: wire), a byte that is no UTF-8 at all, and the write token with such a byte after it.
MALFORMED = [b"Bearer \xc3\xa9", b"Bearer \xff", b"Bearer " + WRITE.encode() + b"\xff"]


async def test_a_malformed_bearer_credential_is_401_like_a_wrong_one() -> None:
    """A token that is not ASCII, sent as raw bytes, is refused as a wrong token is (401
    with WWW-Authenticate), on every write and on reads, not answered with a 500."""
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "orders", {"n": 0})
            path = f"/boards/orders/{resource}"
            answers = []
            requests = [
                ("POST", "/boards/orders", b"1"),
                ("PUT", path, b"2"),
                ("DELETE", path, b""),
                ("GET", path, b""),
            ]
            for credential in MALFORMED:
                for method, target, data in requests:
                    fields = [("Authorization", credential), ("Content-Type", b"application/json")]
                    async with raw_client(served.address) as raw:
                        await raw.send(method, target, body=data, headers=fields)
                        answers.append(await raw.receive())
            # A query token is UTF-8 once percent-decoded: é is a character, not a byte.
            async with raw_client(served.address) as raw:
                await raw.send("GET", f"{path}?token=%C3%A9")
                answers.append(await raw.receive())
            unchanged = await served.client.get(path, headers=bearer(READ))
    for answer in answers:
        body, headers = assert_raw_problem(answer, 401, "board-token")
        assert headers["www-authenticate"].startswith("Bearer")
        assert "token" in body["detail"]
    assert unchanged.json()["data"] == {"n": 0}


async def test_past_the_follower_limit_a_follow_is_refused_with_503() -> None:
    boards = [
        BoardSpec(
            "news",
            BoardSettings(window=0.01, max_per_resource=1),
            write_token=WRITE,
            public_read=True,
        )
    ]
    with trio.fail_after(HANG_GUARD):
        async with serving(boards=boards) as served:
            resource = await create(served, "news", 0)
            path = f"/boards/news/{resource}"
            async with follow_sse(served, path) as (_, events):
                await events.next()
                refused = await served.client.get(path, headers={"Accept": "text/event-stream"})
                body = assert_problem(refused, 503, "followers-full")
                assert body["reason"] == "resource"
                assert refused.headers["retry-after"] == "5"
            # The follower left with its connection: there is room again.
            async with follow_sse(served, path) as (response, events):
                assert response.status_code == 200
                await events.next()


async def test_board_metrics_are_exported() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", 0)
            for n in range(5):
                await put(served, "news", resource, n)
            await flushed(served.container.boards, "news")
            async with follow_sse(served, f"/boards/news/{resource}") as (_, events):
                await events.next()
                text = (await served.client.get("/metrics")).text
            assert 'pipework_board_followers{board="news"} 1.0' in text
            assert 'pipework_board_followers{board="jobs"} 0.0' in text
            values = {
                line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("pipework_board_") and 'board="news"' in line
            }
            assert values["pipework_board_changes_total"] == 6
            # Each change was either published or coalesced into a later one.
            assert (
                values["pipework_board_events_published_total"]
                + values["pipework_board_events_coalesced_total"]
                == 6
            )
            assert values["pipework_board_events_delivered_total"] == 1


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def follow_and_leave(address: BoundAddress, path: str) -> None:
    async with await trio.open_tcp_stream(address.host, address.port) as stream:
        reader = SseReader(stream)
        await reader.open(path, {"Accept": "text/event-stream"})
        await reader.next()  # following: the state arrived; now cut the connection


# 5,000 connections made and dropped: about 40 s alone, several times that beside a second
# test run on two cores. The bound catches a hang, not slowness.
@pytest.mark.hang_guard(real_seconds=600)  # the bound it sets itself, below
async def test_memory_returns_to_its_level_after_many_follow_and_disconnect_cycles() -> None:
    """5,000 SSE followers come and go (50 at a time): the RSS after all of them stays
    within 10% of the level after the first 500, and no follower is left behind.
    ``python -m benchmarks --only bench_board`` measures the same."""
    with trio.fail_after(600):
        async with serving() as served:
            resource = await create(served, "news", {"n": 0})
            await flushed(served.container.boards, "news")
            path = f"/boards/news/{resource}"
            core = served.container.boards.cores["news"]

            async def cycles(count: int) -> None:
                limiter = trio.CapacityLimiter(50)

                async def one() -> None:
                    async with limiter:
                        await follow_and_leave(served.address, path)

                async with trio.open_nursery() as nursery:
                    for _ in range(count):
                        nursery.start_soon(one)

            async def settled() -> None:
                # No event tells when the last handler has seen its disconnect: poll.
                while core.statistics().followers:  # noqa: ASYNC110 - the core has no event to wait on
                    await trio.sleep(0.01)
                gc.collect()

            await cycles(500)
            await settled()
            baseline = rss_bytes()
            for _ in range(9):
                await cycles(500)
            await settled()
            after = rss_bytes()
            assert core.statistics().delivered >= 5000
            assert after <= baseline * 1.10, (baseline, after)


async def test_options_on_the_containers_own_paths_lists_what_they_take() -> None:
    """As on a route's path: 204, no content, the methods the path takes (Quart's automatic
    answer was a 200 in text/html listing every method of the routes' catch-all rule)."""
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            answers = {
                path: await served.client.options(path)
                for path in ("/healthz", "/boards/news/x", "/boards/news", "/jobs/x")
            }
    allowed = {}
    for path, answer in answers.items():
        assert answer.status_code == 204, path
        assert_no_content(answer)
        allowed[path] = set(answer.headers["allow"].split(", "))
    assert allowed == {
        "/healthz": {"GET", "HEAD"},
        "/boards/news/x": {"GET", "HEAD", "PUT", "DELETE"},
        "/boards/news": {"POST"},
        "/jobs/x": {"GET", "HEAD", "DELETE"},
    }


async def test_a_websocket_client_that_talks_still_gets_its_close_answered() -> None:
    """The board only sends; what a client sends is read and ignored, so that its close
    frame is still read after any number of messages (unread, they filled the app's queues
    and the server stopped reading the connection)."""
    with trio.fail_after(HANG_GUARD):
        async with serving() as served:
            resource = await create(served, "news", 1)
            stream, ws, received = await open_websocket(served, f"/boards/news/{resource}")
            async with stream:
                chatter = b"".join(
                    ws.send(wsproto.events.TextMessage(data=f"hello {n}")) for n in range(100)
                )
                await stream.send_all(chatter + ws.send(wsproto.events.CloseConnection(1000)))
                while data := await stream.receive_some():
                    ws.receive_data(data)
                    received.extend(ws.events())
            closes = [e.code for e in received if isinstance(e, wsproto.events.CloseConnection)]
            assert closes == [1000]
