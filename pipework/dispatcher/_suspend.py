"""Suspend and resume: a job parked until a named signal comes, or its time runs out.

A pipe's ``ctx.suspend(name)`` ends its pipe; the job is parked ``suspended`` with its
cursor after that pipe and no slot held, and a timer is set for the earlier of the
suspension's timeout and the cursor's deadline. A signal resumes it (:meth:`deliver`: its
payload written to the state, the job queued to go on at its cursor), the timer expires it.

A signal may come early, while the job is still queued or running: it is kept on the job
(its mailbox) until the job suspends for it, and a signal sent to a parent waiting at a
join is kept there for whichever branch suspends for it first. One signal resumes one job
once: a repeat is refused (:func:`check_early_signal`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import trio

from .._errors import DeadlineExceeded, JobCancelled, JobNotFound, SignalError
from .._logging import log_job
from ..pipes._pipe import Suspend
from ..pipes._stages import Chain
from ..pipes._state import check_state
from ._abilities import Abilities
from ._cursor import next_key, path_of, top_node
from ._ends import Ends
from ._events import Expire, Resume
from ._flight import Flight, Hooks
from ._job import Job
from ._lookup import ChainLookup
from ._outcomes import frame_timeout, note
from ._status import TERMINAL, Status
from ._timers import SuspendTimers

__all__ = ["Suspensions", "check_early_signal"]


class Suspensions:
    def __init__(
        self,
        abilities: Abilities,
        flight: Flight,
        hooks: Hooks,
        ends: Ends,
        timers: SuspendTimers,
        plans: dict[int, ChainLookup],
    ) -> None:
        self._abilities = abilities
        self._store = abilities.store
        self._flight = flight
        self._hooks = hooks
        self._ends = ends
        self._timers = timers
        self._plans = plans

    async def suspend(self, job: Job, chain: Chain, suspend: Suspend, path: str) -> bool:
        """Park ``job`` (its pipe raised ``suspend``); True when the signal had come already
        and the step goes on at once, False when the job is parked (or ended)."""
        check_state(job.state)
        flight = self._flight
        unstored = job.parent is not None and job.id in flight.unstored
        if unstored:
            assert job.join_id is not None
            stage = flight.in_step.get(job.join_id)
            if stage is None or stage.over:
                # Its stage resolved while this branch ran: it is cancelled, not parked.
                job.cancel_requested = True
                exc = JobCancelled(f"job {job.id} was cancelled")
                await self._ends.finish(job, Status.CANCELLED, exc=exc)
                return False
        holder = await self._mailbox_with(job, suspend.signal)
        if holder is not None and await self._take_kept(job, holder, suspend):
            # It came while we ran: no need to park.
            if not unstored:
                await self._store.update(job)
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
            await flight.in_step[job.join_id].outlive(job)
        else:
            await self._store.update(job)
            if suspend.signal in job.signals:
                # Kept on the record by another process while the pipe ran (a shared store's
                # write takes such signals into the job): the job takes it now.
                self._hooks.changed(job)
                if await self.deliver(job, suspend.signal, job.signals.pop(suspend.signal)):
                    return False
                # Changed again since: the record holds the signal still, and its timer
                # ends the job if nothing resumes it.
        self._hooks.changed(job)
        if job.suspend_deadline < math.inf:
            self._timers.expire_at(job.suspend_deadline, job.id, job.version)
        log_job(
            "job suspended",
            logging.DEBUG,
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
            parent = current.parent
            if parent is None:
                return None
            # A parent in a step keeps early signals on the step's record.
            current = self._flight.running.get(parent) or await self._store.get(parent)
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

        if await self.change_parent(holder, take) is None:
            return False
        job.state[suspend.into] = taken[0]
        job.took(suspend.signal)
        return True

    async def change_parent(self, parent: Job, change: Callable[[Job], bool]) -> Job | None:
        """Apply ``change`` to a branch's parent (or root) and write it back; the record
        written, or None if ``change`` found nothing to do or the parent ended.

        A parent no step here holds is read again and written under its lock on a shared
        store: its branches' ends change its join meanwhile, and writing back the copy read
        before would lose them (the parent would wait at its join for ever)."""
        store = self._store
        if self._abilities.shared_store is None or self._flight.running.get(parent.id) is parent:
            # In this process's memory: no checkpoint between the read and the change.
            if not change(parent):
                return None
            await store.update(parent)
            return parent
        async with self._abilities.lock(parent.id):
            try:
                parent = await store.get(parent.id)
                if parent.status in TERMINAL or not change(parent):
                    return None
                await store.update(parent)
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
                child = await self._store.get(child_id)
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
        resume = Resume(job.id, signal)
        queue = self._abilities.shared_queue
        try:
            # On a shared queue the record and its Resume go in one write: a process that
            # dies after the record's write must not leave the job queued with no event.
            written = (
                None
                if queue is None
                else await queue.update_unless_changed_and_put(self._store, job, resume)
            )
            if written is None:
                if not await self._abilities.update_unless_changed(job):
                    return False
                self._abilities.queue.put_nowait(resume)
            elif not written:
                return False
        except JobNotFound:  # ended since: the caller's read says how
            return False
        self._hooks.changed(job)
        log_job(
            "job resumed",
            logging.DEBUG,
            correlation_id=job.correlation_id,
            job_id=job.id,
            route=job.chain,
            signal=signal,
            status=job.status.value,
        )
        return True

    async def expire(self, event: Expire) -> None:
        """A suspension's timer fired: the job fails (or expires, at its own deadline)
        unless it moved on since."""
        try:
            try:
                job = await self._store.get(event.job_id)
            except JobNotFound:
                return  # finished and dropped since: a deadline left in the heap
            if job.status is not Status.SUSPENDED or job.version != event.version:
                return  # resumed or finished meanwhile: the timer lost the race
            assert job.suspend_deadline is not None
            chain = self._plans[job.plan].get_chain(job.chain)
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
                exc = frame_timeout(job, chain, top, where, waiting)
            note(exc, job, where)
            status = Status.EXPIRED if exc.scope == "job" else Status.FAILED
            await self._ends.finish(job, status, exc=exc, where=exc.where)
        finally:
            self._abilities.queue.ack(event)

    # -- early signals ----------------------------------------------------------------------

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
        running = self._flight.running.get(job.id)
        if running is not None:
            if running is not job and running.status is Status.SUSPENDED:
                # Its step parked it, and the write of its record is on its way: a signal
                # kept on the step's record now would go with it. Read it again.
                return False
            change(running)
            return True
        change(job)
        return await self._abilities.update_unless_changed(job)


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
