"""A new job's first event claimed as its record is written (Steps.hold_first,
RedisEventQueue.create_and_claim): with a worker slot free at once, the record is written
running, the event is pending for this consumer, and the step starts with no status write
and no read; a cancel before the step starts runs nothing; an event with other events
before it is left to the next read."""

from __future__ import annotations

import math
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

import pipework as pw
from pipework.dispatcher._dispatcher import Dispatcher
from pipework.dispatcher._events import RunJob
from pipework.dispatcher._job import Job, new_job_id
from pipework.redis import RedisEventQueue, RedisJobStore
from pipework.redis._queue_events import encode_event
from pipework.redis._queue_shared import CLAIM_READ
from pipework.redis._store_scripts import _SHAS
from pipework.redis._wire import Connection, ReplyError

from ._redis import RedisServer


def _prefix() -> str:
    return f"c{secrets.token_hex(6)}"


@asynccontextmanager
async def _shared(
    server: RedisServer, prefix: str
) -> AsyncIterator[tuple[RedisJobStore, RedisEventQueue]]:
    store = RedisJobStore(server.url, prefix=prefix)
    queue = RedisEventQueue(server.url, prefix=prefix, store=store)
    async with store, queue:
        yield store, queue


def _sent(store: RedisJobStore) -> list[Any]:
    """Every command the store sends from now on."""
    commands: list[Any] = []
    real_call = store._call

    async def counted(call: Any) -> Any:
        commands.extend(call.commands)
        return await real_call(call)

    store._call = counted  # type: ignore[method-assign]  # records what this store sends
    return commands


async def _until_pending(server: RedisServer, prefix: str, count: int) -> None:
    """Wait until ``count`` events are pending in the group (polls: another connection)."""
    for _ in range(1000):
        if await _pending(server, prefix) == count:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"{await _pending(server, prefix)} events pending, not {count}")


async def _pending(server: RedisServer, prefix: str) -> int:
    connection = await Connection.open(server.url)
    try:
        (summary,) = await connection.call([["XPENDING", f"{prefix}:events", "workers"]])
    finally:
        await connection.aclose()
    return int(summary[0])


async def test_a_new_job_with_a_free_slot_is_claimed_as_it_is_created(
    redis_server: RedisServer,
) -> None:
    prefix = _prefix()
    store = RedisJobStore(redis_server.url, prefix=prefix)
    pool = pw.WeightedPool(4)
    queue = RedisEventQueue(redis_server.url, prefix=prefix, store=store)
    engine = pw.Engine(store=store, queue=queue, pool=pool)
    seen: list[pw.Status] = []

    @engine.pipe
    async def look(ctx: pw.Context) -> None:
        async with RedisJobStore(redis_server.url, prefix=prefix) as other:
            seen.append((await other.get(ctx.job_id)).status)  # as any process sees it
        ctx.state["looked"] = True

    engine.chain("c", look)
    async with engine:
        await engine.run("c")  # loads the scripts
        sent = _sent(store)
        with trio.fail_after(10):
            assert await engine.run("c", {"n": 1}) == {"n": 1, "looked": True}
        status_script = _SHAS["status"].encode()
        scripts = [c for c in sent if isinstance(c, bytes) and b"EVALSHA" in c]
        assert not [c for c in scripts if status_script in c]  # no status write of its own
        assert len(scripts) == 2  # the create (with its claim) and the end
        assert seen == [pw.Status.RUNNING, pw.Status.RUNNING]  # running from its creation
        with trio.fail_after(10):
            await _until_pending(redis_server, prefix, 0)  # acknowledged once its end is in
        assert pool.statistics().in_use == 0


async def test_a_claimed_job_cancelled_before_its_step_starts_runs_nothing(
    redis_server: RedisServer,
) -> None:
    """Cancelled here or in another process (its cancel published) between the write of
    its record and the start of its step: the step runs no pipe, the slot is given back,
    the event acknowledged, and the job ends cancelled."""
    await _cancel_before_the_step(redis_server, here=True)
    await _cancel_before_the_step(redis_server, here=False)


async def _cancel_before_the_step(redis_server: RedisServer, *, here: bool) -> None:
    prefix = _prefix()
    store = RedisJobStore(redis_server.url, prefix=prefix)
    pool = pw.WeightedPool(4)
    engine = pw.Engine(
        store=store, queue=RedisEventQueue(redis_server.url, prefix=prefix, store=store), pool=pool
    )
    other = pw.Engine(
        store=RedisJobStore(redis_server.url, prefix=prefix),
        queue=RedisEventQueue(redis_server.url, prefix=prefix, max_inflight=0),
    )
    ran: list[str] = []

    @engine.pipe
    async def work(ctx: pw.Context) -> None:
        ran.append(ctx.job_id)

    engine.chain("c", work)
    dispatcher: Dispatcher = engine._dispatcher
    start = dispatcher.steps.start_claimed
    held: list[RunJob] = []
    dispatcher.steps.start_claimed = held.append  # type: ignore[method-assign,assignment]  # starts when told
    async with engine, other:
        with trio.fail_after(10):
            job_id = await engine.submit("c")
            assert [e.job_id for e in held] == [job_id]
            await (engine if here else other).cancel(job_id)
            for _ in range(1000):  # the cancel reaches it (published, from elsewhere)
                if dispatcher.flight.claiming[job_id].cancelled:
                    break
                await trio.sleep(0.01)
            start(held[0])
            try:
                await engine.wait(job_id)
            except pw.JobCancelled:
                pass
            else:
                raise AssertionError("the job was not cancelled")
            await _until_pending(redis_server, prefix, 0)
        assert (await engine.status(job_id)).status is pw.Status.CANCELLED
        assert ran == []
        assert job_id not in dispatcher.flight.claiming
        assert pool.statistics().in_use == 0


async def test_a_claim_with_other_events_before_it_leaves_its_event_to_the_next_read(
    redis_server: RedisServer,
) -> None:
    prefix = _prefix()
    async with _shared(redis_server, prefix) as (store, queue):
        # The blocking read stays off (as under load, reads ride in round trips), so the
        # events put below wait for the claims' reads.
        queue._last_read = math.inf
        for _ in range(1000):
            if not queue._reading:
                break
            await trio.sleep(0.01)
        # Events put elsewhere and not read yet: as many as a claim's read takes.
        foreign = [f"f{i}" for i in range(CLAIM_READ)]
        connection = await Connection.open(redis_server.url)
        try:
            for job_id in foreign:
                await connection.call(
                    [["XADD", queue.stream, "*", "e", encode_event(RunJob(job_id))]]
                )
        finally:
            await connection.aclose()
        first = Job(id=new_job_id(), chain="c", state={}, correlation_id="x")
        second = Job(id=new_job_id(), chain="c", state={}, correlation_id="x")
        assert await queue.create_and_claim(store, first, RunJob(first.id)) is False
        assert (await store.get(first.id)).status is pw.Status.QUEUED
        event = RunJob(second.id)
        assert await queue.create_and_claim(store, second, event) is True
        assert (await store.get(second.id)).status is pw.Status.RUNNING
        with trio.fail_after(10):
            got = await queue.get_batch()
            while len(got) < CLAIM_READ + 1:
                got += await queue.get_batch()
        # The foreign events (read by the first claim) and the first job's, by a later
        # read; never the second job's: it is this consumer's already.
        assert [e.job_id for e in got if isinstance(e, RunJob)] == [*foreign, first.id]
        assert await _pending(redis_server, prefix) == CLAIM_READ + 2
        queue.ack(event)
        queue.step_ended(event)
        for e in got:
            queue.ack(e)
        with trio.fail_after(10):
            await _until_pending(redis_server, prefix, CLAIM_READ + 1)


async def test_a_queue_with_a_connection_of_its_own_claims_nothing(
    redis_server: RedisServer,
) -> None:
    """Claims ride in the store's round trips: a queue that does not share them holds no
    slot for a new job (Steps.hold_first), and its jobs run as before."""
    prefix = _prefix()
    pool = pw.WeightedPool(4)
    engine = pw.Engine(
        store=RedisJobStore(redis_server.url, prefix=prefix),
        queue=RedisEventQueue(redis_server.url, prefix=prefix),
        pool=pool,
    )

    @engine.pipe
    async def work(ctx: pw.Context) -> None:
        ctx.state["done"] = True

    engine.chain("c", work)
    async with engine:
        job = Job(id=new_job_id(), chain="c", state={}, correlation_id="x")
        assert engine._dispatcher.steps.hold_first(job) is None
        assert pool.statistics().in_use == 0
        with trio.fail_after(10):
            assert await engine.run("c") == {"done": True}


class _RefusesAReadAfterADelivery(RedisJobStore):
    """A Redis store whose first read of a job after a signal's delivery is refused
    ``LOADING`` (Redis restarted, reading its file): the read of the ``Resume``'s step."""

    def __init__(self, url: str, prefix: str) -> None:
        super().__init__(url, prefix=prefix)
        self.armed = False
        self.refused = trio.Event()

    async def update_unless_changed(self, job: Job, **kwargs: Any) -> bool:
        written = await super().update_unless_changed(job, **kwargs)
        self.armed = written and job.status is pw.Status.QUEUED
        return written

    async def get(self, job_id: str) -> Job:
        if self.armed:
            self.armed = False
            self.refused.set()
            raise self._refused(ReplyError("LOADING Redis is loading the dataset in memory"))
        return await super().get(job_id)


async def test_a_resume_whose_step_cannot_read_its_job_is_run_once_the_store_is_back(
    redis_server: RedisServer,
) -> None:
    """The step of a delivered signal's ``Resume`` cannot read its job (Redis loading): the
    event is not acknowledged as if run (the job would stay queued for ever, its event
    gone); it is taken again once idle (``claim_idle``) and its step runs the job."""
    prefix = _prefix()
    store = _RefusesAReadAfterADelivery(redis_server.url, prefix)
    queue = RedisEventQueue(redis_server.url, prefix=prefix, store=store, claim_idle=0.3)
    engine = pw.Engine(store=store, queue=queue)

    @engine.pipe
    async def wait_paid(ctx: pw.Context) -> None:
        await ctx.suspend("paid", into="payment")

    engine.chain("order", wait_paid)
    suspended = trio.Event()

    def seen(view: pw.JobView, _: str | None) -> None:
        if view.status is pw.Status.SUSPENDED:
            suspended.set()

    engine.observe(seen)
    async with engine:
        with trio.fail_after(10):
            job_id = await engine.submit("order")
            await suspended.wait()
            await engine.signal(job_id, "paid", {"amount": 5})
            await store.refused.wait()
            assert await engine.wait(job_id) == {"payment": {"amount": 5}}
        await _until_pending(redis_server, prefix, 0)


async def test_a_signal_kept_by_another_process_while_the_step_runs_resumes_the_job(
    redis_server: RedisServer,
) -> None:
    """A signal sent through another process while the job's pipe runs is kept on its
    record; the step then suspends for it: its write of the suspension does not write the
    record back without the signal, and the job takes it and goes on."""
    prefix = _prefix()
    store = RedisJobStore(redis_server.url, prefix=prefix)
    engine = pw.Engine(
        store=store, queue=RedisEventQueue(redis_server.url, prefix=prefix, store=store)
    )

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        async with RedisJobStore(redis_server.url, prefix=prefix) as elsewhere:
            record = await elsewhere.get(ctx.job_id)
            record.signals["go"] = {"ok": True}  # as Engine.signal keeps it there
            assert await elsewhere.update_unless_changed(record)
        await ctx.suspend("go", into="approval")

    engine.chain("approve", hold)
    async with engine:
        with trio.fail_after(10):
            assert await engine.run("approve") == {"approval": {"ok": True}}
