"""The Lua scripts (pipework/redis/lua/*.lua) run on a real Redis, each on its own: what it
answers and what it leaves in Redis, for every answer its header lists. The stores, queues,
relays and backplanes that send them are tested elsewhere; here each script's contract is
checked by itself, with keys and arguments as its header describes them."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from importlib.resources import files
from typing import Any

import pytest
import trio

from pipework.redis import _backplane, _ratelimit, _relay, _store_scripts, _timers
from pipework.redis._client import Client
from pipework.redis._scripts import Script, load, terminal_statuses
from pipework.redis._wire import Arg, Connection, ReplyError

from ._redis import RedisServer

#: Every script a module of pipework.redis runs.
SCRIPTS: dict[str, Script] = {
    script.name: script
    for script in [
        *_store_scripts._SCRIPTS.values(),
        _timers._CLAIM,
        _relay._EMIT,
        _relay._READ,
        _backplane._WRITE,
        _backplane._LOAD,
        _backplane._SEED,
        _ratelimit._SCRIPT,
    ]
}


class Redis:
    """A connection and a key prefix of the test's own; ``run`` runs a script by name."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.client = client
        self.p = prefix

    async def run(self, name: str, keys: list[str], args: list[Arg]) -> Any:
        return await self.client.script(SCRIPTS[name], keys, args)

    async def __call__(self, *command: Arg) -> Any:
        return await self.client.call(*command)


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = Client(redis_server.url)
    try:
        with trio.fail_after(30):
            yield Redis(client, f"s{secrets.token_hex(6)}")
    finally:
        await client.aclose()


def test_every_file_is_a_script_that_pipework_runs() -> None:
    names = {p.name[:-4] for p in files("pipework.redis").joinpath("lua").iterdir()}
    assert names == set(SCRIPTS)
    for name, script in SCRIPTS.items():
        assert script == load(name)
        assert script.source.startswith("-- ")  # a header says what it takes and answers


async def test_each_scripts_sha1_is_the_one_redis_gives_it(redis: Redis) -> None:
    for script in SCRIPTS.values():
        assert await redis("SCRIPT", "LOAD", script.source) == script.sha.encode()


def test_the_scripts_that_tell_finished_jobs_apart_list_the_engines_terminal_statuses() -> None:
    expected = {"cancelled", "done", "expired", "failed"}
    for name in ("store_update", "store_status", "store_awaited"):
        assert terminal_statuses(SCRIPTS[name]) == expected
    broken = Script("x", "local terminal = {['done'] = true}\n", "")
    assert terminal_statuses(broken) == {"done"}
    with pytest.raises(RuntimeError, match="no table of terminal statuses"):
        terminal_statuses(Script("x", "return 1\n", ""))


# -- the job store ---------------------------------------------------------------------


async def _create(
    redis: Redis,
    job: str,
    status: str = "queued",
    origin: str = "me",
    owner: str = "",
    created: float | str = "",
) -> Any:
    keys = [f"{redis.p}:job:{job}", f"{redis.p}:active"]
    return await redis.run("store_create", keys, [b"blob", status, 0, job, origin, owner, created])


def _update_args(
    redis: Redis,
    job: str,
    status: str,
    *,
    terminal: bool = False,
    version: str = "",
    origin: str = "me",
    retain: int = 10,
    remember: int = 10,
) -> tuple[list[str], list[Arg]]:
    """The update script's keys and arguments: a terminal write's retention ends at 100.5
    (wall clock), 30 s from now; a tombstone is remembered 20 s after that."""
    p = redis.p
    keys = [f"{p}:job:{job}", f"{p}:finished", f"{p}:gone"]
    args: list[Arg] = [b"blob2", status, job, int(terminal), 100.5, "hash", p, 60_000, 30.0]
    args += [retain, origin, 20.0, remember, version]
    return keys, args


async def test_create_writes_a_record_once_with_its_event_and_claims_it(redis: Redis) -> None:
    p = redis.p
    assert await _create(redis, "a") == 1
    assert await _create(redis, "a") == 0  # never over an existing one
    assert await redis("HMGET", f"{p}:job:a", "d", "s", "v", "o") == [
        b"blob",
        b"queued",
        b"0",
        b"me",
    ]
    assert await redis("SMEMBERS", f"{p}:active") == [b"a"]
    # With its first event on a stream, and claimed by a consumer of the stream's group.
    stream = f"{p}:events"
    await redis("XGROUP", "CREATE", stream, "g", "0", "MKSTREAM")
    await redis("XADD", stream, "*", "e", "before")
    keys = [f"{p}:job:b", f"{p}:active", stream]
    at, entries = await redis.run(
        "store_create",
        keys,
        [b"blob", "queued", 0, "b", "me", "", "", "e", "b's", "g", "c", 4, 7.5],
    )
    assert [fields for _, fields in entries] == [[b"e", b"before"], [b"e", b"b's"]]
    assert at == entries[1][0]
    assert await redis("HMGET", f"{p}:job:b", "s", "u") == [b"running", b"7.5"]
    assert (await redis("XPENDING", stream, "g"))[0] == 2  # pending for the consumer now
    # Entries before it took the room: left queued, the entries read delivered.
    await redis("XADD", stream, "*", "e", "x")
    keys = [f"{p}:job:c", f"{p}:active", stream]
    at, entries = await redis.run(
        "store_create",
        keys,
        [b"blob", "queued", 0, "c", "me", "", "", "e", "c's", "g", "c", 1, 7.5],
    )
    assert (at, [fields for _, fields in entries]) == (b"", [[b"e", b"x"]])
    assert await redis("HGET", f"{p}:job:c", "s") == b"queued"
    # A group Redis lost (restarted empty): nothing claimed, the record and event written.
    keys = [f"{p}:job:d", f"{p}:active", f"{p}:other"]
    reply = await redis.run(
        "store_create",
        keys,
        [b"blob", "queued", 0, "d", "me", "", "", "e", "d's", "g", "c", 4, 7.5],
    )
    assert reply == [b"", []]
    assert await redis("XLEN", f"{p}:other") == 1
    assert await redis("HGET", f"{p}:job:d", "s") == b"queued"


async def test_update_answers_each_case_with_one_integer(redis: Redis) -> None:
    p = redis.p
    keys, args = _update_args(redis, "missing", "running")
    assert await redis.run("store_update", keys, args) == -1
    await _create(redis, "a")
    keys, args = _update_args(redis, "a", "running", version="5")
    assert await redis.run("store_update", keys, args) == -3  # written since at another
    assert await redis("HGET", f"{p}:job:a", "d") == b"blob"  # nothing written
    keys, args = _update_args(redis, "a", "running", version="0")
    assert await redis.run("store_update", keys, args) == 1
    keys, args = _update_args(redis, "a", "running")  # any version
    assert await redis.run("store_update", keys, args) == 2
    assert await redis("HMGET", f"{p}:job:a", "d", "s", "v", "u") == [
        b"blob2",
        b"running",
        b"2",
        b"",
    ]
    keys, args = _update_args(redis, "a", "done", terminal=True)
    assert await redis.run("store_update", keys, args) == 3
    assert await redis("SMEMBERS", f"{p}:active") == []
    assert await redis("ZRANGE", f"{p}:finished", 0, -1, "WITHSCORES") == [b"a", b"100.5"]
    assert await redis("HGETALL", f"{p}:gone") == [b"a", b"hash"]
    assert await redis("ZRANGE", f"{p}:remembered", 0, -1, "WITHSCORES") == [b"a", b"100.5"]
    assert 0 < await redis("PTTL", f"{p}:job:a") <= 60_000
    # A finished record: a second end leaves it (its version said), anything else refused.
    keys, args = _update_args(redis, "a", "failed", terminal=True)
    assert await redis.run("store_update", keys, args) == -13
    keys, args = _update_args(redis, "a", "running")
    assert await redis.run("store_update", keys, args) == -2
    assert await redis("HGET", f"{p}:job:a", "s") == b"done"


async def test_update_publishes_a_watched_jobs_versions_and_ends_others_may_wait_for(
    redis: Redis, redis_server: RedisServer
) -> None:
    p = redis.p
    for job in ("mine", "theirs", "awaited"):
        await _create(redis, job, origin="me")
    await redis("SET", f"{p}:watch:mine", "1")
    await redis("HSET", f"{p}:job:awaited", "w", "1")
    connection = await Connection.open(redis_server.url)  # a subscriber
    try:
        await connection.send([["SUBSCRIBE", f"{p}:finished", f"{p}:relay:mine"]])
        assert len(await connection.read(2)) == 2
        keys, args = _update_args(redis, "mine", "running")
        assert await redis.run("store_update", keys, args) == 1  # watched: its version
        for job, origin in (("mine", "me"), ("theirs", "another"), ("awaited", "me")):
            keys, args = _update_args(redis, job, "done", terminal=True, origin=origin)
            await redis.run("store_update", keys, args)
        messages = await connection.read(4)
    finally:
        await connection.aclose()
    assert [(m[1].decode().rpartition(":")[2], m[2]) for m in messages] == [
        ("mine", b"1"),
        ("mine", b"2"),  # (its end: recorded by its creator, awaited by nobody else)
        ("finished", b"theirs"),  # recorded by another store than its creator
        ("finished", b"awaited"),  # a process that did not create it waits for it
    ]


async def test_update_keeps_retain_count_finished_records_and_appends_an_entry(
    redis: Redis,
) -> None:
    p = redis.p
    for n in range(4):
        await _create(redis, f"j{n}")
        keys, args = _update_args(redis, f"j{n}", "done", terminal=True, retain=2)
        args[4] = n  # retain_until: the oldest goes first
        assert await redis.run("store_update", keys, args) == 1
    assert await redis("ZRANGE", f"{p}:finished", 0, -1) == [b"j2", b"j3"]
    assert await redis("EXISTS", f"{p}:job:j0", f"{p}:job:j1", f"{p}:job:j2") == 1
    await _create(redis, "next")
    keys, args = _update_args(redis, "next", "queued")
    assert await redis.run("store_update", [*keys, f"{p}:events"], [*args, "e", "run"]) == 1
    (entry,) = await redis("XRANGE", f"{p}:events", "-", "+")
    assert entry[1] == [b"e", b"run"]
    # A refused write adds no entry.
    keys, args = _update_args(redis, "gone", "queued")
    assert await redis.run("store_update", [*keys, f"{p}:events"], [*args, "e", "x"]) == -1
    assert await redis("XLEN", f"{p}:events") == 1


async def test_an_end_remembers_its_id_and_forgets_by_time_and_beyond_the_count(
    redis: Redis,
) -> None:
    """Every end writes its tombstone; at most remember-gone count are kept beyond the
    finished records, the oldest forgotten first, and those whose retention ended more than
    remember-gone seconds ago are forgotten by the next end."""
    p = redis.p

    async def end(job: str, until: float, remember: int = 2) -> None:
        await _create(redis, job)
        keys, args = _update_args(redis, job, "done", terminal=True, retain=1, remember=remember)
        args[4] = until  # its retention ends then: now is 30 s before
        assert await redis.run("store_update", keys, args) == 1

    for n in range(5):
        await end(f"j{n}", 100 + n)
    # j4 kept; j2 and j3 remembered beyond it; j0 and j1 forgotten.
    assert await redis("ZRANGE", f"{p}:finished", 0, -1) == [b"j4"]
    assert await redis("ZRANGE", f"{p}:remembered", 0, -1) == [b"j2", b"j3", b"j4"]
    assert sorted(await redis("HKEYS", f"{p}:gone")) == [b"j2", b"j3", b"j4"]
    # Now 122.5, so what ended before 102.5 is forgotten: j2's (102), not j3's (103).
    await end("j5", 152.5)
    assert await redis("ZRANGE", f"{p}:remembered", 0, -1) == [b"j3", b"j4", b"j5"]
    # Told to remember none, an end writes no tombstone; j3's and j4's time has come (104).
    await end("j6", 154, remember=0)
    assert await redis("ZRANGE", f"{p}:remembered", 0, -1) == [b"j5"]
    assert await redis("HKEYS", f"{p}:gone") == [b"j5"]


async def test_status_writes_the_status_alone_at_the_version_read(redis: Redis) -> None:
    p = redis.p
    key = f"{p}:job:a"
    assert await redis.run("store_status", [key], ["running", 1.5, "a", p, 0]) == -1
    await _create(redis, "a")
    assert await redis.run("store_status", [key], ["running", 1.5, "a", p, 3]) == -3
    await redis("SET", f"{p}:watch:a", "1")
    assert await redis.run("store_status", [key], ["running", 1.5, "a", p, 0]) == 1
    assert await redis("HMGET", key, "d", "s", "v", "u") == [b"blob", b"running", b"1", b"1.5"]
    await redis("HSET", key, "s", "failed")
    assert await redis.run("store_status", [key], ["queued", 2.5, "a", p, 1]) == -2


async def test_an_owners_index_holds_the_records_kept_newest_first(redis: Redis) -> None:
    p = redis.p
    index = f"{p}:owner:team:alice"
    for job, created in (("a", 1.5), ("b", 2.5), ("c", 3.5), ("d", 4.5)):
        assert await _create(redis, job, owner="team:alice", created=created) == 1
    await _create(redis, "x")  # no owner: in no index, no n
    assert await redis("HGET", f"{p}:job:a", "n") == b"team:alice"
    assert await redis("HGET", f"{p}:job:x", "n") is None
    assert await redis("ZRANGE", index, 0, -1, "WITHSCORES") == [
        b"a", b"1.5", b"b", b"2.5", b"c", b"3.5", b"d", b"4.5"
    ]  # fmt: skip
    # A page, newest first, then where the next one starts; the last page says none.
    page = await redis.run("store_owned", [index], [p, "+inf", 2])
    assert page == [b"blob", b"0", b"queued", None] * 2 + [b"3.5"]
    assert await redis.run("store_owned", [index], [p, "(3.5", 2]) == [*page[:8], b"1.5"]
    assert await redis.run("store_owned", [index], [p, "(1.5", 2]) == [b""]
    # A finished record dropped beyond the count leaves the index with it.
    for job in ("a", "b"):
        keys, args = _update_args(redis, job, "done", terminal=True, retain=1)
        args[4] = 10 if job == "a" else 11
        await redis.run("store_update", keys, args)
    assert await redis("ZRANGE", index, 0, -1) == [b"b", b"c", b"d"]
    # Past its time (store_expire), deleted (store_delete): the same.
    expire = [f"{p}:finished", f"{p}:gone", f"{p}:remembered"]
    assert await redis.run("store_expire", expire, [11, p, 20, 10]) == 1
    assert await redis("ZRANGE", index, 0, -1) == [b"c", b"d"]
    await redis.run("store_delete", [f"{p}:job:d", f"{p}:finished"], ["d", p])
    assert await redis("ZRANGE", index, 0, -1) == [b"c"]
    # A record its TTL dropped unread: out of the index at the next read of it...
    await _create(redis, "e", owner="team:alice", created=5.5)
    await redis("DEL", f"{p}:job:c")
    assert await redis.run("store_owned", [index], [p, "+inf", 10]) == [
        b"blob", b"0", b"queued", None, b""
    ]  # fmt: skip
    assert await redis("ZRANGE", index, 0, -1) == [b"e"]
    # ...or at the next end of one of its owner's jobs.
    await _create(redis, "f", owner="team:alice", created=6.5)
    await redis("DEL", f"{p}:job:e")
    keys, args = _update_args(redis, "f", "done", terminal=True)
    await redis.run("store_update", keys, args)
    assert await redis("ZRANGE", index, 0, -1) == [b"f"]


async def test_awaited_marks_an_active_record(redis: Redis) -> None:
    p = redis.p
    keys = [f"{p}:job:a"]
    assert await redis.run("store_awaited", keys, []) == []
    await _create(redis, "a")
    assert await redis.run("store_awaited", keys, []) == [b"blob", b"0", None, b"queued", None]
    assert await redis("HGET", f"{p}:job:a", "w") == b"1"
    await redis("HDEL", f"{p}:job:a", "w")
    await redis("HSET", f"{p}:job:a", "s", "done")
    await redis.run("store_awaited", keys, [])
    assert await redis("HGET", f"{p}:job:a", "w") is None  # its end is published already


async def test_delete_expire_list_and_release(redis: Redis) -> None:
    p = redis.p
    for job in ("a", "b", "c"):
        await _create(redis, job)
    for job, until in (("b", 10), ("c", 20)):
        keys, args = _update_args(redis, job, "done", terminal=True)
        args[4] = until
        await redis.run("store_update", keys, args)
    listed = await redis.run("store_list", [f"{p}:active", f"{p}:finished"], [p])
    assert listed == [b"blob", b"0", b"queued", None] + [b"blob2", b"1", b"done", b""] * 2
    assert await redis.run("store_list", [f"{p}:active"], [p]) == listed[:4]
    expire = [f"{p}:finished", f"{p}:gone", f"{p}:remembered"]
    assert await redis.run("store_expire", expire, [15, p, 20, 10]) == 1  # b's time came
    assert await redis("ZRANGE", f"{p}:finished", 0, -1) == [b"c"]
    assert await redis("EXISTS", f"{p}:job:b") == 0
    # b is remembered (its tombstone, "hash") until 20 s after its retention ended (10).
    assert await redis.run("store_expire", expire, [29, p, 20, 10, "b"]) == b"hash"
    assert await redis.run("store_expire", expire, [29, p, 20, 10, "x"]) is None
    assert await redis.run("store_expire", expire, [30, p, 20, 10, "b"]) is None
    assert await redis("ZRANGE", f"{p}:remembered", 0, -1) == [b"c"]
    assert await redis("HKEYS", f"{p}:gone") == [b"c"]
    # Beyond the count (counted beyond the finished records kept, none now: c's time came
    # too): the oldest forgotten.
    await redis("ZADD", f"{p}:remembered", 1, "old")
    await redis("HSET", f"{p}:gone", "old", "")
    assert await redis.run("store_expire", expire, [0, p, 20, 1, "old"]) is None
    assert await redis("ZRANGE", f"{p}:remembered", 0, -1) == [b"c"]
    assert await redis.run("store_delete", [f"{p}:job:a", f"{p}:finished"], ["a", p]) == 1
    assert await redis.run("store_list", [f"{p}:active", f"{p}:finished"], [p]) == []
    # A deleted job is unknown, not gone: its tombstone goes with it (c's record is gone).
    assert await redis.run("store_delete", [f"{p}:job:c", f"{p}:finished"], ["c", p]) == 0
    assert await redis("EXISTS", f"{p}:gone", f"{p}:remembered") == 0
    await redis("SET", f"{p}:lock:a", "holder")
    assert await redis.run("store_release", [f"{p}:lock:a"], ["another"]) == 0
    assert await redis.run("store_release", [f"{p}:lock:a"], ["holder"]) == 1
    assert await redis("EXISTS", f"{p}:lock:a") == 0


# -- timers and the relay ------------------------------------------------------------------


async def test_timers_claim_moves_each_due_timer_onto_the_stream_once(redis: Redis) -> None:
    p = redis.p
    keys = [f"{p}:timers", f"{p}:events"]
    await redis("ZADD", f"{p}:timers", 1, "t1", 2, "t2", 3, "t3", 9, "later")
    assert await redis.run("timers_claim", keys, [3, 2, "e"]) == 2  # two at most
    assert await redis.run("timers_claim", keys, [3, 2, "e"]) == 1
    assert await redis.run("timers_claim", keys, [3, 2, "e"]) == 0
    entries = await redis("XRANGE", f"{p}:events", "-", "+")
    assert [fields for _, fields in entries] == [[b"e", b"t1"], [b"e", b"t2"], [b"e", b"t3"]]
    assert await redis("ZRANGE", f"{p}:timers", 0, -1) == [b"later"]


async def test_relay_emit_appends_only_for_a_streamed_job_and_read_takes_what_follows(
    redis: Redis,
) -> None:
    p = redis.p
    keys = [f"{p}:streamed:a", f"{p}:chunks:a", f"{p}:relay:a"]
    assert await redis.run("relay_emit", keys, [b"c0", 60_000]) == 0
    assert await redis("EXISTS", f"{p}:chunks:a") == 0  # (the chunk stays in the record)
    await redis("SET", f"{p}:streamed:a", "1")
    for n in range(3):
        assert await redis.run("relay_emit", keys, [b"c%d" % n, 60_000]) == 1
    assert 0 < await redis("PTTL", f"{p}:chunks:a") <= 60_000
    first = await redis.run("relay_read", [f"{p}:chunks:a"], ["0-0", 2])
    assert first[1::2] == [b"c0", b"c1"]
    rest = await redis.run("relay_read", [f"{p}:chunks:a"], [first[-2], 2])
    assert rest[1::2] == [b"c2"]
    assert await redis.run("relay_read", [f"{p}:chunks:a"], [rest[-2], 2]) == []


# -- the board's backplane -------------------------------------------------------------------


async def test_board_write_checks_the_shared_state_and_logs_each_change(redis: Redis) -> None:
    p = redis.p
    keys = [f"{p}:meta", f"{p}:state", f"{p}:log"]

    async def write(op: str, resource: str, state: str = "null", limit: int = 2) -> Any:
        return await redis.run("board_write", keys, [op, resource, state, limit, 1000])

    assert await write("create", "r", "1") == [b"unseeded"]
    assert await redis.run("board_seed", keys[:2], [7, 0]) == 1
    assert await redis.run("board_seed", keys[:2], [8, 0]) == 0  # seeded already
    assert await write("create", "r", "1") == [b"ok", b"7", b"1"]
    assert await write("create", "r", "1") == [b"exists"]
    assert await write("update", "missing", "1") == [b"missing"]
    assert await write("delete", "missing") == [b"missing"]
    assert await write("create", "s", '{"a":[1]}') == [b"ok", b"7", b"2"]
    assert await write("create", "t", "3") == [b"full", b"2"]
    assert await write("update", "r", "5") == [b"ok", b"7", b"3"]
    assert await write("delete", "s") == [b"ok", b"7", b"4"]
    assert await redis("HGETALL", f"{p}:state") == [b"r", b"[3,5]"]
    log = await redis("XRANGE", f"{p}:log", "-", "+")
    assert [dict(zip(f[::2], f[1::2], strict=True)) for _, f in log] == [
        {b"e": b"7", b"v": b"1", b"op": b"create", b"r": b"r", b"d": b"1"},
        {b"e": b"7", b"v": b"2", b"op": b"create", b"r": b"s", b"d": b'{"a":[1]}'},
        {b"e": b"7", b"v": b"3", b"op": b"update", b"r": b"r", b"d": b"5"},
        {b"e": b"7", b"v": b"4", b"op": b"delete", b"r": b"s", b"d": b"null"},
    ]


async def test_board_load_answers_the_state_at_once_and_seed_writes_a_copy(redis: Redis) -> None:
    p = redis.p
    keys = [f"{p}:meta", f"{p}:state", f"{p}:log"]
    assert await redis.run("board_load", keys, []) is None
    assert await redis.run("board_seed", keys[:2], [5, 9, "a", "[3,1]", "b", "[9,2]"]) == 1
    epoch, offset, last, state = await redis.run("board_load", keys, [])
    assert (epoch, offset, last) == (b"5", b"9", b"0-0")  # no log yet
    assert dict(zip(state[::2], state[1::2], strict=True)) == {b"a": b"[3,1]", b"b": b"[9,2]"}
    await redis.run("board_write", keys, ["update", "a", "4", 10, 1000])
    (entry,) = await redis("XRANGE", f"{p}:log", "-", "+")
    _, offset, last, _ = await redis.run("board_load", keys, [])
    assert (offset, last) == (b"10", entry[0])


async def test_ratelimit_decides_every_limit_at_once_and_keeps_each_key_until_full(
    redis: Redis,
) -> None:
    """KEYS: a TAT per limit; ARGV: now (microseconds), then interval and tolerance per
    limit. Passed: every TAT moves on by its interval, kept until its bucket is full again.
    Refused by one: none moves."""
    p = redis.p
    keys = [f"{p}:a", f"{p}:b"]
    now = 10**15
    # a: one per second, burst 2 (tolerance 1 s); b: one a minute, burst 1.
    args: list[Arg] = [now, 1_000_000, 1_000_000, 60_000_000, 0]
    assert await redis.run("ratelimit", keys, args) == [1, now, now + 1_000_000, now + 60_000_000]
    assert await redis("GET", keys[0]) == str(now + 1_000_000).encode()
    assert 0 < await redis("PTTL", keys[0]) <= 1_000
    assert 0 < await redis("PTTL", keys[1]) <= 60_000
    # b is spent: refused, and a (which had room) does not move.
    refused = await redis.run("ratelimit", keys, args)
    assert refused == [0, now, now + 1_000_000, now + 60_000_000]
    assert await redis("GET", keys[0]) == str(now + 1_000_000).encode()
    # '' for now: Redis's own clock (TIME), which every process shares.
    fresh = [f"{p}:c"]
    allowed, clock, tat = await redis.run("ratelimit", fresh, ["", 5_000_000, 0])
    assert allowed == 1
    assert tat == clock + 5_000_000


async def test_a_script_error_is_a_reply_error(redis: Redis) -> None:
    await redis("SET", f"{redis.p}:timers", "not a sorted set")
    with pytest.raises(ReplyError, match="WRONGTYPE"):
        await redis.run("timers_claim", [f"{redis.p}:timers", f"{redis.p}:e"], [1, 1, "e"])
