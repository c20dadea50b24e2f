"""A step: what one worker does with one slot, and the boundary around it.

A step loads the job, takes a slot under the job's key (at once when one is free, else by
waiting in the pool, or refused), and runs pipes from the cursor while they share that
key; it stops at a key change (a hand-off: the job goes back through the queue, or on a
shared store runs on under a slot of the next key free at once), a suspension, a forked
parallel stage, or the end of the chain. A parallel stage whose branches would all run
under the parent's slot runs inside the step (``_instep.py``).

**Each step is a boundary.** Whatever a pipe or the bookkeeping raises — errors, exception
groups, cancellations from inside a library's nursery — ends there as the job's outcome;
only the engine's own shutdown (a cancellation from outside the step) travels on. A step
always leaves its job final or waiting on purpose (``Ends.unsettled`` ends it otherwise).

A new job's first step may be **claimed** with its record (a shared queue that shares the
store's round trips, ``hold_first``): the process that writes the record holds a slot
for it meanwhile, and its step starts with no status write and no read of the event.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Literal

import trio

from .. import _tracing
from .._errors import JobNotFound, PipeworkError, Rejected, StoreUnavailable
from .._logging import job_logger, log_job
from .._metrics import Metrics
from ..pipes._pipe import Pipe
from ..pipes._stages import Chain, Parallel
from ..pipes._state import check_state
from ._abilities import Abilities
from ._boundary import split_outside
from ._branch_runners import BranchRunners
from ._cursor import advance, chain_key
from ._degrade import Degrader
from ._degrade_core import Reason
from ._ends import INTERNAL_PLAN, Ends
from ._events import Resume, RunJob
from ._flight import Claim, Flight, Hooks
from ._forked import Forked
from ._instep import InStepStage, StageParts
from ._job import Job
from ._lookup import ChainLookup
from ._outcomes import invoke, note
from ._pipe_run import PipeRunner
from ._runners import StepRunners
from ._status import QUEUED, RUNNING, TERMINAL, Status
from ._timers import SuspendTimers

__all__ = ["Steps"]


class Steps:
    def __init__(
        self,
        abilities: Abilities,
        flight: Flight,
        hooks: Hooks,
        ends: Ends,
        runner: PipeRunner,
        forked: Forked,
        timers: SuspendTimers,
        metrics: Metrics,
        key_label: Callable[[str], str],
        plans: dict[int, ChainLookup],
        degrader: Degrader,
    ) -> None:
        self._abilities = abilities
        self._store = abilities.store
        self._queue = abilities.queue
        self._nowait = abilities.nowait
        self._grant = abilities.grant
        self._release = abilities.release
        self._flight = flight
        self._hooks = hooks
        self._ends = ends
        self._runner = runner
        self._forked = forked
        self._timers = timers
        self._metrics = metrics
        self._key_label = key_label
        self._plans = plans
        self._degrader = degrader
        #: The tasks steps run in, each kept for further steps (see _runners.py).
        self.runners = StepRunners(self.step)
        #: The tasks in-step branches run in (see _branch_runners.py).
        self.branch_runners = BranchRunners(flight.in_step)
        #: What every in-step stage works with.
        self._parts = StageParts(
            abilities, flight, ends, runner, forked, self, self.branch_runners, metrics, degrader
        )
        # The observers of slot waits by key label: no label tuples built per step.
        self._waits: dict[str, Callable[[float], None]] = {}

    def start(self, event: RunJob | Resume) -> None:
        """Run the event's step in a task of the dispatcher's."""
        nursery = self._flight.nursery
        assert nursery is not None, "the dispatcher is not running"
        self.runners.start(nursery, event)

    # -- a new job's first step, claimed as it is created ---------------------------------

    def hold_first(self, job: Job) -> object | None:
        """A worker slot for a new job's first step, when one is free at once and the queue
        can hand the job's event to this process as the record is written (a Redis queue's
        ``create_and_claim``): the record is then written running, and the step starts
        with no status write of its own and no read of the event. None otherwise. The
        caller writes the record, then calls :meth:`start_claimed` or :meth:`let_go_first`.
        A cancel before the step starts (here, or published from elsewhere) is noted, and
        the step then runs nothing."""
        if not self._abilities.claims or self._flight.nursery is None:
            return None
        held = self._grant(job.key)
        if held is not None:
            self._flight.claiming[job.id] = Claim(held, self._flight.clock())
        return held

    def start_claimed(self, event: RunJob) -> None:
        """Start the step of a job whose event was claimed with its record (hold_first)."""
        claim = self._flight.claiming[event.job_id]
        claim.event = event
        try:
            self.start(event)
        except BaseException:
            # The dispatcher stopped: the event stays pending, taken over by a live process.
            self.let_go_first(event.job_id)
            raise

    def let_go_first(self, job_id: str) -> None:
        """The slot hold_first held, not used (the record was not written, or its event was
        not claimed): given back with no hold time counted."""
        claim = self._flight.claiming.pop(job_id, None)
        if claim is not None:
            self._abilities.withdraw(claim.held)

    # -- a step --------------------------------------------------------------------------

    async def step(self, event: RunJob | Resume, scope: trio.CancelScope) -> bool:
        """One step of one job, in ``scope`` (its runner's, entered and uncancelled): the
        boundary that always leaves its job final or waiting. Returns whether ``scope`` may
        have been cancelled: only a cancel of the job (``Ends.cancel``, ``Ends.interrupt``,
        which mark the step's record first) or a deadline set on it can cancel it.

        Whatever a pipe or the bookkeeping raises — errors, exception groups, cancellations
        from inside a library's nursery — ends here as this job's outcome; only the engine's
        own shutdown (a cancellation from outside the step) travels on."""
        flight, abilities = self._flight, self._abilities
        acked = False
        kept = False  # the event left to its queue to hand out again
        claim = None  # the slot its creator holds for it (hold_first), until the step runs
        if flight.claiming:
            claim = flight.claiming.get(event.job_id)
            if claim is not None and claim.event is not event:
                claim = None
        try:
            try:
                nowait = self._nowait
                own = None
                if nowait:
                    job = nowait[0](event.job_id)
                else:
                    # A shared store may hold the record as it wrote it (a job it created or
                    # handed off): no read, and the status write below says if it is stale.
                    shared = abilities.shared_store
                    if shared and type(event) is RunJob and not abilities.reclaimed(event):
                        own = shared.read_own(event.job_id)
                    job = own or await self._store.get(event.job_id)
            except StoreUnavailable:
                # The job is not read, so nothing is known of it: its event must not be
                # acknowledged as if its step ran (the job would stay queued, its event
                # gone). A shared queue lets go of it, to be taken again once idle.
                shared_queue = abilities.shared_queue
                if shared_queue is not None:
                    shared_queue.let_go(event)
                    kept = True
                return False
            except PipeworkError:
                return False
            if job.status is RUNNING and (claim is not None or abilities.reclaimed(event)):
                # Its step died with the process that ran it (a shared queue handed the
                # event on), or it is claimed and was marked running with its record: run
                # it from the cursor, the last pipe that finished.
                job.transition(QUEUED)
            if job.status is not QUEUED or (claim is not None and claim.cancelled):
                if job.status is Status.SUSPENDED and abilities.reclaimed(event):
                    self._timers.rearm(job)  # its step died before its timer was surely stored
                # Cancelled or finished while the event waited (a claimed job: while its
                # record was written; the cancel recorded its end): nothing to run.
                return False
            record = job  # what a cancel marks, whichever record the step ends with
            flight.scopes[job.id] = scope
            flight.running[job.id] = job
            if claim is not None:  # from here a cancel goes through the step's scope
                del flight.claiming[job.id]
            settled = False  # the job was left waiting on purpose (hand-off, suspend, join)
            escaped: BaseException | None = None
            now = flight.clock()
            span = None
            if _tracing.ACTIVE.on and job.plan != INTERNAL_PLAN:
                span = _step_span(job)
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
                        self._queue.ack(event)
                        acked = True
                        self.waited(job.key, 0.0)
                        ended = await self.run_held(job, now, True, own is job, marked, grant)
                        settled = True
                    finally:
                        end = flight.clock() if ended is None else ended
                        self._release(grant[0], grant[1], end)
                elif self._degrader.grants and await self._without_slot(job):
                    # Its next pipe is one it can do without: degraded, holding no slot.
                    settled = True
                else:
                    # A resumed job carries an outside fact (a payment, an approval): it
                    # waits out the load up to its deadline rather than be refused, as
                    # does a job admitted when it was accepted (an async job's 202).
                    # Every other step fails fast under load, as the pool's bounds intend.
                    continuing = isinstance(event, Resume) or job.admitted
                    slot = abilities.pool.slot(
                        job.key, deadline=job.deadline, continuing=continuing
                    )
                    if span is not None:
                        span.event("slot wait", {"pipework.key": job.key})
                    try:
                        async with slot:
                            self._queue.ack(event)
                            acked = True
                            granted = flight.clock()
                            self.waited(job.key, granted - now)
                            if span is not None:
                                span.event(
                                    "slot granted",
                                    {"pipework.key": job.key, "pipework.waited": granted - now},
                                )
                            await self.run_held(job, granted, as_read=True, own=own is job)
                            settled = True
                    except Rejected as exc:
                        if span is not None:
                            span.event("slot refused", {"pipework.key": job.key})
                        self.waited(job.key, flight.clock() - now)
                        note(exc, job, f"admission key {job.key!r}")
                        await self._ends.finish(job, Status.FAILED, exc=exc)
            except BaseException as exc:  # the step boundary: what belongs outside is re-raised
                escaped = exc
            finally:
                if flight.scopes.get(job.id) is scope:
                    del flight.scopes[job.id]
                if flight.running.get(job.id) is job:
                    del flight.running[job.id]
                if span is not None:
                    span.set("pipework.status", job.status.value)
                    span.end(escaped)
            if flight.left_to_join and job.id in flight.left_to_join:
                # Its in-step stage turned durable: the record is the join's now, so a step
                # ended early reads it afresh before ending the job.
                flight.left_to_join.discard(job.id)
                if not settled:
                    with trio.CancelScope(shield=True):
                        job = await self._store.get(job.id)
            if job.status not in TERMINAL and not settled:
                with trio.CancelScope(shield=True):
                    await self._ends.unsettled(job, scope, escaped)
            if escaped is not None:
                outside, _ = split_outside(escaped)
                if outside is not None:
                    raise outside
            return record.cancel_requested or scope.deadline != math.inf
        finally:
            if claim is not None:  # its slot was not used: the step ran nothing
                flight.claiming.pop(event.job_id, None)
                abilities.withdraw(claim.held)
            if not kept:
                if not acked:
                    self._queue.ack(event)
                pending = self._ends.pending
                if pending and pending.get(event.job_id, event) is None:
                    pending[event.job_id] = event  # let go of once the end is written
                else:
                    abilities.step_ended(event)  # a shared queue lets go of it only now

    def waited(self, key: str, seconds: float) -> None:
        """How long a step waited for its slot under ``key`` (the pool-wait histogram)."""
        label = self._key_label(key)  # the pool's configured keys may change: asked each time
        observe = self._waits.get(label)
        if observe is None:
            metrics = self._metrics
            observe = self._waits[label] = metrics.observer(metrics.pool_wait, (label,))
        observe(seconds)

    # -- the pipes under a held slot ---------------------------------------------------------

    async def run_held(
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
        chain = self._plans[job.plan].get_chain(job.chain)
        hooks = self._hooks
        unstored = self._flight.unstored
        held = job.key
        job.transition(RUNNING)
        if marked:  # written running with its record (hold_first)
            if hooks.observers:
                hooks.changed(job)
        elif job.parent is None or job.id not in unstored:
            if not await self._write_running(job, as_read, own):
                return now
            if hooks.observers:
                hooks.changed(job)
        frames = job.frames
        # A flat sequence of pipes (most chains, most branches) is walked as a list; a
        # sequence holding stages walks the cursor's frames (advance).
        flat = None
        if len(frames) == 1:
            sequence: Any = chain.node_at(job.root) if job.root else chain.root  # a Serial
            flat = sequence.flat
        runner = self._runner
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
                pipe = advance(job, chain, self._flight.clock)
            if pipe is None:
                if job.parent is not None:
                    result = None  # a branch's result is its delta, sent to the join
                elif chain.result is None:
                    result = job.state
                else:
                    result = job.state.get(chain.result)
                if not self._ends.done_nowait(job, result, now):
                    await self._ends.finish(job, Status.DONE, result=result, now=now)
                return now
            if isinstance(pipe, Parallel):
                if not pipe.in_step or not self._shares_slot(job, chain, pipe):
                    await self._forked.fork(job, chain, pipe)  # the slot is released on return
                    return now
                if not await InStepStage(self._parts, job, chain, pipe).run():
                    return now
                now = trio.current_time()
                flat = None
                continue
            key = pipe.key or job.pool_key or chain.key
            # A pipe the job can do without: degraded or run through the degrader.
            degrade: Reason | Literal[False] | None = None
            if pipe.degradable:
                degrade = self._degrader.before(pipe, key, frames[-1].deadline, now) or False
            if key == held or degrade:
                pass  # degraded under the slot held: no hand-off to a key it will not use
            elif slot is not None and await self._go_on_under(job, key, slot, now):
                held = key
            else:
                job.key = key
                job.transition(QUEUED)
                if job.parent is not None and job.id in unstored:
                    return now  # an in-step branch: its task takes the next key's slot
                await self._hand_off(job)
                return now
            # The write of the cursor is left out when the step's next write carries it
            # anyway, with nothing run in between: the job's end or its hand-off.
            if flat is not None:  # is this the flat sequence's last pipe, or its key's last?
                following = frames[0].index + 1
                then_writes = (
                    following >= len(flat)
                    or (flat[following].key or job.pool_key or chain.key) != held
                )
            else:
                then_writes = False
            top = frames[-1]
            if degrade is not None:
                if degrade:
                    ended = await self._degrader.instead(job, chain, pipe, degrade, now, top)
                else:
                    ended = await self._degrader.attempt(job, chain, pipe, now, top)
            else:
                # The pipe runs in this frame (runner.run's parts, no coroutine of its own).
                ctx = runner.context(job, chain, pipe, now, top)
                try:
                    if ctx.deadline == math.inf:
                        await invoke(pipe, ctx)
                        await trio.lowlevel.checkpoint_if_cancelled()
                        check_state(ctx.state)
                    else:
                        await runner.call(pipe, ctx, job)
                except BaseException as raised:  # sorted out there; a cancellation travels on
                    ended = await runner.raised(job, chain, pipe, now, raised, ctx, top)
                else:
                    ended = runner.ok(job, pipe, now, ctx, top)
            if ended is None:
                return now  # it failed, timed out or was suspended: the step is over
            now = ended
            if not then_writes and (job.parent is None or job.id not in unstored):
                nowait = self._nowait
                if nowait:
                    nowait[1](job)
                else:
                    await self._store.update(job)
            if len(frames) != 1:
                flat = None

    async def _without_slot(self, job: Job) -> bool:
        """No slot is free at once under the job's key. When the pipe its cursor is at is
        one the job can do without, it is degraded here, holding none, and the job goes on:
        it ends (nothing follows), or is handed off to its next step's key. False, with
        nothing done, otherwise: the step waits for a slot."""
        chain = self._plans[job.plan].get_chain(job.chain)
        degrader = self._degrader
        whole = degrader.branch_pending(job, chain)
        if whole is not None:  # a branch it can do without, not started yet: degraded whole
            degrader.branch_unheld(job, chain, *whole)
            await self._ends.finish(job, Status.DONE, now=self._flight.clock())
            return True
        pipe = degrader.pending(job, chain)
        if pipe is None:
            return False
        ended = await degrader.unheld(job, chain, pipe, self._flight.clock())
        if ended is None:
            return True  # its fallback failed or suspended the job: the step is over
        following = advance(job, chain, self._flight.clock)
        if following is None:
            result = _result(job, chain)
            if not self._ends.done_nowait(job, result, ended):
                await self._ends.finish(job, Status.DONE, result=result, now=ended)
            return True
        job.key = chain_key(job, chain, following)
        job.transition(QUEUED)
        await self._hand_off(job)
        return True

    async def _write_running(self, job: Job, as_read: bool, own: bool) -> bool:
        """The job's record written ``running`` (readers see it at once); False when there
        is nothing to run: it ended meanwhile, or the store's record moved on."""
        try:
            nowait = self._nowait
            if nowait:
                nowait[1](job)
                return True
            # A shared store may write only what changed since the read: the status.
            shared = self._abilities.shared_store
            if shared is None or not as_read:
                await self._store.update(job)
            elif own:
                if not await shared.update_status(job, verify=True):
                    # Written elsewhere since this store wrote it: nothing runs on a stale
                    # record; the job's next step reads it afresh.
                    self._queue.put_nowait(RunJob(job.id))
                    return False
            else:
                await shared.update_status(job)
        except JobNotFound:
            # Ended while this step loaded it (a cancel, here or in another process,
            # reached a shared store first): there is nothing left to run.
            return False
        return True

    async def _hand_off(self, job: Job) -> None:
        """Send the job on to its next key's step: its record and a new event."""
        hooks = self._hooks
        # A shared queue that writes the record and the next event together (Redis), if it
        # can without this step waiting for the write (see Ends.hand_off_soon).
        shared_queue = self._abilities.shared_queue
        if shared_queue is None or not self._ends.hand_off_soon(
            shared_queue.update_and_put_soon, job
        ):
            if shared_queue is not None and await shared_queue.update_and_put(
                self._store, job, RunJob(job.id)
            ):
                hooks.changed(job)
            else:
                await self._store.update(job)
                hooks.changed(job)
                self._queue.put_nowait(RunJob(job.id))
        _log_hand_off(job)

    def _shares_slot(self, job: Job, chain: Chain, stage: Parallel) -> bool:
        """Whether every branch of the stage would run under the parent's slot (its key,
        not limited). Only such a stage runs inside the step: a branch that needed a slot
        of its own would wait for it while the parent holds one, and parents holding every
        slot would leave their branches none (a stage forked as child jobs holds nothing
        while its branches wait)."""
        held = job.key
        if self._abilities.limited(held):
            return False
        default = job.pool_key or chain.key
        return all((default if key is None else key) == held for key in stage.branch_keys)

    async def _go_on_under(self, job: Job, key: str, slot: list[Any], now: float) -> bool:
        """A hand-off on a shared store, to a key with a slot free at once: the step trades
        its slot for that one and runs on, after one write of the record (the cursor, the
        new key, still running), where a hand-off through the queue costs a write, an event
        to read back, and its next step's status write. The step's event stays unfinished
        until the step ends, so a process that dies meanwhile leaves it to be taken over
        and run again from the cursor, as for any step. False, with nothing done, on an
        in-process store (a hand-off through its queue costs next to nothing) or if no
        slot is free at once."""
        if self._nowait or job.parent is not None:
            return False
        granted = self._grant(key)
        if granted is None:
            return False
        self._release(slot[0], slot[1], now)
        slot[0], slot[1] = granted, now
        job.key = key
        self.waited(key, 0.0)
        await self._store.update(job)  # the cursor and the key, before the next pipe runs
        if self._hooks.observers:
            self._hooks.changed(job)
        _log_hand_off(job)
        return True


def _step_span(job: Job) -> _tracing.Span:
    """The step's span, current while it runs: a child of the span the job carries (its
    request's server span), with the key it waits under and the job's id."""
    attributes: dict[str, _tracing.Attribute] = {
        "pipework.job_id": job.id,
        "pipework.chain": job.chain,
        "pipework.key": job.key,
    }
    if job.parent is not None:
        attributes["pipework.parent_job_id"] = job.parent
    return _tracing.ACTIVE.start(
        f"step {job.chain}",
        "internal",
        attributes,
        traceparent=job.traceparent,
        tracestate=job.tracestate,
        new_trace=True,  # a job submitted outside any span: the task's context is not its
    )


def _result(job: Job, chain: Chain) -> Any:
    """What a job that ran to the end of its sequence answers (as ``run_held`` says)."""
    if job.parent is not None:
        return None  # a branch's result is its delta, sent to the join
    if chain.result is None:
        return job.state
    return job.state.get(chain.result)


def _log_hand_off(job: Job) -> None:
    """The log line of a hand-off, through the queue or run on in its step (job.key is the
    new key)."""
    if job_logger.isEnabledFor(logging.DEBUG):
        log_job(
            "job handed off",
            logging.DEBUG,
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            key=job.key,
            status=job.status.value,
        )
