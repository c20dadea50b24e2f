"""Suspended jobs' timers: when a suspension's time is up, an ``Expire`` event.

Every suspension with a deadline sets one. In-process they are one heap served by one task
(not a task per suspended job); a shared queue keeps them itself, where they outlive this
process (``_abilities.SharedQueue.expire_at``). An entry left by a job that resumed early
fires an ``Expire`` that finds a newer version of the job, and does nothing.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import trio

from ._events import Expire
from ._job import Job
from ._queue import EventQueue

__all__ = ["SuspendTimers"]


class SuspendTimers:
    """``durable``: the shared queue's timers, or None to keep them here (run :meth:`run`)."""

    def __init__(
        self, queue: EventQueue, durable: Callable[[float, str, int], None] | None
    ) -> None:
        self._queue = queue
        self._durable = durable
        # (deadline, job id, version at suspension), the earliest first.
        self._heap: list[tuple[float, str, int]] = []
        self._moved = trio.Event()

    def expire_at(self, deadline: float, job_id: str, version: int) -> None:
        if self._durable is not None:
            self._durable(deadline, job_id, version)
            return
        if not self._heap or deadline < self._heap[0][0]:
            self._moved.set()  # the serving task sleeps until a later one
        heapq.heappush(self._heap, (deadline, job_id, version))

    def rearm(self, job: Job) -> None:
        """Set a suspended job's timer again (a timer already set is the same one: it fires
        once; one that fired already finds the job moved on)."""
        if job.suspend_deadline is not None and job.suspend_deadline < math.inf:
            self.expire_at(job.suspend_deadline, job.id, job.version)

    async def run(self) -> None:
        """Put an Expire event for every suspension whose deadline has come."""
        heap = self._heap
        while True:
            moved = self._moved = trio.Event()
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await moved.wait()
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _, job_id, version = heapq.heappop(heap)
                self._queue.put_nowait(Expire(job_id, version))
