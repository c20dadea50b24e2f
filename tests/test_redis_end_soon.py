"""A step's final write on the Redis store without the step waiting for it
(``RedisJobStore.update_soon``), its job's end or a hand-off: the end is told to waiters,
and the step's event let go of, only once Redis has it; a write that fails after the step
moved on still leaves its job final, and its event is let go of only then."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import pytest
import trio

import pipework as pw
from pipework.dispatcher._job import Job
from pipework.redis import RedisEventQueue, RedisJobStore
from pipework.redis._wire import Connection, encode_args

from ._redis import RedisServer

JOBS = 48


class _CountedEnds(RedisJobStore):
    """Counts the ends written with no wait; makes the first of them fail if ``fail``."""

    #: Which write to make fail, the first of its kind sent with no wait: "end" or
    #: "hand-off" (None: none).
    fail: str | None = None

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.soon: list[str] = []
        self.failed: str | None = None

    def update_soon(
        self,
        job: Job,
        then: Callable[[BaseException | None], None],
        *,
        entry: tuple[str, bytes, bytes] | None = None,
    ) -> bool:
        taken = super().update_soon(job, then, entry=entry)
        if taken:
            self.soon.append(job.id)
            kind = "end" if entry is None else "hand-off"
            if self.fail == kind and self.failed is None:
                # Redis refuses the write it was sent in place of the end (a wrong number
                # of arguments): the error a script bug or a refused command would give.
                self.failed = job.id
                self._calls[-1].commands = [b"*1\r\n" + encode_args(["HSET"])]
        return taken


#: The chain of each kind of write: one pipe (its step ends the job), two pipes under two
#: keys (the first step hands the job off, the second ends it).
_PIPES = {"end": 1, "hand-off": 2}


async def _chain(pipe_ctx: pw.Context) -> None:
    pipe_ctx.state["n"] = pipe_ctx.state.get("n", 0) + 1
    await trio.lowlevel.checkpoint()


async def _run_all(
    server: RedisServer, store: _CountedEnds, prefix: str, kind: str
) -> tuple[dict[str, Any], list[tuple[str, pw.Status | None]], int]:
    """Run JOBS jobs at once; their outcomes by job id, what each step's event saw of its
    job's end when it was let go of, and the events left pending in the group."""
    steps = JOBS * _PIPES[kind] - (store.fail == "hand-off")  # a failed hand-off: no 2nd
    queue = RedisEventQueue(server.url, prefix=prefix, store=store)
    outcomes: dict[str, Any] = {}
    let_go: list[tuple[str, pw.Status | None]] = []
    all_let_go = trio.Event()
    step_ended = queue.step_ended

    def seen(event: Any) -> None:
        ended = store._ended.get(event.job_id)  # the ends Redis has answered for
        let_go.append((event.job_id, None if ended is None else ended.status))
        step_ended(event)
        if len(let_go) == steps:
            all_let_go.set()

    queue.step_ended = seen  # type: ignore[method-assign]  # watches when events are let go of
    engine = pw.Engine(store=store, queue=queue)

    async def through_the_queue(*args: Any) -> bool:
        return False

    # Every hand-off goes through the queue, as when its next key has no slot free at once
    # (a step with one runs on under it: Steps._go_on_under).
    engine._dispatcher.steps._go_on_under = through_the_queue  # type: ignore[method-assign,assignment]  # a test double
    engine.registry.add_pipe(pw.Pipe(_chain, "p"))
    engine.registry.add_pipe(pw.Pipe(_chain, "q", key="other"))
    engine.chain("c", *["p", "q"][: _PIPES[kind]])
    async with engine:

        async def one() -> None:
            job_id = await engine.submit("c", {})
            try:
                outcomes[job_id] = await engine.wait(job_id)
            except pw.PipeworkError as exc:
                outcomes[job_id] = exc

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(JOBS):
                    nursery.start_soon(one)
            await all_let_go.wait()  # the last acknowledgements follow the last ends
    connection = await Connection.open(server.url)
    try:
        (pending,) = await connection.call([["XPENDING", f"{prefix}:events", "workers"]])
    finally:
        await connection.aclose()
    return outcomes, let_go, int(pending[0])


@pytest.mark.parametrize("kind", ["end", "hand-off"])
async def test_a_step_ends_without_waiting_for_its_last_write_and_lets_go_of_its_event_after(
    redis_server: RedisServer, kind: str
) -> None:
    prefix = f"e{secrets.token_hex(6)}"
    store = _CountedEnds(redis_server.url, prefix=prefix)
    outcomes, let_go, pending = await _run_all(redis_server, store, prefix, kind)
    assert store.soon  # under load most such writes go so
    assert outcomes == {job_id: {"n": _PIPES[kind]} for job_id in outcomes}
    assert len(outcomes) == JOBS
    # Every step's event was let go of only once Redis had its write: a first step's once
    # its hand-off was written (the end came later), a last step's once the end was.
    done: list[tuple[str, pw.Status | None]] = [(job_id, pw.Status.DONE) for job_id in outcomes]
    handed: list[tuple[str, pw.Status | None]] = (
        [(job_id, None) for job_id in outcomes] if kind == "hand-off" else []
    )
    assert sorted(let_go, key=repr) == sorted(done + handed, key=repr)
    assert pending == 0


@pytest.mark.parametrize("kind", ["end", "hand-off"])
async def test_a_write_that_fails_after_the_step_moved_on_fails_its_job(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    prefix = f"e{secrets.token_hex(6)}"
    store = _CountedEnds(redis_server.url, prefix=prefix)
    store.fail = kind
    outcomes, let_go, pending = await _run_all(redis_server, store, prefix, kind)
    failed = store.failed
    assert failed is not None
    # The job whose write was refused failed, clearly, as if its step had waited for the
    # write; every other job ran.
    error = outcomes.pop(failed)
    assert isinstance(error, pw.InternalError)
    assert "failed inside the engine (ReplyError" in str(error)
    assert outcomes == {job_id: {"n": _PIPES[kind]} for job_id in outcomes}
    assert "the step of job " + failed + " failed inside the engine" in caplog.text
    async with RedisJobStore(redis_server.url, prefix=prefix) as reader:
        record = await reader.get(failed)
    assert record.status is pw.Status.FAILED
    assert record.error is not None
    assert record.error.type == "InternalError"
    # Its event was let go of only once the failure was recorded.
    assert (failed, pw.Status.FAILED) in let_go
    handed: list[tuple[str, pw.Status | None]] = (
        [(job_id, None) for job_id in outcomes] if kind == "hand-off" else []
    )
    ended: list[tuple[str, pw.Status | None]] = [(failed, pw.Status.FAILED)]
    ended += [(job_id, pw.Status.DONE) for job_id in outcomes]
    assert sorted(let_go, key=repr) == sorted(ended + handed, key=repr)
    assert pending == 0
