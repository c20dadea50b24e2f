"""The event queue: bounded for new work, never dropping what it accepted.

``depth`` counts events taken in and not yet acknowledged: a submission counts until a
worker slot is granted to it, so a backlog waiting for workers fills the queue and new
submissions are then refused at once with :class:`~pipework.Overloaded`. Events about jobs
already accepted (hand-offs, resumes, branch completions, timers) are always taken: refusing
them would lose accepted work, and blocking on them would stall the workers that send them.
So the bound on *new* work is exact, and the depth can exceed ``capacity`` only by events of
accepted jobs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from .._errors import Overloaded
from ._events import Event

__all__ = ["EventQueue", "MemoryEventQueue", "QueueStatistics"]


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    depth: int
    capacity: int
    accepted: int
    refused: int


class EventQueue(Protocol):
    def submit_nowait(self, event: Event) -> None:
        """Take a new submission or raise Overloaded at once."""
        ...

    def put_nowait(self, event: Event) -> None:
        """Take an event about an accepted job; never refuses."""
        ...

    async def get(self) -> Event: ...

    async def get_batch(self, limit: int = 256) -> list[Event]:
        """Wait for at least one event; return it with any others already waiting."""
        ...

    def ack(self, event: Event) -> None:
        """The event's work has started (or ended): it no longer counts toward the depth."""
        ...

    def statistics(self) -> QueueStatistics: ...


class MemoryEventQueue:
    def __init__(self, capacity: int = 10_000, *, retry_after: float = 1.0) -> None:
        if capacity < 1:
            raise ValueError(f"queue capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.retry_after = retry_after
        # A deque and the dispatcher parked when it is empty, rather than a memory channel:
        # an event in and out costs a third of a channel's send_nowait and receive_nowait.
        self._events: deque[Event] = deque()
        self._waiting = trio.lowlevel.ParkingLot()
        self._parked = 0  # tasks parked in it (a lot's own count is a call away)
        self._depth = 0
        self._accepted = 0
        self._refused = 0
        #: Set by the dispatcher while it runs: takes an event as its loop would, straight
        #: from the sender, when it can (True); only asked while the loop waits on an empty
        #: queue, so nothing queued before the event is passed over.
        self.handoff: Callable[[Event], bool] | None = None

    def submit_nowait(self, event: Event) -> None:
        if self._depth >= self.capacity:
            self._refused += 1
            raise Overloaded(
                f"the event queue is full ({self._depth} of {self.capacity} events waiting); "
                f"retry after {self.retry_after:g}s",
                reason="queue_full",
                retry_after=self.retry_after,
            )
        self.put_nowait(event)

    def put_nowait(self, event: Event) -> None:
        self._depth += 1
        self._accepted += 1
        if self._parked and not self._events:
            # The consumer waits: an event it would only pass on is passed on here, without
            # waking it (a task's step and a scheduler pass fewer per event).
            handoff = self.handoff
            if handoff is not None and handoff(event):
                return
            self._events.append(event)
            self._waiting.unpark()
            return
        self._events.append(event)
        if self._parked:
            self._waiting.unpark()

    async def get(self) -> Event:
        await self._wait()
        return self._events.popleft()

    async def get_batch(self, limit: int = 256) -> list[Event]:
        await self._wait()
        events = self._events
        if len(events) <= limit:
            batch = list(events)
            events.clear()
            return batch
        return [events.popleft() for _ in range(limit)]

    async def _wait(self) -> None:
        """Until an event is queued; a schedule point (and a cancellation point) even when
        one is, as a channel's ``receive`` makes."""
        await trio.lowlevel.checkpoint()
        while not self._events:
            self._parked += 1
            try:
                await self._waiting.park()
            finally:
                self._parked -= 1

    def ack(self, event: Event) -> None:
        self._depth -= 1

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(self._depth, self.capacity, self._accepted, self._refused)
