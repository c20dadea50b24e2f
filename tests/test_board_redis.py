"""The push board's backplane: every write goes through it, and on Redis two containers (two
processes' boards, here in one trio run) share their boards: a follower on one hears a write
made on the other, a Last-Event-ID from one resumes on the other, and Redis going away
refuses writes clearly while followers stay connected and recover after."""

from __future__ import annotations

import functools
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import coredis
import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

import pipework as pw
from pipework import Gateway
from pipework.board import (
    Backplane,
    BoardCore,
    Boards,
    BoardSettings,
    BoardSpec,
    Change,
    Kind,
    LocalBackplane,
    Version,
)
from pipework.container import BoundAddress, Container, ContainerConfig
from pipework.redis._backplane import RedisBackplane

from ._redis import RedisServer, redis_server, start_redis
from .test_board_http import WRITE, create, follow_sse, put
from .test_container_harness import HANG_GUARD, SECRET, Served, assert_problem, bearer

__all__ = ["redis_server"]  # the session's Redis, a fixture

SETTINGS = BoardSettings(window=0.01, keep_all=True)


def board_specs() -> list[BoardSpec]:
    return [BoardSpec("news", SETTINGS, write_token=WRITE, public_read=True, keepalive=0.2)]


@asynccontextmanager
async def serving(backplane: Backplane) -> AsyncIterator[Served]:
    engine = pw.Engine(registry=pw.Registry())
    config = ContainerConfig(callback_secret=SECRET, shutdown_grace=0.5)
    stop = trio.Event()
    async with engine:
        container = Container(engine, None, config, boards=board_specs(), backplane=backplane)
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(container.serve, shutdown_trigger=stop)
            )
            try:
                async with httpx.AsyncClient(base_url=address.url, timeout=HANG_GUARD) as client:
                    yield Served(container, address, client, stop)
            finally:
                stop.set()


@asynccontextmanager
async def two_processes(url: str) -> AsyncIterator[tuple[Served, Served]]:
    """Two containers sharing their boards through the Redis at ``url``."""
    prefix = f"t{secrets.token_hex(6)}"
    async with (
        serving(RedisBackplane(url, prefix=prefix, io_timeout=2.0)) as a,
        serving(RedisBackplane(url, prefix=prefix, io_timeout=2.0)) as b,
    ):
        yield a, b


async def readable(
    client: httpx.AsyncClient, path: str, version: str | None = None
) -> dict[str, Any]:
    """The resource as ``client``'s process answers it, once that process has heard of it (at
    ``version``, if given)."""
    while True:
        response = await client.get(path)
        if response.status_code == 200:
            body: dict[str, Any] = response.json()
            if version is None or body["version"] == version:
                return body
        await trio.sleep(0.01)  # the other process's reader has not applied it yet


# -- the interface, without Redis ------------------------------------------------------


class Recording(LocalBackplane):
    """A backplane that records what goes through it and counts its own versions."""

    def __init__(self) -> None:
        super().__init__()
        self.changes: list[Change] = []
        self.offset = 1000

    async def publish(self, change: Change) -> Version:
        assert self._boards is not None
        self.changes.append(change)
        self.offset += 7  # versions decided here, not by the board
        epoch = self._boards.cores[change.board].epoch
        return self._boards.apply(change, Version(epoch, self.offset))


async def test_every_http_write_goes_through_the_backplane_and_answers_its_version() -> None:
    plane = Recording()
    with trio.fail_after(HANG_GUARD):
        async with serving(plane) as served:
            resource = await create(served, "news", {"n": 0})
            version = await put(served, "news", resource, {"n": 1})
            path = f"/boards/news/{resource}"
            assert (await served.client.get(path)).json()["version"] == version
            assert (await served.client.delete(path, headers=bearer(WRITE))).status_code == 204
    assert [(c.op, c.resource, c.data) for c in plane.changes] == [
        ("create", resource, {"n": 0}),
        ("update", resource, {"n": 1}),
        ("delete", resource, None),
    ]
    assert version.endswith("-1014")


async def test_a_shared_board_refuses_writes_that_cannot_wait_for_their_version() -> None:
    boards = Boards(board_specs(), backplane=RedisBackplane("redis://127.0.0.1:1/0"))
    with pytest.raises(TypeError, match=r"await boards\.write"):
        boards.create("news", "r", 1)
    local = Boards([BoardSpec("jobs-like", SETTINGS, local=True)], backplane=boards.backplane)
    assert local.create("jobs-like", "r", 1).offset == 1  # a local board stays synchronous


def test_reconcile_brings_a_board_to_the_shared_state_and_old_positions_get_a_resync() -> None:
    core = BoardCore(BoardSettings(window=0.0, keep_all=True), epoch=5)
    core.create("a", 1, 0.0)
    core.create("b", 1, 0.0)
    core.flush()
    follower = core.join(["a", "b"])
    core.take(follower)
    # The shared log went on to offset 9: a changed, b deleted, c new.
    core.reconcile(5, 9, {"a": (7, 2), "c": (8, 3)}, 1.0)
    core.flush()
    taken = core.take(follower)
    assert {(e.resource, e.kind, e.version) for e in taken.events} == {
        ("a", Kind.UPDATE, Version(5, 9)),
        ("b", Kind.DELETE, Version(5, 9)),
    }
    assert core.read("a") == (Version(5, 9), 2)
    assert core.read("c") == (Version(5, 9), 3)
    late = core.join(["a"], since=Version(5, 2))  # behind what the reconcile could know
    assert [e.kind for e in core.take(late).events] == [Kind.RESYNC]
    # A new epoch: every resource is told again, positions from the old one are foreign.
    core.reconcile(6, 3, {"a": (9, 2), "c": (9, 3)}, 2.0)
    core.flush()
    assert [(e.resource, e.version) for e in core.take(follower).events] == [("a", Version(6, 3))]
    stale = core.join(["c"], since=Version(5, 9))
    assert [e.kind for e in core.take(stale).events] == [Kind.RESYNC]
    with pytest.raises(ValueError, match="does not follow"):
        core.update("a", 3, 3.0, Version(6, 3))  # not after the board's position


# -- on Redis ------------------------------------------------------------------------------


async def test_a_follower_on_one_process_gets_a_write_made_on_another(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with two_processes(redis_server.url) as (a, b):
            resource = await create(a, "news", {"n": 0})
            path = f"/boards/news/{resource}"
            assert (await readable(b.client, path))["data"] == {"n": 0}
            async with follow_sse(b, path) as (_, events):
                first_id, _, _ = await events.next()
                version = await put(a, "news", resource, {"n": 1})
                event_id, kind, body = await events.next()
                assert (event_id, kind, body["data"]) == (version, "update", {"n": 1})
                assert Version.parse(version) > Version.parse(first_id)  # type: ignore[operator]  # ids written by the board always parse
                # and the other way round, with the same versions on both
                version = await put(b, "news", resource, {"n": 2})
                assert (await a.client.get(path)).json()["version"] == version
                assert (await events.next())[0] == version
                assert (await a.client.delete(path, headers=bearer(WRITE))).status_code == 204
                assert (await events.next())[1] == "delete"
                with pytest.raises(EOFError):
                    await events.next()
            # A create collides or a missing resource is refused whichever process asks.
            assert_problem(
                await b.client.put(path, json=3, headers=bearer(WRITE)), 404, "resource-not-found"
            )


async def test_a_reconnect_to_another_process_gets_exactly_what_it_missed(
    redis_server: RedisServer,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with two_processes(redis_server.url) as (a, b):
            resource = await create(a, "news", 0)
            path = f"/boards/news/{resource}"
            await readable(b.client, path)
            async with follow_sse(a, path) as (_, events):
                last_id, _, _ = await events.next()
            missed = [await put(a, "news", resource, n) for n in (1, 2, 3)]
            await readable(b.client, path, missed[-1])
            async with follow_sse(b, path, {"Last-Event-ID": str(last_id)}) as (_, events):
                got = [await events.next() for _ in missed]
                assert [(i, k, d["data"]) for i, k, d in got] == [
                    (v, "update", n) for v, n in zip(missed, (1, 2, 3), strict=True)
                ]
                with trio.move_on_after(0.3):
                    extra = await events.next()
                    raise AssertionError(f"got more than it missed: {extra}")


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own: it is stopped and restarted."""
    server = start_redis(tmp_path)
    try:
        yield server
    finally:
        server.stop()


async def test_redis_away_refuses_writes_clearly_and_followers_recover_after(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(HANG_GUARD * 2):
        async with two_processes(own_redis.url) as (a, b):
            resource = await create(a, "news", 0)
            path = f"/boards/news/{resource}"
            await readable(b.client, path)
            async with follow_sse(b, path) as (_, events):
                before, _, _ = await events.next()
                await trio.to_thread.run_sync(own_redis.stop)
                refused = await a.client.put(path, json=1, headers=bearer(WRITE))
                problem = assert_problem(refused, 503, "board-unavailable")
                assert refused.headers["Retry-After"]
                assert "nothing was written" in problem["detail"]
                assert own_redis.url not in problem["detail"]  # where it is: the log's
                refusals = [r for r in caplog.records if "was refused" in r.getMessage()]
                assert f"127.0.0.1:{own_redis.port}" in refusals[0].getMessage()
                # Reads and follows go on from each process's copy meanwhile.
                assert (await b.client.get(path)).json()["data"] == 0
                # Back, empty (no persistence): a process writes its copy back under a new
                # epoch, the other reconciles; the follower stays and hears the new epoch.
                await trio.to_thread.run_sync(own_redis.restart)
                while True:
                    answer = await a.client.put(path, json=2, headers=bearer(WRITE))
                    if answer.status_code == 200:
                        break
                    assert_problem(answer, 503, "board-unavailable")
                    await trio.sleep(0.05)  # the readers are reconnecting
                version = answer.json()["version"]
                seen: list[tuple[str | None, str, Any]] = []
                while not seen or seen[-1][0] != version:
                    seen.append(await events.next())
                assert seen[-1][1:] == (
                    "update",
                    {"id": resource, "event": "update", "version": version, "data": 2},
                )
                assert Version.parse(version).epoch != Version.parse(before).epoch  # type: ignore[union-attr]  # ids written by the board always parse
            # A position from before the restart is foreign now: a resync, never a gap.
            async with follow_sse(b, path, {"Last-Event-ID": str(before)}) as (_, events):
                _, kind, body = await events.next()
                assert (kind, body["data"]) == ("resync", 2)


async def test_two_gateways_on_one_redis_share_their_boards(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(
        f'[boards]\nbackplane = "redis"\nurl = "{redis_server.url}"\n'
        f'prefix = "g{secrets.token_hex(4)}"\n\n'
        f'[boards.news]\npublic_read = true\nwrite_token = "{WRITE}"\nwindow = 0.01\n'
    )
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            first: BoundAddress = await nursery.start(
                functools.partial(Gateway(str(path)).run, port=0, stop=stop)
            )
            second: BoundAddress = await nursery.start(
                functools.partial(Gateway(str(path)).run, port=0, stop=stop)
            )
            async with (
                httpx.AsyncClient(base_url=first.url) as a,
                httpx.AsyncClient(base_url=second.url) as b,
            ):
                created = await a.post("/boards/news", json={"n": 1}, headers=bearer(WRITE))
                assert created.status_code == 201, created.text
                resource = created.json()["id"]
                assert await readable(b, f"/boards/news/{resource}") == created.json()
            stop.set()


def _apply(view: dict[str, Any], events: Any) -> None:
    for event in events:
        if event.kind is Kind.DELETE:
            view.pop(event.resource, None)
        else:
            view[event.resource] = event.data


@given(
    local=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 3)),
    shared=st.dictionaries(st.sampled_from("abcde"), st.integers(0, 3)),
    new_epoch=st.booleans(),
    taken_before=st.booleans(),
    ahead=st.integers(0, 5),
)
def test_after_a_reconcile_every_follower_holds_the_shared_state(
    local: dict[str, int], shared: dict[str, int], new_epoch: bool, taken_before: bool, ahead: int
) -> None:
    core = BoardCore(BoardSettings(window=0.0, history=4), epoch=1)
    for resource, data in local.items():
        core.create(resource, data, 0.0)
    core.flush()
    follower = core.join(local) if local else None
    view: dict[str, Any] = {}
    if follower is not None and taken_before:
        _apply(view, core.take(follower).events)
    position = core.position
    # The shared log is past this board's position if anything differs (or exactly there).
    offset = position.offset + ahead + (shared != local)
    # An unchanged resource keeps its version in the shared state; a changed one is newer.
    state = {
        r: ((core.read(r)[0].offset if r in core and core.read(r)[1] == d else offset), d)
        for r, d in shared.items()
    }
    epoch = 2 if new_epoch else 1
    core.reconcile(epoch, offset, state, 1.0)
    core.flush()
    if follower is not None:
        _apply(view, core.take(follower).events)
        assert view == {r: shared[r] for r in local if r in shared}
    for resource in "abcde":
        assert (resource in core) == (resource in shared)
        if resource in shared:
            assert core.read(resource)[1] == shared[resource]
    # A follower joining at the old position converges too (exactly, or by a resync).
    if state:
        late = core.join(state, since=position)
        seen: dict[str, Any] = {r: local.get(r) for r in state if r in local}
        _apply(seen, core.take(late).events)
        assert seen == shared


async def test_an_unreadable_log_entry_is_logged_and_the_board_reloaded(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with two_processes(redis_server.url) as (a, b):
            resource = await create(a, "news", 0)
            path = f"/boards/news/{resource}"
            await readable(b.client, path)
            plane = b.container.boards.backplane
            assert isinstance(plane, RedisBackplane)
            async with coredis.Redis.from_url(redis_server.url) as redis:
                await redis.xadd(f"{plane.prefix}:board:news:log", {"junk": "1"})
            version = await put(a, "news", resource, 1)
            assert (await readable(b.client, path, version))["data"] == 1
            assert any("reader failed" in r.getMessage() for r in caplog.records)
