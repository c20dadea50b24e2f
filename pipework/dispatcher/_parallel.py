"""Parallel stages in the dispatcher: fork branches as child jobs, join on their events.

At a parallel stage the parent's step ends and its slot is released: the parent stays
``running`` holding nothing, with a ``join`` record (the join state machine's wire form, the
branches' child-job ids, the ok branches' deltas). Each branch is a child job on a snapshot of
the parent's state, admitted under its own keys like any job, and able to suspend. When a
child ends, a ``BranchDone`` event (with its delta) drives the join; once it resolves, the
deltas are merged in declaration order and the parent continues at the next cursor through
the queue. A late or duplicate ``BranchDone`` finds the join gone or already resolved and
changes nothing.
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
from ..pipes._join import Join, Outcome
from ..pipes._merge import Delta, delta, merge, snapshot
from ..pipes._stages import BranchEnd, Callback, Chain, Parallel
from ._events import BranchDone, RunJob
from ._job import Job, new_job_id
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
    job.join = {
        "id": new_job_id(),
        "path": [*d.path_of(job), top.index],
        "join": join,  # the live state machine; Job.to_wire() stores its wire form
        "deadline": deadline,
        "children": {},
        "deltas": {},
        "errors": {},
    }
    for index in decision.start:
        await _start_branch(d, job, chain, index)
    await d.store.update(job)


def _frontier(stage: Parallel, nodes: set[int]) -> list[int]:
    """The nodes of ``nodes`` none of whose descendants is in ``nodes``, in declaration
    order. A graph node starts from its ancestors' results, so its delta (taken against
    the parent's state) already holds theirs: merging only the frontier counts each
    change once, also under reducers such as extend or sum."""
    covered: set[int] = set()
    for node in nodes:
        pending = list(stage.parents[node])
        while pending:
            ancestor = pending.pop()
            if ancestor not in covered:
                covered.add(ancestor)
                pending.extend(stage.parents[ancestor])
    return sorted(nodes - covered)


def _ancestors(stage: Parallel, index: int) -> set[int]:
    found: set[int] = set()
    pending = list(stage.parents[index])
    while pending:
        node = pending.pop()
        if node not in found:
            found.add(node)
            pending.extend(stage.parents[node])
    return found


def _start_state(parent: Job, stage: Parallel, index: int) -> dict[str, Any]:
    """What a branch starts from: a snapshot of the parent's state and, for a graph node,
    what the nodes it depends on (directly or not) produced, merged under the stage's
    policy, so that a node reads its parents' results."""
    state = snapshot(parent.state)
    if stage.kind != "graph" or not stage.parents[index]:
        return state
    assert parent.join is not None
    deltas = parent.join["deltas"]
    frontier = _frontier(stage, _ancestors(stage, index))
    pairs = [(stage.names[i], Delta.from_wire(deltas[str(i)])) for i in frontier]
    return merge(state, pairs, stage.merge, where=f"graph node {stage.names[index]!r}")


async def _start_branch(d: Dispatcher, parent: Job, chain: Chain, index: int) -> None:
    assert parent.join is not None
    stage = chain.node_at(parent.join["path"])
    assert isinstance(stage, Parallel)
    child = Job(
        id=new_job_id(),
        chain=parent.chain,
        state=_start_state(parent, stage, index),
        correlation_id=parent.correlation_id,
        deadline=parent.join["deadline"],
        root=(*parent.join["path"], index),
        parent=parent.id,
        branch=index,
        join_id=parent.join["id"],
        accepted_at=trio.current_time(),
        plan=parent.plan,
    )
    d.start_frames(child, chain)
    parent.join["children"][str(index)] = child.id
    await d.store.create(child)
    d.queue.put_nowait(RunJob(child.id))


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
        d.branch_errors[child.id] = child.exception
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
    await d.store.delete(child.id)


async def on_branch_done(d: Dispatcher, event: BranchDone) -> None:
    try:
        await _branch_done(d, event)
    finally:
        d.queue.ack(event)


async def _branch_done(d: Dispatcher, event: BranchDone) -> None:
    exception = d.branch_errors.pop(event.branch_id, None)
    try:
        parent = await d.store.get(event.parent_id)
    except JobNotFound:
        return  # the parent ended and was dropped: nothing waits for this branch
    chain = d.chain_of(parent)
    stage = chain.node_at(event.stage)
    assert isinstance(stage, Parallel)
    if stage.detach and stage.detach[event.index] and event.outcome in ("error", "timed_out"):
        d.metrics.detached_failures.labels(parent.chain).inc()
    join_record = parent.join
    if parent.status in TERMINAL or join_record is None or join_record["id"] != event.join_id:
        return  # the stage is over: a late branch changes nothing
    join: Join = join_record["join"]
    decision = join.branch_done(event.index, event.outcome)
    if event.outcome == "ok" and event.delta is not None:
        join_record["deltas"][str(event.index)] = event.delta
    if event.error is not None:
        join_record["errors"][str(event.index)] = list(event.error)
    if exception is not None:
        join_record.setdefault("exceptions", {})[str(event.index)] = exception
    where = chain.describe(event.stage)
    try:
        for index in decision.start:
            await _start_branch(d, parent, chain, index)
    except MergeConflict as conflict:  # two of a graph node's parents disagree
        d.note(conflict, parent, where)
        await d.finish(parent, Status.FAILED, exc=conflict, where=where)  # cancels the rest
        return
    for index in decision.cancel:
        await _cancel_branch(d, join_record["children"][str(index)])
    if decision.resolved is None:
        await d.store.update(parent)
    elif decision.resolved == "ok" or stage.settle:
        await _continue(d, parent, chain, stage, join, decision.merge, where)
    else:
        errors = [_error_of(join_record, i) for i in decision.failures]
        exc = _stage_error(stage, errors, where, parent)
        d.note(exc, parent, where)
        parent.join = None
        status = Status.EXPIRED if _is_job_deadline(exc) else Status.FAILED
        await d.finish(parent, status, exc=exc, where=where)


async def _continue(
    d: Dispatcher,
    parent: Job,
    chain: Chain,
    stage: Parallel,
    join: Join,
    merged: tuple[int, ...],
    where: str,
) -> None:
    assert parent.join is not None
    deltas = parent.join["deltas"]
    if stage.settle:  # merge whatever succeeded and say how each branch ended
        merged = tuple(i for i, o in enumerate(join.outcomes) if o == "ok" and not join.detached[i])
    if stage.kind == "graph":
        merged = tuple(_frontier(stage, set(merged)))
    pairs = [(stage.names[i], Delta.from_wire(deltas[str(i)])) for i in sorted(merged)]
    try:
        state = merge(parent.state, pairs, stage.merge, where=where)
    except MergeConflict as exc:
        d.note(exc, parent, where)
        parent.join = None
        await d.finish(parent, Status.FAILED, exc=exc, where=where)
        return
    if stage.settle:
        state["outcomes"] = {
            stage.names[i]: _describe_outcome(parent.join, i, o)
            for i, o in enumerate(join.outcomes)
        }
    parent.state = state
    parent.join = None
    parent.frames[-1].index += 1
    await d.continue_later(parent, chain)


def _describe_outcome(join_record: dict[str, Any], index: int, outcome: str) -> dict[str, Any]:
    info: dict[str, Any] = {"outcome": outcome}
    error = join_record["errors"].get(str(index))
    if error is not None and outcome not in ("ok", "not_started"):
        info["error"] = {"type": error[0], "message": error[1]}
    return info


async def _cancel_branch(d: Dispatcher, child_id: str) -> None:
    try:
        child = await d.store.get(child_id)
    except JobNotFound:
        return  # it ended and reported already
    if child.status not in TERMINAL:
        await d.cancel(child)


async def cancel_branches(d: Dispatcher, parent: Job) -> None:
    if parent.join is not None:
        for child_id in list(parent.join["children"].values()):
            await _cancel_branch(d, child_id)


def _error_of(join_record: dict[str, Any], index: int) -> BaseException:
    """The branch's own exception when it failed in this process, else its record."""
    exception = join_record.get("exceptions", {}).get(str(index))
    if exception is not None:
        return exception  # type: ignore[no-any-return]  # stored from a BaseException
    error = join_record["errors"].get(str(index))
    if error is None:
        return JobCancelled(f"branch {index} was cancelled")
    return JobFailed(error[1], error_type=error[0], where=error[2])


def _stage_error(
    stage: Parallel, errors: list[BaseException], where: str, parent: Job
) -> BaseException:
    errors = [_as_stage_timeout(e, where, parent) for e in errors]
    if stage.kind == "any_of" and len(errors) > 1:
        return ExceptionGroup(f"every branch of {where} failed", _exceptions(errors))
    if stage.kind == "quorum" and len(errors) > 1:
        return ExceptionGroup(
            f"{where} can no longer reach {stage.k} successes", _exceptions(errors)
        )
    return errors[0]


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
    except Exception:
        _log.exception("graph node %r callback failed (job %s)", end.node, end.job_id)
