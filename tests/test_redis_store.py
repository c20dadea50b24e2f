"""The Redis job store's own promises, beyond the engine suite that runs on it (each_store):
gone vs unknown, the first end stands, atomic read-modify-write across clients, and a clear
error when Redis is away."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
import trio
import trio.testing

import pipework as pw
from pipework.dispatcher._abilities import FollowingStore
from pipework.dispatcher._events import RunJob
from pipework.dispatcher._job import Frame, Job, new_job_id
from pipework.dispatcher._wake import Wake
from pipework.redis import RedisJobStore
from pipework.redis._batches import _EARLY, _FLIGHTS
from pipework.redis._record import _FIELDS
from pipework.redis._wire import Connection

from ._redis import RedisServer, TestRedisJobStore, held, wait_idle


def _store(server: RedisServer, prefix: str | None = None, **options: Any) -> RedisJobStore:
    return TestRedisJobStore(server.url, prefix=prefix or f"s{secrets.token_hex(6)}", **options)


def _job(token_hash: str | None = None) -> Job:
    return Job(
        id=new_job_id(), chain="c", state={"n": 0}, correlation_id="x", token_hash=token_hash
    )


async def test_a_finished_job_is_kept_then_gone_and_an_unknown_id_is_not_found(
    autojump_clock: trio.abc.Clock, redis_server: RedisServer
) -> None:
    async with _store(redis_server, retain_seconds=60) as store:
        job = _job(token_hash="abc")
        await store.create(job)
        job.transition(pw.Status.FAILED)
        await store.update(job)
        assert (await store.get(job.id)).status is pw.Status.FAILED
        assert [j.id for j in await store.list(pw.Status.FAILED)] == [job.id]
        await trio.sleep(61)
        with pytest.raises(pw.JobGone) as gone:
            await store.get(job.id)
        assert gone.value.token_hash == "abc"
        assert await store.list(pw.Status.FAILED) == []
        with pytest.raises(pw.JobNotFound) as unknown:
            await store.get("never-there")
        assert not isinstance(unknown.value, pw.JobGone)


async def test_retention_by_count_drops_the_oldest_finished(redis_server: RedisServer) -> None:
    async with _store(redis_server, retain_count=2) as store:
        jobs = [_job() for _ in range(3)]
        for job in jobs:
            await store.create(job)
            job.transition(pw.Status.CANCELLED)
            await store.update(job)
        with pytest.raises(pw.JobGone):
            await store.get(jobs[0].id)
        assert {j.id for j in await store.list()} == {jobs[1].id, jobs[2].id}


async def _keys(store: RedisJobStore) -> set[str]:
    """The keys under the store's prefix, without it (read in the store's round trips,
    which hold an autojumping clock)."""
    (found,) = await store.pipeline([["KEYS", f"{store.prefix}:*"]])
    return {key.decode().removeprefix(f"{store.prefix}:") for key in found}


async def _end(store: RedisJobStore, count: int) -> list[Job]:
    """``count`` jobs ended a second apart (under an autojumping clock)."""
    jobs = [_job(token_hash=f"t{n}") for n in range(count)]
    for job in jobs:
        await trio.sleep(1)
        await store.create(job)
        job.transition(pw.Status.CANCELLED)
        await store.update(job)
    return jobs


async def test_a_dropped_job_leaves_no_key_of_its_own(
    autojump_clock: trio.abc.Clock, redis_server: RedisServer
) -> None:
    """However many jobs ended, the ids remembered as gone are in two keys (a hash of the
    owner-token hashes, a sorted set of when each is forgotten): no key per job once its
    record is dropped, as there was one for a week."""
    prefix = f"s{secrets.token_hex(6)}"
    async with _store(redis_server, prefix, retain_count=2) as store:
        jobs = await _end(store, 10)
        kept = {f"job:{job.id}" for job in jobs[-2:]}
        assert await _keys(store) == {"finished", "gone", "remembered"} | kept
        with pytest.raises(pw.JobGone) as gone:
            await store.get(jobs[0].id)
        assert gone.value.token_hash == "t0"


async def test_the_tombstones_kept_are_bounded_by_count_and_a_delete_takes_its_own(
    autojump_clock: trio.abc.Clock, redis_server: RedisServer
) -> None:
    prefix = f"s{secrets.token_hex(6)}"
    async with _store(
        redis_server, prefix, retain_count=2, remember_gone_count=3, remember_gone_seconds=60
    ) as store:
        jobs = await _end(store, 10)

        async def remembered() -> list[bytes]:
            ids, hashed = await store.pipeline(
                [["ZRANGE", f"{prefix}:remembered", 0, -1], ["HKEYS", f"{prefix}:gone"]]
            )
            assert sorted(ids) == sorted(hashed)
            return list(ids)

        # The 2 records kept, and the 3 dropped last: the owners of the others get 404.
        assert await remembered() == [job.id.encode() for job in jobs[5:]]
        await store.delete(jobs[-1].id)
        assert await remembered() == [job.id.encode() for job in jobs[5:-1]]
        with pytest.raises(pw.JobNotFound) as unknown:
            await store.get(jobs[-1].id)
        assert not isinstance(unknown.value, pw.JobGone)
        # Forgotten with time: 60 s after their retention (an hour) ended, at the next end.
        await trio.sleep(3600 + 60)
        (last,) = await _end(store, 1)
        assert await remembered() == [last.id.encode()]


async def test_one_callback_secret_is_kept_for_every_process(redis_server: RedisServer) -> None:
    prefix = f"s{secrets.token_hex(6)}"
    async with _store(redis_server, prefix) as one, _store(redis_server, prefix) as two:
        assert await one.callback_secret(b"a" * 32) == b"a" * 32
        assert await two.callback_secret(b"b" * 32) == b"a" * 32  # the first one's stands
        async with _store(redis_server) as elsewhere:  # another prefix, another deployment
            assert await elsewhere.callback_secret(b"c" * 32) == b"c" * 32
        connection = await Connection.open(redis_server.url)
        try:
            await connection.call([["SET", f"{prefix}:callback_secret", "short"]])
        finally:
            await connection.aclose()
        with pytest.raises(ValueError, match=f"'{prefix}:callback_secret' is not one pipework"):
            await one.callback_secret(b"a" * 32)


async def test_the_first_end_stands_and_a_finished_job_is_never_brought_back(
    redis_server: RedisServer,
) -> None:
    prefix = f"s{secrets.token_hex(6)}"
    async with _store(redis_server, prefix) as one, _store(redis_server, prefix) as two:
        job = _job()
        await one.create(job)
        with pytest.raises(ValueError, match="already exists"):
            await two.create(job)
        mine, theirs = await one.get(job.id), await two.get(job.id)
        theirs.transition(pw.Status.CANCELLED)
        await two.update(theirs)
        mine.transition(pw.Status.RUNNING)
        with pytest.raises(pw.JobNotFound, match="not active"):
            await one.update(mine)  # a step that loaded it before the cancel landed
        mine.transition(pw.Status.DONE)
        await one.update(mine)  # a second end changes nothing
        assert (await one.get(job.id)).status is pw.Status.CANCELLED
        assert await one.list([pw.Status.QUEUED, pw.Status.RUNNING]) == []


async def test_the_lock_loses_no_update_between_clients(redis_server: RedisServer) -> None:
    """Two clients (as two processes would) each add to one record 50 times, each addition
    a read-modify-write under the job's lock: every addition is there."""
    prefix = f"s{secrets.token_hex(6)}"
    async with _store(redis_server, prefix) as one, _store(redis_server, prefix) as two:
        job = _job()
        await one.create(job)

        async def add(store: RedisJobStore) -> None:
            for _ in range(50):
                async with store.lock(job.id):
                    record = await store.get(job.id)
                    await trio.lowlevel.checkpoint()  # let the other one try meanwhile
                    record.state["n"] += 1
                    await store.update(record)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(add, one)
            nursery.start_soon(add, two)
        assert (await one.get(job.id)).state["n"] == 100


async def _pause(server: RedisServer, milliseconds: int) -> None:
    """Redis holds every client's commands for ``milliseconds`` of real time: a round trip
    made meanwhile waits on its socket."""
    with held(10):  # (a round trip of its own)
        connection = await Connection.open(server.url)
        try:
            await connection.call([["CLIENT", "PAUSE", milliseconds, "ALL"]])
        finally:
            await connection.aclose()


async def test_the_suites_store_follows_ends_and_its_round_trips_leave_virtual_time_alone(
    autojump_clock: trio.abc.Clock, redis_server: RedisServer
) -> None:
    """The engine suite's store (each_store's "redis") is the production store, following
    ends; while it waits on Redis (a round trip, the subscription being made) an
    autojumping clock does not take the wait for idleness: times stay exact, however
    slowly Redis answers."""
    store = _store(redis_server)
    assert isinstance(store, FollowingStore)
    engine = pw.Engine(store=store)

    async def nap(ctx: pw.Context) -> None:
        await trio.sleep(5)
        ctx.state["napped"] = trio.current_time()

    engine.chain("c", pw.Pipe(nap, "nap"))
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 3600)  # a deadline for the clock to leap to
        await _pause(redis_server, 100)
        async with engine:  # subscribes to ends while Redis holds its commands
            assert trio.current_time() == start
            await _pause(redis_server, 100)
            job_id = await engine.submit("c")
            assert trio.current_time() == start
            assert await engine.wait(job_id) == {"napped": start + 5}
            assert trio.current_time() == start + 5
        nursery.cancel_scope.cancel()


async def test_wait_idle_waits_for_the_round_trip_on_its_way(
    autojump_clock: trio.abc.Clock, redis_server: RedisServer
) -> None:
    """Every task but one is blocked, and that one waits for Redis's answer: the suite's
    wait_idle waits for it (trio's wait_all_tasks_blocked would not)."""
    async with _store(redis_server) as store:
        job = _job()
        await store.create(job)
        got: list[Job] = []

        async def get() -> None:
            got.append(await store.get(job.id))

        await _pause(redis_server, 100)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(get)
            await wait_idle()
            assert [j.id for j in got] == [job.id]


_UNREACHABLE = """
import socket, sys, trio
from pipework.redis import RedisJobStore, StoreUnavailable
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]  # nothing listens here once the socket closes
async def main():
    store = RedisJobStore(f"redis://127.0.0.1:{port}/0", io_timeout=5)
    try:
        async with store:
            await store.get("x")
    except StoreUnavailable as exc:
        print(exc.http_status, exc.reason, exc)
        return
    sys.exit("no StoreUnavailable")
trio.run(main)
"""


def test_an_unreachable_redis_is_a_clear_503() -> None:
    # In a process of its own: coredis leaves a failed connection's streams to the
    # garbage collector, whose warnings this suite turns into errors.
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _UNREACHABLE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("503 store_unavailable the job store at redis://127.0.0.1:")
    assert "cannot be reached" in done.stdout


async def test_calls_made_together_share_round_trips_and_keep_their_own_answers(
    redis_server: RedisServer,
) -> None:
    """Writes made while a round trip is on its way go together in the next one; each
    caller still gets its own answer, a refused create its own error."""
    store = _store(redis_server)
    trips: list[int] = []
    fly = store._fly

    async def counted() -> None:
        trips.append(len(store._calls))
        await fly()

    async with store:
        await store.create(_job())  # loads the create script: no batch of its own below
        store._fly = counted  # type: ignore[method-assign]  # counts the round trips of this store only
        jobs = [_job() for _ in range(40)]
        await store.create(jobs[0])
        refused: list[str] = []

        async def create(job: Job) -> None:
            try:
                await store.create(job)
            except ValueError:
                refused.append(job.id)

        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(create, job)
        assert refused == [jobs[0].id]
        gets: dict[str, Job] = {}

        async def get(job_id: str) -> None:
            gets[job_id] = await store.get(job_id)

        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(get, job.id)
        assert {job_id: job.state for job_id, job in gets.items()} == {
            job.id: {"n": 0} for job in jobs
        }
    assert sum(trips) == 81  # every call sent once
    assert len(trips) < 81 // 2  # and most of them together


class _HeldRead(TestRedisJobStore):
    """A store whose next read of one job waits, once it has read, for ``hold()``."""

    held: tuple[str, Callable[[], Awaitable[None]]] | None = None

    async def get(self, job_id: str) -> Job:
        job = await super().get(job_id)
        if self.held is not None and self.held[0] == job_id:
            hold = self.held[1]
            self.held = None
            await hold()
        return job


async def test_a_signal_kept_on_a_record_a_step_wrote_since_it_was_read_loses_nothing(
    autojump_clock: trio.abc.Clock, redis_server: RedisServer
) -> None:
    """A signal reads the record; the job's step forks a parallel stage meanwhile (it
    writes the join into the record, without the per-job lock the signal holds) and ends;
    then the signal keeps itself on the record. It must not write back the record it read:
    the join would be lost, the branches' ends ignored, and the job would never end."""
    store = _HeldRead(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    engine = pw.Engine(store=store)
    gate, branches = trio.Event(), trio.Event()

    async def first(ctx: pw.Context) -> None:
        await gate.wait()

    async def branch(ctx: pw.Context) -> None:
        await branches.wait()
        ctx.state[ctx.pipe.name] = True

    engine.chain(
        "c",
        pw.Pipe(first, "first"),
        pw.all_of(pw.Pipe(branch, "x", key="x"), pw.Pipe(branch, "y", key="y")),
    )
    async with engine:
        job_id = await engine.submit("c")

        async def forked() -> None:  # the step goes on, forks the stage and ends
            gate.set()
            for _ in range(1000):
                if (await RedisJobStore.get(store, job_id)).join is not None:
                    break
                await trio.sleep(0.01)
            await wait_idle()

        for _ in range(1000):
            if (await store.get(job_id)).status is pw.Status.RUNNING:
                break
            await trio.sleep(0.01)
        store.held = (job_id, forked)
        await engine.signal(job_id, "go", 1)  # read while the step runs, kept after it
        record = await store.get(job_id)
        assert record.join is not None  # the fork's write stands...
        assert record.signals == {"go": 1}  # ...with the signal on it
        branches.set()
        with trio.fail_after(60):
            assert await engine.wait(job_id) == {"x": True, "y": True}


async def test_two_signals_that_read_one_suspended_record_deliver_once(
    redis_server: RedisServer,
) -> None:
    """A branch suspended for "go" gets it twice at once: sent to the branch by its own id
    (a callback its pipe handed out) and sent to the job it belongs to. The two hold
    different locks, and both read the branch suspended; the delivery is a compare-and-set
    on the record's version, so the second to write finds it resumed, reads it again and
    is refused, rather than resume the branch a second time with another payload."""
    store = _HeldRead(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    engine = pw.Engine(store=store)
    branch_ids: list[str] = []
    release = trio.Event()

    async def wait_go(ctx: pw.Context) -> None:
        branch_ids.append(ctx.job_id)
        await ctx.suspend("go", into="go")

    async def other(ctx: pw.Context) -> None:
        await release.wait()

    engine.chain("c", pw.all_of(pw.Pipe(wait_go, "a", key="a"), pw.Pipe(other, "b", key="b")))
    async with engine:
        job_id = await engine.submit("c")
        while not await store.list(pw.Status.SUSPENDED):
            await wait_idle()
        [branch_id] = branch_ids

        async def sent_to_the_job() -> None:  # while the branch's own signal holds its read
            await engine.signal(job_id, "go", "to the job")

        store.held = (branch_id, sent_to_the_job)
        with pytest.raises(pw.SignalError, match="'go' was already delivered"):
            await engine.signal(branch_id, "go", "to the branch")
        release.set()
        with trio.fail_after(60):
            result = await engine.wait(job_id)
    assert result == {"go": "to the job"}


async def test_a_signal_that_read_a_record_a_cancel_ended_since_is_refused(
    redis_server: RedisServer,
) -> None:
    """A signal reads the job suspended; the job is cancelled before the signal writes.
    The delivery's compare-and-set finds the record changed, reads it again and refuses
    the signal as for any ended job (409), rather than answer that no such job exists."""
    store = _HeldRead(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    engine = pw.Engine(store=store)

    async def park(ctx: pw.Context) -> None:
        await ctx.suspend("go")

    engine.chain("c", pw.Pipe(park, "park"))
    async with engine:
        job_id = await engine.submit("c")
        while not await store.list(pw.Status.SUSPENDED):
            await wait_idle()

        async def cancelled() -> None:
            await engine.cancel(job_id)

        store.held = (job_id, cancelled)
        with pytest.raises(pw.SignalError, match="is cancelled"):
            await engine.signal(job_id, "go", 1)
        assert (await engine.status(job_id)).status is pw.Status.CANCELLED


class _HeldSuspend(RedisJobStore):
    """A store whose next write of a parked (suspended) record waits for ``held()``."""

    held: Callable[[], Awaitable[None]] | None = None

    async def update(self, job: Job, **kwargs: Any) -> None:
        if self.held is not None and job.status is pw.Status.SUSPENDED:
            hold, self.held = self.held, None
            await hold()
        await super().update(job, **kwargs)


async def test_a_signal_sent_while_the_step_writes_the_job_parked_resumes_it(
    redis_server: RedisServer,
) -> None:
    """The job's step has parked it (its own record says suspended) and its write is on
    its way; a signal reads the record as it still is, running. Kept on the step's record
    (as for a job running here) it would be lost with it, answered "delivered", and the
    job would wait on; it reads the record again, finds the job suspended for it, and
    resumes it."""
    store = _HeldSuspend(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    engine = pw.Engine(store=store)
    job_ids: list[str] = []

    async def park(ctx: pw.Context) -> None:
        job_ids.append(ctx.job_id)
        await ctx.suspend("go", into="go")

    engine.chain("c", pw.Pipe(park, "park"))
    reads = 0
    real_get = store.get

    async def counted(job_id: str) -> Job:
        nonlocal reads
        job = await real_get(job_id)
        reads += 1
        return job

    async with engine, trio.open_nursery() as nursery:
        signalled = trio.Event()

        async def send() -> None:
            await engine.signal(job_ids[0], "go", 1)
            signalled.set()

        async def meanwhile() -> None:  # the step's write waits until the signal decided
            store.get = counted  # type: ignore[method-assign]  # counts the signal's reads
            nursery.start_soon(send)
            while not signalled.is_set() and reads < 2:
                await trio.testing.wait_all_tasks_blocked()

        store.held = meanwhile
        job_id = await engine.submit("c")
        await signalled.wait()
        with trio.fail_after(10):  # a signal lost leaves the job suspended for ever
            assert await engine.wait(job_id) == {"go": 1}


async def test_a_status_write_leaves_the_record_and_a_stale_one_writes_it_whole(
    redis_server: RedisServer,
) -> None:
    async with _store(redis_server) as store, _store(redis_server, store.prefix) as other:
        job = _job()
        await store.create(job)
        read = await store.get(job.id)
        read.transition(pw.Status.RUNNING)
        await store.update_status(read)  # the status alone: the blob is as created
        seen = await other.get(job.id)
        assert (seen.status, seen.updated_at, seen.version) == (
            pw.Status.RUNNING,
            read.updated_at,
            read.version,
        )
        assert [j.id for j in await other.list(pw.Status.RUNNING)] == [job.id]
        assert await other.list(pw.Status.QUEUED) == []
        assert (await other.read_awaited(job.id)).status is pw.Status.RUNNING
        # A whole write after it is read whole: the status write's fields give way.
        seen.state["n"] = 1
        seen.transition(pw.Status.QUEUED)
        await other.update(seen)
        again = await store.get(job.id)
        assert (again.status, again.state, again.updated_at) == (
            pw.Status.QUEUED,
            {"n": 1},
            seen.updated_at,
        )
        # Written since it was read: the status write writes the reader's record whole.
        stale = await store.get(job.id)
        seen.state["n"] = 2
        await other.update(seen)
        stale.transition(pw.Status.RUNNING)
        await store.update_status(stale)
        final = await other.get(job.id)
        assert (final.status, final.state, final.version) == (
            pw.Status.RUNNING,
            {"n": 1},
            stale.version,
        )
        # An ended record is not brought back.
        final.transition(pw.Status.CANCELLED)
        await other.update(final)
        stale.transition(pw.Status.QUEUED)
        with pytest.raises(pw.JobNotFound):
            await store.update_status(stale)


async def test_a_step_takes_the_record_its_store_wrote_and_verifies_it(
    redis_server: RedisServer,
) -> None:
    async with _store(redis_server) as store, _store(redis_server, store.prefix) as other:
        job = _job()
        await store.create(job)
        own = store.read_own(job.id)  # as created, no round trip
        assert own is not None
        assert (own.state, own.version, own.status) == ({"n": 0}, job.version, pw.Status.QUEUED)
        assert store.read_own(job.id) is None  # taken once
        own.transition(pw.Status.RUNNING)
        assert await store.update_status(own, verify=True)
        assert (await other.get(job.id)).status is pw.Status.RUNNING
        own.transition(pw.Status.QUEUED)
        await store.update(own)  # a hand-off: kept for the next step
        seen = await other.get(job.id)
        seen.state["n"] = 1
        await other.update(seen)  # written elsewhere since
        stale = store.read_own(job.id)
        assert stale is not None
        assert stale.state == {"n": 0}
        stale.transition(pw.Status.RUNNING)
        assert not await store.update_status(stale, verify=True)  # refused, nothing written
        after = await other.get(job.id)
        assert (after.status, after.state, after.version) == (
            pw.Status.QUEUED,
            {"n": 1},
            seen.version,
        )
        done = _job()
        done.status = pw.Status.DONE
        await store.create(done)
        assert store.read_own(done.id) is None  # only a record left queued is kept


class _GatedQueue(pw.MemoryEventQueue):
    """Hands out no event until ``gate`` is set; counts the ``RunJob`` events put."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = trio.Event()
        self.runs = 0

    def put_nowait(self, event: Any) -> None:
        self.runs += type(event) is RunJob
        super().put_nowait(event)

    async def get_batch(self, limit: int = 256) -> list[Any]:
        await self.gate.wait()
        return await super().get_batch(limit)


async def test_a_step_on_a_record_written_elsewhere_since_runs_it_as_written_there(
    redis_server: RedisServer,
) -> None:
    """The store holds the record as it created it; another process writes it before the
    step starts. The step must not run the stale record: the job runs once, on the record
    as the other process left it."""
    store = _store(redis_server)
    queue = _GatedQueue()
    engine = pw.Engine(store=store, queue=queue)
    ran: list[int] = []

    async def pipe(ctx: pw.Context) -> None:
        ran.append(ctx.state["n"])

    engine.chain("c", pw.Pipe(pipe, "p"))
    async with engine, _store(redis_server, store.prefix) as other:
        job_id = await engine.submit("c", {"n": 0})
        seen = await other.get(job_id)
        seen.state["n"] = 1
        await other.update(seen)
        queue.gate.set()
        with trio.fail_after(10):
            assert await engine.wait(job_id) == {"n": 1}
    assert ran == [1]
    assert queue.runs == 2  # the submission's, and the one the stale step sent on


async def test_a_wait_without_a_time_limit_is_woken_when_the_subscription_drops(
    redis_server: RedisServer,
) -> None:
    """While every end reaches this process, a waiter waits with no recheck; once the
    subscription that hears other processes' ends drops, it is woken to read the record
    again, and a wait that follows has its time limit back."""
    store = RedisJobStore(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    async with store, trio.open_nursery() as nursery:
        await nursery.start(store.follow_finished, lambda job_id: None)
        job = _job()
        await store.create(job)
        assert (await store.read_awaited(job.id)).status is pw.Status.QUEUED
        wake = Wake()
        woken = trio.Event()

        async def wait() -> None:
            await store.wait_end(job.id, wake, 3600.0)
            woken.set()

        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not woken.is_set()
        killer = await Connection.open(redis_server.url)
        try:
            await killer.call([["CLIENT", "KILL", "TYPE", "pubsub"]])
        finally:
            await killer.aclose()
        with trio.fail_after(10):
            await woken.wait()
        assert not wake.is_set()  # woken to read again, not told the job ended
        await store.read_awaited(job.id)  # a real read now: the subscription dropped
        with trio.fail_after(10):  # it returns: its recheck limit is back
            await store.wait_end(job.id, wake, 0.01)
        assert not wake.is_set()
        nursery.cancel_scope.cancel()


async def test_a_record_written_as_a_map_by_an_older_version_still_reads(
    redis_server: RedisServer,
) -> None:
    """Records are msgpack arrays of the job's fields; one written as a map of
    ``Job.to_wire()`` (with its writer's clock) reads as the same job."""
    async with _store(redis_server) as store:
        job = _job(token_hash="abc")
        job.frames = [Frame(1, 12.5, -1)]
        job.progress = pw.Progress(1.0, 2.0, "half")
        await store.create(job)
        wire = job.to_wire()
        wire["clock"] = store._shift()
        blob = msgpack.packb(wire, use_bin_type=True)
        connection = await Connection.open(redis_server.url)
        try:
            await connection.call([["HSET", f"{store.prefix}:job:{job.id}", "d", blob]])
        finally:
            await connection.aclose()
        read = await store.get(job.id)
        assert read.to_wire() == job.to_wire()


async def test_the_signals_a_job_took_are_stored_and_an_older_record_took_none(
    redis_server: RedisServer,
) -> None:
    """``delivered`` round-trips; a record written as an array by an earlier pipework —
    before jobs remembered the signals they took, when the running process's cancel flag
    was stored before ``created_at`` and the blob's last element was its writer's clock —
    reads as having taken none, the cancel flag dropped."""
    async with _store(redis_server) as store:
        job = _job()
        job.took("go")
        await store.create(job)
        assert (await store.get(job.id)).delivered == ("go",)
        older = _job()
        await store.create(older)
        key = f"{store.prefix}:job:{older.id}"
        connection = await Connection.open(redis_server.url)
        try:
            [blob] = await connection.call([["HGET", key, "d"]])
            values = msgpack.unpackb(blob, raw=False)
            assert values.pop() == 2  # the layout: none before
            # delivered and the fields after it (tracestate, baggage), which it lacked,
            # before the writer's clock
            del values[_FIELDS.index("delivered") : -1]
            values.insert(_FIELDS.index("created_at"), True)  # the cancel flag, stored then
            older_blob = msgpack.packb(values, use_bin_type=True)
            await connection.call([["HSET", key, "d", older_blob]])
        finally:
            await connection.aclose()
        read = await store.get(older.id)
        assert read.delivered == ()
        assert read.to_wire() == older.to_wire()


async def test_the_trace_context_is_stored_and_an_older_record_carries_none(
    redis_server: RedisServer,
) -> None:
    """``tracestate`` and ``baggage`` round-trip; a record written before jobs carried them
    (its last field ``delivered``) reads as carrying neither, the rest unchanged."""
    async with _store(redis_server) as store:
        job = _job()
        job.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        job.tracestate, job.baggage = "vendor=opaque", "user=ada;p=1"
        await store.create(job)
        read = await store.get(job.id)
        assert (read.tracestate, read.baggage) == ("vendor=opaque", "user=ada;p=1")
        older = _job()
        older.took("go")
        await store.create(older)
        key = f"{store.prefix}:job:{older.id}"
        connection = await Connection.open(redis_server.url)
        try:
            [blob] = await connection.call([["HGET", key, "d"]])
            values = msgpack.unpackb(blob, raw=False)
            # tracestate and baggage, before the writer's clock and the layout
            del values[_FIELDS.index("tracestate") : -2]
            older_blob = msgpack.packb(values, use_bin_type=True)
            await connection.call([["HSET", key, "d", older_blob]])
        finally:
            await connection.aclose()
        read = await store.get(older.id)
        assert (read.tracestate, read.baggage, read.delivered) == (None, None, ("go",))
        assert read.to_wire() == older.to_wire()


async def test_the_pool_key_is_stored_and_an_older_record_carries_none(
    redis_server: RedisServer,
) -> None:
    """``pool_key`` (a route's tenant) round-trips; a record written before jobs carried
    one (its last field ``baggage``) reads as carrying none: the chain's key."""
    async with _store(redis_server) as store:
        job = _job()
        job.pool_key = "tenant:acme"
        job.baggage = "user=ada"
        await store.create(job)
        read = await store.get(job.id)
        assert (read.pool_key, read.baggage) == ("tenant:acme", "user=ada")
        older = _job()
        older.baggage = "user=bob"
        await store.create(older)
        key = f"{store.prefix}:job:{older.id}"
        connection = await Connection.open(redis_server.url)
        try:
            [blob] = await connection.call([["HGET", key, "d"]])
            values = msgpack.unpackb(blob, raw=False)
            # the pool key, before the writer's clock and the layout
            del values[_FIELDS.index("pool_key") : -2]
            older_blob = msgpack.packb(values, use_bin_type=True)
            await connection.call([["HSET", key, "d", older_blob]])
        finally:
            await connection.aclose()
        read = await store.get(older.id)
        assert (read.pool_key, read.baggage) == (None, "user=bob")
        assert read.to_wire() == older.to_wire()


class _Gated(RedisJobStore):
    """A store whose next round trip waits for ``gate`` before it is sent; the calls each
    batch carries are counted as it goes (in the order the batches go). On the real clock,
    where a task waiting for Redis's answer is idle for ``wait_all_tasks_blocked``."""

    gate: trio.Event | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trips: list[int] = []
        self.flights: list[Any] = []

    async def _fly(self) -> None:
        self.trips.append(len(self._calls))
        await super()._fly()

    async def _wait(self, request: Callable[[], Awaitable[Any]]) -> Any:
        self.flights.append(getattr(request, "args", (None,))[0])
        gate, self.gate = self.gate, None
        if gate is not None:
            await gate.wait()
        return await super()._wait(request)


async def test_the_next_batch_goes_while_one_is_on_its_way(redis_server: RedisServer) -> None:
    """Calls made while a batch is on its way go in the next one without waiting for its
    replies (it is sent after the batch before it, and its replies read after theirs); at
    most _FLIGHTS batches are on their way, later calls wait for one to land. Every caller
    gets its own answer."""
    store = _Gated(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    async with store:
        jobs = [_job() for _ in range(3)]
        for job in jobs:
            await store.create(job)
        store.trips.clear()
        store.flights.clear()
        gate = store.gate = trio.Event()
        read: list[tuple[str, str]] = []

        async def get(job_id: str) -> None:
            read.append((job_id, (await store.get(job_id)).id))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(get, jobs[0].id)  # the held batch's one call
            await trio.testing.wait_all_tasks_blocked()
            assert len(store._flights) == 1
            for _ in range(3):
                nursery.start_soon(get, jobs[1].id)
            await trio.testing.wait_all_tasks_blocked()
            assert _FLIGHTS == 2
            assert len(store._flights) == 2  # gathered and gone after the held one
            for _ in range(2):
                nursery.start_soon(get, jobs[2].id)
            await trio.testing.wait_all_tasks_blocked()
            assert len(store._flights) == 2
            assert len(store._calls) == 2  # waiting for a batch to land
            gate.set()
        assert store.trips == [1, 3, 2]
        # A landed batch is no longer held by the one after it (else each would hold every
        # batch before it, for as long as batches overlap).
        assert [f.previous for f in store.flights] == [None, None, None]
        assert sorted(read) == sorted(
            [(jobs[0].id,) * 2] + [(jobs[1].id,) * 2] * 3 + [(jobs[2].id,) * 2] * 2
        )


async def test_a_batch_goes_as_soon_as_it_holds_enough_calls(redis_server: RedisServer) -> None:
    """A batch goes after at most _PASSES passes of the run loop, or at once when it holds
    _EARLY calls (or half the calls waiting for answers, if more): the tasks of the pass
    that made them go on while Redis runs it, and later calls make the next batch."""
    store = _Gated(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    async with store:
        job = _job()
        await store.create(job)
        store.trips.clear()
        gate = store.gate = trio.Event()
        read: list[str] = []

        async def get() -> None:
            read.append((await store.get(job.id)).id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(get)  # the held batch's one call
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(_EARLY + 3):  # made in one pass of the run loop
                nursery.start_soon(get)
            await trio.testing.wait_all_tasks_blocked()
            # The _EARLY-th call sent its batch, the three after it wait (two on their way).
            assert store.trips == [1, _EARLY]
            gate.set()
        assert store.trips == [1, _EARLY, 3]
        assert read == [job.id] * (_EARLY + 4)


async def test_a_connection_lost_with_two_batches_on_their_way_fails_both_then_recovers(
    redis_server: RedisServer,
) -> None:
    """Both batches on the one connection fail with the store's error (none is read by
    the wrong caller); the next call opens a new connection."""
    store = RedisJobStore(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    async with store:
        job = _job()
        await store.create(job)
        failed: list[str] = []

        async def call(name: str, commands: list[Any]) -> None:
            try:
                await store.pipeline(commands)
            except pw.StoreUnavailable:
                failed.append(name)

        async with trio.open_nursery() as nursery:
            # The first batch holds Redis on this connection; the second is sent behind it.
            nursery.start_soon(call, "held", [["BLPOP", f"{store.prefix}:nothing", 10]])
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(call, "behind", [["GET", f"{store.prefix}:other"]])
            await trio.testing.wait_all_tasks_blocked()
            assert len(store._flights) == 2
            assert store._connection is not None
            address = store._connection._usable().socket.getsockname()  # type: ignore[attr-defined]  # a TCP stream
            killer = await Connection.open(redis_server.url)
            try:
                await killer.call([["CLIENT", "KILL", "ADDR", f"{address[0]}:{address[1]}"]])
            finally:
                await killer.aclose()
        assert sorted(failed) == ["behind", "held"]
        assert (await store.get(job.id)).id == job.id  # a new connection


async def test_scripts_flushed_are_loaded_and_their_calls_sent_again(
    redis_server: RedisServer,
) -> None:
    """A batch whose scripts Redis no longer knows: the calls that needed them go again
    after the scripts are loaded; the others keep the answers they had."""
    store = RedisJobStore(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    async with store:
        first, second = _job(), _job()
        await store.create(first)
        await store.pipeline([["SCRIPT", "FLUSH"]])
        got: dict[str, Any] = {}

        async def read() -> None:
            got["read"] = (await store.get(first.id)).id

        async def create() -> None:
            await store.create(second)
            got["created"] = True

        async with trio.open_nursery() as nursery:  # one batch: a plain read and a script
            nursery.start_soon(read)
            nursery.start_soon(create)
        assert got == {"read": first.id, "created": True}
        assert (await store.get(second.id)).status is pw.Status.QUEUED
