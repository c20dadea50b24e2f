"""Connections to Redis dropped while Redis stays up (``CLIENT KILL``): a parked request is
answered with its job's real outcome, and a step's writes are sent again on a new
connection, so no job fails for a blip.

These tests run on the real clock (a Redis round trip is real time); each wait is bounded
by ``fail_after``.
"""

from __future__ import annotations

import functools
import secrets
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import pipework as pw
from pipework.container import BoundAddress
from pipework.dispatcher._job import Job, new_job_id
from pipework.redis import RedisEventQueue, RedisJobStore
from pipework.redis._wire import Connection

from ._redis import RedisServer, start_redis

#: Requests (or jobs) in flight when the connections are killed.
PARKED = 6


async def _kill(server: RedisServer, *kinds: str) -> None:
    """``CLIENT KILL TYPE kind`` for each kind, from a connection of the test's own."""
    killer = await Connection.open(server.url)
    try:
        for kind in kinds:
            await killer.call([["CLIENT", "KILL", "TYPE", kind]])
    finally:
        await killer.aclose()


class _Gate:
    def __init__(self, parked: int = PARKED) -> None:
        self.parked = parked
        self.entered = 0
        self.all_in = trio.Event()
        self.release = trio.Event()


def _engine(
    server: RedisServer, prefix: str, gate: _Gate, *, takes_work: bool, **options: Any
) -> pw.Engine:
    """An engine as ``[store] backend = "redis"`` builds it (the queue in the store's round
    trips); its one pipe waits on the gate. ``options``: the store's."""
    store = RedisJobStore(server.url, prefix=prefix, **options)
    engine = pw.Engine(
        store=store,
        queue=RedisEventQueue(
            server.url, prefix=prefix, store=store, max_inflight=64 if takes_work else 0
        ),
    )

    @engine.pipe
    async def held(ctx: pw.Context) -> None:
        gate.entered += 1
        if gate.entered == gate.parked:
            gate.all_in.set()
        await gate.release.wait()
        ctx.state["done"] = ctx.state["n"]

    engine.chain("held", held, result="done")
    return engine


@asynccontextmanager
async def _serving(engine: pw.Engine) -> AsyncIterator[httpx.AsyncClient]:
    container = pw.Container(
        engine,
        [pw.Route("held", "POST", "/held", "held", timeout=60)],
        pw.ContainerConfig(callback_secret="test-callback-secret-0123456789"),
    )
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(container.serve, shutdown_trigger=stop)
        )
        try:
            async with httpx.AsyncClient(base_url=address.url, timeout=60) as client:
                yield client
        finally:
            stop.set()


async def test_requests_parked_through_a_connection_drop_get_their_jobs_real_outcome(
    redis_server: RedisServer,
) -> None:
    """Engine a accepts and parks six sync requests; engine b runs their jobs. Every
    connection is killed (the store's and the subscriptions') while they are parked: a's
    waiters are woken by the dropped subscription, read their records again on a new
    connection, and answer each job's result once b ends it. Before, each read on the
    killed connection failed and the request was told 503 "nothing was done" while its
    job went on to end ``done``: a client that retried ran it twice."""
    prefix = f"w{secrets.token_hex(6)}"
    gate = _Gate()
    a = _engine(redis_server, prefix, gate, takes_work=False)
    b = _engine(redis_server, prefix, gate, takes_work=True)
    answers: dict[int, httpx.Response] = {}
    async with a, b, _serving(a) as client:

        async def post(n: int) -> None:
            answers[n] = await client.post("/held", json={"n": n})

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for n in range(PARKED):
                    nursery.start_soon(post, n)
                await gate.all_in.wait()
                assert isinstance(a.store, RedisJobStore)
                assert isinstance(b.store, RedisJobStore)
                dropped = a.store._generation  # how many of its subscriptions dropped so far
                await _kill(redis_server, "normal", "pubsub")
                # b's own connection was killed too: it is made again here, so that what
                # this test sees is the waiters', not b's end writes on a dead connection.
                with suppress(pw.StoreUnavailable):
                    await b.store.pipeline([["PING"]])
                # The waiters are woken by the drop (they read again) before the jobs end.
                while a.store._generation == dropped:  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.01)
                gate.release.set()
    for n, answer in sorted(answers.items()):
        assert answer.status_code == 200, (n, answer.text)
        assert answer.json() == n


async def test_a_steps_end_written_on_a_killed_connection_is_sent_again_and_its_job_is_done(
    redis_server: RedisServer,
) -> None:
    """Six steps are running when the store's connection is killed; their ends go in the
    next round trip, which finds the connection dead. Each end is sent again on a new
    connection (an end already written is not written twice) and every job ends ``done``.
    Before, nothing sent it again: the jobs failed with an InternalError
    (``StoreUnavailable … Redis closed the connection``) though their pipes succeeded and
    Redis stayed up."""
    prefix = f"w{secrets.token_hex(6)}"
    gate = _Gate()
    engine = _engine(redis_server, prefix, gate, takes_work=True)
    async with engine:
        with trio.fail_after(60):
            ids = [await engine.submit("held", {"n": n}) for n in range(PARKED)]
            await gate.all_in.wait()
            await _kill(redis_server, "normal")
            gate.release.set()
            results = {job_id: await engine.wait(job_id) for job_id in ids}
        assert results == {job_id: n for n, job_id in enumerate(ids)}
        async with RedisJobStore(redis_server.url, prefix=prefix) as reader:
            for job_id in ids:
                record = await reader.get(job_id)
                assert (record.status, record.error) == (pw.Status.DONE, None)


async def test_a_request_parked_when_redis_goes_away_is_told_its_job_not_nothing_was_done(
    tmp_path: Path,
) -> None:
    """A sync request is parked while its job's pipe runs (its backends called) when Redis
    stops: its waiter, woken by the dropped subscription, cannot read the record. It is
    answered 503 naming the job — its status's Location, its id and its token — never
    "nothing was done" (a client that believed it would submit the job again)."""
    server = start_redis(tmp_path)
    try:
        gate = _Gate(parked=1)
        # Its read is sent again for a second (resend_seconds) before it is answered.
        prefix = f"w{secrets.token_hex(6)}"
        engine = _engine(server, prefix, gate, takes_work=True, resend_seconds=1)
        async with engine, _serving(engine) as client:
            answers: list[httpx.Response] = []

            async def post() -> None:
                answers.append(await client.post("/held", json={"n": 1}))

            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(post)
                    await gate.all_in.wait()
                    server.stop()
                server.restart()  # (before any check: the engine stops on a live Redis)
                gate.release.set()
                (answer,) = answers
                assert answer.status_code == 503, answer.text
                problem = answer.json()
                assert problem["type"] == "urn:pipework:problem:store-unavailable"
                assert "nothing was done" not in problem["detail"]
                assert "may still run" in problem["detail"]
                job_id = problem["job_id"]
                assert gate.entered == 1  # its pipe did run
                assert answer.headers["location"] == f"/jobs/{job_id}"
                assert answer.headers["x-job-id"] == job_id
                assert answer.headers["x-job-token"] == problem["token"]
                assert "retry-after" not in answer.headers  # not to be sent again
    finally:
        server.stop()


class _CountedTimeouts(RedisJobStore):
    """Counts the round trips that got no answer in time."""

    timed_out = 0

    def _no_answer(self, *args: Any, **kwargs: Any) -> pw.StoreUnavailable:
        self.timed_out += 1
        return super()._no_answer(*args, **kwargs)


async def test_ends_written_while_redis_is_paused_are_made_once_it_is_back(
    tmp_path: Path,
) -> None:
    """Redis is paused (SIGSTOP) while six steps end: their writes get no answer within
    the store's time for one, and are sent again, with pauses, within their jobs'
    deadline. Once Redis goes on (SIGCONT) it runs the first writes, still in its sockets,
    and then those sent again, which find their very record written and do nothing more:
    every job is ``done``, once. Before, the first write with no answer failed its job."""
    server = start_redis(tmp_path)
    try:
        prefix = f"w{secrets.token_hex(6)}"
        gate = _Gate()
        store = _CountedTimeouts(server.url, prefix=prefix, io_timeout=0.5)
        engine = pw.Engine(
            store=store, queue=RedisEventQueue(server.url, prefix=prefix, store=store)
        )

        @engine.pipe
        async def held(ctx: pw.Context) -> None:
            gate.entered += 1
            if gate.entered == gate.parked:
                gate.all_in.set()
            await gate.release.wait()
            ctx.state["done"] = ctx.state["n"]

        engine.chain("held", held, result="done")
        async with engine:
            with trio.fail_after(60):
                ids = [await engine.submit("held", {"n": n}, timeout=50) for n in range(PARKED)]
                await gate.all_in.wait()
                server.process.send_signal(signal.SIGSTOP)
                try:
                    gate.release.set()
                    while store.timed_out == 0:  # noqa: ASYNC110 - no event to wait on
                        await trio.sleep(0.05)
                finally:
                    server.process.send_signal(signal.SIGCONT)
                results = {job_id: await engine.wait(job_id) for job_id in ids}
            assert results == {job_id: n for n, job_id in enumerate(ids)}
            async with RedisJobStore(server.url, prefix=prefix) as reader:
                for job_id in ids:
                    record = await reader.get(job_id)
                    assert (record.status, record.error) == (pw.Status.DONE, None)
    finally:
        server.stop()


async def test_a_lock_whose_answer_was_lost_is_known_held_by_its_taker(tmp_path: Path) -> None:
    """The per-job lock's ``SET NX`` gets no answer (Redis paused past ``io_timeout``); Redis
    runs it when it goes on. Sent again, it finds the lock held — by this very call, which
    looks and takes it, rather than waiting out its own lease (a minute here)."""
    server = start_redis(tmp_path)
    try:
        store = _CountedTimeouts(
            server.url, prefix=f"w{secrets.token_hex(6)}", io_timeout=0.3, lock_seconds=60
        )
        async with store:
            await store.pipeline([["PING"]])  # connected before Redis pauses
            taken = trio.Event()

            async def take() -> None:
                async with store.lock("j"):
                    taken.set()

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    server.process.send_signal(signal.SIGSTOP)
                    try:
                        nursery.start_soon(take)
                        while store.timed_out == 0:  # noqa: ASYNC110 - no event to wait on
                            await trio.sleep(0.05)
                    finally:
                        server.process.send_signal(signal.SIGCONT)
                    await taken.wait()
            (held,) = await store.pipeline([["EXISTS", f"{store.prefix}:lock:j"]])
            assert held == 0  # let go of after
    finally:
        server.stop()


async def test_the_store_says_a_write_may_have_been_made_and_a_read_did_nothing(
    tmp_path: Path,
) -> None:
    """With Redis paused past ``io_timeout`` (a call sent, its answer not come), a write
    that fails may have been made (``maybe_done``: its client is not told "nothing was
    done"); a read that fails did nothing; and with Redis stopped, a call that found no
    connection to be sent on did nothing."""
    server = start_redis(tmp_path)
    try:
        store = RedisJobStore(
            server.url, prefix=f"w{secrets.token_hex(6)}", io_timeout=0.2, resend_seconds=0
        )
        async with store:
            job = Job(id=new_job_id(), chain="c", state={}, correlation_id="x")
            await store.create(job)
            job.transition(pw.Status.RUNNING)
            with trio.fail_after(20):
                server.process.send_signal(signal.SIGSTOP)
                try:
                    with pytest.raises(pw.StoreUnavailable) as written:
                        await store.update(job)
                    with pytest.raises(pw.StoreUnavailable) as read:
                        await store.get(job.id)
                finally:
                    server.process.send_signal(signal.SIGCONT)
                assert written.value.maybe_done
                assert not read.value.maybe_done
                server.stop()
                with pytest.raises(pw.StoreUnavailable) as refused:
                    await store.update(job)
                assert not refused.value.maybe_done
    finally:
        server.stop()


async def test_a_submission_whose_create_got_no_answer_is_told_its_job_and_it_runs_once(
    tmp_path: Path,
) -> None:
    """Redis is paused past ``io_timeout`` while a sync request's job is created: the
    create, and the create sent again, get no answer, and the request is answered 503
    naming the job it may have created (Location, id, token). Redis goes on, runs the
    create, and the job runs — once: its client follows it to its result, and the same
    request sent again with its Idempotency-Key gets that job, not a second one."""
    server = start_redis(tmp_path)
    try:
        gate = _Gate(parked=1)
        gate.release.set()
        prefix = f"w{secrets.token_hex(6)}"
        store = _CountedTimeouts(server.url, prefix=prefix, io_timeout=0.3)
        queue = RedisEventQueue(server.url, prefix=prefix, store=store, claim_idle=1)
        engine = pw.Engine(store=store, queue=queue)

        @engine.pipe
        async def held(ctx: pw.Context) -> None:
            gate.entered += 1
            ctx.state["done"] = ctx.state["n"]

        engine.chain("held", held, result="done")
        key = {"Idempotency-Key": secrets.token_hex(8)}
        async with engine, _serving(engine) as client:
            await client.post("/held", json={"n": 0})  # connected before Redis pauses
            with trio.fail_after(60):
                server.process.send_signal(signal.SIGSTOP)
                try:
                    answer = await client.post("/held", json={"n": 1}, headers=key)
                finally:
                    server.process.send_signal(signal.SIGCONT)
                assert answer.status_code == 503, answer.text
                problem = answer.json()
                assert "nothing was done" not in problem["detail"]
                job_id, token = problem["job_id"], problem["token"]
                assert answer.headers["location"] == f"/jobs/{job_id}"
                auth = {"Authorization": f"Bearer {token}"}
                while True:  # the client follows it
                    status = await client.get(f"/jobs/{job_id}", headers=auth)
                    assert status.status_code == 200, status.text
                    if status.json()["status"] == "done":
                        break
                    await trio.sleep(0.05)
                result = await client.get(f"/jobs/{job_id}/result", headers=auth)
                assert result.json() == 1
                again = await client.post("/held", json={"n": 1}, headers=key)
                assert again.status_code == 200, again.text
                assert again.headers["x-job-id"] == job_id
                assert again.json() == 1
        assert gate.entered == 2  # the first request's job, and this one's once
    finally:
        server.stop()


async def test_a_step_whose_store_stays_away_past_its_time_fails_its_job_and_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis stops while a step runs and stays away past ``resend_seconds``: its end is sent
    again until then, and only then does the job fail for the store (an InternalError
    naming StoreUnavailable, in the log); the step lets go of its job, it does not hang."""
    server = start_redis(tmp_path)
    try:
        gate = _Gate(parked=1)
        prefix = f"w{secrets.token_hex(6)}"
        engine = _engine(server, prefix, gate, takes_work=True, resend_seconds=0.5)
        async with engine:
            with trio.fail_after(60):
                job_id = await engine.submit("held", {"n": 1})
                await gate.all_in.wait()
                server.stop()
                gate.release.set()
                line = f"the step of job {job_id} failed inside the engine"
                while line not in caplog.text:  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.05)
                ends = engine._dispatcher.ends
                while job_id in ends.pending:  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.05)
            assert "StoreUnavailable" in caplog.text
            server.restart()
    finally:
        server.stop()
