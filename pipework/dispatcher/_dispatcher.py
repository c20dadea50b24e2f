"""The dispatcher: takes events off the queue and hands each to its handler.

A ``RunJob`` or a ``Resume`` starts a step (``_step.py``): what one worker does with one
slot, pipes run from the cursor while they share the slot's key. An ``Expire`` is a
suspension's timer (``_suspend.py``), a ``BranchDone`` a forked branch's end reaching its
join (``_forked.py``); both are short bookkeeping on the job pool, handled in the loop one
at a time. Nothing survives a step but the job record, so any worker can take the next one
(see docs/design.md).

The dispatcher makes the engine's parts and wires them, each handed what it works with:

=================  ==========================================================================
part               owns
=================  ==========================================================================
``_abilities``     what the store, the queue and the pool can do, resolved once
``_cursor``        walking a job's cursor (no I/O)
``_flight``        what this process holds of the jobs it runs now, and the engine's hooks
``_step``          the step boundary, the slot a step holds, hand-offs, claims
``_pipe_run``      running one pipe: its context, its deadline, what its end means
``_degrade``       pipes a job can do without: skipped or answered by their fallback
``_suspend``       suspend, signals, resume, the timers' expiry (``_timers``)
``_ends``          ending jobs, cancels, waiters, retention of exception objects
``_stage``         the decisions of one run of a parallel stage (no I/O)
``_forked``        parallel stages as child jobs; ``_instep``: in the parent's step
``_ops``           what a pipe's Context calls: progress, chunks, callback URLs
``_outcomes``      sorting out what a pipe raised, naming where (no I/O)
=================  ==========================================================================
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeGuard

import trio

from .._metrics import Metrics
from ..pipes._stages import Chain
from ._abilities import Abilities
from ._degrade import NEVER_REFUSING, Degrader, Refusals
from ._ends import INTERNAL_PLAN, Ends
from ._events import BranchDone, Event, Expire, Resume, RunJob, job_of
from ._flight import Flight, Hooks
from ._forked import Forked
from ._job import Job
from ._lookup import ChainLookup
from ._ops import PipeOps
from ._pipe_run import PipeRunner
from ._queue import MemoryEventQueue
from ._status import TERMINAL
from ._step import Steps
from ._suspend import Suspensions
from ._timers import SuspendTimers

__all__ = ["INTERNAL_PLAN", "Dispatcher"]

_log = logging.getLogger("pipework.dispatcher")

#: Events handed out per pass of the dispatcher's loop. A backlog is started a few dozen
#: steps per scheduler pass rather than hundreds at once: steps that start together hold
#: their objects together (more of them survive into older GC generations, so collections
#: run more often and take longer), and beyond the free slots they queue in the pool
#: (measured: a 1-pipe job at 4.2 times a bare task with 256, 3.7 with 32; with 64
#: workers, 2.9 and 1.5; see docs/performance.md).
_BATCH: Final = 32


class Dispatcher:
    def __init__(
        self,
        registry: ChainLookup,
        abilities: Abilities,
        metrics: Metrics,
        key_label: Callable[[str], str],
        refusals: Refusals = NEVER_REFUSING,
    ) -> None:
        #: Every plan (registry) jobs may still run on, by generation: a reload adds one,
        #: and a job keeps the plan it was accepted under (its cursor means nothing elsewhere).
        self.plans: dict[int, ChainLookup] = {1: registry}
        #: What the store, the queue and the pool can do, resolved once (see _abilities.py).
        self.abilities = abilities
        self.store = abilities.store
        self.queue = abilities.queue
        #: The store's synchronous access, when it offers it.
        self.nowait = abilities.nowait
        self.flight = flight = Flight()
        self.hooks = hooks = Hooks()
        self.timers = SuspendTimers(abilities.queue, abilities.expire_at)
        self.ends = ends = Ends(abilities, flight, hooks, metrics, self.plans)
        self.suspensions = Suspensions(abilities, flight, hooks, ends, self.timers, self.plans)
        self.ops = PipeOps(abilities.store, flight, hooks, ends, self.suspensions)
        runner = PipeRunner(flight, ends, self.suspensions, abilities.pool, metrics, self.ops)
        self.degrader = runner.degrader = Degrader(
            flight, runner, metrics, refusals, grants=abilities.grants
        )
        self.forked = Forked(abilities, flight, hooks, ends, metrics, self.plans)
        self.forked.degrader = self.degrader
        ends.branches = self.forked
        self.steps = Steps(
            abilities,
            flight,
            hooks,
            ends,
            runner,
            self.forked,
            self.timers,
            metrics,
            key_label,
            self.plans,
            self.degrader,
        )
        # Handlers run in the dispatcher's loop, one at a time: only a RunJob spawns a task
        # (pipes run concurrently); the others are short bookkeeping on the job pool.
        self._handlers: dict[type[Any], Callable[[Any], Awaitable[None]]] = {
            Expire: self.suspensions.expire,
            BranchDone: self.forked.branch_done,
        }

    def chain_of(self, job: Job) -> Chain:
        return self.plans[job.plan].get_chain(job.chain)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Dispatch events until cancelled; steps run in this task's nursery."""
        flight = self.flight
        flight.clock = trio.lowlevel.current_clock().current_time
        try:
            async with trio.open_nursery() as nursery:
                flight.nursery = nursery
                nursery.start_soon(self.timers.run)
                handlers = self._handlers
                runners = self.steps.runners
                start = runners.start
                queue = self.queue
                # Only where the loop would get the event as the queue holds it: a queue
                # that changes how its batches are taken keeps every event for the loop.
                if _hands_off(queue):

                    def handoff(event: Event) -> bool:
                        # What this loop does with a step's event when a runner is parked:
                        # start cannot fail then (no task to spawn), and wakes that runner.
                        if (type(event) is RunJob or type(event) is Resume) and runners.idle:
                            start(nursery, event)
                            return True
                        return False

                    queue.handoff = handoff
                task_status.started()
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
            if _hands_off(self.queue):
                self.queue.handoff = None
            flight.nursery = None
            flight.clock = trio.current_time  # another run may have another clock

    async def _event_failed(self, event: Event, exc: Exception) -> None:
        _log.error("pipework: handling %r failed inside the engine", event, exc_info=exc)
        try:
            job = await self.store.get(job_of(event))
        except Exception:  # the store itself is what failed: the log line above is all
            return
        if job.status not in TERMINAL:
            await self.ends.fail_inside(job, exc)


def _hands_off(queue: object) -> TypeGuard[MemoryEventQueue]:
    """Whether the dispatcher may take events straight from their senders' puts."""
    return isinstance(queue, MemoryEventQueue) and (
        type(queue).get_batch is MemoryEventQueue.get_batch
    )
