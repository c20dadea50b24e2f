"""How the Redis job store hears of the ends other processes record: its subscription to
``{p}:finished`` (:meth:`EndsHeard.follow_finished`), whether every end recorded anywhere
reaches this process now (:meth:`EndsHeard._hearing`), and the waits for an end that rely
on it (:meth:`EndsHeard.wait_end`), woken when a subscription drops (see :mod:`._store`,
**Ends**).

Separate from the reads and writes that consult and feed it (the jobs created here whose
end was not heard of, the ends recorded here): this is the state they share, and the one
long-running task the store has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import trio

from ..dispatcher._job import Job
from ..dispatcher._wake import Waiting, Wake
from ._batches import Batches
from ._client import Subscription
from ._wire import UNREACHABLE

__all__ = ["EndsHeard"]

#: How many ends recorded here are kept for this process's waiters (each taken once).
_ENDED_KEPT: Final = 4096


class EndsHeard(Batches):
    """The store's hearing of ends (see the module). The store sets this state in its
    ``__init__``: ``prefix``; the subscriptions running and subscribed now; the jobs created
    here whose end was not heard of (``_active``); the subscriptions dropped so far
    (``_generation``) and the count when each job was last found active (``_read_at``);
    the waits without a limit; the ends recorded here (``_ended``)."""

    prefix: str
    _following: int
    _subscribed: int
    _active: dict[str, Job]
    _generation: int
    _read_at: dict[str, int]
    _waits: set[Waiting]
    _ended: dict[str, Job]

    async def follow_finished(
        self,
        finished: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``finished(job_id)`` for every job any process finishes (published by the
        update that records the end), until cancelled: whoever waits here for a job that
        another process ran hears of its end. Reconnects while Redis is away."""

        def heard(channel: bytes, data: bytes) -> None:
            job_id = data.decode()
            self._active.pop(job_id, None)  # before the waiter wakes
            finished(job_id)

        def live() -> None:
            self._subscribed += 1

        def dropped() -> None:
            # Ends published until it subscribes again are not heard: whoever waits reads
            # the record from now on.
            self._subscribed -= 1
            self._deaf()

        subscription = Subscription(
            self.url, [f"{self.prefix}:finished"], what="the job store's subscription to ends"
        )
        self._following += 1
        try:
            await subscription.run(heard, live=live, dropped=dropped, task_status=task_status)
        except UNREACHABLE as exc:  # the first connection failed
            raise self._unavailable(exc) from exc
        finally:
            self._following -= 1
            self._deaf()

    async def wait_end(self, job_id: str, wake: Wake, recheck: float) -> None:
        """Engine.wait's wait for the end of a job that :meth:`read_awaited` has just found
        active: until ``wake`` is set, or an end may have been missed. While every end
        recorded anywhere has reached this process since that read (its subscription has
        not dropped), none can be, so it waits with no time limit (no cancel scope either),
        and a drop of the subscription wakes it; otherwise for ``recheck`` seconds at most."""
        if wake.is_set():  # the end came while the record was read
            return
        if self._read_at.pop(job_id, None) == self._generation and self._hearing():
            waiting = wake.join(trio.lowlevel.current_task())
            self._waits.add(waiting)
            try:
                await trio.lowlevel.wait_task_rescheduled(waiting)
            finally:
                self._waits.discard(waiting)
            return
        with trio.move_on_after(recheck):
            await wake.wait()

    def _deaf(self) -> None:
        """A subscription dropped: ends recorded from now on may not be heard, so whoever
        waits without a time limit reads the record again."""
        self._generation += 1
        self._active.clear()
        self._read_at.clear()
        for waiting in list(self._waits):
            waiting.cut()

    def _hearing(self) -> bool:
        """Whether every end recorded elsewhere reaches this process now."""
        return self._following > 0 and self._subscribed == self._following
