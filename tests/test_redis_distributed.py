"""Several engines on one Redis: the event queue's promises, and jobs that cross engines.

Two engines in one trio run, each with its own clients, consumer and dispatcher, are two
processes as far as Redis can tell. These tests run on the real clock (a Redis round trip
is real time); each wait is bounded by ``fail_after``.
"""

from __future__ import annotations

import functools
import math
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import pipework as pw
from pipework import Gateway
from pipework.container import BoundAddress
from pipework.dispatcher._events import BranchDone, Event, Expire, Resume, RunJob
from pipework.dispatcher._job import Job
from pipework.redis import RedisEventQueue, RedisJobStore
from pipework.redis._queue_events import decode_event, encode_event
from pipework.redis._wire import ReplyError

from ._redis import RedisServer, start_redis
from ._redis_worker import SLOT_WAIT
from ._redis_worker import declare as declare_work
from .test_gateway import backend, gateway_file


def _prefix() -> str:
    return f"d{secrets.token_hex(6)}"


@pytest.mark.parametrize(
    "event",
    [
        RunJob("a"),
        Resume("a", "paid"),
        Expire("a", 7),
        BranchDone(
            "p", "c", 2, "error", None, join_id="j", stage=(0, 3), error=("E", "m", "w", 502)
        ),
        BranchDone("p", "c", 0, "ok", {"set": {"k": [1, {"x": None}]}}, join_id="j", stage=()),
    ],
)
def test_events_round_trip_through_the_stream_encoding(event: Event) -> None:
    assert decode_event(encode_event(event)) == event


async def test_new_work_is_bounded_and_events_of_accepted_jobs_always_taken(
    redis_server: RedisServer,
) -> None:
    async with RedisEventQueue(redis_server.url, prefix=_prefix(), capacity=2) as queue:
        queue.submit_nowait(RunJob("a"))
        queue.submit_nowait(RunJob("b"))
        with pytest.raises(pw.Overloaded, match=r"the event queue is full \(2 of 2"):
            queue.submit_nowait(RunJob("c"))
        queue.put_nowait(Resume("a", "go"))  # an accepted job's: never refused
        await queue.flush()
        with trio.fail_after(10):
            got = await queue.get_batch()
            while len(got) < 3:
                got += await queue.get_batch()
        assert got == [RunJob("a"), RunJob("b"), Resume("a", "go")]
        assert queue.statistics().depth == 3
        for event in got:
            queue.ack(event)
        assert queue.statistics().depth == 0
        assert queue.statistics().refused == 1


async def test_a_submission_writes_its_record_and_first_event_in_one_write(
    redis_server: RedisServer,
) -> None:
    prefix = _prefix()
    url = redis_server.url
    store = RedisJobStore(url, prefix=prefix)
    async with store, RedisEventQueue(url, prefix=prefix, capacity=1, store=store) as queue:
        # The script is known to Redis first: a server that has not run it yet answers
        # NOSCRIPT, and the store sends the command again (with the test's file alone).
        await store.create(_job("known"))
        commands = []
        real_call = store._call

        async def counted(call: Any) -> Any:
            commands.extend(call.commands)
            return await real_call(call)

        store._call = counted  # type: ignore[method-assign]  # counts what the store sends
        assert await queue.create_and_submit(store, _job("a"), RunJob("a"))
        # The record and its event: one command, and no XADD of its own.
        key = f"{prefix}:job:a"
        assert (
            len([c for c in commands if (key.encode() if isinstance(c, bytes) else key) in c]) == 1
        )
        assert not [c for c in commands if not isinstance(c, bytes) and c[0] == "XADD"]
        assert (await store.get("a")).status is pw.Status.QUEUED
        with trio.fail_after(10):
            assert await queue.get_batch() == [RunJob("a")]
        assert queue.statistics().depth == 1
        # Full: refused before anything is written.
        with pytest.raises(pw.Overloaded, match=r"the event queue is full \(1 of 1"):
            await queue.create_and_submit(store, _job("b"), RunJob("b"))
        with pytest.raises(pw.JobNotFound):
            await store.get("b")
        assert queue.statistics().refused == 1
        # Another store's job is not the queue's to write: nothing done, the caller goes on.
        async with RedisJobStore(url, prefix=prefix) as other:
            assert not await queue.create_and_submit(other, _job("c"), RunJob("c"))
        with pytest.raises(pw.JobNotFound):
            await store.get("c")


async def test_a_hand_off_writes_its_record_and_next_event_in_one_write(
    redis_server: RedisServer,
) -> None:
    prefix = _prefix()
    url = redis_server.url
    store = RedisJobStore(url, prefix=prefix)
    async with store, RedisEventQueue(url, prefix=prefix, store=store) as queue:
        job = _job("a")
        await store.create(job)
        job.transition(pw.Status.RUNNING)
        await store.update(job)
        commands = []
        real_call = store._call

        async def counted(call: Any) -> Any:
            commands.extend(call.commands)
            return await real_call(call)

        store._call = counted  # type: ignore[method-assign]  # counts what the store sends
        job.state["n"] = 1
        job.transition(pw.Status.QUEUED)
        assert await queue.update_and_put(store, job, RunJob("a"))
        key = f"{prefix}:job:a".encode()
        assert len([c for c in commands if isinstance(c, bytes) and key in c]) == 1
        assert not [c for c in commands if not isinstance(c, bytes) and c[0] == "XADD"]
        assert (await store.get("a")).state == {"n": 1}
        with trio.fail_after(10):
            assert await queue.get_batch() == [RunJob("a")]
        # A record the script refuses (ended meanwhile) puts no event.
        ended = await store.get("a")
        ended.transition(pw.Status.CANCELLED)
        await store.update(ended)
        with pytest.raises(pw.JobNotFound):
            await queue.update_and_put(store, job, RunJob("a"))
        assert queue.statistics().accepted == 1
        assert await store.pipeline([["XLEN", queue.stream]]) == [1]
        async with RedisJobStore(url, prefix=prefix) as other:
            assert not await queue.update_and_put(other, job, RunJob("a"))


def _job(job_id: str) -> Job:
    return Job(id=job_id, chain="c", state={}, correlation_id="x")


async def test_a_silent_consumers_events_are_claimed_by_another(
    redis_server: RedisServer,
) -> None:
    prefix = _prefix()
    dead = RedisEventQueue(redis_server.url, prefix=prefix, claim_idle=0.3, consumer="dead")
    async with dead:
        for i in range(5):
            dead.put_nowait(RunJob(f"j{i}"))
        await dead.flush()
        with trio.fail_after(10):
            held = await dead.get_batch()
            while len(held) < 5:
                held += await dead.get_batch()
        dead.ack(held[0])  # a step it started...
        dead.step_ended(held[0])  # ...and ended: done with
        dead.ack(held[1])  # a step it started and never ended; three it never started
    # "dead" is gone without acknowledging: a live consumer claims what it held.
    async with RedisEventQueue(redis_server.url, prefix=prefix, claim_idle=0.3) as alive:
        with trio.fail_after(10):
            claimed = await alive.get_batch()
            while len(claimed) < 4:
                claimed += await alive.get_batch()
        assert sorted(e.job_id for e in claimed if isinstance(e, RunJob)) == [
            "j1",
            "j2",
            "j3",
            "j4",
        ]
        # Each was taken over: a job found running lost its step with the dead consumer.
        assert all(alive.reclaimed(e) for e in claimed)


class _Counted(RedisEventQueue):
    """Counts its claim rounds (each refreshes what it holds, then claims what sits idle)."""

    rounds = 0

    async def _claim(self) -> None:
        await super()._claim()
        self.rounds += 1


async def test_a_live_consumer_keeps_what_it_holds(redis_server: RedisServer) -> None:
    """Events a consumer holds for longer than the idle time (waiting for a worker slot)
    are not taken from it while it lives. The other consumer's rounds are counted, not
    timed: four of them outlast the idle time whatever the machine's speed; and the idle
    time is long beside the holder's refresh (a third of it), so that a busy machine's
    pause does not pass for a dead consumer."""
    prefix = _prefix()
    async with RedisEventQueue(redis_server.url, prefix=prefix, claim_idle=1.5) as holder:
        holder.put_nowait(RunJob("slow"))
        await holder.flush()
        with trio.fail_after(10):
            held = await holder.get_batch()
        other = _Counted(redis_server.url, prefix=prefix, claim_idle=1.5)
        async with other:
            taken: list[Event] = []

            async def take() -> None:
                taken.extend(await other.get_batch())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(take)
                with trio.fail_after(30):
                    while other.rounds < 4:  # noqa: ASYNC110 - the queue has no event for it
                        await trio.sleep(0.05)
                nursery.cancel_scope.cancel()
            assert taken == [], "a live consumer's event was claimed"
        holder.ack(held[0])


@asynccontextmanager
async def _engines(
    server: RedisServer, declare: Callable[[pw.Engine, str], None], *, a_takes_work: bool
) -> AsyncIterator[tuple[pw.Engine, pw.Engine]]:
    """Engines "a" and "b" on one Redis, each with its own clients and consumer."""
    prefix = _prefix()
    engines = []
    for name in ("a", "b"):
        inflight = 0 if name == "a" and not a_takes_work else 8
        engine = pw.Engine(
            store=RedisJobStore(server.url, prefix=prefix),
            queue=RedisEventQueue(server.url, prefix=prefix, consumer=name, max_inflight=inflight),
        )
        declare(engine, name)
        engines.append(engine)
    async with AsyncExitStack() as stack:
        for engine in engines:
            await stack.enter_async_context(engine)
        yield engines[0], engines[1]


async def test_a_job_parked_on_one_engine_completes_through_work_done_on_the_other(
    redis_server: RedisServer,
) -> None:
    """Engine a only accepts (it takes no events): every step runs on b; a signal sent to
    either engine resumes the job parked on a; a's waiter hears the end b recorded."""

    def declare(engine: pw.Engine, name: str) -> None:
        @engine.pipe(key="users")
        async def load(ctx: pw.Context) -> None:
            ctx.state["ran"] = [*ctx.state.get("ran", []), f"load@{name}"]

        @engine.pipe(key="payments")
        async def pay(ctx: pw.Context) -> None:
            ctx.state["ran"] = [*ctx.state["ran"], f"pay@{name}"]
            await ctx.suspend("paid", into="payment")

        @engine.pipe(key="users")
        async def confirm(ctx: pw.Context) -> None:
            ctx.state["ran"] = [*ctx.state["ran"], f"confirm@{name}"]

        engine.chain("order", load, pay, confirm)

    async with _engines(redis_server, declare, a_takes_work=False) as (a, b):
        with trio.fail_after(20):
            job_id = await a.submit("order", {"n": 1})
            for _ in range(2000):  # a's own observers hear nothing: b runs the steps
                if (await a.status(job_id)).status is pw.Status.SUSPENDED:
                    break
                await trio.sleep(0.01)
            assert (await b.status(job_id)).waiting_for == "paid"  # status from anywhere
            await a.signal(job_id, "paid", {"amount": 12})
            result = await a.wait(job_id)
            # The same again, the signal sent to the engine that does not park the request.
            again = await a.submit("order", {"n": 2})
            for _ in range(2000):
                if (await b.status(again)).status is pw.Status.SUSPENDED:
                    break
                await trio.sleep(0.01)
            await b.signal(again, "paid", {"amount": 5})
            second = await a.wait(again)
    assert result["ran"] == ["load@b", "pay@b", "confirm@b"]
    assert result["payment"] == {"amount": 12}
    assert second["ran"] == ["load@b", "pay@b", "confirm@b"]
    assert (second["n"], second["payment"]) == (2, {"amount": 5})


async def test_jobs_shared_by_two_engines_all_complete_with_the_right_state(
    redis_server: RedisServer,
) -> None:
    """Both engines take work: hand-offs between keys and the branches of a parallel stage
    land on either, and every job ends with every step's effect exactly once."""

    def declare(engine: pw.Engine, name: str) -> None:
        def step(label: str) -> pw.Pipe:
            async def run(ctx: pw.Context) -> None:
                await trio.sleep(0.001)
                ctx.state[label] = name

            return pw.Pipe(run, label, key=label[0])

        engine.chain(
            "c",
            step("x1"),
            step("y1"),
            pw.all_of(step("x2"), step("y2"), step("z2")),
            step("z3"),
        )

    async with _engines(redis_server, declare, a_takes_work=True) as (a, b):
        with trio.fail_after(60):
            ids = [await (a if i % 2 else b).submit("c", {"i": i}) for i in range(30)]
            results = [await (b if i % 2 else a).wait(job_id) for i, job_id in enumerate(ids)]
    mixed = 0
    for i, result in enumerate(results):
        assert result["i"] == i
        steps = {k: v for k, v in result.items() if k != "i"}
        assert set(steps) == {"x1", "y1", "x2", "y2", "z2", "z3"}
        assert set(steps.values()) <= {"a", "b"}
        mixed += len(set(steps.values())) == 2
    assert mixed > 0  # some jobs had steps on both engines


async def test_while_redis_is_away_submissions_get_a_clear_503_and_recover_after(
    tmp_path: Path,
) -> None:
    """A server of the test's own, stopped and started again: meanwhile the HTTP answer is
    a 503 problem naming the store; once it is back, requests are served again."""
    server = start_redis(tmp_path)
    try:
        with trio.fail_after(40):
            async with backend() as users:
                path = tmp_path / "gateway.toml"
                text = gateway_file(users.url)
                text += f'\n[store]\nbackend = "redis"\nurl = "{server.url}"\nclaim_idle = 1\n'
                path.write_text(text)
                gateway = Gateway(str(path))
                stop = trio.Event()
                async with trio.open_nursery() as nursery:
                    address: BoundAddress = await nursery.start(
                        functools.partial(gateway.run, port=0, stop=stop)
                    )
                    async with httpx.AsyncClient(base_url=address.url, timeout=15) as client:
                        assert (await client.get("/users/1")).status_code == 200
                        server.stop()
                        away = await client.get("/users/2")
                        assert away.status_code == 503, away.text
                        assert away.headers["content-type"] == "application/problem+json"
                        assert away.json()["detail"].startswith(
                            "the server cannot reach its job store now"
                        )
                        assert "redis:" not in away.text  # where it is: the log, not the client
                        server.restart()
                        status: int | str | None = None
                        for _ in range(100):  # the clients reconnect on their own
                            try:
                                back = await client.get("/users/3")
                            except httpx.TransportError as exc:
                                status = repr(exc)  # a connection the 503 closed
                                continue
                            status = back.status_code
                            if status == 200:
                                break
                            await trio.sleep(0.1)
                        assert status == 200, status
                        assert back.json()["id"] == "3"
                    stop.set()
    finally:
        server.stop()


@pytest.mark.hang_guard(real_seconds=240)
@pytest.mark.parametrize(("chain", "jobs"), [("work", 1000), ("fan", 300)])
async def test_kill_9_in_the_middle_of_the_jobs_loses_none(
    redis_server: RedisServer, chain: str, jobs: int
) -> None:
    """A worker process is killed with SIGKILL while it runs 1,000 jobs (or 300 with a
    parallel stage); another process claims its pending events (the steps and branches it
    was running among them) and every accepted job ends done, with every step's effect:
    none stays running, none is lost."""
    prefix = _prefix()
    front = pw.Engine(  # accepts and parks; takes no work
        store=RedisJobStore(redis_server.url, prefix=prefix),
        queue=RedisEventQueue(redis_server.url, prefix=prefix, max_inflight=0),
    )
    declare_work(front, "front")
    command = [sys.executable, "-m", "tests._redis_worker", redis_server.url, prefix]
    async with front, trio.open_nursery() as nursery:
        worker: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert worker.stdout is not None
        with trio.fail_after(30):
            assert (await worker.stdout.receive_some()).startswith(b"ready")
            ids = [await front.submit(chain, {"n": i}) for i in range(jobs)]
            done, at_join = 0, 0
            while done < 20 or (chain == "fan" and not at_join):  # well into them
                await trio.sleep(0.02)
                done = len(await front.store.list(pw.Status.DONE))
                if chain == "fan":
                    running = await front.store.list(pw.Status.RUNNING)
                    at_join = sum(job.join is not None for job in running)
        worker.kill()  # SIGKILL: no cleanup of any kind, parents waiting at their joins
        await worker.wait()
        assert len(await front.store.list(pw.Status.DONE)) < jobs  # it died mid-run

        rescuer = pw.Engine(
            pool=pw.WeightedPool(16, wait_timeout=SLOT_WAIT),
            store=RedisJobStore(redis_server.url, prefix=prefix),
            queue=RedisEventQueue(redis_server.url, prefix=prefix, claim_idle=1),
        )
        declare_work(rescuer, "rescuer")
        async with rescuer:
            with trio.fail_after(180):
                results = [await front.wait(job_id) for job_id in ids]
    assert [r["n"] for r in results] == list(range(jobs))
    effects = ("fetched_by",) if chain == "work" else ("left_by", "right_by")
    for r in results:
        assert {r[effect] for effect in (*effects, "stored_by")} <= {"doomed", "rescuer"}
    assert any(r["stored_by"] == "rescuer" for r in results)
    statuses = [(await front.store.get(job_id)).status for job_id in ids]
    assert statuses.count(pw.Status.DONE) == jobs


async def test_engines_whose_queues_share_their_stores_round_trips_share_work(
    redis_server: RedisServer,
) -> None:
    """As ``[store] backend = "redis"`` builds them: each engine's queue writes, acknowledges
    and reads in its store's round trips. Jobs submitted on either engine and waited for on
    either (its end recorded by the engine that did not create it, or by the one that did
    while the other waits) all complete, with every step's effect."""
    prefix = _prefix()
    engines = []
    for name in ("a", "b"):
        store = RedisJobStore(redis_server.url, prefix=prefix)
        queue = RedisEventQueue(redis_server.url, prefix=prefix, consumer=name, store=store)
        engine = pw.Engine(store=store, queue=queue)

        def step(label: str, name: str = name) -> pw.Pipe:
            async def run(ctx: pw.Context) -> None:
                await trio.sleep(0.001)
                ctx.state[label] = name

            return pw.Pipe(run, label, key=label[0])

        engine.chain("c", step("x1"), step("y1"), step("x2"))
        engines.append(engine)
    a, b = engines
    async with a, b:
        with trio.fail_after(60):
            ids = [await (a if i % 2 else b).submit("c", {"i": i}) for i in range(60)]
            results = [await (b if i % 3 else a).wait(job_id) for i, job_id in enumerate(ids)]
        read_in_round_trips = [e.queue._last_read > -math.inf for e in engines]  # type: ignore[attr-defined]  # the Redis queue's own record
    for i, result in enumerate(results):
        assert result["i"] == i
        assert set(result) == {"i", "x1", "y1", "x2"}
        assert set(result.values()) - {i} <= {"a", "b"}
    assert any(read_in_round_trips)


@pytest.mark.hang_guard(real_seconds=240)
async def test_kill_9_loses_none_when_the_queue_shares_the_stores_round_trips(
    redis_server: RedisServer,
) -> None:
    """The crash test's promise, with the worker's queue reading and writing in its store's
    round trips (what ``[store] backend = "redis"`` builds): every accepted job ends."""
    prefix = _prefix()
    store = RedisJobStore(redis_server.url, prefix=prefix)
    front = pw.Engine(
        store=store,
        queue=RedisEventQueue(redis_server.url, prefix=prefix, max_inflight=0, store=store),
    )
    declare_work(front, "front")
    jobs = 300
    command = [sys.executable, "-m", "tests._redis_worker", redis_server.url, prefix, "shared"]
    async with front, trio.open_nursery() as nursery:
        worker: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert worker.stdout is not None
        with trio.fail_after(30):
            assert (await worker.stdout.receive_some()).startswith(b"ready")
            ids = [await front.submit("work", {"n": i}) for i in range(jobs)]
            done = 0
            while done < 20:  # well into them
                await trio.sleep(0.02)
                done = len(await front.store.list(pw.Status.DONE))
        worker.kill()
        await worker.wait()
        assert len(await front.store.list(pw.Status.DONE)) < jobs  # it died mid-run

        rescue_store = RedisJobStore(redis_server.url, prefix=prefix)
        rescuer = pw.Engine(
            pool=pw.WeightedPool(16),
            store=rescue_store,
            queue=RedisEventQueue(
                redis_server.url, prefix=prefix, claim_idle=1, store=rescue_store
            ),
        )
        declare_work(rescuer, "rescuer")
        async with rescuer:
            with trio.fail_after(180):
                results = [await front.wait(job_id) for job_id in ids]
    assert [r["n"] for r in results] == list(range(jobs))
    assert any(r["stored_by"] == "rescuer" for r in results)
    statuses = [(await front.store.get(job_id)).status for job_id in ids]
    assert statuses.count(pw.Status.DONE) == jobs


class _Deaf(RedisJobStore):
    """A store whose subscription to other processes' ends hears none of them, as one that
    was away while they were published (Redis restarted, the client reconnecting)."""

    async def follow_finished(
        self,
        finished: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        await trio.sleep_forever()


async def test_a_request_parked_where_the_end_was_not_heard_still_completes(
    redis_server: RedisServer,
) -> None:
    """Engine a only accepts and parks; b runs the job and publishes its end, which a's
    subscription misses: a looks at the record again now and then, and answers."""
    prefix = _prefix()
    a = pw.Engine(
        store=_Deaf(redis_server.url, prefix=prefix),
        queue=RedisEventQueue(redis_server.url, prefix=prefix, max_inflight=0),
    )
    b = pw.Engine(
        store=RedisJobStore(redis_server.url, prefix=prefix),
        queue=RedisEventQueue(redis_server.url, prefix=prefix),
    )
    for name, engine in (("a", a), ("b", b)):

        @engine.pipe(name="work")
        async def work(ctx: pw.Context, name: str = name) -> None:
            ctx.state["by"] = name

        engine.chain("c", work)
    async with a, b:
        with trio.fail_after(30):
            assert await a.run("c") == {"by": "b"}


class _Lines:
    """The lines a process writes, one at a time."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def receive(self) -> str:
        while b"\n" not in self._buffer:
            data = await self._stream.receive_some()
            if not data:
                raise EOFError("the process closed its output")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()


async def test_kill_9_of_the_process_that_accepted_and_claimed_the_jobs_loses_none(
    redis_server: RedisServer,
) -> None:
    """The process that accepts the jobs runs them too, claiming a job's first event with
    its record when a slot is free (its record written running): killed with SIGKILL in the
    middle, every job it accepted ends, the claimed ones whose step it was running run
    again elsewhere from their cursor."""
    prefix = _prefix()
    jobs = 400
    command = [
        *(sys.executable, "-m", "tests._redis_worker", redis_server.url, prefix),
        *("shared", "accept", str(jobs)),
    ]
    accepted: dict[str, bool] = {}
    async with trio.open_nursery() as nursery:
        worker: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        assert worker.stdout is not None
        lines = _Lines(worker.stdout)
        with trio.fail_after(60):
            assert await lines.receive() == "ready"
            claimed_last = False
            while len(accepted) < 20 or not claimed_last:  # well into them, one just claimed
                job_id, claimed = (await lines.receive()).split()
                accepted[job_id] = claimed_last = claimed == "1"
        worker.kill()  # the job just claimed is in its first pipe (a second)
        await worker.wait()
    assert any(accepted.values())  # claims among them
    rescue_store = RedisJobStore(redis_server.url, prefix=prefix)
    rescuer = pw.Engine(
        pool=pw.WeightedPool(16),
        store=rescue_store,
        queue=RedisEventQueue(redis_server.url, prefix=prefix, claim_idle=1, store=rescue_store),
    )
    declare_work(rescuer, "rescuer")
    async with rescuer:
        with trio.fail_after(180):
            results = {job_id: await rescuer.wait(job_id) for job_id in accepted}
    assert all(r["stored_by"] in ("doomed", "rescuer") for r in results.values())
    # A claimed job whose first step died with its process ran that step again elsewhere.
    assert any(
        claimed and results[job_id]["fetched_by"] == "rescuer"
        for job_id, claimed in accepted.items()
    )
    statuses = [(await rescue_store.get(job_id)).status for job_id in accepted]
    assert statuses.count(pw.Status.DONE) == len(accepted)


@asynccontextmanager
async def _serving(engine: pw.Engine) -> AsyncIterator[httpx.AsyncClient]:
    """A container serving ``engine`` with no callback secret configured."""
    container = pw.Container(engine, config=pw.ContainerConfig(shutdown_grace=0.5))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(container.serve, shutdown_trigger=stop)
        )
        try:
            async with httpx.AsyncClient(base_url=address.url) as client:
                yield client
        finally:
            stop.set()


async def test_a_callback_url_one_process_signed_is_accepted_by_another(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no callback secret configured, each process signed with a random one of its own
    and the others refused its URLs (403). The first to serve keeps its secret in Redis and
    every other takes it: a URL signed by one process is accepted by another."""
    monkeypatch.delenv("PIPEWORK_CALLBACK_SECRET", raising=False)
    monkeypatch.delenv("PIPEWORK_WORKERS_CALLBACK_SECRET", raising=False)
    urls: list[str] = []
    signed = trio.Event()

    def declare(engine: pw.Engine, name: str) -> None:
        @engine.pipe
        async def pay(ctx: pw.Context) -> None:
            urls.append(ctx.callback_url("paid", ttl=60))
            signed.set()
            await ctx.suspend("paid", into="payment")  # (a signal sent before is kept)

        engine.chain("order", pay)

    engines = _engines(redis_server, declare, a_takes_work=False)
    async with engines as (a, b), _serving(a) as client_a, _serving(b) as client_b:
        with trio.fail_after(20):
            job_id = await a.submit("order")
            await signed.wait()
            (url,) = urls  # signed by b, whose engine runs the steps
            assert url.startswith(str(client_b.base_url).rstrip("/"))
            path = httpx.URL(url).raw_path.decode()
            answer = await client_a.post(path, json={"amount": 3})
            assert answer.status_code == 204, answer.text
            assert await a.wait(job_id) == {"payment": {"amount": 3}}


async def test_a_delivered_signal_and_its_resume_reach_redis_in_one_write(
    redis_server: RedisServer,
) -> None:
    """The chaos harness killed a process (SIGKILL) while it delivered a signal: the record
    was written queued, the Resume waited in the process's outbox and died with it, and the
    job stayed queued for ever. The Resume now goes in the record's own write: with nothing
    of the outbox ever written (as for a process killed then), the job still resumes."""
    prefix = _prefix()
    store = RedisJobStore(redis_server.url, prefix=prefix)
    queue = RedisEventQueue(redis_server.url, prefix=prefix, store=store)
    engine = pw.Engine(store=store, queue=queue)

    @engine.pipe
    async def hold(ctx: pw.Context) -> None:
        await ctx.suspend("go", into="payment")

    engine.chain("c", hold)
    async with engine:
        with trio.fail_after(20):
            job_id = await engine.submit("c")
            status = pw.Status.QUEUED
            while status is not pw.Status.SUSPENDED:  # (its step's write, in another task)
                await trio.sleep(0.01)
                status = (await store.get(job_id)).status
            lost: list[Event] = []
            real_put = queue.put_nowait
            # What the outbox holds from now on dies with it, never written.
            queue.put_nowait = lost.append  # type: ignore[method-assign,assignment]  # a spy
            try:
                await engine.signal(job_id, "go", {"amount": 3})
            finally:
                queue.put_nowait = real_put  # type: ignore[method-assign]  # restored
            assert lost == []
            assert await engine.wait(job_id) == {"payment": {"amount": 3}}


class _Loading(RedisEventQueue):
    """A queue whose first claims are answered ``LOADING``, as by a Redis restarted with
    AOF persistence that is still reading its file."""

    loading = 2

    async def _call(self, commands: list[list[Any]]) -> list[Any]:
        if self.loading and commands[0][0] in ("XCLAIM", "XAUTOCLAIM"):
            self.loading -= 1
            return [ReplyError("LOADING Redis is loading the dataset in memory")]
        return await super()._call(commands)


async def test_a_redis_still_loading_its_data_is_waited_for_not_fatal(
    redis_server: RedisServer,
) -> None:
    """The chaos harness restarted Redis with AOF: a claim round answered LOADING raised
    out of the queue's task, stopping the engine (its steps cancelled, "the engine
    stopped") and its `pipework serve` process. It is now retried as a Redis away is."""
    prefix = _prefix()
    store = RedisJobStore(redis_server.url, prefix=prefix)
    queue = _Loading(redis_server.url, prefix=prefix, store=store, claim_idle=0.3)
    engine = pw.Engine(store=store, queue=queue)

    @engine.pipe
    async def work(ctx: pw.Context) -> None:
        ctx.state["by"] = "me"

    engine.chain("c", work)
    async with engine:
        with trio.fail_after(20):
            while queue.loading:  # (its claim rounds come every claim_idle / 3)
                await trio.sleep(0.05)
                assert await engine.run("c") == {"by": "me"}
            assert await engine.run("c") == {"by": "me"}
