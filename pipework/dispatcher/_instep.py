"""Parallel stages run inside the parent's step: branches as tasks, the join in memory. A
driver of :mod:`._stage`, which decides; this module acts.

The parent keeps its step (and its slot) while its branches run in tasks of the
dispatcher's nursery (branch runners, ``_branch_runners.py``), each on a snapshot of the
state as an in-memory branch record that is never stored. Only a stage whose branches all
run under the parent's slot runs here (their keys are the parent's, and it is not limited:
``Steps._shares_slot``). When the parent's key becomes limited while the stage runs (a
limit, an adaptive limit or a pause must count each branch), its branches' next pipes take
slots of their own or, when none is free, the parent's, lent to one branch at a time. Once
the join resolves, running branches are cancelled and the parent goes on in the same step
with the deltas merged: no event, no second pass through the queue.

**A branch that suspends must outlive the step.** It becomes a child job at once (its record
is created, suspended, exactly as a forked branch suspends), and the stage turns *durable*:
the join, with what it has recorded so far, is written to the parent as its
:class:`~._job.JoinRecord`, and from then on every branch end — of the in-step branches
still running too — reaches the join as a ``BranchDone`` event (``_forked.py``). The step
then only waits for its in-step branches to end, and the parent waits at its join holding
nothing, as it does for a forked stage.

Stages whose branches need slots of their own keys, that nest another parallel stage inside
a branch, or that have detached graph nodes (which the parent must not wait for), are forked
as child jobs (``_forked.py``).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Final, Protocol

import trio

from .._errors import MergeConflict, Rejected
from .._metrics import Metrics
from ..pipes._join import Decision
from ..pipes._merge import Delta, packed_state, unpacked_state
from ..pipes._pipe import Pipe
from ..pipes._stages import Chain, Parallel
from ._abilities import Abilities
from ._boundary import split_outside
from ._branch_runners import BranchRunners
from ._cursor import advance, chain_key, path_of, start_frames
from ._degrade import Degrader
from ._ends import Ends
from ._flight import Flight
from ._forked import Forked, run_callback
from ._job import Frame, Job, JoinRecord, new_ids
from ._outcomes import note
from ._pipe_run import PipeRunner
from ._stage import Continue, StageRun, branch_outcome, error_of, graph_callback, told_of
from ._status import TERMINAL, Status

__all__ = ["InStepStage", "StageParts"]


class Segments(Protocol):
    """How a branch whose pipes need slots of their own runs them (the steps' loop)."""

    async def run_held(self, job: Job, now: float) -> float:
        """Run the job's pipes while they share the slot held for its key."""
        ...

    def waited(self, key: str, seconds: float) -> None:
        """How long a step waited for its slot under ``key``."""
        ...


@dataclass(frozen=True, slots=True)
class StageParts:
    """What every in-step stage works with (made once, by the steps)."""

    abilities: Abilities
    flight: Flight
    ends: Ends
    runner: PipeRunner
    forked: Forked
    segments: Segments
    runners: BranchRunners
    metrics: Metrics
    degrader: Degrader


@lru_cache(maxsize=1024)
def _roots(path: tuple[int, ...], n: int) -> tuple[tuple[int, ...], ...]:
    """The root path of each branch of the stage at ``path``: the same tuples for every run
    of it (a stage's path is its place in its chain; chains are few)."""
    return tuple((*path, index) for index in range(n))


#: The types msgpack gives back as they were given: a state holding only these (keys all
#: ``str``) needs no packing to be copied.
_SCALARS: Final = frozenset({str, int, float, bool, bytes, type(None)})


def _packed_unless_scalar(state: dict[str, Any]) -> bytes:
    """``state`` packed for the branches to unpack, or ``b""`` (which no packing gives) when
    a shallow copy of it is a deep copy, exactly as an unpacking would make it."""
    scalars = _SCALARS
    for key, value in state.items():
        if type(value) not in scalars or type(key) is not str:
            return packed_state(state)
    return b""


class InStepStage:
    """One run of a parallel stage inside its parent's step (see the module docstring)."""

    def __init__(self, parts: StageParts, parent: Job, chain: Chain, stage: Parallel) -> None:
        self.parts = parts
        self.parent = parent
        self.stage = stage
        top = parent.frames[-1]
        deadline = top.deadline
        self.started = trio.current_time()  # the stage's timer, and its branches' start
        if stage.timeout is not None:
            deadline = min(deadline, self.started + stage.timeout)
        self.record = JoinRecord(
            # A job id's 128 random bits, from the batched read-ahead: no system call per stage.
            id=new_ids()[0],
            path=(*path_of(parent), top.index),
            join=stage.new_join(),
            deadline=deadline,
        )
        self.run_of = StageRun(stage, chain, self.record)
        self.branches: dict[int, Job] = {}  # the in-step branches still running, by index
        self.durable = False  # a branch suspended: the join now lives in the parent's record
        self.resolved: Decision | None = None
        self.conflict: MergeConflict | None = None
        # Set once the parent may go on: the join resolved (losers are cancelled, not waited
        # for: their late results are ignored), or it went durable and the branches that
        # run under this step's slot have ended. The step's task waits for it parked, not
        # on a trio.Event: one waiter needs no parking lot (objects the collector walks).
        self.settled = False
        self._waiter: trio.lowlevel.Task | None = None
        self._packed: bytes | None = None
        # A shared store gets the parent's record from several awaits of this stage: they
        # take turns (a later write never lands under an earlier one), and once the stage
        # turned durable nothing reaches the join before its record is written.
        self._writing: trio.Lock | None = None
        self._written: trio.Event | None = None
        self._lent: trio.Lock | None = None

    @property
    def over(self) -> bool:
        """Resolved in the step: a branch that ends now changes nothing."""
        return self.settled and not self.durable

    async def run(self) -> bool:
        """Run the stage; True when the parent goes on in this step (its state merged),
        False when the step ends here (the parent finished, or waits at a durable join)."""
        parts, flight = self.parts, self.parts.flight
        flight.in_step[self.record.id] = self
        try:
            self._apply(self.run_of.start())
            if parts.abilities.nowait is None:
                await self._record_progress()
            if not self.settled:
                self._waiter = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        except BaseException:
            # The step was cancelled (the job, or the engine stopping): so are its branches.
            for index in list(self.branches):
                self._cancel(index)
            if not self.durable:
                self._forget_errors()
            raise
        finally:
            # Losers still ending report through events from now on, and find it over.
            del flight.in_step[self.record.id]
            if not flight.in_step:  # no branch is started before another stage runs
                parts.runners.release()
        if self.durable:
            return False
        parent = self.parent
        parent.join = None
        where = self.run_of.where
        if self.conflict is not None:
            self._forget_errors()
            note(self.conflict, parent, where)
            await parts.ends.finish(parent, Status.FAILED, exc=self.conflict, where=where)
            return False
        assert self.resolved is not None
        resolution = self.run_of.resolution(parent, self.resolved, self._error)
        self._forget_errors()  # the resolution has taken the errors it needs
        if isinstance(resolution, Continue):
            parent.state = resolution.state
            parent.frames[-1].index += 1
            return True
        note(resolution.error, parent, where)
        await parts.ends.finish(parent, resolution.status, exc=resolution.error, where=where)
        return False

    def _error(self, index: int) -> BaseException:
        child_id = self.record.children.get(index)
        exception = None if child_id is None else self.parts.flight.branch_errors.get(child_id)
        return error_of(exception, self.record, index)

    def _forget_errors(self) -> None:
        branch_errors = self.parts.flight.branch_errors
        for child_id in self.record.children.values():
            branch_errors.pop(child_id, None)

    def _settle(self) -> None:
        if not self.settled:
            self.settled = True
            waiter, self._waiter = self._waiter, None
            if waiter is not None:
                trio.lowlevel.reschedule(waiter)

    def _abort_wait(self, _: Any) -> trio.lowlevel.Abort:
        self._waiter = None  # the step was cancelled while it waited
        return trio.lowlevel.Abort.SUCCEEDED

    # -- the join's decisions ------------------------------------------------------------

    def _apply(self, decision: Decision) -> None:
        if decision.resolved is not None:
            self.resolved = decision
        degraded: list[tuple[int, Delta]] = []
        for index in decision.start:
            if self.conflict is not None:
                break
            try:
                change = self._start(index)
            except MergeConflict as conflict:  # two of a graph node's parents disagree
                self.conflict = conflict
                break
            if change is not None:
                degraded.append((index, change))
        for index in decision.cancel:
            self._cancel(index)
        if self.conflict is not None or (decision.resolved is not None and not self.durable):
            for index in list(self.branches):
                self._cancel(index)
            self._settle()
        for index, change in degraded:
            # Degraded before it started: the join hears it ended ok with its fallback
            # (after this decision is acted on: a join hears one end at a time).
            if self.resolved is None and self.conflict is None:
                self._apply(self.run_of.heard(index, "ok", change, None))

    def _start(self, index: int) -> Delta | None:
        """Start branch ``index``; or, when it is degraded before it starts, what it hands
        the join instead (its fallback and its mark)."""
        parts, parent, record = self.parts, self.parent, self.record
        chain = self.run_of.chain
        if self.stage.branches[index].degradable:
            degrader = parts.degrader
            reason = degrader.branch_before(
                chain, self.stage, index, record.deadline, trio.current_time(), parent.pool_key
            )
            if reason is not None:
                start = self.run_of.start_state(index, self._snapshot())
                return degrader.branch_instead(parent, chain, self.stage, index, reason, start)
        root = self.stage.branches[index]
        flat = root.flat
        branch = Job(
            # Unguessable as the join's id is; a branch needs no random read of its own.
            id=f"{record.id}.{index}",
            chain=parent.chain,
            state=self.run_of.start_state(index, self._snapshot()),
            correlation_id=parent.correlation_id,
            traceparent=parent.traceparent,
            tracestate=parent.tracestate,
            baggage=parent.baggage,
            pool_key=parent.pool_key,
            deadline=record.deadline,
            root=_roots(record.path, len(self.stage.branches))[index],
            parent=parent.id,
            branch=index,
            join_id=record.id,
            accepted_at=self.started,
            plan=parent.plan,
            admitted=parent.admitted,
            created_at=parent.created_at,
            updated_at=parent.updated_at,
        )
        if flat is not None and root.timeout is None:
            # What start_frames finds for a branch of pipes only, without walking the chain.
            branch.key = flat[0].key or branch.pool_key or chain.key
            branch.frames = [Frame(0, branch.deadline)]
        else:
            start_frames(branch, chain, parts.flight.clock())
            flat = None
        record.children[index] = branch.id
        self.branches[index] = branch
        # In the dispatcher's nursery, not the step's: a loser that is slow to stop must not
        # hold the parent up (its late result is ignored, as a forked branch's is). On a
        # parked runner when there is one: no task spawned and no scope entered.
        nursery = parts.flight.nursery
        assert nursery is not None, "the dispatcher is not running"
        parts.runners.start(nursery, self, branch, flat)
        return None

    def _snapshot(self) -> dict[str, Any]:
        """A copy of the parent's state for a branch (packed once for all the branches; each
        unpacks its own copy). A state of scalars only (checked storable when it was
        written) is copied as it is: its values cannot be changed in place, so a shallow
        copy is a deep one."""
        packed = self._packed
        if packed is None:
            packed = self._packed = _packed_unless_scalar(self.parent.state)
        return unpacked_state(packed) if packed else dict(self.parent.state)

    def _cancel(self, index: int) -> None:
        branch = self.branches.get(index)
        if branch is None:
            return
        branch.cancel_requested = True
        scope = self.parts.flight.scopes.get(branch.id)
        if scope is not None:
            scope.cancel()

    async def _record_progress(self) -> None:
        """A store without a synchronous path (a shared one) gets the join's progress at
        every branch end, as for a forked stage, so readers in other processes see it; the
        process's own memory store needs no copy of what the step holds."""
        if self.parts.abilities.nowait is None and not self.settled:
            if self._writing is None:
                self._writing = trio.Lock()
            async with self._writing:
                if self.durable:  # the join's record is the event handlers' now
                    return
                self.parent.join = self.record
                await self.parts.abilities.store.update(self.parent)

    async def report(self, branch: Job) -> None:
        """An in-step branch ended (called from its finish): tell the join."""
        self._told(branch)
        if self.parts.abilities.nowait is None:
            await self._record_progress()

    def _told(self, branch: Job) -> None:
        """The join hears of a branch's end (what :meth:`report` does with no store)."""
        assert branch.branch is not None
        index = branch.branch
        self.branches.pop(index, None)
        outcome = branch_outcome(branch)
        change, error = told_of(branch, self.parent.state)
        stage, chain = self.stage, self.run_of.chain
        degrader = self.parts.degrader
        reason = (
            degrader.branch_ended(
                chain, stage, index, branch, branch.accepted_at, trio.current_time()
            )
            if stage.branches[index].degradable
            else None
        )
        if reason is not None:
            # Its job can do without it: what it wrote is dropped, its fallback answers.
            outcome, error = "ok", None
            start = self.run_of.start_state(index, self._snapshot())
            change = degrader.branch_instead(self.parent, chain, stage, index, reason, start)
        elif branch.exception is not None:  # in the process-local side table, as any branch's
            self.parts.flight.branch_errors[branch.id] = branch.exception
        call = graph_callback(self.stage, self.parent.id, index, outcome, branch.exception)
        if call is not None:
            self.parts.flight.spawn(run_callback, *call)
        self._apply(self.run_of.heard(index, outcome, change, error))

    # -- a branch ------------------------------------------------------------------------

    async def run_branch(
        self, scope: trio.CancelScope, branch: Job, flat: tuple[Pipe, ...] | None
    ) -> None:
        """One branch, as a step does one job, in ``scope`` (its runner's: see
        ``_branch_runners.py``): whatever it raises ends here as its outcome; a cancellation
        (of the scope, which its runner ends, or from outside the stage) travels on.
        ``flat``: the branch's pipes, when it is a sequence of pipes only (no stage, no
        timeout of its own)."""
        parts = self.parts
        flight, abilities = parts.flight, parts.abilities
        flight.scopes[branch.id] = scope
        flight.running[branch.id] = branch
        flight.unstored.add(branch.id)
        escaped: BaseException | None = None
        try:
            key = branch.key
            if flat is None or key != self.parent.key or abilities.limited(key):
                await self._run_segments(branch)
            else:
                # The common branch: its pipes one after another under the parent's slot.
                branch.transition(Status.RUNNING)
                chain = self.run_of.chain
                runner = parts.runner
                top = branch.frames[0]
                now: float | None = flight.clock()
                while now is not None and top.index < len(flat):
                    if top.index and abilities.limited(key):
                        # The key was limited while the stage ran: it still counts, so the
                        # branch's next pipes take slots of their own (_run_segments).
                        branch.transition(Status.QUEUED)
                        await self._run_segments(branch)
                        now = None
                        break
                    now = await runner.run(branch, chain, flat[top.index], now, top)
                if now is not None:
                    branch.frames.pop()
                    if not self._done_nowait(branch, now):
                        await parts.ends.finish(branch, Status.DONE, now=now)
        except BaseException as exc:
            escaped = exc
        finally:
            flight.scopes.pop(branch.id, None)
            flight.running.pop(branch.id, None)
        try:
            if branch.status not in TERMINAL and branch.status is not Status.SUSPENDED:
                with trio.CancelScope(shield=True):
                    await parts.ends.unsettled(branch, scope, escaped)
        finally:
            flight.unstored.discard(branch.id)
        if escaped is not None:
            outside, _ = split_outside(escaped)
            if outside is not None:
                raise outside

    def _done_nowait(self, branch: Job, now: float) -> bool:
        """``finish(branch, DONE)`` with no await when nothing in it waits: the stage is
        still in the step and not durable, on a store that answers at once (a branch's end
        writes nothing then). False, with nothing done, otherwise."""
        flight, ends = self.parts.flight, self.parts.ends
        if (
            self.parts.abilities.nowait is None
            or self.durable
            or flight.in_step.get(self.record.id) is not self
            or branch.id not in flight.unstored
            or branch.join is not None
        ):
            return False
        if branch.status in TERMINAL:
            return True
        try:
            ends.mark(branch, Status.DONE, None, None, "")
            ends.ended(branch, Status.DONE, "", now)
            self._told(branch)
        finally:
            ends.heard(branch)
        return True

    async def _run_segments(self, branch: Job) -> None:
        """Run the branch's pipes, one key at a time: under the parent's slot when the key
        is the parent's and not limited, else under a slot of the key's own."""
        parts = self.parts
        abilities, segments = parts.abilities, parts.segments
        parent_key = self.parent.key
        while branch.status is Status.QUEUED:
            key = branch.key
            now = trio.current_time()
            if key == parent_key and not abilities.limited(key):
                await segments.run_held(branch, now)
                continue
            held = abilities.grant(key)
            if held is None and parts.degrader.grants and await self._without_slot(branch):
                continue  # its next pipe, one it can do without, was degraded holding none
            if held is None and key == parent_key:
                # The parent's key, limited since the stage started: the parent's own slot
                # is the stage's to lend, one branch at a time (waiting for another while
                # the parent holds this one could wait for ever under a limit of one).
                async with self._lent_slot():
                    await segments.run_held(branch, trio.current_time())
                continue
            if held is not None:
                segments.waited(key, 0.0)
                ended = None
                try:
                    ended = await segments.run_held(branch, now)
                finally:
                    abilities.release(held, now, trio.current_time() if ended is None else ended)
                continue
            slot = abilities.pool.slot(key, deadline=branch.deadline, continuing=branch.admitted)
            try:
                async with slot:
                    granted = trio.current_time()
                    segments.waited(key, granted - now)
                    await segments.run_held(branch, granted)
            except Rejected as exc:
                segments.waited(key, trio.current_time() - now)
                note(exc, branch, f"admission key {key!r}")
                await parts.ends.finish(branch, Status.FAILED, exc=exc)

    async def _without_slot(self, branch: Job) -> bool:
        """No slot is free at once under the branch's key: when the pipe its cursor is at is
        one it can do without, it is degraded, holding none, and the branch goes on (it
        ends, or waits for its next key, queued). False, with nothing done, otherwise."""
        degrader, chain = self.parts.degrader, self.run_of.chain
        whole = degrader.branch_pending(branch, chain)
        if whole is not None:  # a branch it can do without, not started yet: degraded whole
            degrader.branch_unheld(branch, chain, *whole)
            await self.parts.ends.finish(branch, Status.DONE, now=trio.current_time())
            return True
        pipe = degrader.pending(branch, chain)
        if pipe is None:
            return False
        ended = await degrader.unheld(branch, chain, pipe, trio.current_time())
        if ended is None:
            return True  # its fallback failed or suspended the branch
        following = advance(branch, chain, self.parts.flight.clock)
        if following is None:
            await self.parts.ends.finish(branch, Status.DONE, now=ended)
            return True
        branch.key = chain_key(branch, chain, following)
        branch.transition(Status.QUEUED)
        return True

    def _lent_slot(self) -> AbstractAsyncContextManager[None]:
        """The parent's slot, lent to one branch at a time (see _run_segments)."""
        if self._lent is None:
            self._lent = trio.Lock()
        return self._lent

    # -- a branch suspends ---------------------------------------------------------------

    async def outlive(self, branch: Job) -> None:
        """Make a suspending branch a child job of its own (its record is created), and the
        stage durable if it is not yet: the join is written to the parent, and every later
        branch end goes through the event queue."""
        parts = self.parts
        store, flight = parts.abilities.store, parts.flight
        if not self.durable:
            self.durable = True
            written = self._written = trio.Event()
            parent = self.parent
            parent.join = self.record
            # The parent is written once more, with its join; from now on it is the event
            # handlers' (and a store may hand them copies): this step no longer owns it.
            try:
                if self._writing is None:
                    await store.update(parent)
                else:  # a progress write may be on its way: this one lands after it
                    async with self._writing:
                        await store.update(parent)
            finally:
                written.set()  # whoever waits goes on (a failed write fails the parent)
            if flight.running.get(parent.id) is parent:
                del flight.running[parent.id]
            flight.left_to_join.add(parent.id)
        else:
            await self._join_written()
        flight.unstored.discard(branch.id)
        self.branches.pop(branch.branch or 0, None)
        await store.create(branch)
        if not self.branches:
            self._settle()

    async def report_late(self, branch: Job) -> None:
        """An in-step branch ended after the stage turned durable: an event, as a forked
        branch's end is."""
        self.branches.pop(branch.branch or 0, None)
        if not self.branches:
            self._settle()
        await self._join_written()
        await self.parts.forked.report(branch)

    async def _join_written(self) -> None:
        """Wait until the durable join is in the parent's record: a branch's end (or a
        suspended branch's record, which a signal may end at once) must not reach a join
        that a store, shared with other processes, does not hold yet."""
        written = self._written
        if written is not None and not written.is_set():
            await written.wait()
