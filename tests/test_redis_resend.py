"""When a store call whose round trip failed is sent again (``pipework/redis/_resend.py``),
and the scripts' answers to a write sent again: a write the first made is not made twice."""

from __future__ import annotations

import secrets

from hypothesis import given
from hypothesis import strategies as st

import pipework as pw
from pipework.dispatcher._job import Job, new_job_id
from pipework.redis import RedisJobStore
from pipework.redis._resend import MOST_PAUSE, Resend
from pipework.redis._store_scripts import _sent_again

from ._redis import RedisServer


@given(
    start=st.floats(0, 1e6),
    window=st.floats(-100, 100),
    steps=st.lists(st.floats(0, 5), max_size=60),
)
def test_a_call_is_sent_again_at_once_then_never_past_its_time(
    start: float, window: float, steps: list[float]
) -> None:
    """Whatever the time each failure takes: the first resend is at once (even past the
    time given), every later one starts by ``until``, no pause is longer than the most,
    and it gives up only once ``until`` has passed."""
    until = start + window
    resend = Resend(until)
    now = start
    assert resend.pause(now) == 0.0
    for spent in steps:
        now += spent  # the failed attempt's time
        pause = resend.pause(now)
        if pause is None:
            assert now >= until
            return
        assert now < until
        assert 0 <= pause <= MOST_PAUSE
        now += pause
        assert now <= until


def test_the_pauses_double_up_to_the_most() -> None:
    resend = Resend(1000.0, first=0.1, most=1.0)
    assert [resend.pause(0.0) for _ in range(7)] == [0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def _job() -> Job:
    return Job(id=new_job_id(), chain="c", state={"n": 0}, correlation_id="x")


async def _stream_length(store: RedisJobStore, stream: str) -> int:
    (length,) = await store.pipeline([["XLEN", stream]])
    return int(length)


async def test_a_write_sent_again_after_the_first_was_made_is_not_made_twice(
    redis_server: RedisServer,
) -> None:
    """The update script, sent again (marked), finds the record holding its very blob: it
    answers the version as if it wrote it, and neither bumps it nor adds the entry again
    (a hand-off's next event); a record written since by someone else is not taken for it."""
    store = RedisJobStore(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    stream = f"{store.prefix}:events"
    async with store:
        job = _job()
        await store.create(job)
        entry = (stream, b"e", b"run")
        command, _ = store._update_command(job, "", entry)
        first = await store._run(command, "update")
        assert first == job.version + 1
        again = _sent_again(command, "", entry)
        assert again != command
        assert await store._run(again, "update") == first  # the first's write: nothing more
        assert await _stream_length(store, stream) == 1
        # A record written since with another blob: a write sent again is made as any.
        job.version = first
        other = await store.get(job.id)
        other.state = {"n": 2}
        await store.update(other)
        assert await store._run(again, "update") == first + 2
        assert await _stream_length(store, stream) == 2
        # An end sent again after it was made answers its version, and stays the end.
        job = await store.get(job.id)
        job.transition(pw.Status.RUNNING)
        job.transition(pw.Status.DONE)
        command, _ = store._update_command(job, "", None)
        ended = await store._run(command, "update")
        assert await store._run(_sent_again(command, "", None), "update") == ended
        assert (await store.get(job.id)).status is pw.Status.DONE


async def test_a_create_and_a_status_write_sent_again_take_their_first_for_theirs(
    redis_server: RedisServer,
) -> None:
    """A create sent again (the job marked unsure) over the record it wrote answers as if it
    created it; a status write sent again over the status it wrote answers its version."""
    store = RedisJobStore(redis_server.url, prefix=f"s{secrets.token_hex(6)}")
    async with store:
        job = _job()
        await store.create(job)
        store._unsure_of(job.id)
        await store.create(job)  # (without the mark: "already exists")
        assert job.id not in store._unsure
        running = await store.get(job.id)
        running.transition(pw.Status.RUNNING)
        read = running.version
        assert await store.update_status(running)
        written = running.version
        running.version = read  # as the first write was sent
        assert await store._run(store._status_command(running), "status") == -3  # unmarked
        marked = store._status_command(running, again=True)
        assert await store._run(marked, "status") == written
        # A status written since by someone else is not taken for the first's.
        running.transition(pw.Status.SUSPENDED)
        assert await store._run(store._status_command(running, again=True), "status") == -3


async def test_a_steps_write_keeps_a_signal_another_process_kept_since_it_read(
    redis_server: RedisServer,
) -> None:
    """A step's write of its job (made from the record as the step holds it) lands after
    another process kept a signal on the record: the write keeps that signal (on the record
    and on the step's job), whether sent once or sent again after its round trip failed
    (marked: Redis was loading, say) — it never writes the record back without it."""
    prefix = f"s{secrets.token_hex(6)}"
    step = RedisJobStore(redis_server.url, prefix=prefix)
    other = RedisJobStore(redis_server.url, prefix=prefix)
    async with step, other:
        for sent_again in (False, True):
            job = _job()
            await step.create(job)
            job.transition(pw.Status.RUNNING)
            await step.update(job)
            kept = await other.get(job.id)
            kept.signals["go"] = {"by": "other"}
            assert await other.update_unless_changed(kept)
            if sent_again:
                step._unsure_of(job.id)  # its last write got no answer: this one goes marked
            job.state = {"n": 1}
            await step.update(job)
            record = await other.get(job.id)
            assert record.signals == {"go": {"by": "other"}}, sent_again
            assert record.state == {"n": 1}
            assert job.signals == {"go": {"by": "other"}}
            assert job.version == record.version
