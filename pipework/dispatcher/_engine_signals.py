"""Delivering a signal to a job (:meth:`Engine.signal`): to the job or the branch that waits
for it, or kept until the job suspends for it; a repeat refused; on a shared store, under
the job's lock and decided again on what was written when a record changed meanwhile.

A part of :class:`~._engine.Engine` (a base it is made of), in a module of its own so the
engine reads in one sitting; the suspension itself is the dispatcher's (``_suspend.py``).
"""

from __future__ import annotations

from typing import Any

from .._errors import JobNotFound, SignalError, StoreUnavailable
from ..pipes._state import check_value
from ._abilities import Abilities
from ._dispatcher import Dispatcher
from ._job import Job
from ._status import TERMINAL
from ._store import JobStore
from ._suspend import check_early_signal

__all__ = ["JobSignals"]


class JobSignals:
    """The engine's :meth:`signal`."""

    # Made by Engine.__init__.
    store: JobStore
    _abilities: Abilities
    _dispatcher: Dispatcher

    async def signal(self, job_id: str, name: str, payload: Any = None) -> None:
        """Deliver signal ``name``: resumes the job if it is suspended waiting for it, or
        is kept until the job suspends for it if the job is still queued or running.

        Raises SignalError if the job has ended, waits for another signal, already has
        this one pending, or already took a signal of this name and is not suspended for
        it again: a repeat (of a callback, say) is refused, never kept, so of several
        sent at once exactly one is delivered."""
        check_value(payload, root="payload")
        if self._abilities.shared_store is None:
            # An in-process store: the read-check-write has no checkpoint.
            await self._signal(job_id, name, payload, [])
            return
        # A shared store: a join's update (a branch ending here or in another process)
        # must not land between this read and this write, or one of the two is lost.
        written: list[bool] = []
        try:
            async with self._abilities.lock(job_id):
                await self._signal(job_id, name, payload, written)
        except StoreUnavailable as exc:
            if written:
                # Delivered (or kept) already: what failed after must not say nothing was
                # done. The job is named: its client follows it, not sends the signal again.
                exc.maybe_done = True
                exc.job_id = job_id
            raise

    async def _signal(self, job_id: str, name: str, payload: Any, written: list[bool]) -> None:
        """``written`` gets an item once the signal is written (delivered or kept)."""
        # Each decision is made on the records as read, and written only if they are still
        # so: on a shared store a record changed since it was read (by a step, its timer, a
        # signal sent to one of its branches by their own id) sends the signal round again,
        # on what was written. On an in-process store the read, the decision and the write
        # have no checkpoint between them: concurrent signals are decided one by one.
        while True:
            job = await self.store.get(job_id)
            if job.status in TERMINAL:
                raise SignalError(
                    f"job {job_id} is {job.status.value}; "
                    f"signal {name!r} can only reach an active job"
                )
            target = await self._dispatcher.suspensions.find_waiting(job, name)
            if target is not None:
                if not await self._dispatcher.suspensions.deliver(target, name, payload):
                    continue
                written.append(True)
                if target is not job:
                    await self._note_taken(job, name)
                return
            check_early_signal(job, name)
            if await self._dispatcher.suspensions.keep_signal(job, name, payload):
                written.append(True)
                return

    async def _note_taken(self, job: Job, name: str) -> None:
        """Remember on ``job`` the signal sent to it that one of its branches took: a
        repeat of it will be sent to ``job`` too. The signal is delivered already: a job
        that ended meanwhile needs nothing remembered, and nothing is raised for it."""
        while not await self._dispatcher.suspensions.note_taken(job, name):
            try:
                job = await self.store.get(job.id)
            except JobNotFound:
                return
            if job.status in TERMINAL:
                return
