"""The queue's writes that travel in the job store's own: a job's record and its event
reach Redis in one command and one round trip (create, hand-off, signal), and a creator
holding a worker slot claims the job's first event in that same write.

A part of :class:`~._queue.RedisEventQueue` (a base it is made of), in a module of its own
so the queue reads in one sitting; each method does nothing unless the store given is the
one whose round trips the queue shares (``store=``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import trio

from ..dispatcher._events import Event, RunJob
from ..dispatcher._job import Job
from ._queue_events import FIELD, encode_event
from ._queue_reads import QueueReads

__all__ = ["CLAIM_READ", "SharedWrites"]

#: How many entries create_and_claim's read may take: its own, and a few before it (other
#: processes' events, or events put without a claim); with more before it, the job's
#: event is left to the next read and the job runs as any other.
CLAIM_READ: Final = 4


class SharedWrites(QueueReads):
    """The queue's writes in the store's round trips, and :meth:`create_and_claim`."""

    # Made by RedisEventQueue.__init__.
    _accepted: int
    _shared_depth: int
    _claim_arg: bytes
    # RedisEventQueue's: refuses a submission past the capacity (Overloaded).
    _check_room: Callable[[], None]

    async def create_and_submit(self, store: object, job: Job, event: RunJob) -> bool:
        """Create the job's record in ``store`` and submit its first event in one write, if
        ``store`` is the store this queue shares (False, doing nothing, otherwise): the
        record and the event reach Redis together, in one command and one round trip.
        Raises :class:`~pipework.Overloaded` as :meth:`submit_nowait` does, writing
        nothing."""
        if store is not self._store or self._store is None:
            return False
        self._check_room()
        await self._store.create(job, entry=(self.stream, FIELD, encode_event(event)))
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True

    def can_claim(self, store: object) -> bool:
        """Whether :meth:`create_and_claim` can claim a job of ``store``'s: the store is the
        one whose round trips this queue shares."""
        return self._store is not None and store is self._store

    async def create_and_claim(self, store: object, job: Job, event: RunJob) -> bool | None:
        """:meth:`create_and_submit`, with the event read for this consumer in the same
        write, for a creator that holds a worker slot for the job's first step: True if
        the event is this consumer's (pending for it, the record marked running: the
        caller starts the step with ``event``, which it must :meth:`ack` and
        :meth:`step_ended` as any delivered one), False if entries before it took the
        room this consumer has (the record stays queued, the event on the stream). The
        entries read before it are delivered as any read's. None, with nothing done, if
        ``store`` is not the queue's or the queue has no room to claim (the caller uses
        :meth:`create_and_submit`)."""
        room = min(self._room_left(), CLAIM_READ)
        if store is not self._store or self._store is None or room <= 0 or self._running is None:
            return None
        self._check_room()
        self._reserved += room
        claimed: list[bytes] = []

        def read(reply: Any) -> None:
            # Told in reply order, before any later read's entries are delivered.
            self._reserved -= room
            self._room.set()
            claimed.append(b"")
            if not reply:
                return  # not created: it exists already
            at, entries = reply
            if entries:
                self._last_read = trio.current_time()
                others = [e for e in entries if e[0] != at] if at else entries
                if others:
                    self._deliver(others)
            if at:
                self._inflight[id(event)] = (event, at)
                claimed[0] = at

        try:
            await self._store.create(
                job,
                entry=(self.stream, FIELD, encode_event(event)),
                claim=(self._claim_arg, room, read),
            )
        finally:
            if not claimed:  # no answer came
                self._reserved -= room
                self._room.set()
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return bool(claimed[0])

    async def update_and_put(self, store: object, job: Job, event: RunJob) -> bool:
        """Write the job's record to ``store`` and put its next event in the same write, if
        ``store`` is the store this queue shares (False, doing nothing, otherwise): a
        hand-off's record and the event that runs its next step reach Redis together, and
        nothing waits in the outbox before the step's own event is acknowledged."""
        if store is not self._store or self._store is None:
            return False
        await self._store.update(job, entry=(self.stream, FIELD, encode_event(event)))
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True

    async def update_unless_changed_and_put(
        self, store: object, job: Job, event: Event
    ) -> bool | None:
        """``store.update_unless_changed(job)`` with ``event`` put in the same write, if
        ``store`` is the store this queue shares (None, doing nothing, otherwise): a
        delivered signal's record and its ``Resume`` reach Redis together. Put in the
        outbox after the write, a process killed between the two left its job queued with
        no event to run it, for ever (found by the chaos harness)."""
        if store is not self._store or self._store is None:
            return None
        entry = (self.stream, FIELD, encode_event(event))
        if not await self._store.update_unless_changed(job, entry=entry):
            return False
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True

    def update_and_put_soon(
        self,
        store: object,
        job: Job,
        event: RunJob,
        then: Callable[[BaseException | None], None],
    ) -> bool:
        """:meth:`update_and_put` with no wait (``RedisJobStore.update_soon``): ``then`` is
        told how the write went. False, with nothing done, when the store cannot take it so
        (the caller awaits :meth:`update_and_put`)."""
        if store is not self._store or self._store is None:
            return False
        if not self._store.update_soon(job, then, entry=(self.stream, FIELD, encode_event(event))):
            return False
        self._accepted += 1
        self._shared_depth += 1  # as for a batch written (_send_outbox)
        return True
