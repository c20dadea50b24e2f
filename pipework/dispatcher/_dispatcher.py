"""The dispatcher: takes events off the queue and turns them into steps on worker slots.

A *step* is what one worker does with one slot: load the job from the pool, run pipes from
the cursor while they share the slot's key, and stop at a key change (hand-off: the job goes
back through the queue), a suspension, or the end of the chain. Nothing survives a step but
the job record, so any worker can take the next one (see docs/design.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from types import CoroutineType
from typing import Any, Final

import trio

from .._errors import (
    BackendError,
    DeadlineExceeded,
    InternalError,
    JobCancelled,
    JobGone,
    JobNotFound,
    PipeContractError,
    PipeworkError,
    Rejected,
    SignalError,
    StateError,
)
from .._logging import job_logger, log_job
from .._metrics import Metrics
from ..pipes._merge import snapshot
from ..pipes._pipe import Context, Pipe, Suspend
from ..pipes._stages import Chain, Parallel
from ..pipes._state import check_state, storable_part
from ._abilities import Abilities
from ._boundary import split_outside
from ._branch_runners import BranchRunners
from ._cursor import advance, next_key, path_of, stage_path, top_node
from ._events import BranchDone, Event, Expire, Resume, RunJob, job_of
from ._flight import Claim, Flight
from ._instep import InStepStage
from ._job import ENDED_CURSOR, ErrorInfo, Frame, Job, Progress
from ._lookup import ChainLookup
from ._parallel import cancel_branches, fork, on_branch_done, report_branch
from ._retained import Retained
from ._runners import StepRunners
from ._status import TERMINAL, Status
from ._timers import SuspendTimers
from ._wake import Wake

__all__ = ["INTERNAL_PLAN", "Dispatcher", "check_early_signal"]

_log = logging.getLogger("pipework.dispatcher")

# The statuses a step reads on every job, as module globals: on Python 3.11 ``Status.DONE``
# goes through ``EnumType.__getattr__``, three times the cost of reading a global.
_QUEUED: Final = Status.QUEUED
_RUNNING: Final = Status.RUNNING
_DONE: Final = Status.DONE
#: The statuses whose end is logged at INFO (others at WARNING).
_ORDINARY_ENDS: Final = frozenset({Status.DONE, Status.CANCELLED})

#: Events handed out per pass of the dispatcher's loop. A backlog is started a few dozen
#: steps per scheduler pass rather than hundreds at once: steps that start together hold
#: their objects together (more of them survive into older GC generations, so collections
#: run more often and take longer), and beyond the free slots they queue in the pool
#: (measured: a 1-pipe job at 4.2 times a bare task with 256, 3.7 with 32; with 64
#: workers, 2.9 and 1.5; see docs/design.md).
_BATCH: Final = 32

#: The plan generation of the engine's own chains (the readiness probe): below every user
#: plan, never swapped, and kept out of the per-route and per-pipe metrics.
INTERNAL_PLAN: Final = 0


class Dispatcher:
    def __init__(
        self,
        registry: ChainLookup,
        abilities: Abilities,
        metrics: Metrics,
        key_label: Callable[[str], str],
    ) -> None:
        #: Every plan (registry) jobs may still run on, by generation: a reload adds one,
        #: and a job keeps the plan it was accepted under (its cursor means nothing elsewhere).
        self.plans: dict[int, ChainLookup] = {1: registry}
        #: What the store, the queue and the pool can do, resolved once (see _abilities.py).
        self.abilities = abilities
        self.store = abilities.store
        self.queue = abilities.queue
        self.pool = abilities.pool
        self.metrics = metrics
        self.key_label = key_label
        self._nursery: trio.Nursery | None = None
        #: The trio clock, read without ``trio.current_time``'s two calls of indirection
        #: (the same reading: that asks this clock); bound to the run's clock in :meth:`run`.
        self.clock: Callable[[], float] = trio.current_time
        #: The store's synchronous access, when it offers it; the pool's uncontended grant.
        self.nowait = abilities.nowait
        self._grant = abilities.grant
        self._release = abilities.release
        self.limited = abilities.limited
        #: What this process holds of the jobs it runs now (see _flight.py).
        self.flight = Flight()
        self._claims = abilities.claims
        self.runners = StepRunners(self._step)
        # The observers of the two series every job feeds, by pipe and by route: no label
        # tuples built and hashed per observation (label values are bounded by registration).
        self._pipe_ok: dict[str, Callable[[float], None]] = {}
        self._job_done: dict[str, Callable[[float], None]] = {}
        self._waits: dict[str, Callable[[float], None]] = {}  # by key label
        #: The tasks in-step branches run in (see _branch_runners.py).
        self.branch_runners = BranchRunners(self.flight.in_step)
        #: Suspended jobs' timers (see _timers.py).
        self.timers = SuspendTimers(abilities.queue, abilities.expire_at)
        self._waiters: dict[str, Wake] = {}
        self._streams: dict[str, trio.MemorySendChannel[Any]] = {}
        #: The exception objects of failed jobs, for ``Engine.wait`` to raise as they are: a
        #: record read back from a store has only their type, message and stage path. Kept
        #: as long as finished records are, and only in the process that ran the job.
        self.exceptions: Retained[BaseException] = Retained(
            abilities.retain_count, abilities.retain_seconds
        )
        #: Set by an HTTP container: (job id, signal, ttl) -> a signed callback URL.
        self.callback_factory: Callable[[str, str, float], str] | None = None
        #: Called with each top-level job once it is final (the engine retires idle plans).
        self.on_finished: Callable[[Job], None] | None = None
        #: Called with a job's record after each change of its status or progress.
        self.changed: Callable[[Job], None] = lambda job: None
        #: Whoever ``changed`` reports to: while empty, ``changed`` does nothing, and the
        #: steps of every job skip the call (the engine hands in its list of observers).
        self.observers: list[Any] = []
        # A shared queue (Redis) keeps a step's event until the step ends, and says when an
        # event was taken over from a process that died during its step.
        self._step_ended = abilities.step_ended
        self.reclaimed = abilities.reclaimed
        # A shared store may take a step's final write without the step waiting for it
        # (update_soon): the jobs whose end is on its way, with their step's event once
        # the step has ended (let go of only when the end is written, see _end_soon).
        self._update_soon = abilities.update_soon
        self._end_pending: dict[str, Any] = {}
        #: Set when a job's steps may run in other processes: a cancel of a job not running
        #: here is told to them, and a streamed job's chunks go to where its reader is
        #: (True when taken; False leaves them in the record).
        self.cancel_elsewhere: Callable[[str], None] | None = None
        self.emit_elsewhere: Callable[[str, Any], Awaitable[bool]] | None = None
        # Handlers run in the dispatcher's loop, one at a time: only a RunJob spawns a task
        # (pipes run concurrently); the others are short bookkeeping on the job pool.
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[None]]] = {
            RunJob: self._on_run,
            Resume: self._on_run,
            Expire: self._expire,
            BranchDone: functools.partial(on_branch_done, self),
        }

    def chain_of(self, job: Job) -> Chain:
        return self.plans[job.plan].get_chain(job.chain)

    # -- the loop ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Dispatch events until cancelled; steps run in this task's nursery."""
        self.clock = trio.lowlevel.current_clock().current_time
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self.timers.run)
                task_status.started()
                handlers = self._handlers
                start = self.runners.start
                while True:
                    for event in await self.queue.get_batch(_BATCH):
                        try:
                            if type(event) is RunJob or type(event) is Resume:
                                start(nursery, event)  # the common event, with no handler call
                                continue
                            await handlers[type(event)](event)
                        except Exception as exc:
                            # A bug in one event's bookkeeping must not stop every other job:
                            # the job it was about fails, with the traceback logged.
                            await self._event_failed(event, exc)
        finally:
            self.clock = trio.current_time  # another run may have another clock

    async def _event_failed(self, event: Event, exc: Exception) -> None:
        _log.error("pipework: handling %r failed inside the engine", event, exc_info=exc)
        try:
            job = await self.store.get(job_of(event))
        except Exception:  # the store itself is what failed: the log line above is all
            return
        if job.status not in TERMINAL:
            await self._fail_inside(job, exc)

    async def _fail_inside(self, job: Job, bug: BaseException) -> None:
        """Fail ``job`` because the engine's own bookkeeping failed for it."""
        exc = InternalError(
            f"job {job.id} failed inside the engine ({type(bug).__name__}: {bug}); "
            "the traceback is in the log"
        )
        exc.__cause__ = bug
        where = chain_where(self, job)
        self.note(exc, job, where)
        job.state = storable_part(job.state)  # what a pipe left unstorable cannot stay
        try:
            await self.finish(job, Status.FAILED, exc=exc, where=where)
        except Exception:  # the job is marked final here; its record may be stale
            _log.exception("pipework: recording the failure of job %s failed", job.id)

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        assert self._nursery is not None, "the dispatcher is not running"
        self._nursery.start_soon(fn, *args)

    async def _on_run(self, event: RunJob | Resume) -> None:
        assert self._nursery is not None, "the dispatcher is not running"
        self.runners.start(self._nursery, event)

    # -- a new job's first step, claimed as it is created ---------------------------------

    def hold_first(self, job: Job) -> object | None:
        """A worker slot for a new job's first step, when one is free at once and the queue
        can hand the job's event to this process as the record is written (a Redis queue's
        ``create_and_claim``): the record is then written running, and the step starts
        with no status write of its own and no read of the event. None otherwise. The
        caller writes the record, then calls :meth:`start_claimed` or :meth:`let_go_first`.
        A cancel before the step starts (here, or published from elsewhere) is noted, and
        the step then runs nothing."""
        if not self._claims or self._nursery is None:
            return None
        held = self._grant(job.key)
        if held is not None:
            self.flight.claiming[job.id] = Claim(held, self.clock())
        return held

    def start_claimed(self, event: RunJob) -> None:
        """Start the step of a job whose event was claimed with its record (hold_first)."""
        claim = self.flight.claiming[event.job_id]
        claim.event = event
        try:
            assert self._nursery is not None, "the dispatcher is not running"
            self.runners.start(self._nursery, event)
        except BaseException:
            # The dispatcher stopped: the event stays pending, taken over by a live process.
            self.let_go_first(event.job_id)
            raise

    def let_go_first(self, job_id: str) -> None:
        """The slot hold_first held, not used (the record was not written, or its event was
        not claimed)."""
        claim = self.flight.claiming.pop(job_id, None)
        if claim is not None:
            self._unhold(claim)

    def _unhold(self, claim: Claim) -> None:
        """Give back a claim's slot, unused: no hold time counted."""
        self.abilities.withdraw(claim.held)

    # -- a step --------------------------------------------------------------------------

    async def _step(self, event: RunJob | Resume, scope: trio.CancelScope) -> bool:
        """One step of one job, in ``scope`` (its runner's, entered and uncancelled): the
        boundary that always leaves its job final or waiting. Returns whether ``scope`` may
        have been cancelled: only a cancel of the job (:meth:`cancel`, :meth:`interrupt`,
        which mark the step's record first) or a deadline set on it can cancel it.

        Whatever a pipe or the bookkeeping raises — errors, exception groups, cancellations
        from inside a library's nursery — ends here as this job's outcome; only the engine's
        own shutdown (a cancellation from outside the step) travels on."""
        acked = False
        claim = None  # the slot its creator holds for it (hold_first), until the step runs
        if self.flight.claiming:
            claim = self.flight.claiming.get(event.job_id)
            if claim is not None and claim.event is not event:
                claim = None
        try:
            try:
                nowait = self.nowait
                own = None
                if nowait:
                    job = nowait[0](event.job_id)
                else:
                    # A shared store may hold the record as it wrote it (a job it created or
                    # handed off): no read, and the status write below says if it is stale.
                    shared = self.abilities.shared_store
                    if shared and type(event) is RunJob and not self.reclaimed(event):
                        own = shared.read_own(event.job_id)
                    job = own or await self.store.get(event.job_id)
            except PipeworkError:
                return False
            if job.status is _RUNNING and (claim is not None or self.reclaimed(event)):
                # Its step died with the process that ran it (a shared queue handed the
                # event on), or it is claimed and was marked running with its record: run
                # it from the cursor, the last pipe that finished.
                job.transition(Status.QUEUED)
            if job.status is not _QUEUED or (claim is not None and claim.cancelled):
                if job.status is Status.SUSPENDED and self.reclaimed(event):
                    self.timers.rearm(job)  # its step died before its timer was surely stored
                # Cancelled or finished while the event waited (a claimed job: while its
                # record was written; the cancel recorded its end): nothing to run.
                return False
            record = job  # what a cancel marks, whichever record the step ends with
            self.flight.scopes[job.id] = scope
            self.flight.running[job.id] = job
            if claim is not None:  # from here a cancel goes through the step's scope
                del self.flight.claiming[job.id]
            settled = False  # the job was left waiting on purpose (hand-off, suspend, join)
            escaped: BaseException | None = None
            now = self.clock()
            try:
                # The uncontended grant: no schedule point (the step's task has just been
                # scheduled) and no context manager; a step that would wait or be
                # refused takes the pool's ``slot`` below.
                marked = claim is not None  # its record was written running (hold_first)
                if claim is not None:
                    held, granted, claim = claim.held, claim.granted, None  # released below
                else:
                    held = self._grant(job.key)
                    granted = now
                if held is not None:
                    ended = None
                    # The slot and when it was granted: a hand-off may trade it for one
                    # under the next key (_go_on_under).
                    grant: list[Any] = [held, granted]
                    try:
                        self.queue.ack(event)
                        acked = True
                        self._waited(job.key, 0.0)
                        ended = await self._run_held(job, now, True, own is job, marked, grant)
                        settled = True
                    finally:
                        end = self.clock() if ended is None else ended
                        self._release(grant[0], grant[1], end)
                else:
                    # A resumed job carries an outside fact (a payment, an approval): it
                    # waits out the load up to its deadline rather than be refused, as
                    # does a job admitted when it was accepted (an async job's 202).
                    # Every other step fails fast under load, as the pool's bounds intend.
                    continuing = isinstance(event, Resume) or job.admitted
                    slot = self.pool.slot(job.key, deadline=job.deadline, continuing=continuing)
                    try:
                        async with slot:
                            self.queue.ack(event)
                            acked = True
                            granted = self.clock()
                            self._waited(job.key, granted - now)
                            await self._run_held(job, granted, as_read=True, own=own is job)
                            settled = True
                    except Rejected as exc:
                        self._waited(job.key, self.clock() - now)
                        self.note(exc, job, f"admission key {job.key!r}")
                        await self.finish(job, Status.FAILED, exc=exc)
            except BaseException as exc:  # the step boundary: what belongs outside is re-raised
                escaped = exc
            finally:
                if self.flight.scopes.get(job.id) is scope:
                    del self.flight.scopes[job.id]
                if self.flight.running.get(job.id) is job:
                    del self.flight.running[job.id]
            if self.flight.left_to_join and job.id in self.flight.left_to_join:
                # Its in-step stage turned durable: the record is the join's now, so a step
                # ended early reads it afresh before ending the job.
                self.flight.left_to_join.discard(job.id)
                if not settled:
                    with trio.CancelScope(shield=True):
                        job = await self.store.get(job.id)
            if job.status not in TERMINAL and not settled:
                with trio.CancelScope(shield=True):
                    await self._end_unsettled(job, scope, escaped)
            if escaped is not None:
                outside, _ = split_outside(escaped)
                if outside is not None:
                    raise outside
            return record.cancel_requested or scope.deadline != math.inf
        finally:
            if claim is not None:  # its slot was not used: the step ran nothing
                self.flight.claiming.pop(event.job_id, None)
                self._unhold(claim)
            if not acked:
                self.queue.ack(event)
            pending = self._end_pending
            if pending and pending.get(event.job_id, event) is None:
                pending[event.job_id] = event  # let go of once the end is written
            else:
                self._step_ended(event)  # a shared queue lets go of the event only now

    async def _end_unsettled(
        self, job: Job, scope: trio.CancelScope, escaped: BaseException | None
    ) -> None:
        """Finish a job its step left neither final nor waiting on purpose."""
        bugs = None if escaped is None else split_outside(escaped)[1]
        if isinstance(bugs, JobNotFound) and await self._ended_elsewhere(job):
            return
        if bugs is not None:
            # The bookkeeping (a store, metrics, the dispatcher itself) failed for this job.
            _log.error(
                "pipework: the step of job %s failed inside the engine", job.id, exc_info=bugs
            )
            await self._fail_inside(job, bugs)
            return
        if scope.cancel_called or job.cancel_requested:
            exc = JobCancelled(f"job {job.id} was cancelled")
        else:  # the engine is stopping: the step was cancelled from outside
            exc = JobCancelled(f"job {job.id} was cancelled: the engine stopped")
        try:
            await self.finish(job, Status.CANCELLED, exc=exc)
        except Exception as bug:
            await self._fail_inside(job, bug)

    async def _ended_elsewhere(self, job: Job) -> bool:
        """Whether the store refused the step's write because the job ended meanwhile (a
        cancel that reached a shared store while this step loaded the record): its end is
        recorded, and the step has nothing left to write."""
        try:
            stored = await self.store.get(job.id)
        except JobGone:
            return True
        except JobNotFound:
            return job.parent is not None  # a branch's record goes once its end is reported
        return stored.status in TERMINAL

    def _shares_slot(self, job: Job, chain: Chain, stage: Parallel) -> bool:
        """Whether every branch of the stage would run under the parent's slot (its key,
        not limited). Only such a stage runs inside the step: a branch that needed a slot
        of its own would wait for it while the parent holds one, and parents holding every
        slot would leave their branches none (a stage forked as child jobs holds nothing
        while its branches wait)."""
        held = job.key
        if self.limited(held):
            return False
        default = chain.key
        return all((default if key is None else key) == held for key in stage.branch_keys)

    def _waited(self, key: str, seconds: float) -> None:
        label = self.key_label(key)  # the pool's configured keys may change: asked each time
        observe = self._waits.get(label)
        if observe is None:
            observe = self._waits[label] = self.metrics.observer(self.metrics.pool_wait, (label,))
        observe(seconds)

    async def _run_held(
        self,
        job: Job,
        now: float,
        as_read: bool = False,
        own: bool = False,
        marked: bool = False,
        slot: list[Any] | None = None,
    ) -> float:
        """Run pipes while they share the held slot's key. ``now``: the clock at the grant;
        each pipe's end is the next one's start, so a step reads the clock once per pipe.
        ``as_read``: the job is as the store returned it but for its status; ``own``: as the
        store last wrote it (``read_own``), which may be stale; ``marked``: the store has
        it running already (a claimed first step, see hold_first); ``slot``: the uncontended
        grant the step holds and when it was granted, which a hand-off may trade
        (_go_on_under). Returns the last clock read."""
        chain = self.plans[job.plan].get_chain(job.chain)  # chain_of, inline
        held = job.key
        job.transition(_RUNNING)
        if marked:  # written running with its record (hold_first)
            if self.observers:
                self.changed(job)
        elif job.parent is None or job.id not in self.flight.unstored:
            nowait = self.nowait
            try:
                if nowait:
                    nowait[1](job)
                else:
                    # A shared store may write only what changed since the read: the status.
                    shared = self.abilities.shared_store
                    status_only = shared.update_status if shared and as_read else None
                    if status_only is None:
                        await self.store.update(job)  # readers see it running at once
                    elif own:
                        if not await status_only(job, verify=True):
                            # Written elsewhere since this store wrote it: nothing runs on a
                            # stale record; the job's next step reads it afresh.
                            self.queue.put_nowait(RunJob(job.id))
                            return now
                    else:
                        await status_only(job)
            except JobNotFound:
                # Ended while this step loaded it (a cancel, here or in another process,
                # reached a shared store first): there is nothing left to run.
                return now
            if self.observers:
                self.changed(job)
        frames = job.frames
        # A flat sequence of pipes (most chains, most branches) is walked as a list; a
        # sequence holding stages walks the cursor's frames (advance).
        flat = None
        if len(frames) == 1:
            sequence: Any = chain.node_at(job.root) if job.root else chain.root  # a Serial
            flat = sequence.flat
        while True:
            pipe: Pipe | Parallel | None
            if flat is not None:
                index = frames[0].index
                if index < len(flat):
                    pipe = flat[index]
                else:
                    frames.pop()
                    pipe = None
            else:
                pipe = advance(job, chain, self.clock)
            if pipe is None:
                if job.parent is not None:
                    result = None  # a branch's result is its delta, sent to the join
                elif chain.result is None:
                    result = job.state
                else:
                    result = job.state.get(chain.result)
                if not self._done_nowait(job, result, now):
                    await self.finish(job, Status.DONE, result=result, now=now)
                return now
            if isinstance(pipe, Parallel):
                if not pipe.in_step or not self._shares_slot(job, chain, pipe):
                    await fork(self, job, chain, pipe)  # the slot is released on return
                    return now
                if not await InStepStage(self, job, chain, pipe).run():
                    return now
                now = trio.current_time()
                flat = None
                continue
            key = pipe.key or chain.key
            if key != held and slot is not None and await self._go_on_under(job, key, slot, now):
                held = key
            elif key != held:
                job.key = key
                job.transition(Status.QUEUED)
                if job.parent is not None and job.id in self.flight.unstored:
                    return now  # an in-step branch: its task takes the next key's slot
                # A shared queue that writes the record and the next event together (Redis),
                # if it can without this step waiting for the write (see _end_soon).
                shared_queue = self.abilities.shared_queue
                if shared_queue is None or not self._hand_off_soon(
                    shared_queue.update_and_put_soon, job
                ):
                    if shared_queue is not None and await shared_queue.update_and_put(
                        self.store, job, RunJob(job.id)
                    ):
                        self.changed(job)
                    else:
                        await self.store.update(job)
                        self.changed(job)
                        self.queue.put_nowait(RunJob(job.id))
                _log_hand_off(job)
                return now
            # The write of the cursor is left out when the step's next write carries it
            # anyway, with nothing run in between: the job's end or its hand-off.
            if flat is not None:  # is this the flat sequence's last pipe, or its key's last?
                following = frames[0].index + 1
                then_writes = following >= len(flat) or (flat[following].key or chain.key) != held
            else:
                then_writes = False
            # The pipe runs in this frame (no coroutine of its own): one object and one frame
            # fewer per pipe, and every one a step holds across its awaits costs collections.
            top = frames[-1]
            pipe_deadline = math.inf if pipe.timeout is None else now + pipe.timeout
            deadline = top.deadline if pipe_deadline > top.deadline else pipe_deadline
            # A thread cannot be stopped: a blocking pipe works on a copy of the state that
            # is adopted only if it ends in time and uncancelled.
            ctx = Context(  # in the order of its parameters: no keyword matching
                snapshot(job.state) if pipe.blocking else job.state,
                job.id,
                job.correlation_id,
                chain.name,
                pipe,
                chain,
                job.root if len(frames) == 1 else path_of(job),  # path_of's flat case
                held,
                deadline,
                self,
                job.traceparent,
            )
            try:
                if deadline == math.inf:
                    await _invoke(pipe, ctx)  # no limit anywhere: nothing to arm
                    # A pipe that swallowed the step's cancellation (or a thread that could
                    # not see it) must not carry on as if it had not come.
                    await trio.lowlevel.checkpoint_if_cancelled()
                else:
                    await self._call_within(pipe, ctx, job)
                check_state(ctx.state)
            except BaseException as raised:  # sorted out there; a cancellation travels on
                resumed = await self._pipe_raised(job, chain, pipe, now, raised, ctx, top)
                if resumed is None:
                    return now
                now = resumed
            else:
                if pipe.blocking:
                    job.state = ctx.state
                now = self._pipe_ended(job, pipe, now, "ok")
                top.index += 1
                if not then_writes and (job.parent is None or job.id not in self.flight.unstored):
                    nowait = self.nowait
                    if nowait:
                        nowait[1](job)
                    else:
                        await self.store.update(job)
            if len(frames) != 1:
                flat = None

    async def _go_on_under(self, job: Job, key: str, slot: list[Any], now: float) -> bool:
        """A hand-off on a shared store, to a key with a slot free at once: the step trades
        its slot for that one and runs on, after one write of the record (the cursor, the
        new key, still running), where a hand-off through the queue costs a write, an event
        to read back, and its next step's status write. The step's event stays unfinished
        until the step ends, so a process that dies meanwhile leaves it to be taken over
        and run again from the cursor, as for any step. False, with nothing done, on an
        in-process store (a hand-off through its queue costs next to nothing) or if no
        slot is free at once."""
        if self.nowait or job.parent is not None:
            return False
        granted = self._grant(key)
        if granted is None:
            return False
        self._release(slot[0], slot[1], now)
        slot[0], slot[1] = granted, now
        job.key = key
        self._waited(key, 0.0)
        await self.store.update(job)  # the cursor and the key, before the next pipe runs
        if self.observers:
            self.changed(job)
        _log_hand_off(job)
        return True

    async def _run_pipe(
        self, job: Job, chain: Chain, pipe: Pipe, started: float, *, write: bool = True
    ) -> float | None:
        """Run one pipe, as :meth:`_run_held` does in its own loop (an in-step branch's
        flat sequence calls this): the clock at its end to go on, None when the step ended
        (failure or suspension). Cancellation of the step travels on."""
        top = job.frames[-1]
        pipe_deadline = math.inf if pipe.timeout is None else started + pipe.timeout
        deadline = top.deadline if pipe_deadline > top.deadline else pipe_deadline
        ctx = Context(
            snapshot(job.state) if pipe.blocking else job.state,
            job.id,
            job.correlation_id,
            chain.name,
            pipe,
            chain,
            path_of(job),
            job.key,
            deadline,
            self,
            job.traceparent,
        )
        try:
            if deadline == math.inf:
                await _invoke(pipe, ctx)
                await trio.lowlevel.checkpoint_if_cancelled()
            else:
                await self._call_within(pipe, ctx, job)
            check_state(ctx.state)
        except BaseException as raised:  # sorted out there; a cancellation travels on
            return await self._pipe_raised(job, chain, pipe, started, raised, ctx, top)
        if pipe.blocking:
            job.state = ctx.state
        ended = self._pipe_ended(job, pipe, started, "ok")
        top.index += 1
        if write and (job.parent is None or job.id not in self.flight.unstored):
            nowait = self.nowait
            if nowait:
                nowait[1](job)
            else:
                await self.store.update(job)
        return ended

    async def _pipe_raised(
        self,
        job: Job,
        chain: Chain,
        pipe: Pipe,
        started: float,
        raised: BaseException,
        ctx: Context,
        top: Frame,
    ) -> float | None:
        """What a pipe raised, sorted out: the clock to go on at (a suspension whose signal
        had come), None when the step ended (failure, timeout, suspension). Cancellation of
        the step travels on."""
        if isinstance(raised, Suspend):
            ended = self._pipe_ended(job, pipe, started, "suspended")
            top.index += 1
            # A signal that came while the pipe ran lets the step go on at once.
            return ended if await self._suspend(job, chain, raised, ctx.path) else None
        if isinstance(raised, _Timeout):
            pipe_deadline = math.inf if pipe.timeout is None else started + pipe.timeout
            timeout = self._timeout(job, chain, pipe_deadline, top, ctx.path)
            # The step's scope stays cancelled once a deadline passed: record the end shielded.
            with trio.CancelScope(shield=True):
                await self._pipe_failed(job, pipe, started, timeout, ctx.path)
            return None
        cancellation = _cancellation_in(raised, lambda: ctx.path)
        if cancellation is not None:
            # The step's (or the engine's) cancellation: the step boundary ends the job.
            self._pipe_ended(job, pipe, started, "cancelled")
            raise cancellation from None
        exc = _pipe_error(raised, ctx.path)
        await self._pipe_failed(job, pipe, started, exc, ctx.path)
        return None

    async def _pipe_failed(
        self, job: Job, pipe: Pipe, started: float, exc: BaseException, path: str
    ) -> None:
        outcome = "timeout" if isinstance(exc, DeadlineExceeded) else "error"
        if isinstance(exc, StateError):
            exc.http_status = 500  # a pipe wrote bad state: the server's fault, not input
            job.state = storable_part(job.state)  # the record must still be storable
        self._pipe_ended(job, pipe, started, outcome, exc)
        where = exc.where if isinstance(exc, DeadlineExceeded) and exc.where else path
        self.note(exc, job, path)
        status = Status.EXPIRED if _is_job_timeout(exc) else Status.FAILED
        await self.finish(job, status, exc=exc, where=where)

    def _pipe_ended(
        self, job: Job, pipe: Pipe, started: float, outcome: str, exc: BaseException | None = None
    ) -> float:
        """Measure, record and log a pipe's end; returns the clock read at its end."""
        now = self.clock()
        if job.plan == INTERNAL_PLAN:
            return now  # the engine's own probe: no user pipe to measure, nothing to learn
        duration = now - started
        if outcome == "ok":
            observe = self._pipe_ok.get(pipe.name)
            if observe is None:
                metrics = self.metrics
                observe = metrics.observer(metrics.pipe_duration, (pipe.name, outcome))
                self._pipe_ok[pipe.name] = observe
            observe(duration)
        else:
            self.metrics.observe(self.metrics.pipe_duration, (pipe.name, outcome), duration)
        # Only the backend's trouble (its errors, timeouts) may shrink an adaptive limit: a
        # bug in a pipe says nothing about the backend's capacity; a cancel says nothing.
        if outcome in ("ok", "suspended"):
            self.pool.record(job.key, ok=True, latency=duration)
        elif outcome == "timeout" or (exc is not None and backend_trouble(exc)):
            self.pool.record(job.key, ok=False, latency=duration)
        level = logging.WARNING if exc is not None else logging.INFO
        if not job_logger.isEnabledFor(level):
            return now  # the common case: skip building the record's fields
        log_job(
            "pipe ended",
            level,
            # A backend's failure is logged where it happens, in one line; its traceback
            # (httpx's chain) only at DEBUG. A pipe's own bug keeps its traceback.
            exc
            if outcome == "error"
            and exc is not None
            and not (
                (isinstance(exc, BackendError) or backend_trouble(exc))
                and not job_logger.isEnabledFor(logging.DEBUG)
            )
            else None,
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            pipe=pipe.name,
            key=job.key,
            duration=round(duration, 6),
            outcome=outcome,
            error=None if exc is None else f"{type(exc).__name__}: {exc}",
        )
        return now

    async def _call_within(self, pipe: Pipe, ctx: Context, job: Job) -> None:
        """Run the pipe within ``ctx.deadline``; raise _Timeout if that limit ran out."""
        # The step's own scope carries the pipe's limit: one scope per step, not one more
        # per pipe. A cancel marks the record first, which is how the two are told apart.
        scope = self.flight.scopes[job.id]
        scope.deadline = ctx.deadline
        try:
            await _invoke(pipe, ctx)
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException as exc:
            if (
                scope.cancel_called
                and not job.cancel_requested
                and trio.current_time() >= ctx.deadline
                and _cancellation_in(exc, lambda: ctx.path) is not None
            ):
                raise _Timeout from None
            raise
        finally:
            if not scope.cancel_called:
                scope.deadline = math.inf  # the bookkeeping that follows is not the pipe's

    def _timeout(
        self, job: Job, chain: Chain, pipe_deadline: float, top: Frame, path: str
    ) -> DeadlineExceeded:
        """The DeadlineExceeded of the limit that fired: the pipe's, a stage's or the job's."""
        if pipe_deadline < top.deadline:
            return DeadlineExceeded(
                f"the pipe's timeout ran out in {path}",
                scope="pipe",
                where=path,
                deadline=pipe_deadline,
            )
        return self._frame_timeout(job, chain, top, path)

    def _frame_timeout(
        self, job: Job, chain: Chain, top: Frame, path: str, while_: str = ""
    ) -> DeadlineExceeded:
        if top.bound < 0:
            return DeadlineExceeded(
                f"job {job.id} passed its deadline{while_} in {path}",
                scope="job",
                where=path,
                deadline=top.deadline,
            )
        stage = chain.describe(stage_path(job, top.bound))
        return DeadlineExceeded(
            f"the stage timeout of {stage} ran out{while_} (in {path})",
            scope="stage",
            where=stage,
            deadline=top.deadline,
        )

    # -- suspend, resume, expire ---------------------------------------------------------

    async def _suspend(self, job: Job, chain: Chain, suspend: Suspend, path: str) -> bool:
        check_state(job.state)
        unstored = job.parent is not None and job.id in self.flight.unstored
        if unstored:
            assert job.join_id is not None
            stage = self.flight.in_step.get(job.join_id)
            if stage is None or stage.over:
                # Its stage resolved while this branch ran: it is cancelled, not parked.
                job.cancel_requested = True
                exc = JobCancelled(f"job {job.id} was cancelled")
                await self.finish(job, Status.CANCELLED, exc=exc)
                return False
        holder = await self._mailbox_with(job, suspend.signal)
        if holder is not None and await self._take_kept(job, holder, suspend):
            # It came while we ran: no need to park.
            if not unstored:
                await self.store.update(job)
            return True
        top = job.frames[-1]
        now = trio.current_time()
        limit = math.inf if suspend.timeout is None else now + suspend.timeout
        job.suspend_deadline = min(limit, top.deadline)
        job.waiting_for = suspend.signal
        job.suspend_into = suspend.into
        job.key = next_key(job, chain)
        job.transition(Status.SUSPENDED)
        if unstored:  # an in-step branch must outlive the step: it gets its record now
            assert job.join_id is not None
            await self.flight.in_step[job.join_id].outlive(job)
        else:
            await self.store.update(job)
        self.changed(job)
        if job.suspend_deadline < math.inf:
            self.timers.expire_at(job.suspend_deadline, job.id, job.version)
        log_job(
            "job suspended",
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            stage=path,
            signal=suspend.signal,
            status=job.status.value,
        )
        return False

    async def _mailbox_with(self, job: Job, signal: str) -> Job | None:
        """The job, or the nearest parent, holding an early ``signal`` (a signal sent to a
        parent waiting at a join is meant for whichever branch suspends for it)."""
        current: Job | None = job
        while current is not None:
            if signal in current.signals:
                return current
            if current.parent is None:
                return None
            # A parent in a step keeps early signals on the step's record.
            current = self.flight.running.get(current.parent) or await self.store.get(
                current.parent
            )
        return None

    async def _take_kept(self, job: Job, holder: Job, suspend: Suspend) -> bool:
        """Take the early signal ``holder`` keeps into ``job``'s state; False if a sibling
        suspending for it took it first (one signal resumes one branch)."""
        if holder is job:
            job.state[suspend.into] = job.signals.pop(suspend.signal)
            job.took(suspend.signal)  # written with the job's record by the caller
            return True
        taken: list[Any] = []

        def take(parent: Job) -> bool:
            if suspend.signal not in parent.signals:
                return False
            taken.append(parent.signals.pop(suspend.signal))
            parent.took(suspend.signal)  # sent to the parent: so would a repeat of it be
            return True

        if await self._change_parent(holder, take) is None:
            return False
        job.state[suspend.into] = taken[0]
        job.took(suspend.signal)
        return True

    async def _change_parent(self, parent: Job, change: Callable[[Job], bool]) -> Job | None:
        """Apply ``change`` to a branch's parent (or root) and write it back; the record
        written, or None if ``change`` found nothing to do or the parent ended.

        A parent no step here holds is read again and written under its lock on a shared
        store: its branches' ends change its join meanwhile, and writing back the copy read
        before would lose them (the parent would wait at its join for ever)."""
        if self.abilities.shared_store is None or self.flight.running.get(parent.id) is parent:
            # In this process's memory: no checkpoint between the read and the change.
            if not change(parent):
                return None
            await self.store.update(parent)
            return parent
        async with self.abilities.lock(parent.id):
            try:
                parent = await self.store.get(parent.id)
                if parent.status in TERMINAL or not change(parent):
                    return None
                await self.store.update(parent)
            except JobNotFound:
                return None  # it ended and was dropped: its end cancels its branches
        return parent

    async def find_waiting(self, job: Job, signal: str) -> Job | None:
        """The job or one of its branches (depth first) suspended waiting for ``signal``."""
        if job.status is Status.SUSPENDED and job.waiting_for == signal:
            return job
        if job.join is None:
            return None
        for child_id in job.join.children.values():
            try:
                child = await self.store.get(child_id)
            except JobNotFound:
                continue  # ended and reported
            if child.status not in TERMINAL:
                found = await self.find_waiting(child, signal)
                if found is not None:
                    return found
        return None

    async def deliver(self, job: Job, signal: str, payload: Any) -> bool:
        """Resume a suspended job waiting for ``signal`` (the caller checked both, on
        ``job`` as read). False if the record changed since it was read from a shared store
        (another signal resumed it, its timer or a cancel ended it): nothing is written, and
        the caller reads it again and decides anew. On an in-process store nothing can
        change it between the caller's read and this write: no checkpoint comes between."""
        assert job.suspend_into is not None
        job.state[job.suspend_into] = payload
        job.waiting_for = job.suspend_into = job.suspend_deadline = None
        job.took(signal)
        job.transition(Status.QUEUED)
        try:
            if not await self.abilities.update_unless_changed(job):
                return False
        except JobNotFound:  # ended since: the caller's read says how
            return False
        self.changed(job)
        self.queue.put_nowait(Resume(job.id, signal))
        log_job(
            "job resumed",
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            signal=signal,
            status=job.status.value,
        )
        return True

    async def _expire(self, event: Expire) -> None:
        try:
            try:
                job = await self.store.get(event.job_id)
            except JobNotFound:
                return  # finished and dropped since: a deadline left in the heap
            if job.status is not Status.SUSPENDED or job.version != event.version:
                return  # resumed or finished meanwhile: the timer lost the race
            assert job.suspend_deadline is not None
            chain = self.chain_of(job)
            top = job.frames[-1]
            # The cursor is already past the suspended pipe, in the same frame.
            pipe = top_node(job.frames, job.root, chain).children[top.index - 1]
            where = chain.describe(path_of(job), pipe)
            waiting = f" while suspended for {job.waiting_for!r}"
            if job.suspend_deadline < top.deadline:
                exc = DeadlineExceeded(
                    f"no signal {job.waiting_for!r} before the suspend timeout at {where}",
                    scope="suspend",
                    where=where,
                    deadline=job.suspend_deadline,
                )
            else:
                exc = self._frame_timeout(job, chain, top, where, waiting)
            self.note(exc, job, where)
            status = Status.EXPIRED if exc.scope == "job" else Status.FAILED
            await self.finish(job, status, exc=exc, where=exc.where)
        finally:
            self.queue.ack(event)

    # -- cancel and finish ---------------------------------------------------------------

    async def continue_later(self, job: Job, chain: Chain) -> None:
        """Send a job back through the queue to continue at its cursor (after a join)."""
        job.key = next_key(job, chain)
        job.transition(Status.QUEUED)
        await self.store.update(job)
        self.changed(job)
        self.queue.put_nowait(RunJob(job.id))

    async def cancel(self, job: Job) -> None:
        job.cancel_requested = True
        scope = self.flight.scopes.get(job.id)
        if scope is not None:
            # The step's own record: its scope also carries pipe deadlines, and this is how
            # the step tells a cancel from a timeout.
            running = self.flight.running.get(job.id)
            if running is not None:
                running.cancel_requested = True
            scope.cancel()  # the step finishes it once the pipe's cleanup has run
        else:
            claim = self.flight.claiming.get(job.id)
            if claim is not None:
                claim.cancelled = True  # its step has not started: it will not
            await self.finish(
                job, Status.CANCELLED, exc=JobCancelled(f"job {job.id} was cancelled")
            )
            if self.cancel_elsewhere is not None:  # a step of it may run in another process
                self.cancel_elsewhere(job.id)

    def interrupt(self, job_id: str) -> None:
        """Cancel the step running ``job_id`` here, if one is (a cancel recorded by another
        process): the step ends the job once the pipe's cleanup has run."""
        scope = self.flight.scopes.get(job_id)
        if scope is None:
            claim = self.flight.claiming.get(job_id)
            if claim is not None:  # its step has not started: it will not
                claim.cancelled = True
            return
        running = self.flight.running.get(job_id)
        if running is not None:
            running.cancel_requested = True
        scope.cancel()

    async def finish(
        self,
        job: Job,
        status: Status,
        *,
        result: Any = None,
        exc: BaseException | None = None,
        where: str = "",
        now: float | None = None,
    ) -> None:
        """End ``job`` with ``status`` (``now``: the caller's clock read, if it has one)."""
        if job.status in TERMINAL:
            return
        try:
            await self._record_end(job, status, result, exc, where, now)
        finally:
            self._heard_of_end(job)  # even if recording it failed

    def _done_nowait(self, job: Job, result: Any, now: float) -> bool:
        """``finish(job, DONE)`` with no await (no coroutines for the common end) when
        nothing in it waits: a top-level job with no join, on a store that answers at once.
        False, with nothing done, otherwise."""
        nowait = self.nowait
        if job.parent is not None or job.join is not None:
            return False
        if nowait is None:
            return self._update_soon is not None and self._end_soon(job, result, now)
        if job.status in TERMINAL:
            return True
        try:
            previous = job.status
            # _mark_end(job, DONE, result, None, ""), inline
            job.transition(_DONE)
            job.finished_at = job.updated_at
            job.waiting_for = None
            if not job.frames:
                job.frames = ENDED_CURSOR
            job.result = result
            try:
                nowait[1](job, now)  # the step's clock read: the store reads none of its own
            except BaseException:
                job.status = previous  # not recorded: ending it may be tried again
                raise
            self._ended(job, _DONE, "", now)
        finally:
            self._heard_of_end(job)
        return True

    def _end_soon(self, job: Job, result: Any, now: float) -> bool:
        """``finish(job, DONE)`` with the write left to the store (``update_soon``): the
        step goes on without waiting for it; what follows a recorded end (waiters woken,
        the step's event let go of) follows once the store says it is written, and a
        write that failed ends the job as an awaited one would have (_end_unwritten)."""
        assert self._update_soon is not None
        if job.status in TERMINAL:
            return True
        if job.id in self._end_pending:  # a write of its own still on its way
            return False
        previous = job.status
        self._mark_end(job, Status.DONE, result, None, "")

        def written(error: BaseException | None) -> None:
            if error is None:
                self._ended(job, Status.DONE, "", now)
                self._heard_of_end(job)
                self._let_go(job)
                return
            job.status = previous  # not recorded: ending it may be tried again
            self._heard_of_end(job)
            try:
                self.spawn(self._end_unwritten, job, error)
            except RuntimeError:  # the dispatcher has stopped: the event stays pending
                _log.error("pipework: the end of job %s was not written", job.id, exc_info=error)

        if not self._update_soon(job, written):
            job.status = previous
            return False
        self._end_pending[job.id] = None
        return True

    def _hand_off_soon(self, soon: Callable[..., bool], job: Job) -> bool:
        """A hand-off's write of the record and the next step's event, with no wait (as
        _end_soon): its step's event is let go of once both are in Redis."""

        def written(error: BaseException | None) -> None:
            if error is None:
                self.changed(job)
                self._let_go(job)
                return
            try:
                self.spawn(self._end_unwritten, job, error)
            except RuntimeError:  # the dispatcher has stopped: the event stays pending
                _log.error(
                    "pipework: the hand-off of job %s was not written", job.id, exc_info=error
                )

        if job.id in self._end_pending or not soon(self.store, job, RunJob(job.id), written):
            return False
        self._end_pending[job.id] = None
        return True

    async def _end_unwritten(self, job: Job, error: BaseException) -> None:
        """A step's end the store did not write (``update_soon``): the job ends as if the
        step's awaited write had raised ``error``, then its event is let go of."""
        try:
            with trio.CancelScope(shield=True):
                await self._end_unsettled(job, trio.CancelScope(), error)
        finally:
            self._let_go(job)

    def _let_go(self, job: Job) -> None:
        """Let go of the step's event kept while the job's write was on its way."""
        event = self._end_pending.pop(job.id, None)
        if event is not None and self._step_ended is not None:
            self._step_ended(event)

    def _heard_of_end(self, job: Job) -> None:
        """Tell whoever waits for the job that it ended."""
        if self.on_finished is not None and job.parent is None:
            self.on_finished(job)
        stream = self._streams.pop(job.id, None)
        if stream is not None:
            stream.close()
        waiter = self._waiters.pop(job.id, None)
        if waiter is not None:
            waiter.set()

    async def _record_end(
        self,
        job: Job,
        status: Status,
        result: Any,
        exc: BaseException | None,
        where: str,
        now: float | None,
    ) -> None:
        previous = job.status
        self._mark_end(job, status, result, exc, where)
        if job.parent is None:  # a branch's record is dropped once it reports
            try:
                nowait = self.nowait
                if nowait:
                    nowait[1](job)
                else:
                    await self.store.update(job)
            except BaseException:
                job.status = previous  # not recorded: ending it may be tried again
                raise
        self._ended(job, status, where, now)
        if job.join is not None:
            await cancel_branches(self, job)
        if job.parent is not None:
            stage = None if job.join_id is None else self.flight.in_step.get(job.join_id)
            if stage is None or job.id not in self.flight.unstored:
                await report_branch(self, job)
            elif stage.durable:
                await stage.report_late(job)
            else:
                await stage.report(job)

    def _mark_end(
        self, job: Job, status: Status, result: Any, exc: BaseException | None, where: str
    ) -> None:
        job.transition(status)
        job.finished_at = job.updated_at  # the transition's wall-clock read
        job.waiting_for = None
        if not job.frames:  # it ran to the end of its chain: nothing to keep of the cursor
            job.frames = ENDED_CURSOR
        if status is _DONE:
            job.result = result
        elif exc is not None:
            job.exception = exc
            if job.parent is None:
                self.exceptions.put(job.id, exc, self.clock())
            job.error = ErrorInfo(
                type(exc).__name__, str(exc), where, getattr(exc, "http_status", 500)
            )

    def _ended(self, job: Job, status: Status, where: str, now: float | None) -> None:
        """What follows a recorded end: observers, the job's duration, its log line."""
        if self.observers:
            self.changed(job)
        duration = (self.clock() if now is None else now) - job.accepted_at
        if job.parent is None and job.plan != INTERNAL_PLAN:
            if status is _DONE:
                observe = self._job_done.get(job.chain)
                if observe is None:
                    metrics = self.metrics
                    observe = metrics.observer(metrics.job_duration, (job.chain, status.value))
                    self._job_done[job.chain] = observe
                observe(duration)
            else:
                self.metrics.observe(self.metrics.job_duration, (job.chain, status.value), duration)
        level = logging.INFO if status in _ORDINARY_ENDS else logging.WARNING
        if job_logger.isEnabledFor(level):
            self._log_end(job, status, level, duration, where)

    @staticmethod
    def _log_end(job: Job, status: Status, level: int, duration: float, where: str) -> None:
        log_job(
            "job finished" if job.parent is None else "branch finished",
            level,
            None,
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            key=job.key,
            duration=round(duration, 6),
            outcome=status.value,
            stage=where or None,
            error=None if job.error is None else f"{job.error.type}: {job.error.message}",
        )

    async def wait_finished(self, job_id: str) -> None:
        waiter = self._waiters.setdefault(job_id, Wake())
        await waiter.wait()

    def open_stream(self, job_id: str, buffer: int) -> trio.MemoryReceiveChannel[Any]:
        send, receive = trio.open_memory_channel[Any](buffer)
        self._streams[job_id] = send
        return receive

    @staticmethod
    def note(exc: BaseException, job: Job, where: str) -> None:
        note = f"pipework: in {where} (job {job.id}, correlation id {job.correlation_id})"
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)

    # -- what a pipe's Context calls -----------------------------------------------------

    async def report_progress(
        self, ctx: Context, done: float, total: float | None, message: str | None
    ) -> None:
        job = self.flight.running.get(ctx.job_id)
        if job is not None and job.parent is None:  # the job's own pipe, in this step
            job.progress = Progress(done, total, message)
            job.updated_at = time.time()
            await self.store.update(job)
            self.changed(job)
            return

        # A pipe inside a parallel branch reports on the job its caller follows.
        def report(root: Job) -> bool:
            root.progress = Progress(done, total, message, branch=ctx.path)
            root.updated_at = time.time()
            return True

        root = await self._change_parent(await self._root_of(ctx.job_id), report)
        if root is not None:
            self.changed(root)

    async def _root_of(self, job_id: str) -> Job:
        """The top-level job a branch (at any depth) belongs to."""
        job = self.flight.running.get(job_id) or await self.store.get(job_id)
        while job.parent is not None:
            # A parent in a step (its stage runs there) is the step's record, not the store's.
            job = self.flight.running.get(job.parent) or await self.store.get(job.parent)
        return job

    def callback_url(self, ctx: Context, signal: str, ttl: float) -> str:
        if self.callback_factory is None:
            raise RuntimeError(
                "callback URLs need an HTTP container serving this engine; in process, "
                "call engine.signal(job_id, name, payload) instead"
            )
        return self.callback_factory(ctx.job_id, signal, ttl)

    async def emit(self, ctx: Context, chunk: Any) -> None:
        job = self.flight.running.get(ctx.job_id)
        if job is None or job.parent is not None:
            job = await self._root_of(ctx.job_id)
            own = False
        else:
            own = True
        stream = self._streams.get(job.id)
        if stream is not None:
            try:
                await stream.send(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The reader left (a stream route's client hung up): nobody reads the job's
                # chunks any more, so it is cancelled, as a hang-up cancels it; the cancel
                # lands here when it is this step's (a branch's lands with its stage's).
                self._streams.pop(job.id, None)
                if job.status not in TERMINAL:
                    await self.cancel(job)
                await trio.lowlevel.checkpoint_if_cancelled()
            return
        if self.emit_elsewhere is not None and await self.emit_elsewhere(job.id, chunk):
            return
        if own:  # the step writes its own job back
            _append_output(job, chunk)
        else:  # a branch's parent is written here

            def append(root: Job) -> bool:
                _append_output(root, chunk)
                return True

            await self._change_parent(job, append)

    async def keep_signal(self, job: Job, name: str, payload: Any) -> bool:
        """Keep an early signal on an active job until it suspends for it. A job in a step
        here keeps it on the step's own record, which the step writes back. False if the
        record changed since ``job`` was read from a shared store (a step wrote it
        meanwhile, without the lock the caller holds), or the step here has just parked
        it: nothing is kept; read it again."""

        def keep(record: Job) -> None:
            # The step's record may hold what the store's does not yet: checked again.
            check_early_signal(record, name)
            record.signals[name] = payload

        return await self._note_signal(job, keep)

    async def note_taken(self, job: Job, name: str) -> bool:
        """Remember on ``job`` that one of its branches took the signal ``name`` sent to
        it, as :meth:`keep_signal` keeps one (False: read it again and retry)."""
        return await self._note_signal(job, lambda record: record.took(name))

    async def _note_signal(self, job: Job, change: Callable[[Job], None]) -> bool:
        """``change`` made on the job's record where it stays: the step's, if one runs the
        job here, else ``job``'s, written back unless the store's changed since it was read
        (False, as for :meth:`keep_signal`)."""
        running = self.flight.running.get(job.id)
        if running is not None:
            if running is not job and running.status is Status.SUSPENDED:
                # Its step parked it, and the write of its record is on its way: a signal
                # kept on the step's record now would go with it. Read it again.
                return False
            change(running)
            return True
        change(job)
        return await self.abilities.update_unless_changed(job)


def check_early_signal(job: Job, name: str) -> None:
    """Raise SignalError unless ``job`` (active, and waiting for no signal ``name``) may
    keep a signal ``name`` until it suspends for it."""
    if name in job.delivered:
        # A repeat (a backend retrying its callback, say): one signal resumes the job
        # once, and it is not waiting for this one now.
        raise SignalError(
            f"signal {name!r} was already delivered to job {job.id}, which is not waiting "
            "for it now; this one is refused, not kept"
        )
    if job.status is Status.SUSPENDED:
        raise SignalError(
            f"job {job.id} is suspended waiting for signal {job.waiting_for!r}, not {name!r}"
        )
    if name in job.signals:
        raise SignalError(f"signal {name!r} is already pending for job {job.id}")


def _log_hand_off(job: Job) -> None:
    """The log line of a hand-off, through the queue or run on in its step (job.key is the
    new key)."""
    if job_logger.isEnabledFor(logging.INFO):
        log_job(
            "job handed off",
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            key=job.key,
            status=job.status.value,
        )


def _is_job_timeout(exc: BaseException) -> bool:
    return isinstance(exc, DeadlineExceeded) and exc.scope == "job"


def chain_where(d: Dispatcher, job: Job) -> str:
    try:
        return d.chain_of(job).describe(path_of(job))
    except Exception:  # only a description, for an error already raised
        return f"chain {job.chain!r}"


class _Timeout(Exception):
    """The pipe's deadline (its own, a stage's or the job's) ran out."""


def _invoke(pipe: Pipe, ctx: Context) -> Awaitable[None]:
    """The pipe's awaitable, for the step to await directly: one coroutine frame fewer on
    every resume."""
    if pipe.blocking:
        return pipe.run(ctx)
    awaitable = pipe.fn(ctx)
    if type(awaitable) is not CoroutineType and not inspect.isawaitable(awaitable):
        raise PipeContractError(
            f"pipe {pipe.name!r} returned {type(awaitable).__name__}, not an awaitable; "
            "a pipe is an `async def` (or declared blocking=True)"
        )
    return awaitable


def _cancellation_in(raised: BaseException, describe: Callable[[], str]) -> BaseException | None:
    """The part of a pipe's exception that is a cancellation from outside the pipe (the
    step's or the engine's), to travel on; None when there is none. Errors raised alongside
    a cancellation are logged: the cancellation decides the job's end."""
    if isinstance(raised, trio.Cancelled | KeyboardInterrupt):
        return raised
    if not isinstance(raised, BaseExceptionGroup):
        return None
    if raised.split(Suspend)[0] is not None:
        return None  # a contract error, whatever else is in the group
    cancelled, errors = raised.split((trio.Cancelled, KeyboardInterrupt))
    if cancelled is not None and errors is not None:
        _log.warning("errors while %s was being cancelled", describe(), exc_info=errors)
    return cancelled


def _pipe_error(raised: BaseException, path: str) -> BaseException:
    """What a pipe's exception (not a cancellation) fails its job with: the exception
    itself, or a PipeContractError caused by it when a job cannot end with it."""
    if isinstance(raised, BaseExceptionGroup) and raised.split(Suspend)[0] is not None:
        exc: BaseException = PipeContractError(
            f"ctx.suspend() was called from a child task inside {path}; a pipe suspends "
            "from its own task (close the nursery first, then suspend)"
        )
    elif isinstance(raised, Exception):
        return raised
    else:
        exc = PipeContractError(
            f"{path} raised {type(raised).__name__}, which is not an error a job can end "
            "with; raise an Exception subclass"
        )
    exc.__cause__ = raised
    return exc


def backend_trouble(exc: BaseException) -> bool:
    """Whether ``exc`` points at the key's backend (it failed, could not be reached or was
    too slow), as opposed to a bug in the pipe: only such trouble may shrink an adaptive
    limit. Only pipework's errors and the standard library's are known here: the backends
    layer turns its clients' failures into pipework's, and a pipe that calls a backend
    through a client of its own raises ``BackendError`` to count (docs/design.md)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(backend_trouble(e) for e in exc.exceptions)
    if isinstance(exc, BackendError):
        return exc.status is None or exc.status >= 500
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    # A bare OSError: trio's "all attempts to connect failed", socket errors. Anything
    # else, an HTTP client's own exception too, is the pipe's.
    return type(exc) is OSError


def _append_output(job: Job, chunk: Any) -> None:
    # A record has no output list until its first chunk (most jobs never emit).
    if isinstance(job.output, list):
        job.output.append(chunk)
    else:
        job.output = [chunk]
