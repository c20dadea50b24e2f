"""Parallel stages run inside the parent's step: branches as tasks, the join in memory.

The parent keeps its step (and its slot) while its branches run in a nursery of the step,
each on a snapshot of the state as an in-memory branch record that is never stored. A branch
takes a worker slot of its own key only when that key differs from the parent's or is
limited (a limit, an adaptive limit or a pause must count it); otherwise it runs under the
parent's slot. The sans-IO :class:`~pipework.pipes._join.Join` decides exactly as it does for
branches run as child jobs: which branches start, which are cancelled, when the stage
resolves, whose deltas are merged. Once it resolves, running branches are cancelled, the
nursery closes, and the deltas are merged in declaration order: the parent goes on in the
same step, with no event and no second pass through the queue.

**A branch that suspends must outlive the step.** It becomes a child job at once (its record
is created, suspended, exactly as a branch run as a child job suspends), and the stage turns
*durable*: the join, with what it has recorded so far, is written to the parent as its
:class:`~._job.JoinRecord`, and from then on every branch end — of the in-step branches
still running too — reaches the join as a ``BranchDone`` event (see ``_parallel.py``). The
step then only waits for its in-step branches to end, and the parent waits at its join
holding nothing, as it does for a stage forked as child jobs.

Stages that nest another parallel stage inside a branch, or that have detached graph
nodes (which the parent must not wait for), are forked as child jobs (``_parallel.fork``).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, Any, cast

import trio

from .._errors import MergeConflict, Rejected
from ..pipes._join import Decision, Outcome
from ..pipes._merge import (
    delta,
    merge,
    merge_strict,
    packed_state,
    snapshot,
    unpacked_state,
)
from ..pipes._pipe import Context, Pipe
from ..pipes._stages import Chain, Parallel
from ..pipes._state import check_state
from ._boundary import split_outside
from ._cursor import path_of, start_frames
from ._job import Frame, Job, JoinRecord, new_ids
from ._parallel import (
    _callback,
    _error_of,
    _forget_errors,
    _is_job_deadline,
    _stage_error,
    branch_outcome,
    report_branch,
)
from ._status import TERMINAL, Status

if TYPE_CHECKING:
    from ._dispatcher import Dispatcher

__all__ = ["InStepStage"]

# The dispatcher's call of a pipe, taken once the dispatcher is importable (it imports this).
_invoke: Callable[[Pipe, Context], Awaitable[None]] | None = None


def _load_invoke() -> Callable[[Pipe, Context], Awaitable[None]]:
    global _invoke
    from ._dispatcher import _invoke as invoke

    _invoke = invoke
    return invoke


@lru_cache(maxsize=1024)
def _roots(path: tuple[int, ...], n: int) -> tuple[tuple[int, ...], ...]:
    """The root path of each branch of the stage at ``path``: the same tuples for every run
    of it (a stage's path is its place in its chain; chains are few)."""
    return tuple((*path, index) for index in range(n))


#: The cursor of a branch of pipes until it needs one: an empty tuple, not a list per
#: branch (one object fewer for the collector to walk while it runs), and one that nothing
#: can append to by mistake. Code that walks a cursor gives the branch a list of its own.
_NO_FRAMES = cast("list[Frame]", ())

#: The types msgpack gives back as they were given: a state holding only these (keys all
#: ``str``) needs no packing to be copied.
_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


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

    def __init__(self, d: Dispatcher, parent: Job, chain: Chain, stage: Parallel) -> None:
        self.d = d
        self.parent = parent
        self.chain = chain
        self.stage = stage
        top = parent.frames[-1]
        deadline = top.deadline
        self.started = trio.current_time()  # the stage's timer, and its branches' start
        if stage.timeout is not None:
            deadline = min(deadline, self.started + stage.timeout)
        self.join = stage.new_join()
        self.record = JoinRecord(
            # A job id's 128 random bits, from the batched read-ahead: no system call per stage.
            id=new_ids()[0],
            path=(*path_of(parent), top.index),
            join=self.join,
            deadline=deadline,
        )
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

    @cached_property
    def where(self) -> str:
        """The stage's path, for errors (formatted only when one needs it)."""
        return self.chain.describe(self.record.path)

    async def run(self) -> bool:
        """Run the stage; True when the parent goes on in this step (its state merged),
        False when the step ends here (the parent finished, or waits at a durable join)."""
        d = self.d
        d.flight.in_step[self.record.id] = self
        try:
            self._apply(self.join.start())
            if d.nowait is None:
                await self._record_progress()
            if not self.settled:
                self._waiter = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(self._abort_wait)
        except BaseException:
            # The step was cancelled (the job, or the engine stopping): so are its branches.
            for index in list(self.branches):
                self._cancel(index)
            if not self.durable:
                _forget_errors(d, self.record)
            raise
        finally:
            # Losers still ending report through events from now on, and find it over.
            del d.flight.in_step[self.record.id]
            if not d.flight.in_step:  # no branch is started before another stage runs
                d.branch_runners.release()
        if self.durable:
            return False
        parent = self.parent
        parent.join = None
        if self.conflict is not None:
            _forget_errors(d, self.record)
            d.note(self.conflict, parent, self.where)
            await d.finish(parent, Status.FAILED, exc=self.conflict, where=self.where)
            return False
        assert self.resolved is not None
        if self.join.continues:
            _forget_errors(d, self.record)
            pairs = [(self.stage.names[i], self.record.deltas[i]) for i in self.join.to_merge]
            try:
                # The common merge first: it needs no stage path (formatted only for errors).
                policy = self.stage.merge
                strict = policy.default == "strict" and not policy.keys
                state = merge_strict(parent.state, pairs) if strict else None
                if state is None:
                    state = merge(parent.state, pairs, policy, where=self.where)
            except MergeConflict as exc:
                d.note(exc, parent, self.where)
                await d.finish(parent, Status.FAILED, exc=exc, where=self.where)
                return False
            if self.stage.settle:
                state["outcomes"] = self.record.settled_outcomes(self.stage.names)
            parent.state = state
            parent.frames[-1].index += 1
            return True
        errors = [_error_of(d, self.record, i) for i in self.resolved.failures]
        _forget_errors(d, self.record)
        failure = _stage_error(self.stage, errors, self.where, parent)
        d.note(failure, parent, self.where)
        status = Status.EXPIRED if _is_job_deadline(failure) else Status.FAILED
        await d.finish(parent, status, exc=failure, where=self.where)
        return False

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
        for index in decision.start:
            if self.conflict is not None:
                break
            try:
                self._start(index)
            except MergeConflict as conflict:  # two of a graph node's parents disagree
                self.conflict = conflict
        for index in decision.cancel:
            self._cancel(index)
        if self.conflict is not None or (decision.resolved is not None and not self.durable):
            for index in list(self.branches):
                self._cancel(index)
            self._settle()

    def _start(self, index: int) -> None:
        d, parent, record = self.d, self.parent, self.record
        root = self.stage.branches[index]
        flat = root.flat
        branch = Job(
            # No cursor yet (see _NO_FRAMES): a branch of pipes keeps its place in a local
            # and gets a frame only when it leaves the common path.
            frames=_NO_FRAMES,
            # Unguessable as the join's id is; a branch needs no random read of its own.
            id=f"{record.id}.{index}",
            chain=parent.chain,
            state=self._start_state(index),
            correlation_id=parent.correlation_id,
            traceparent=parent.traceparent,
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
            branch.key = flat[0].key or self.chain.key
        else:
            start_frames(branch, self.chain, d.clock())
            flat = None
        record.children[index] = branch.id
        self.branches[index] = branch
        # In the dispatcher's nursery, not the step's: a loser that is slow to stop must not
        # hold the parent up (its late result is ignored, as a forked branch's is). On a
        # parked runner when there is one: no task spawned and no scope entered.
        assert d._nursery is not None, "the dispatcher is not running"
        d.branch_runners.start(d._nursery, self, branch, flat)

    def _start_state(self, index: int) -> dict[str, Any]:
        """A snapshot of the parent's state (packed once for all the branches; each unpacks
        its own copy) and, for a graph node, what the nodes it depends on produced."""
        packed = self._packed
        if packed is None:
            packed = self._packed = _packed_unless_scalar(self.parent.state)
        # A state of scalars only (checked storable when it was written) is copied as it
        # is: its values cannot be changed in place, so a shallow copy is a deep one.
        state = unpacked_state(packed) if packed else dict(self.parent.state)
        sources = self.join.start_from(index)
        if not sources:
            return state
        pairs = [(self.stage.names[i], self.record.deltas[i]) for i in sources]
        return merge(
            state, pairs, self.stage.merge, where=f"graph node {self.stage.names[index]!r}"
        )

    def _cancel(self, index: int) -> None:
        branch = self.branches.get(index)
        if branch is None:
            return
        branch.cancel_requested = True
        scope = self.d.flight.scopes.get(branch.id)
        if scope is not None:
            scope.cancel()

    async def _record_progress(self) -> None:
        """A store without a synchronous path (a shared one) gets the join's progress at
        every branch end, as for a stage forked as child jobs, so readers in other processes
        see it; the process's own memory store needs no copy of what the step holds."""
        if self.d.nowait is None and not self.settled:
            if self._writing is None:
                self._writing = trio.Lock()
            async with self._writing:
                if self.durable:  # the join's record is the event handlers' now
                    return
                self.parent.join = self.record
                await self.d.store.update(self.parent)

    async def report(self, branch: Job) -> None:
        """An in-step branch ended (called from its finish): tell the join."""
        self._told(branch)
        if self.d.nowait is None:
            await self._record_progress()

    def _told(self, branch: Job) -> None:
        """The join hears of a branch's end (what :meth:`report` does with no store)."""
        assert branch.branch is not None
        index = branch.branch
        self.branches.pop(index, None)
        outcome: Outcome = branch_outcome(branch)
        if outcome == "ok":
            self.record.deltas[index] = delta(self.parent.state, branch.state)
        if branch.error is not None:
            self.record.errors[index] = branch.error
        if branch.exception is not None:  # in the process-local side table, as any branch's
            self.d.flight.branch_errors[branch.id] = branch.exception
        if self.stage.kind == "graph":
            _callback(self.d, branch, outcome)
        self._apply(self.join.branch_done(index, outcome))

    # -- a branch ------------------------------------------------------------------------

    async def _run_branch(
        self, scope: trio.CancelScope, branch: Job, flat: tuple[Pipe, ...] | None
    ) -> None:
        """One branch, as a step does one job, in ``scope`` (its runner's: see
        ``_branch_runners.py``): whatever it raises ends here as its outcome; a cancellation
        (of the scope, which its runner ends, or from outside the stage) travels on.
        ``flat``: the branch's pipes, when it is a sequence of pipes only (no stage, no
        timeout of its own)."""
        d = self.d
        d.flight.scopes[branch.id] = scope
        d.flight.running[branch.id] = branch
        d.flight.unstored.add(branch.id)
        escaped: BaseException | None = None
        try:
            key = branch.key
            if flat is None or key != self.parent.key or d.limited(key):
                if not branch.frames:  # a branch of pipes, under a slot of its own
                    branch.frames = [Frame(0, branch.deadline)]
                await self._run_segments(branch)
            else:
                # The common branch: its pipes one after another under the parent's
                # slot, each run as ``Dispatcher._run_pipe`` runs one but in this
                # coroutine (one coroutine and one frame fewer per pipe, on every
                # resume), without the lookups of _run_held (an in-step stage's pipes
                # share the parent's key; a branch writes no record).
                branch.transition(Status.RUNNING)
                chain = self.chain
                # The cursor: a local index, and a frame only once a pipe raised (the
                # dispatcher's handling of a failure or suspension reads it).
                index = 0
                top: Frame | None = None
                bound = branch.deadline
                invoke = _invoke or _load_invoke()
                now: float | None = trio.current_time()
                while now is not None and index < len(flat):
                    if index and d.limited(key):
                        # The key was limited while the stage ran: it still counts, so
                        # the branch's next pipes take slots of their own (_run_segments).
                        branch.frames = [Frame(index, bound)]
                        branch.transition(Status.QUEUED)
                        await self._run_segments(branch)
                        now = None
                        break
                    pipe = flat[index]
                    limit = math.inf if pipe.timeout is None else now + pipe.timeout
                    deadline = bound if limit > bound else limit
                    ctx = Context(
                        state=snapshot(branch.state) if pipe.blocking else branch.state,
                        job_id=branch.id,
                        correlation_id=branch.correlation_id,
                        chain=chain.name,
                        pipe=pipe,
                        where=chain,
                        position=branch.root,  # a branch of one frame: its path
                        key=key,
                        deadline=deadline,
                        ops=d,
                        traceparent=branch.traceparent,
                    )
                    try:
                        if deadline == math.inf:
                            await invoke(pipe, ctx)
                            # A pipe that swallowed the cancellation must not carry on
                            # as if it had not come.
                            await trio.lowlevel.checkpoint_if_cancelled()
                        else:
                            await d._call_within(pipe, ctx, branch)
                        check_state(ctx.state)
                    except BaseException as raised:  # a cancellation travels on
                        if top is None:
                            top = Frame(index, bound)
                            branch.frames = [top]
                        else:
                            top.index = index
                        # None: it failed or suspended, and ended there.
                        now = await d._pipe_raised(branch, chain, pipe, now, raised, ctx, top)
                        index = top.index
                        continue
                    if pipe.blocking:
                        branch.state = ctx.state
                    now = d._pipe_ended(branch, pipe, now, "ok")
                    index += 1
                if now is not None:
                    if top is not None:
                        branch.frames.pop()
                    if not self._done_nowait(branch, now):
                        await d.finish(branch, Status.DONE, now=now)
        except BaseException as exc:
            escaped = exc
        finally:
            d.flight.scopes.pop(branch.id, None)
            d.flight.running.pop(branch.id, None)
        try:
            if branch.status not in TERMINAL and branch.status is not Status.SUSPENDED:
                with trio.CancelScope(shield=True):
                    await d._end_unsettled(branch, scope, escaped)
        finally:
            d.flight.unstored.discard(branch.id)
        if escaped is not None:
            outside, _ = split_outside(escaped)
            if outside is not None:
                raise outside

    def _done_nowait(self, branch: Job, now: float) -> bool:
        """``finish(branch, DONE)`` with no await when nothing in it waits: the stage is
        still in the step and not durable, on a store that answers at once (a branch's end
        writes nothing then). False, with nothing done, otherwise."""
        d = self.d
        if (
            d.nowait is None
            or self.durable
            or d.flight.in_step.get(self.record.id) is not self
            or branch.id not in d.flight.unstored
            or branch.join is not None
        ):
            return False
        if branch.status in TERMINAL:
            return True
        try:
            d._mark_end(branch, Status.DONE, None, None, "")
            d._ended(branch, Status.DONE, "", now)
            self._told(branch)
        finally:
            d._heard_of_end(branch)
        return True

    async def _run_segments(self, branch: Job) -> None:
        """Run the branch's pipes, one key at a time: under the parent's slot when the key
        is the parent's and not limited, else under a slot of the key's own."""
        d = self.d
        parent_key = self.parent.key
        while branch.status is Status.QUEUED:
            key = branch.key
            now = trio.current_time()
            if key == parent_key and not d.limited(key):
                await d._run_held(branch, now)
                continue
            held = d._grant(key)
            if held is None and key == parent_key:
                # The parent's key, limited since the stage started: the parent's own slot
                # is the stage's to lend, one branch at a time (waiting for another while
                # the parent holds this one could wait for ever under a limit of one).
                async with self._lent_slot():
                    await d._run_held(branch, trio.current_time())
                continue
            if held is not None:
                d._waited(key, 0.0)
                ended = None
                try:
                    ended = await d._run_held(branch, now)
                finally:
                    d._release(held, now, trio.current_time() if ended is None else ended)
                continue
            slot = d.pool.slot(key, deadline=branch.deadline, continuing=branch.admitted)
            try:
                async with slot:
                    granted = trio.current_time()
                    d._waited(key, granted - now)
                    await d._run_held(branch, granted)
            except Rejected as exc:
                d._waited(key, trio.current_time() - now)
                d.note(exc, branch, f"admission key {key!r}")
                await d.finish(branch, Status.FAILED, exc=exc)

    def _lent_slot(self) -> trio.Lock:
        """The parent's slot, lent to one branch at a time (see _run_segments)."""
        if self._lent is None:
            self._lent = trio.Lock()
        return self._lent

    # -- a branch suspends ---------------------------------------------------------------

    async def outlive(self, branch: Job) -> None:
        """Make a suspending branch a child job of its own (its record is created), and the
        stage durable if it is not yet: the join is written to the parent, and every later
        branch end goes through the event queue."""
        d = self.d
        if not self.durable:
            self.durable = True
            written = self._written = trio.Event()
            parent = self.parent
            parent.join = self.record
            # The parent is written once more, with its join; from now on it is the event
            # handlers' (and a store may hand them copies): this step no longer owns it.
            try:
                if self._writing is None:
                    await d.store.update(parent)
                else:  # a progress write may be on its way: this one lands after it
                    async with self._writing:
                        await d.store.update(parent)
            finally:
                written.set()  # whoever waits goes on (a failed write fails the parent)
            if d.flight.running.get(parent.id) is parent:
                del d.flight.running[parent.id]
            d.flight.left_to_join.add(parent.id)
        else:
            await self._join_written()
        d.flight.unstored.discard(branch.id)
        self.branches.pop(branch.branch or 0, None)
        await d.store.create(branch)
        if not self.branches:
            self._settle()

    async def report_late(self, branch: Job) -> None:
        """An in-step branch ended after the stage turned durable: an event, as a child
        job's end is."""
        self.branches.pop(branch.branch or 0, None)
        if not self.branches:
            self._settle()
        await self._join_written()
        await report_branch(self.d, branch)

    async def _join_written(self) -> None:
        """Wait until the durable join is in the parent's record: a branch's end (or a
        suspended branch's record, which a signal may end at once) must not reach a join
        that a store, shared with other processes, does not hold yet."""
        written = self._written
        if written is not None and not written.is_set():
            await written.wait()
