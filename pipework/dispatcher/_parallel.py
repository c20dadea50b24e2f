"""Parallel stages in the dispatcher: fork branches as child jobs, join on their events.

This is the trio driver of the sans-IO :class:`~pipework.pipes._join.Join`: it creates child
jobs, queues events, cancels branches and finishes or continues the parent, and decides
nothing itself. Which branches start, which are cancelled, when the stage resolves, whose
deltas a graph node starts from and whose the parent merges: all of that the join says.

At a parallel stage the parent's step ends and its slot is released: the parent stays
``running`` holding nothing, with a :class:`~._job.JoinRecord` (the join, the branches'
child-job ids, the ok branches' deltas, the failed branches' errors), plain data a store may
copy on every read. Each branch is a child job on a snapshot of the parent's state (a graph
node's also holds what its ancestors produced), admitted under its own keys like any job, and
able to suspend. When a child ends, a ``BranchDone`` event (with its delta or error) drives
the join; once it resolves, the deltas it names are merged in declaration order and the
parent continues at the next cursor through the queue. A late or duplicate ``BranchDone``
finds the join gone or already resolved and changes nothing.

A branch's exception object cannot be stored, so it waits in ``Dispatcher.branch_errors``
(keyed by the child's id) until its join resolves or is over; when the join fails in the
process where the branch ended, the original exception surfaces, traceback intact, and
otherwise a :class:`~pipework.JobFailed` built from the recorded error does. A graph node's
``on_success`` / ``on_error`` callback runs when its child job ends, however it ends.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

import trio

from .._errors import (
    DeadlineExceeded,
    JobCancelled,
    JobFailed,
    JobNotFound,
    MergeConflict,
    Rejected,
)
from ..pipes._join import Outcome
from ..pipes._merge import Delta, delta, merge, snapshot
from ..pipes._stages import BranchEnd, Callback, Chain, Parallel
from ._boundary import split_outside
from ._cursor import path_of, start_frames
from ._events import BranchDone, RunJob
from ._job import ErrorInfo, Job, JoinRecord, new_job_id
from ._status import TERMINAL, Status

if TYPE_CHECKING:
    from ._dispatcher import Dispatcher

__all__ = ["branch_outcome", "fork", "on_branch_done"]

_log = logging.getLogger("pipework.dispatcher")


async def fork(d: Dispatcher, job: Job, chain: Chain, stage: Parallel) -> None:
    """Start the stage's first branches; the parent then waits holding no slot."""
    top = job.frames[-1]
    deadline = top.deadline
    if stage.timeout is not None:
        deadline = min(deadline, trio.current_time() + stage.timeout)
    join = stage.new_join()
    decision = join.start()
    job.join = JoinRecord(
        id=new_job_id(), path=(*path_of(job), top.index), join=join, deadline=deadline
    )
    # The branches run only once the join is in the parent's record: on a shared store a
    # branch could otherwise end, and report to a join not written yet, while the others
    # are being created.
    started = [await _start_branch(d, job, chain, index, run=False) for index in decision.start]
    await d.store.update(job)
    for child_id in started:
        d.queue.put_nowait(RunJob(child_id))


async def _start_branch(
    d: Dispatcher, parent: Job, chain: Chain, index: int, *, run: bool = True
) -> str:
    """Create the branch's child job; ``run``: put its first event (else the caller does)."""
    record = parent.join
    assert record is not None
    stage = chain.node_at(record.path)
    assert isinstance(stage, Parallel)
    child = Job(
        id=new_job_id(),
        chain=parent.chain,
        state=_start_state(parent.state, record, stage, index),
        correlation_id=parent.correlation_id,
        traceparent=parent.traceparent,
        deadline=record.deadline,
        root=(*record.path, index),
        parent=parent.id,
        branch=index,
        join_id=record.id,
        accepted_at=trio.current_time(),
        plan=parent.plan,
        admitted=parent.admitted,
    )
    start_frames(child, chain, trio.current_time())
    record.children[index] = child.id
    await d.store.create(child)
    if run:
        d.queue.put_nowait(RunJob(child.id))
    return child.id


def _start_state(
    state: dict[str, Any], record: JoinRecord, stage: Parallel, index: int
) -> dict[str, Any]:
    """A snapshot of the parent's state and, for a graph node, what the nodes it depends on
    produced (the join says whose deltas), merged under the stage's policy."""
    sources = record.join.start_from(index)
    if not sources:
        return snapshot(state)
    pairs = [(stage.names[i], record.deltas[i]) for i in sources]
    return merge(snapshot(state), pairs, stage.merge, where=f"graph node {stage.names[index]!r}")


def branch_outcome(job: Job) -> Outcome:
    if job.status is Status.DONE:
        return "ok"
    if job.status is Status.CANCELLED:
        return "cancelled"
    exc = job.exception
    if job.status is Status.EXPIRED or isinstance(exc, DeadlineExceeded):
        return "timed_out"
    if isinstance(exc, Rejected) and exc.reason == "deadline":
        return "timed_out"
    return "error"


async def report_branch(d: Dispatcher, child: Job) -> None:
    """Called when a child job ends: send its outcome and delta (or error) to the parent's
    join, then drop the child's record: it is internal, and the event carries what the
    join needs (the exception object itself stays in this process until the join uses it)."""
    assert child.parent is not None
    assert child.branch is not None
    outcome = branch_outcome(child)
    change = None
    if outcome == "ok":
        parent = await d.store.get(child.parent)
        change = delta(parent.state, child.state).to_wire()
    error = None
    if child.error is not None:
        e = child.error
        error = (e.type, e.message, e.where, e.status)
    if child.exception is not None:
        d.flight.branch_errors[child.id] = child.exception
    _callback(d, child, outcome)
    d.queue.put_nowait(
        BranchDone(
            child.parent,
            child.id,
            child.branch,
            outcome,
            change,
            join_id=child.join_id or "",
            stage=child.root[:-1],
            error=error,
        )
    )
    # A shared queue: the report is in Redis before the record goes, so a process dying in
    # between leaves a branch to rerun (its event is still pending), never a lost one.
    await d.abilities.flush()
    await d.store.delete(child.id)


async def on_branch_done(d: Dispatcher, event: BranchDone) -> None:
    try:
        # A shared store holds the parent's record while its join changes: two branches
        # ending at once in two processes must not both read it and one lose its update.
        async with d.abilities.lock(event.parent_id):
            await _branch_done(d, event)
    finally:
        d.queue.ack(event)


async def _branch_done(d: Dispatcher, event: BranchDone) -> None:
    try:
        parent = await d.store.get(event.parent_id)
    except JobNotFound:
        d.flight.branch_errors.pop(event.branch_id, None)
        return  # the parent ended and was dropped: nothing waits for this branch
    chain = d.chain_of(parent)
    stage = chain.node_at(event.stage)
    assert isinstance(stage, Parallel)
    if stage.detach and stage.detach[event.index] and event.outcome in ("error", "timed_out"):
        d.metrics.detached_failures.labels(parent.chain).inc()
    record = parent.join
    if parent.status in TERMINAL or record is None or record.id != event.join_id:
        d.flight.branch_errors.pop(event.branch_id, None)
        if parent.status is Status.QUEUED and d.reclaimed(event):
            # The process that took this end in died after it sent the parent on (the
            # record says queued), perhaps before the parent's event reached the shared
            # queue: send it again. A duplicate finds the parent no longer queued.
            d.queue.put_nowait(RunJob(parent.id))
        return  # the stage is over: a late branch changes nothing
    join = record.join
    decision = join.branch_done(event.index, event.outcome)
    if event.outcome == "ok" and event.delta is not None:
        record.deltas[event.index] = Delta.from_wire(event.delta)
    if event.error is not None:
        record.errors[event.index] = ErrorInfo(*event.error)
    where = chain.describe(event.stage)
    try:
        for index in decision.start:
            await _start_branch(d, parent, chain, index)
    except MergeConflict as conflict:  # two of a graph node's parents disagree
        d.note(conflict, parent, where)
        await d.finish(parent, Status.FAILED, exc=conflict, where=where)  # cancels the rest
        return
    for index in decision.cancel:
        await _cancel_branch(d, record.children[index])
    if decision.resolved is None:
        await d.store.update(parent)
    elif join.continues:
        _forget_errors(d, record)
        await _continue(d, parent, chain, stage, record, where)
    else:
        errors = [_error_of(d, record, i) for i in decision.failures]
        _forget_errors(d, record)
        exc = _stage_error(stage, errors, where, parent)
        d.note(exc, parent, where)
        parent.join = None
        status = Status.EXPIRED if _is_job_deadline(exc) else Status.FAILED
        await d.finish(parent, status, exc=exc, where=where)


async def _continue(
    d: Dispatcher, parent: Job, chain: Chain, stage: Parallel, record: JoinRecord, where: str
) -> None:
    """Merge what the join says into the parent's state and send the parent on."""
    pairs = [(stage.names[i], record.deltas[i]) for i in record.join.to_merge]
    try:
        state = merge(parent.state, pairs, stage.merge, where=where)
    except MergeConflict as exc:
        d.note(exc, parent, where)
        parent.join = None
        await d.finish(parent, Status.FAILED, exc=exc, where=where)
        return
    if stage.settle:
        state["outcomes"] = record.settled_outcomes(stage.names)
    parent.state = state
    parent.join = None
    parent.frames[-1].index += 1
    await d.continue_later(parent, chain)


async def _cancel_branch(d: Dispatcher, child_id: str) -> None:
    running = d.flight.running.get(child_id)
    if running is not None and running.parent is not None:  # a branch running in a step
        await d.cancel(running)
        return
    try:
        child = await d.store.get(child_id)
    except JobNotFound:
        return  # it ended and reported already
    if child.status not in TERMINAL:
        await d.cancel(child)


async def cancel_branches(d: Dispatcher, parent: Job) -> None:
    """The parent ended while waiting at its join: cancel every branch still going."""
    if parent.join is not None:
        _forget_errors(d, parent.join)
        for child_id in list(parent.join.children.values()):
            await _cancel_branch(d, child_id)


def _error_of(d: Dispatcher, record: JoinRecord, index: int) -> BaseException:
    """The branch's own exception when it ended in this process (traceback intact), else
    what its record says."""
    child_id = record.children.get(index)
    exception = None if child_id is None else d.flight.branch_errors.get(child_id)
    return _error_of_exception(exception, record, index)


def _error_of_exception(
    exception: BaseException | None, record: JoinRecord, index: int
) -> BaseException:
    if exception is not None:
        return exception
    error = record.errors.get(index)
    if error is None:
        return JobCancelled(f"branch {index} was cancelled")
    return JobFailed(error.message, error_type=error.type, where=error.where)


def _forget_errors(d: Dispatcher, record: JoinRecord) -> None:
    """Drop the exception objects of the join's branches once it no longer needs them; a
    branch that reports later finds the join over and drops its own."""
    for child_id in record.children.values():
        d.flight.branch_errors.pop(child_id, None)


def _stage_error(
    stage: Parallel, errors: list[BaseException], where: str, parent: Job
) -> BaseException:
    errors = [_as_stage_timeout(e, where, parent) for e in errors]
    # The stage's own time ran out (its timeout, or the job's deadline): that is why it
    # failed, whatever else its branches met before (docs/stages.md). The job's deadline
    # first: it makes the job expired.
    ran_out = [e for e in errors if isinstance(e, DeadlineExceeded) and e.scope in _OWN_TIME]
    if ran_out:
        return min(ran_out, key=lambda e: _OWN_TIME.index(e.scope))
    if stage.kind == "any_of" and len(errors) > 1:
        return ExceptionGroup(f"every branch of {where} failed", _exceptions(errors))
    if stage.kind == "quorum" and len(errors) > 1:
        return ExceptionGroup(
            f"{where} can no longer reach {stage.k} successes", _exceptions(errors)
        )
    return errors[0]


#: The limits that are the stage's own time, the job's first.
_OWN_TIME = ("job", "stage")


def _exceptions(errors: list[BaseException]) -> list[Exception]:
    return [e if isinstance(e, Exception) else RuntimeError(repr(e)) for e in errors]


def _as_stage_timeout(exc: BaseException, where: str, parent: Job) -> BaseException:
    """A branch that hit its own deadline hit the stage's (or the parent job's) limit."""
    if not (isinstance(exc, DeadlineExceeded) and exc.scope == "job"):
        return exc
    if exc.deadline >= parent.deadline:
        return DeadlineExceeded(
            f"job {parent.id} passed its deadline in {where}",
            scope="job",
            where=where,
            deadline=exc.deadline,
        )
    return DeadlineExceeded(
        f"the stage timeout of {where} ran out", scope="stage", where=where, deadline=exc.deadline
    )


def _is_job_deadline(exc: BaseException) -> bool:
    return isinstance(exc, DeadlineExceeded) and exc.scope == "job"


def _callback(d: Dispatcher, child: Job, outcome: Outcome) -> None:
    """A graph node's callback: ``on_success`` when it ended ok, ``on_error`` when it ended
    with an error, timed out or was cancelled (``BranchEnd.outcome`` says which). Called from
    the child's end, which happens exactly once and whatever became of the parent, so every
    started node gets exactly one call; a node never started gets none. Run in its own task
    so a slow callback never holds up the dispatcher."""
    assert child.branch is not None
    stage = d.chain_of(child).node_at(child.root[:-1])
    if not isinstance(stage, Parallel) or stage.kind != "graph":
        return
    callbacks = stage.on_success if outcome == "ok" else stage.on_error
    callback = callbacks[child.branch]
    if callback is not None:
        assert child.parent is not None
        error = None if outcome == "ok" else child.exception
        end = BranchEnd(child.parent, stage.names[child.branch], outcome, error)
        d.spawn(_run_callback, callback, end)


async def _run_callback(callback: Callback, end: BranchEnd) -> None:
    try:
        result = callback(end)
        if inspect.isawaitable(result):
            await result
    except BaseException as exc:  # user code in the dispatcher's nursery: a boundary
        outside, errors = split_outside(exc)
        if errors is not None:
            _log.error(
                "graph node %r callback failed (job %s)", end.node, end.job_id, exc_info=errors
            )
        if outside is not None:
            raise outside from None
