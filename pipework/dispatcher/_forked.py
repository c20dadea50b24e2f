"""Parallel stages forked as child jobs: branches are jobs of their own, the join is driven
by their end events. A driver of :mod:`._stage`, which decides; this module acts.

At a parallel stage the parent's step ends and its slot is released: the parent stays
``running`` holding nothing, with a :class:`~._job.JoinRecord` (the join, the branches'
child-job ids, the ok branches' deltas, the failed branches' errors), plain data a store may
copy on every read. Each branch is a child job on a snapshot of the parent's state,
admitted under its own keys like any job, and able to suspend. When a child ends, a
``BranchDone`` event (with its delta or error) drives the join; once it resolves, the parent
goes on at its next cursor through the queue, or ends. A late or duplicate ``BranchDone``
finds the join gone or already resolved and changes nothing.

A branch's exception object cannot be stored, so it waits in ``Flight.branch_errors``
(keyed by the child's id) until its join resolves or is over; when the join fails in the
process where the branch ended, the original exception surfaces, traceback intact, and
otherwise a :class:`~pipework.JobFailed` built from the recorded error does.
"""

from __future__ import annotations

import inspect
import logging

import trio

from .._errors import JobNotFound, MergeConflict
from .._metrics import Metrics
from ..pipes._merge import Delta, snapshot
from ..pipes._stages import BranchEnd, Callback, Chain, Parallel
from ._abilities import Abilities
from ._boundary import split_outside
from ._cursor import next_key, path_of, start_frames
from ._degrade import Degrader
from ._ends import Ends
from ._events import BranchDone, RunJob
from ._flight import Flight, Hooks
from ._job import ErrorInfo, Job, JoinRecord, new_job_id
from ._lookup import ChainLookup
from ._outcomes import note
from ._stage import Continue, StageRun, branch_outcome, error_of, graph_callback, told_of
from ._status import TERMINAL, Status

__all__ = ["Forked", "run_callback"]

_log = logging.getLogger("pipework.dispatcher")


class Forked:
    def __init__(
        self,
        abilities: Abilities,
        flight: Flight,
        hooks: Hooks,
        ends: Ends,
        metrics: Metrics,
        plans: dict[int, ChainLookup],
    ) -> None:
        self._abilities = abilities
        #: Degrades the branches a job can do without (wired in with the dispatcher).
        self.degrader: Degrader | None = None
        self._store = abilities.store
        self._queue = abilities.queue
        self._flight = flight
        self._hooks = hooks
        self._ends = ends
        self._metrics = metrics
        self._plans = plans

    def _chain_of(self, job: Job) -> Chain:
        return self._plans[job.plan].get_chain(job.chain)

    async def fork(self, job: Job, chain: Chain, stage: Parallel) -> None:
        """Start the stage's first branches; the parent then waits holding no slot."""
        top = job.frames[-1]
        deadline = top.deadline
        if stage.timeout is not None:
            deadline = min(deadline, trio.current_time() + stage.timeout)
        record = JoinRecord(
            id=new_job_id(),
            path=(*path_of(job), top.index),
            join=stage.new_join(),
            deadline=deadline,
        )
        job.join = record
        run = StageRun(stage, chain, record)
        # The branches run only once the join is in the parent's record: on a shared store a
        # branch could otherwise end, and report to a join not written yet, while the others
        # are being created.
        first = run.start().start
        started = [await self._start(job, run, index, go=False) for index in first]
        await self._store.update(job)
        for index, child in zip(first, started, strict=True):
            if isinstance(child, Delta):
                self._degraded(job.id, record, index, child)
            else:
                self._queue.put_nowait(RunJob(child))

    def _degraded(self, parent_id: str, record: JoinRecord, index: int, change: Delta) -> None:
        """Branch ``index`` was degraded before it started: its stage hears that it ended ok,
        with ``change`` (its fallback and its mark), as it hears any branch's end."""
        self._queue.put_nowait(
            BranchDone(
                parent_id,
                record.children[index],
                index,
                "ok",
                change.to_wire(),
                join_id=record.id,
                stage=record.path,
                error=None,
            )
        )

    async def _start(
        self, parent: Job, run: StageRun, index: int, *, go: bool = True
    ) -> str | Delta:
        """Create the branch's child job; ``go``: put its first event (else the caller does).
        A branch degraded before it starts gets no job: what it hands its stage instead is
        returned (the caller reports it once the join is written)."""
        record = run.record
        stage = run.stage
        if stage.branches[index].degradable:
            degrader = self.degrader
            assert degrader is not None, "the degrader is wired in with the dispatcher"
            reason = degrader.branch_before(
                run.chain, stage, index, record.deadline, trio.current_time(), parent.pool_key
            )
            if reason is not None:
                record.children[index] = f"{record.id}.{index}"  # no job: nothing to cancel
                start = run.start_state(index, snapshot(parent.state))
                return degrader.branch_instead(parent, run.chain, stage, index, reason, start)
        child = Job(
            id=new_job_id(),
            chain=parent.chain,
            state=run.start_state(index, snapshot(parent.state)),
            correlation_id=parent.correlation_id,
            traceparent=parent.traceparent,
            tracestate=parent.tracestate,
            baggage=parent.baggage,
            pool_key=parent.pool_key,
            deadline=record.deadline,
            root=(*record.path, index),
            parent=parent.id,
            branch=index,
            join_id=record.id,
            accepted_at=trio.current_time(),
            plan=parent.plan,
            admitted=parent.admitted,
        )
        start_frames(child, run.chain, self._flight.clock())
        if self.degrader is not None and stage.branches[index].degradable:
            self.degrader.branch_started(child.id, child.accepted_at)
        record.children[index] = child.id
        await self._store.create(child)
        if go:
            self._queue.put_nowait(RunJob(child.id))
        return child.id

    # -- a branch ended -------------------------------------------------------------------

    async def report(self, branch: Job) -> None:
        """A child job ended: send its outcome and delta (or error) to the parent's join,
        then drop its record: it is internal, and the event carries what the join needs
        (the exception object itself stays in this process until the join uses it)."""
        assert branch.parent is not None
        assert branch.branch is not None
        record_path = branch.root[:-1]
        outcome = branch_outcome(branch)
        chain = self._chain_of(branch)
        stage = chain.node_at(record_path)
        assert isinstance(stage, Parallel)
        reason = None
        if stage.branches[branch.branch].degradable:
            assert self.degrader is not None, "the degrader is wired in with the dispatcher"
            now = trio.current_time()
            started = self.degrader.branch_starts.pop(branch.id, None)
            reason = self.degrader.branch_ended(chain, stage, branch.branch, branch, started, now)
        parent_state = {}
        if outcome == "ok" or reason is not None:  # its delta is against the parent's state
            parent = await self._store.get(branch.parent)
            parent_state = parent.state
        change, error = told_of(branch, parent_state)
        if reason is not None:
            # Its job can do without it: what it wrote is dropped, its fallback answers.
            assert self.degrader is not None
            outcome, error = "ok", None
            record = parent.join
            start = parent_state
            if record is not None and record.id == branch.join_id:  # else it is heard late
                start = StageRun(stage, chain, record).start_state(
                    branch.branch, snapshot(parent_state)
                )
            change = self.degrader.branch_instead(
                parent, chain, stage, branch.branch, reason, start
            )
        elif branch.exception is not None:
            self._flight.branch_errors[branch.id] = branch.exception
        call = graph_callback(stage, branch.parent, branch.branch, outcome, branch.exception)
        if call is not None:
            self._flight.spawn(run_callback, *call)
        self._queue.put_nowait(
            BranchDone(
                branch.parent,
                branch.id,
                branch.branch,
                outcome,
                None if change is None else change.to_wire(),
                join_id=branch.join_id or "",
                stage=record_path,
                error=None if error is None else error.to_wire(),
            )
        )
        # A shared queue: the report is there before the record goes, so a process dying in
        # between leaves a branch to rerun (its event is still pending), never a lost one.
        await self._abilities.flush()
        await self._store.delete(branch.id)

    async def branch_done(self, event: BranchDone) -> None:
        """The join hears a branch's end (the ``BranchDone`` handler)."""
        try:
            # A shared store holds the parent's record while its join changes: two branches
            # ending at once in two processes must not both read it and one lose its update.
            async with self._abilities.lock(event.parent_id):
                await self._branch_done(event)
        finally:
            self._queue.ack(event)

    async def _branch_done(self, event: BranchDone) -> None:
        branch_errors = self._flight.branch_errors
        try:
            parent = await self._store.get(event.parent_id)
        except JobNotFound:
            branch_errors.pop(event.branch_id, None)
            return  # the parent ended and was dropped: nothing waits for this branch
        chain = self._chain_of(parent)
        stage = chain.node_at(event.stage)
        assert isinstance(stage, Parallel)
        if stage.detach and stage.detach[event.index] and event.outcome in ("error", "timed_out"):
            self._metrics.detached_failures.labels(parent.chain).inc()
        record = parent.join
        if parent.status in TERMINAL or record is None or record.id != event.join_id:
            branch_errors.pop(event.branch_id, None)
            if parent.status is Status.QUEUED and self._abilities.reclaimed(event):
                # The process that took this end in died after it sent the parent on (the
                # record says queued), perhaps before the parent's event reached the shared
                # queue: send it again. A duplicate finds the parent no longer queued.
                self._queue.put_nowait(RunJob(parent.id))
            return  # the stage is over: a late branch changes nothing
        run = StageRun(stage, chain, record)
        change = None if event.delta is None else Delta.from_wire(event.delta)
        error = None if event.error is None else ErrorInfo(*event.error)
        decision = run.heard(event.index, event.outcome, change, error)
        degraded: list[tuple[int, Delta]] = []
        try:
            for index in decision.start:
                started = await self._start(parent, run, index)
                if isinstance(started, Delta):
                    degraded.append((index, started))
        except MergeConflict as conflict:  # two of a graph node's parents disagree
            note(conflict, parent, run.where)
            await self._ends.finish(parent, Status.FAILED, exc=conflict, where=run.where)
            return  # its end cancels the rest
        for index in decision.cancel:
            await self._cancel(record.children[index])
        if decision.resolved is None:
            await self._store.update(parent)
            for index, degraded_change in degraded:  # heard once the join is written
                self._degraded(parent.id, record, index, degraded_change)
            return
        resolution = run.resolution(parent, decision, lambda i: self._error(record, i))
        self._forget_errors(record)
        parent.join = None
        if isinstance(resolution, Continue):
            parent.state = resolution.state
            parent.frames[-1].index += 1
            await self._continue_later(parent, chain)
            return
        note(resolution.error, parent, run.where)
        await self._ends.finish(parent, resolution.status, exc=resolution.error, where=run.where)

    async def _continue_later(self, job: Job, chain: Chain) -> None:
        """Send the parent back through the queue to go on at its cursor."""
        job.key = next_key(job, chain)
        job.transition(Status.QUEUED)
        await self._store.update(job)
        self._hooks.changed(job)
        self._queue.put_nowait(RunJob(job.id))

    def _error(self, record: JoinRecord, index: int) -> BaseException:
        child_id = record.children.get(index)
        exception = None if child_id is None else self._flight.branch_errors.get(child_id)
        return error_of(exception, record, index)

    def _forget_errors(self, record: JoinRecord) -> None:
        """Drop the exception objects of the join's branches once it no longer needs them;
        a branch that reports later finds the join over and drops its own."""
        branch_errors = self._flight.branch_errors
        for child_id in record.children.values():
            branch_errors.pop(child_id, None)

    async def _cancel(self, child_id: str) -> None:
        running = self._flight.running.get(child_id)
        if running is not None and running.parent is not None:  # a branch running in a step
            await self._ends.cancel(running)
            return
        try:
            child = await self._store.get(child_id)
        except JobNotFound:
            return  # it ended and reported already
        if child.status not in TERMINAL:
            await self._ends.cancel(child)

    async def cancel_branches(self, parent: Job) -> None:
        """The parent ended while waiting at its join: cancel every branch still going."""
        if parent.join is not None:
            self._forget_errors(parent.join)
            for child_id in list(parent.join.children.values()):
                await self._cancel(child_id)


async def run_callback(callback: Callback, end: BranchEnd) -> None:
    """A graph node's callback, in a task of its own (a slow one never holds the dispatcher
    up): its failure is logged, not fatal."""
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
