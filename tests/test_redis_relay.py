"""What crosses processes besides a job's end: progress and chunks reach the process that
holds the request, a cancel interrupts a step running elsewhere, and a suspend timer fires
(once) when the process that set it is gone.

Two engines in one trio run, each with its own clients, consumer and relay, are two
processes as far as Redis can tell; the timer test also kills a real process. These run on
the real clock (a Redis round trip is real time), each wait bounded by ``fail_after``; the
timers' own schedule is tested on the mock clock.
"""

from __future__ import annotations

import contextlib
import functools
import math
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import coredis
import pytest
import trio

import pipework as pw
from pipework import JobView
from pipework.dispatcher._events import Expire, RunJob
from pipework.dispatcher._job import Job
from pipework.redis import RedisEventQueue, RedisJobStore
from pipework.redis._queue_events import decode_event, encode_event
from pipework.redis._relay import RedisRelay
from pipework.redis._timers import RedisTimers
from pipework.redis._wire import Arg, Connection

from ._redis import RedisServer, held
from ._redis_worker import declare as declare_work
from .test_board_http import follow_sse, serving
from .test_board_jobs import Gate
from .test_container_harness import HANG_GUARD, bearer


def _prefix() -> str:
    return f"r{secrets.token_hex(6)}"


@pytest.fixture(params=[False, True], ids=["own", "shared"])
def shared(request: pytest.FixtureRequest) -> bool:
    """Whether each engine's queue shares its store's round trips (what ``[store] backend =
    "redis"`` builds) or has a connection of its own: the relay and timers work either way."""
    value: bool = request.param
    return value


def _pair(url: str, prefix: str, *, shared: bool, **options: Any) -> dict[str, Any]:
    """A process's store and queue on ``url``: the engine's arguments."""
    store = RedisJobStore(url, prefix=prefix)
    queue = RedisEventQueue(url, prefix=prefix, store=store if shared else None, **options)
    return {"store": store, "queue": queue}


@asynccontextmanager
async def _engines(
    server: RedisServer,
    declare: Callable[[pw.Engine, str], None],
    *,
    a_takes_work: bool,
    shared: bool,
) -> AsyncIterator[tuple[pw.Engine, pw.Engine]]:
    """Engines "a" and "b" on one Redis; "a" takes no events unless told to: every step of
    a job it accepts then runs on "b"."""
    prefix = _prefix()
    engines = []
    for name in ("a", "b"):
        inflight = 0 if name == "a" and not a_takes_work else 8
        engine = pw.Engine(
            **_pair(server.url, prefix, shared=shared, consumer=name, max_inflight=inflight)
        )
        declare(engine, name)
        engines.append(engine)
    async with AsyncExitStack() as stack:
        for engine in engines:
            await stack.enter_async_context(engine)
        yield engines[0], engines[1]


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll what another engine (or process) changes; the caller bounds the wait."""
    while True:
        if await check():
            return
        await trio.sleep(0.01)


# -- streamed chunks ---------------------------------------------------------------------


def _declare_streaming(engine: pw.Engine, name: str) -> None:
    def emitter(label: str, key: str, count: int) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            for i in range(count):
                await ctx.emit({"from": label, "i": i, "by": name})
            ctx.state[label] = name

        return pw.Pipe(run, label, key=key)

    # Two keys: the job is handed off between its steps, which may run on either engine.
    engine.chain("talk", emitter("x", "x", 5), emitter("y", "y", 4), emitter("z", "x", 3))


@pytest.mark.parametrize("a_takes_work", [False, True])
async def test_chunks_of_steps_run_elsewhere_reach_the_stream_in_order(
    redis_server: RedisServer, a_takes_work: bool, shared: bool
) -> None:
    async with _engines(
        redis_server, _declare_streaming, a_takes_work=a_takes_work, shared=shared
    ) as (a, _b):
        with trio.fail_after(30):
            runs = []
            for _ in range(6):
                job_id = await a.submit("talk", {}, stream=True)
                chunks = [chunk async for chunk in a.stream(job_id)]
                runs.append((chunks, await a.wait(job_id)))
            plain = await a.submit("talk", {})  # not streamed: its chunks stay in its record
            await a.wait(plain)
            record = await a.store.get(plain)
    expected = [(label, i) for label, n in (("x", 5), ("y", 4), ("z", 3)) for i in range(n)]
    by = set()
    for chunks, state in runs:
        assert [(c["from"], c["i"]) for c in chunks] == expected
        # Each chunk says where its step ran, and so does the state.
        assert {c["from"]: c["by"] for c in chunks} == {k: state[k] for k in ("x", "y", "z")}
        by |= {c["by"] for c in chunks}
    if not a_takes_work:
        assert by == {"b"}
    elif shared:
        # "a" claims each job's first event as it accepts it, its slots being free, and the
        # hand-offs run on in the same step: a process runs what it accepts when it can.
        assert by == {"a"}
    else:
        assert by <= {"a", "b"}
    assert [(c["from"], c["i"]) for c in record.output] == expected


# -- progress and status of a watched job --------------------------------------------------


async def test_a_watched_jobs_progress_made_elsewhere_reaches_this_engines_observers(
    redis_server: RedisServer, shared: bool
) -> None:
    halfway = trio.Event()
    go_on = trio.Event()

    def declare(engine: pw.Engine, name: str) -> None:
        @engine.pipe(key="work")
        async def crunch(ctx: pw.Context) -> None:
            await ctx.progress(1, 3, "one")
            halfway.set()
            await go_on.wait()  # the test has seen the first report arrive on "a"
            await ctx.progress(2, 3, "two")
            ctx.state["by"] = name

        engine.chain("crunch", crunch)

    async with _engines(redis_server, declare, a_takes_work=False, shared=shared) as (a, _b):
        seen: list[JobView] = []
        a.observe(lambda view, token: seen.append(view))
        with trio.fail_after(30):
            job_id = await a.submit("crunch", {})
            a.watch(job_id)
            await halfway.wait()

            async def reported(done: float) -> bool:
                return any(v.progress is not None and v.progress.done == done for v in seen)

            await _until(functools.partial(reported, 1))
            go_on.set()
            assert (await a.wait(job_id))["by"] == "b"
            await _until(lambda: _ended(seen))
    mine = [v for v in seen if v.id == job_id]
    progress = [v.progress.message for v in mine if v.progress is not None]
    assert progress[0] == "one"
    assert "two" in progress
    assert mine[-1].status is pw.Status.DONE
    assert mine[-1].progress is not None
    assert mine[-1].progress.message == "two"
    versions = [(v.status, v.progress, v.updated_at) for v in mine]
    assert len(versions) == len(set(versions))  # no change told twice


async def _ended(seen: list[JobView]) -> bool:
    return any(v.status is pw.Status.DONE for v in seen)


@pytest.mark.parametrize("watched_before_the_end", [True, False])
async def test_a_follower_hears_the_end_of_a_job_created_and_ended_in_another_engine(
    redis_server: RedisServer, watched_before_the_end: bool, shared: bool
) -> None:
    """A job created and ended by "b" has its end published on no ``finished`` channel
    (only "b" can be waiting for it); a follower on "a" hears of it anyway, from the
    version notice its watch asks for (or, watching late, from its first read)."""
    go_on = trio.Event()

    def declare(engine: pw.Engine, name: str) -> None:
        @engine.pipe(key="work")
        async def step(ctx: pw.Context) -> None:
            await go_on.wait()
            ctx.state["by"] = name

        engine.chain("late", step)

    async with _engines(redis_server, declare, a_takes_work=False, shared=shared) as (a, b):
        prefix = a.queue.stream.partition(":")[0]  # type: ignore[attr-defined]  # a RedisEventQueue
        seen: list[JobView] = []
        a.observe(lambda view, token: seen.append(view))
        client: coredis.Redis[bytes] = coredis.Redis.from_url(redis_server.url)
        async with client:
            finished = f"{prefix}:finished"
            async with client.pubsub(channels=[finished], ignore_subscribe_messages=True) as sub:
                with trio.fail_after(30):
                    job_id = await b.submit("late", {})
                    if watched_before_the_end:
                        a.watch(job_id)
                        await _until(lambda: _told(seen, job_id))  # "a" follows it now
                    go_on.set()
                    assert (await b.wait(job_id))["by"] == "b"
                    if not watched_before_the_end:
                        a.watch(job_id)
                    await _until(lambda: _ended(seen))
                    await client.publish(finished, b"sentinel")
                    async for message in sub:
                        assert message["data"] == b"sentinel"  # the end was not published
                        break
    mine = [v for v in seen if v.id == job_id]
    assert mine[-1].status is pw.Status.DONE
    assert mine[-1].result == {"by": "b"}


async def _told(seen: list[JobView], job_id: str) -> bool:
    return any(v.id == job_id for v in seen)


async def test_an_unwatched_job_publishes_nothing(redis_server: RedisServer, shared: bool) -> None:
    """Nobody follows the job: its steps' writes publish nothing on its channel (the first
    message there is the test's own, sent after the job ended)."""

    def declare(engine: pw.Engine, name: str) -> None:
        @engine.pipe(key="work")
        async def step(ctx: pw.Context) -> None:
            await ctx.progress(1, 1)

        engine.chain("quiet", step)

    async with _engines(redis_server, declare, a_takes_work=False, shared=shared) as (a, _b):
        prefix = a.queue.stream.partition(":")[0]  # type: ignore[attr-defined]  # a RedisEventQueue
        client: coredis.Redis[bytes] = coredis.Redis.from_url(redis_server.url)
        async with client:
            with trio.fail_after(30):
                job_id = await a.submit("quiet", {})
                channel = f"{prefix}:relay:{job_id}"
                async with client.pubsub(channels=[channel], ignore_subscribe_messages=True) as sub:
                    await a.wait(job_id)
                    await client.publish(channel, b"sentinel")
                    async for message in sub:
                        assert message["data"] == b"sentinel"
                        break


class _Followed:
    """A relay's target that counts its reads of a job that stays queued."""

    def __init__(self) -> None:
        self.reads = 0
        self.read_again = trio.Event()

    def interrupt(self, job_id: str) -> None:
        pass

    async def read(self, job_id: str) -> Job:
        self.reads += 1
        self.read_again.set()
        self.read_again = trio.Event()
        return Job.accepted(job_id, "c", {}, "corr", math.inf, None, None, 1, 0.0, False, 0.0)

    def changed(self, job: Job) -> None:
        pass

    async def until_read(self, times: int) -> None:
        while self.reads < times:
            await self.read_again.wait()


async def test_a_relay_whose_subscription_dropped_reads_every_followed_job_again(
    redis_server: RedisServer,
) -> None:
    """Redis drops the relay's subscription (CLIENT KILL): it subscribes again, and reads
    every job it follows again, since what was published meanwhile was lost."""
    relay = RedisRelay(redis_server.url, prefix=_prefix())
    relay._subscription.retry = 0.01
    target = _Followed()
    killer = await Connection.open(redis_server.url)
    try:
        with trio.fail_after(30):
            async with relay, trio.open_nursery() as nursery:
                await nursery.start(relay.run, target)
                relay.watch("j")
                await target.until_read(1)  # once subscribed and marked
                await killer.call([["CLIENT", "KILL", "TYPE", "pubsub"]])
                await target.until_read(2)
                nursery.cancel_scope.cancel()
    finally:
        await killer.aclose()


# -- cancel ------------------------------------------------------------------------------


async def test_a_cancel_interrupts_a_step_running_in_another_engine(
    redis_server: RedisServer, shared: bool
) -> None:
    started = trio.Event()
    cleaned: list[str] = []

    def declare(engine: pw.Engine, name: str) -> None:
        @engine.pipe(key="work")
        async def wait_forever(ctx: pw.Context) -> None:
            try:
                started.set()
                await trio.sleep_forever()
            finally:
                cleaned.append(name)

        engine.chain("forever", wait_forever)

    async with _engines(redis_server, declare, a_takes_work=False, shared=shared) as (a, b):
        with trio.fail_after(30):
            job_id = await a.submit("forever", {})
            await started.wait()
            view = await a.cancel(job_id)
            assert view.status is pw.Status.CANCELLED
            with pytest.raises(pw.JobCancelled):
                await a.wait(job_id)
            await _until(lambda: _returns(bool(cleaned)))  # the pipe's cleanup ran on "b"
            assert cleaned == ["b"]
            assert (await b.status(job_id)).status is pw.Status.CANCELLED


async def _returns(value: bool) -> bool:
    await trio.lowlevel.checkpoint()
    return value


# -- suspend timers ----------------------------------------------------------------------


def _raw(value: str | bytes) -> bytes:
    assert isinstance(value, bytes)  # the clients here do not decode answers
    return value


class _Held:
    """A round trip under the mock clock, the clock held while the socket waits, so an
    autojumping clock does not take the wait for idleness (see tests/_redis.py)."""

    async def __call__(self, what: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        with held(10.0):
            return await fn(*args)


async def test_suspend_timers_fire_once_on_time_and_outlive_the_process_that_set_them(
    autojump_clock: trio.abc.Clock, redis_server: RedisServer
) -> None:
    prefix = _prefix()
    stream = f"{prefix}:events"
    client: coredis.Redis[bytes] = coredis.Redis.from_url(redis_server.url)

    async def call(commands: list[list[Arg]]) -> list[Any]:
        # A round trip on a connection of its own, as a queue's timers have (the queue's).
        connection = await Connection.open(redis_server.url)
        try:
            return await connection.call(commands)
        finally:
            await connection.aclose()

    def timers() -> RedisTimers:
        return RedisTimers(call, prefix=prefix, stream=stream, field=b"e", retrying=_Held(), poll=5)

    async def fired() -> list[Any]:
        entries = await _Held()("read", client.xrange, stream)
        return [decode_event(_raw(e.field_values[b"e"])) for e in entries]

    async with client:
        setter, other = timers(), timers()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other.run)
            async with trio.open_nursery() as doomed:
                doomed.start_soon(setter.run)
                setter.add(start + 11, encode_event(Expire("j1", 3)))
                setter.add(start + 21, encode_event(Expire("j2", 5)))
                await setter.flush()
                await trio.sleep_until(start + 10.5)  # the other process polled at 10
                assert await fired() == []
                await trio.sleep_until(start + 11.5)
                assert await fired() == [Expire("j1", 3)]  # by the setter, on time
                assert (setter.fired, other.fired) == (1, 0)
                doomed.cancel_scope.cancel()  # the process that set them is gone
            await trio.sleep_until(start + 20.9)
            assert await fired() == [Expire("j1", 3)]
            await trio.sleep_until(start + 25.5)  # at the other process's next poll, 25
            assert await fired() == [Expire("j1", 3), Expire("j2", 5)]
            assert (setter.fired, other.fired) == (1, 1)
            await trio.sleep_until(start + 60)
            assert len(await fired()) == 2  # fired once each, whatever polls came after
            nursery.cancel_scope.cancel()


async def test_a_steps_event_is_acknowledged_only_once_its_timer_is_in_redis(
    redis_server: RedisServer, shared: bool
) -> None:
    """A step that suspended with a timer ends: its event stays pending in the group until
    the timer is written (a process dying in between leaves the event to be claimed, and
    the claimed step sets the timer again). A step that set no timer is acknowledged
    meanwhile."""
    prefix = _prefix()
    parts = _pair(redis_server.url, prefix, shared=shared)
    store: RedisJobStore = parts["store"]
    queue: RedisEventQueue = parts["queue"]
    timers = queue._timers
    call, release = timers._call, trio.Event()

    async def held(commands: list[list[Arg]]) -> list[Any]:
        if commands[0][0] == "ZADD":
            await release.wait()
        return await call(commands)

    timers._call = held
    probe = await Connection.open(redis_server.url)

    async def pending() -> int:
        (reply,) = await probe.call([["XPENDING", f"{prefix}:events", queue.group]])
        return int(reply[0])

    try:
        async with store, queue:
            with trio.fail_after(30):
                queue.put_nowait(RunJob("plain"))
                queue.put_nowait(RunJob("suspending"))
                first, second = await queue.get(), await queue.get()
                queue.ack(first)
                queue.ack(second)
                queue.step_ended(first)  # set no timer
                queue.expire_at(trio.current_time() + 600, "suspending", 2)
                queue.step_ended(second)  # after its timer
                await _until(lambda: _equals(pending, 1))  # the first one's ack went
                assert timers.written == 0
                release.set()
                await _until(lambda: _equals(pending, 0))
                (count,) = await probe.call([["ZCARD", f"{prefix}:timers"]])
                assert count == 1
    finally:
        await probe.aclose()


async def _equals(read: Callable[[], Awaitable[int]], value: int) -> bool:
    return await read() == value


@pytest.mark.hang_guard(real_seconds=120)
async def test_a_suspended_jobs_timeout_fires_after_the_process_that_suspended_it_is_killed(
    redis_server: RedisServer, shared: bool
) -> None:
    """A worker process suspends 50 jobs with a timeout and is killed with SIGKILL; another
    process fires every timeout, once: each job fails with its suspend timeout."""
    prefix = _prefix()
    front = pw.Engine(**_pair(redis_server.url, prefix, shared=shared, max_inflight=0))
    declare_work(front, "front")
    command = [sys.executable, "-m", "tests._redis_worker", redis_server.url, prefix]
    command += ["shared"] if shared else []
    jobs = 50
    async with front, trio.open_nursery() as nursery:
        worker: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert worker.stdout is not None
        with trio.fail_after(30):
            assert (await worker.stdout.receive_some()).startswith(b"ready")
            ids = [await front.submit("wait", {"n": i}) for i in range(jobs)]

            async def all_suspended() -> bool:
                return len(await front.store.list(pw.Status.SUSPENDED)) == jobs

            await _until(all_suspended)
        worker.kill()
        await worker.wait()
        rescuer = pw.Engine(**_pair(redis_server.url, prefix, shared=shared, claim_idle=1))
        declare_work(rescuer, "rescuer")
        async with rescuer:
            with trio.fail_after(60):
                for job_id in ids:
                    # Failed in another process: the recorded type and message.
                    with pytest.raises(pw.JobFailed, match="before the suspend timeout") as exc:
                        await front.wait(job_id)
                    assert exc.value.error_type == "DeadlineExceeded"
            client: coredis.Redis[bytes] = coredis.Redis.from_url(redis_server.url)
            async with client:
                entries = await client.xrange(f"{prefix}:events")
                left = await client.zcard(f"{prefix}:timers")
            # Every process polls the timers: those that lived on fired them all.
            fired = sum(e.queue._timers.fired for e in (front, rescuer))  # type: ignore[attr-defined]  # RedisEventQueues
    events = [decode_event(_raw(e.field_values[b"e"])) for e in entries]
    expires = [e for e in events if isinstance(e, Expire)]
    assert sorted(e.job_id for e in expires) == sorted(ids)  # once each
    assert left == 0
    assert fired == jobs
    statuses = [(await front.store.get(job_id)).status for job_id in ids]
    assert statuses == [pw.Status.FAILED] * jobs


# -- through the container ---------------------------------------------------------------


def _exporting(engine: pw.Engine, gate: Gate) -> None:
    @engine.pipe
    async def export(ctx: pw.Context) -> None:
        await ctx.progress(1, 4, "first batch")
        gate.progressed.set()
        await gate.release.wait()
        await ctx.progress(4, 4, "written")
        ctx.state["rows"] = 4

    engine.chain("export", export)


async def test_an_sse_follower_on_one_process_sees_a_job_run_on_another(
    redis_server: RedisServer, shared: bool
) -> None:
    """The container of engine "a" accepts the job and holds its follower; every step runs
    on engine "b": the follower gets the progress made there, and the end."""
    prefix = _prefix()
    gate = Gate()
    registry = pw.Registry()
    front = pw.Engine(
        registry=registry, **_pair(redis_server.url, prefix, shared=shared, max_inflight=0)
    )
    _exporting(front, gate)
    registry.route("export", path="/export", chain="export", mode="async")
    worker = pw.Engine(**_pair(redis_server.url, prefix, shared=shared))
    _exporting(worker, gate)
    with trio.fail_after(HANG_GUARD):
        async with worker, serving(front) as served:
            accepted = (await served.client.post("/export", json={})).json()
            job_id, token = accepted["id"], accepted["token"]
            await gate.progressed.wait()
            async with follow_sse(served, f"/jobs/{job_id}/events", bearer(token)) as (_, events):
                _, _, first = await events.next()
                assert first["data"]["status"] == "running"
                assert first["data"]["progress"]["done"] == 1
                gate.release.set()
                bodies: list[Any] = []
                while not bodies or bodies[-1]["data"]["status"] != "done":
                    bodies.append((await events.next())[2])
                with contextlib.suppress(EOFError):
                    await events.next()
                    raise AssertionError("the stream went on after the final state")
    assert bodies[-1]["data"]["progress"]["message"] == "written"
    assert bodies[-1]["data"]["links"]["result"] == f"/jobs/{job_id}/result"
