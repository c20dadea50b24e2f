"""The parked requests' waits: a sync or auto request that waits for its job's end is
parked here, its deadline in one heap served by one task, so that a shutdown can cut every
such wait to its grace period at once.

Separate from the routes' view (:mod:`._modes`): it is the container's own state, shared by
every route and read by ``/readyz`` (a shutdown begun), and holds no request.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from contextlib import contextmanager

import trio
from prometheus_client import Gauge

from ..dispatcher._wake import Waiting, Wake

__all__ = ["Parking"]


class Parking:
    """The parked requests' waits, so that a shutdown can cut them all short at once.

    A sync request on an in-process store parks on its job's wake (:meth:`park`): its
    deadline is an entry in one heap, served by one task (:meth:`run`), instead of a
    cancel scope per request (a scope's cancel status takes two sets, ~0.7 KB a request
    held for as long as it is parked). Other waits (streams, shared stores, or before
    :meth:`run` has started) take a cancel scope (:meth:`scope`, :meth:`open`).
    """

    def __init__(self, gauge: Gauge | None = None) -> None:
        self._scopes: set[trio.CancelScope] = set()
        self._watchers: dict[str, int] = {}
        self.drain_deadline = math.inf
        self._gauge = gauge  # pipework_parked_requests
        # Ordered by deadline; a request that leaves clears its waiting's task.
        self._heap: list[Waiting] = []
        self._lean = 0  # parked in the heap
        self._timer: trio.CancelScope | None = None  # set while run() serves the heap

    @property
    def draining(self) -> bool:
        return self.drain_deadline < math.inf

    @property
    def drained(self) -> bool:
        """The grace period is over: what still waits is answered 503."""
        return trio.current_time() >= self.drain_deadline

    @property
    def parked(self) -> int:
        return len(self._scopes) + self._lean

    @property
    def serving(self) -> bool:
        """Whether :meth:`run` serves the heap's deadlines (else :meth:`park` must not be used)."""
        return self._timer is not None

    @contextmanager
    def scope(self, deadline: float) -> Iterator[trio.CancelScope]:
        """A wait that ends at ``deadline`` or at the end of a shutdown's grace period."""
        scope = trio.CancelScope(deadline=min(deadline, self.drain_deadline))
        self._scopes.add(scope)
        if self._gauge is not None:
            self._gauge.inc()
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)
            if self._gauge is not None:
                self._gauge.dec()

    def drain(self, grace: float) -> None:
        """Start a shutdown: every wait, present or future, ends within ``grace`` seconds."""
        self.drain_deadline = min(self.drain_deadline, trio.current_time() + grace)
        for scope in self._scopes:
            scope.deadline = min(scope.deadline, self.drain_deadline)
        if self._timer is not None and self._heap:
            self._timer.deadline = min(self._timer.deadline, self.drain_deadline)

    def open(self, deadline: float, job_id: str) -> trio.CancelScope:
        """A parked request's wait on ``job_id``, as :meth:`scope` but without a context
        manager (the request's own frame holds it); end it with :meth:`close`."""
        scope = trio.CancelScope(deadline=min(deadline, self.drain_deadline))
        self._scopes.add(scope)
        self._watch(job_id)
        return scope

    def close(self, scope: trio.CancelScope, job_id: str) -> None:
        self._scopes.discard(scope)
        self._unwatch(job_id)

    def park(self, deadline: float, job_id: str, wake: Wake) -> Waiting:
        """The current task's wait on ``job_id``'s unset ``wake``, cut at ``deadline`` or
        at the end of a shutdown's grace period (the wake stays unset then); only while
        :attr:`serving`. Await ``trio.lowlevel.wait_task_rescheduled(waiting)``, then
        :meth:`unpark`, whatever happened."""
        waiting = wake.join(trio.lowlevel.current_task(), deadline)
        heapq.heappush(self._heap, waiting)
        self._lean += 1
        timer = self._timer
        if timer is not None:
            earlier = min(deadline, self.drain_deadline)
            if earlier < timer.deadline:  # (setting it costs, even to the same value)
                timer.deadline = earlier
        self._watch(job_id)
        return waiting

    def unpark(self, waiting: Waiting, job_id: str) -> None:
        waiting.task = None  # its heap entry is dropped when it comes up, or compacted
        self._lean -= 1
        self._unwatch(job_id)
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self._lean:  # mostly left: compact it
            heap[:] = [waiting for waiting in heap if waiting.task is not None]
            heapq.heapify(heap)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the parked requests' deadlines until cancelled (then cut what still waits)."""
        heap = self._heap
        started = False
        try:
            while True:
                while heap and heap[0].task is None:
                    heapq.heappop(heap)
                # Nothing parked: nothing to wake for (a drain's deadline included).
                first = min(heap[0].deadline, self.drain_deadline) if heap else math.inf
                with trio.CancelScope(deadline=first) as timer:
                    self._timer = timer
                    if not started:
                        started = True
                        task_status.started()
                    await trio.sleep_forever()
                self._timer = None
                now = trio.current_time()
                everything = now >= self.drain_deadline
                while heap and (everything or heap[0].deadline <= now):
                    heapq.heappop(heap).cut()
        finally:
            self._timer = None
            for waiting in heap:
                waiting.cut()
            heap.clear()

    def _watch(self, job_id: str) -> None:
        self._watchers[job_id] = self._watchers.get(job_id, 0) + 1
        if self._gauge is not None:
            self._gauge.inc()

    def _unwatch(self, job_id: str) -> None:
        left = self._watchers[job_id] - 1
        if left:
            self._watchers[job_id] = left
        else:
            del self._watchers[job_id]
        if self._gauge is not None:
            self._gauge.dec()

    def watchers(self, job_id: str) -> int:
        """How many parked requests wait on ``job_id``."""
        return self._watchers.get(job_id, 0)
