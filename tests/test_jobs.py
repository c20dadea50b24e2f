"""Job records, the status table, state checks, the job pool and the event queue, tested
without running an engine."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import msgpack
import pytest
import trio

import pipework as pw
from pipework import ErrorInfo, Status
from pipework.dispatcher._events import RunJob
from pipework.dispatcher._job import Frame, Job, JobRecord, JoinRecord, new_job_id
from pipework.dispatcher._status import ACTIVE, TERMINAL, TRANSITIONS, check_transition
from pipework.pipes._join import Join
from pipework.pipes._merge import Delta
from pipework.pipes._state import check_state

from ._copying_store import CopyingJobStore


def make_job(**kwargs: object) -> Job:
    return Job(id=new_job_id(), chain="c", state={}, correlation_id="corr", **kwargs)  # type: ignore[arg-type]  # fields vary by test


def test_an_accepted_job_is_the_record_the_constructor_builds() -> None:
    # The submission path's constructor sets every field itself: one it missed, or a field
    # added to the record later and not to it, would show here.
    fast = Job.accepted("j", "c", {"a": 1}, "corr", 5.0, "hash", "tp", 2, 1.5, True, 100.0)
    slow = Job(
        id="j",
        chain="c",
        state={"a": 1},
        correlation_id="corr",
        deadline=5.0,
        token_hash="hash",
        traceparent="tp",
        plan=2,
        accepted_at=1.5,
        admitted=True,
        created_at=100.0,
        updated_at=100.0,
    )
    for f in dataclasses.fields(Job):
        assert getattr(fast, f.name) == getattr(slow, f.name), f.name
    assert fast.to_wire() == slow.to_wire()
    other = Job.accepted("k", "c", {}, "corr", 5.0, None, None, 1, 1.5, False, 100.0)
    assert other.frames is not fast.frames  # no mutable default shared between records
    assert other.signals is not fast.signals


def test_job_ids_are_unguessable_and_unique() -> None:
    ids = {new_job_id() for _ in range(1000)}
    assert len(ids) == 1000
    # 16 random bytes, base64url without padding: 22 characters, 128 bits.
    assert all(len(i) == 22 for i in ids)


def test_transition_table_is_complete_and_terminal_states_are_final() -> None:
    assert set(TRANSITIONS) == set(Status)
    assert TERMINAL == {Status.DONE, Status.FAILED, Status.CANCELLED, Status.EXPIRED}
    assert ACTIVE == {Status.QUEUED, Status.RUNNING, Status.SUSPENDED}
    for status in ACTIVE:
        assert TRANSITIONS[status] & TERMINAL


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (Status.DONE, Status.RUNNING),
        (Status.QUEUED, Status.SUSPENDED),
        (Status.QUEUED, Status.DONE),
        (Status.SUSPENDED, Status.RUNNING),
        (Status.CANCELLED, Status.QUEUED),
    ],
)
def test_illegal_transition_names_both_states(current: Status, target: Status) -> None:
    with pytest.raises(pw.InvalidTransition) as info:
        check_transition(current, target, "job-1")
    assert f"'{current.value}' -> '{target.value}'" in str(info.value)
    assert "job-1" in str(info.value)


def test_job_transition_goes_through_the_table() -> None:
    job = make_job()
    job.transition(Status.RUNNING)
    job.transition(Status.DONE)
    with pytest.raises(pw.InvalidTransition):
        job.transition(Status.RUNNING)
    assert job.status is Status.DONE


def test_job_record_round_trips_through_msgpack() -> None:
    job = make_job(deadline=math.inf, frames=[Frame(2, 10.5), Frame(0, math.inf)])
    job.state = {"a": [1, 2], "b": {"c": None}}
    job.progress = pw.Progress(1, 3, "one")
    job.error = pw.ErrorInfo("KeyError", "'x'", "chain 'c' > pipe 'p'", 500)
    wire = msgpack.unpackb(msgpack.packb(job.to_wire()))
    back = Job.from_wire(wire)
    assert back.to_wire() == job.to_wire()


def test_a_parent_waiting_at_a_join_round_trips_through_msgpack() -> None:
    join = Join.graph([[], [], [0]], [False, True, False])
    join.start()
    join.branch_done(0, "ok")
    join.branch_done(1, "error")
    record = JoinRecord(
        id=new_job_id(),
        path=(0, 2),
        join=join,
        deadline=math.inf,
        children={0: "c0", 1: "c1", 2: "c2"},
        deltas={0: Delta(changed={"a": [1, {"b": None}]}, removed=("gone",))},
        errors={1: ErrorInfo("KeyError", "'x'", "chain 'c' > graph[0] > branch 'n1'", 500)},
    )
    job = make_job(frames=[Frame(0, 12.5)], status=Status.RUNNING, join=record)
    back = Job.from_wire(msgpack.unpackb(msgpack.packb(job.to_wire())))
    assert back.to_wire() == job.to_wire()
    assert back.join is not None
    assert back.join.children == {0: "c0", 1: "c1", 2: "c2"}  # int keys again
    assert back.join.deltas == record.deltas
    assert back.join.errors == record.errors
    assert back.join.path == (0, 2)
    assert back.join.join.outcomes == ("ok", "error", "running")
    assert back.join.join.start_from(2) == (0,)
    assert back.join.settled_outcomes(["n0", "n1", "n2"]) == {
        "n0": {"outcome": "ok"},
        "n1": {"outcome": "error", "error": {"type": "KeyError", "message": "'x'"}},
        "n2": {"outcome": "running"},
    }


def test_a_join_record_of_another_version_is_refused() -> None:
    record = JoinRecord(id="j", path=(0,), join=Join.any_of(2))
    wire = msgpack.unpackb(msgpack.packb(record.to_wire()))
    assert JoinRecord.from_wire(wire).to_wire() == record.to_wire()
    with pytest.raises(ValueError, match="unsupported join record version 2"):
        JoinRecord.from_wire({**wire, "version": 2})


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"a": object()}, "state.a"),
        ({"a": {"b": [1, 2, {3}]}}, "state.a.b[2]"),
        ({"a": {1: {"x": object()}}}, "state.a[1].x"),
        ({"a": 2**70}, "state.a"),
        ({1: "x"}, "state[1]"),
        ([1, 2], "state"),
    ],
)
def test_state_errors_name_the_key_path(state: object, path: str) -> None:
    with pytest.raises(pw.StateError) as info:
        check_state(state)
    assert info.value.path == path
    assert path in str(info.value)


def test_serializable_state_passes() -> None:
    state = {"s": "x", "b": b"y", "i": 1, "f": 1.5, "n": None, "l": [1, (2, 3)], "d": {"k": True}}
    assert check_state(state) is state


async def test_store_keeps_active_jobs_and_retains_finished_ones_by_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    store = pw.MemoryJobStore(retain_seconds=60, retain_count=10)
    active, finished = make_job(), make_job()
    await store.create(active)
    await store.create(finished)
    finished.transition(Status.RUNNING)
    finished.transition(Status.DONE)
    await store.update(finished)
    assert finished.retain_until == pytest.approx(trio.current_time() + 60)
    assert {j.id for j in await store.list(Status.DONE)} == {finished.id}
    assert {j.id for j in await store.list(Status.QUEUED)} == {active.id}
    await trio.sleep(59)
    assert (await store.get(finished.id)) is finished
    await trio.sleep(2)
    with pytest.raises(pw.JobGone, match="dropped after its retention"):
        await store.get(finished.id)
    await trio.sleep(10_000)
    assert (await store.get(active.id)) is active  # active jobs are never evicted
    with pytest.raises(pw.JobNotFound, match="no job with id"):
        await store.get("unknown")


async def test_a_finished_record_keeps_an_empty_cursor() -> None:
    # A job that ran to the end of its chain has nothing left of its cursor.
    store = pw.MemoryJobStore()
    engine = pw.Engine(store=store)

    @engine.pipe
    async def one(ctx: pw.Context) -> None:
        ctx.state["n"] = 1

    engine.chain("c", one)
    async with engine:
        job_id = await engine.submit("c")
        assert await engine.wait(job_id) == {"n": 1}
    record = store.get_nowait(job_id)
    assert record.frames == []
    assert record.to_wire()["frames"] == []


def test_the_wire_form_holds_the_stored_record_only() -> None:
    """What only the running process knows (its cancel flag, its exception object) is
    not part of the record a store keeps; a map written before that still reads."""
    job = make_job()
    job.cancel_requested = True
    job.exception = RuntimeError("x")
    wire = job.to_wire()
    assert "cancel_requested" not in wire
    assert "exception" not in wire
    assert set(wire) == {f.name for f in dataclasses.fields(JobRecord)}
    back = Job.from_wire(msgpack.unpackb(msgpack.packb({**wire, "cancel_requested": True})))
    assert (back.cancel_requested, back.exception) == (False, None)
    assert back.to_wire() == wire


async def test_store_retains_finished_jobs_by_count() -> None:
    store = pw.MemoryJobStore(retain_seconds=3600, retain_count=3)
    jobs = [make_job() for _ in range(5)]
    for job in jobs:
        await store.create(job)
        job.transition(Status.CANCELLED)
        await store.update(job)
    for job in jobs[:2]:
        with pytest.raises(pw.JobGone):
            await store.get(job.id)
    for job in jobs[2:]:
        assert await store.get(job.id) is job
    assert store.counts()[Status.CANCELLED] == 3


async def test_store_delete_and_duplicate_create() -> None:
    store = pw.MemoryJobStore()
    job = make_job()
    await store.create(job)
    with pytest.raises(ValueError, match="already exists"):
        await store.create(job)
    await store.delete(job.id)
    with pytest.raises(pw.JobNotFound):
        await store.get(job.id)


async def _known(engine: pw.Engine, ids: list[str]) -> list[str]:
    """What the store says of each id: kept, gone (remembered) or unknown."""
    said = []
    for job_id in ids:
        try:
            await engine.status(job_id)
        except pw.JobGone:
            said.append("gone")
        except pw.JobNotFound:
            said.append("unknown")
        else:
            said.append("kept")
    return said


async def test_dropped_ids_are_remembered_by_count_and_by_time(
    autojump_clock: trio.abc.Clock, each_store: type[Any]
) -> None:
    """``retain_count`` finished records are kept; of the dropped ids, the newest
    ``remember_gone_count`` are remembered (gone, 410 for the owner), each until
    ``remember_gone_seconds`` after its retention ended; an id forgotten is unknown (404)
    as one that never existed. The same on every store (each_store)."""
    store = each_store(
        retain_seconds=60, retain_count=2, remember_gone_count=3, remember_gone_seconds=600
    )
    engine = pw.Engine(store=store)

    @engine.pipe
    async def one(ctx: pw.Context) -> None:
        ctx.state["n"] = 1

    engine.chain("c", one)
    async with engine:
        ids = []
        for n in range(8):
            await trio.sleep(n - trio.current_time())
            ids.append(await engine.submit("c"))
            await engine.wait(ids[-1])
        # 8 finished: the last 2 kept, the 3 dropped before them remembered, 3 forgotten.
        assert await _known(engine, ids) == ["unknown"] * 3 + ["gone"] * 3 + ["kept"] * 2
        await trio.sleep(60)  # the kept ones' retention ends: dropped, and remembered
        assert await _known(engine, ids) == ["unknown"] * 5 + ["gone"] * 3
        # Jobs ended at 0, 1, ... 7 s: the one that ended at 5 s is forgotten at 665 s.
        await trio.sleep(665.5 - trio.current_time())
        assert await _known(engine, ids) == ["unknown"] * 6 + ["gone"] * 2
        await trio.sleep(2)
        assert await _known(engine, ids) == ["unknown"] * 8


async def test_a_deleted_job_is_unknown_not_gone(each_store: type[Any]) -> None:
    engine = pw.Engine(store=each_store(retain_count=1))

    @engine.pipe
    async def one(ctx: pw.Context) -> None:
        ctx.state["n"] = 1

    engine.chain("c", one)
    async with engine:
        first = await engine.submit("c")
        await engine.wait(first)
        second = await engine.submit("c")
        await engine.wait(second)
        await engine.store.delete(second)
        assert await _known(engine, [first, second]) == ["gone", "unknown"]


async def test_queue_refuses_new_work_at_capacity_but_takes_internal_events() -> None:
    queue = pw.MemoryEventQueue(capacity=2, retry_after=3)
    queue.submit_nowait(RunJob("a"))
    queue.submit_nowait(RunJob("b"))
    with pytest.raises(pw.Overloaded) as info:
        queue.submit_nowait(RunJob("c"))
    assert info.value.retry_after == 3
    queue.put_nowait(RunJob("a"))  # about an accepted job: never refused
    assert queue.statistics() == pw.QueueStatistics(depth=3, capacity=2, accepted=3, refused=1)
    first = await queue.get()
    assert first == RunJob("a")
    queue.ack(first)
    queue.ack(await queue.get())
    queue.submit_nowait(RunJob("d"))
    assert queue.statistics().depth == 2


def test_state_diagram_matches_the_transition_table() -> None:
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs/diagrams/job-states.md").read_text()
    drawn = set()
    for line in text.splitlines():
        parts = line.strip().split(":")[0].split(" --> ")
        if len(parts) == 2 and "[*]" not in parts:
            drawn.add((Status(parts[0].strip()), Status(parts[1].strip())))
    table = {(a, b) for a, targets in TRANSITIONS.items() for b in targets}
    assert drawn == table


async def test_the_copying_store_hands_out_a_fresh_copy_on_every_read() -> None:
    store = CopyingJobStore()
    job = Job(id="j1", chain="c", state={"a": [1, 2]}, correlation_id="x")
    await store.create(job)
    first, second = await store.get("j1"), await store.get("j1")
    assert first is not second
    assert first is not job
    first.state["a"].append(3)  # a write to a copy is not a write to the store...
    assert (await store.get("j1")).state == {"a": [1, 2]}
    await store.update(first)  # ...until it is written back
    assert (await store.get("j1")).state == {"a": [1, 2, 3]}
    assert first.version == 1


def test_a_record_has_no_output_list_until_it_has_output() -> None:
    # A new record shares one empty tuple (no list per job); it stores as an empty list.
    job = make_job()
    assert job.output == ()
    assert job.to_wire()["output"] == []
    back = Job.from_wire(msgpack.unpackb(msgpack.packb(job.to_wire())))
    assert back.output == []
