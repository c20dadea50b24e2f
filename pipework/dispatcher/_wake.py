"""What a job's waiters wait on: a one-shot event, lighter than ``trio.Event``.

Every job someone waits on has one, for as long as it runs (a parked HTTP request waits
on its job's for as long as the job is suspended: thousands at once). ``trio.Event`` keeps
a set of its tasks from birth (216 bytes even when one task or none waits); this keeps
one task in a slot and makes a list only for a second. Its waiters can also be woken
early by whoever holds their task (:meth:`Wake.cut`: a container's own deadline), so
a parked request needs no cancel scope of its own.
"""

from __future__ import annotations

import math
from typing import Any

import trio

__all__ = ["Waiting", "Wake"]


class Wake:
    """Set once, by the job's end; ``wait`` returns then, or when :meth:`cut` wakes its
    task early (``is_set`` tells which)."""

    __slots__ = ("_flag", "_more", "_task")

    def __init__(self) -> None:
        self._flag = False
        self._task: trio.lowlevel.Task | None = None
        self._more: list[trio.lowlevel.Task] | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        """Wake every waiting task; later waits return at once."""
        if self._flag:
            return
        self._flag = True
        task, more = self._task, self._more
        self._task = self._more = None
        if task is not None:
            trio.lowlevel.reschedule(task)
        if more:
            for task in more:
                trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        """Until :meth:`set`, or :meth:`cut` of this task; a checkpoint either way."""
        if self._flag:
            await trio.lowlevel.checkpoint()
            return
        await trio.lowlevel.wait_task_rescheduled(self.join(trio.lowlevel.current_task()))

    def join(self, task: trio.lowlevel.Task, deadline: float = math.inf) -> Waiting:
        """``wait`` in the caller's own frame: ``task`` (the current one, the wake unset)
        waits from now on; pass the answer to ``trio.lowlevel.wait_task_rescheduled``.
        ``deadline``: when the caller means to cut it (kept on the answer, which orders by
        it: a heap of them is one object per wait)."""
        if self._task is None:
            self._task = task
        elif self._more is None:
            self._more = [task]
        else:
            self._more.append(task)
        return Waiting(self, task, deadline)

    def cut(self, task: trio.lowlevel.Task) -> bool:
        """Wake ``task`` now if it waits here (its ``wait`` returns; the wake stays unset)."""
        if not self._drop(task):
            return False
        trio.lowlevel.reschedule(task)
        return True

    def _drop(self, task: trio.lowlevel.Task) -> bool:
        if self._task is task:
            self._task = None
            return True
        if self._more and task in self._more:
            self._more.remove(task)
            return True
        return False


class Waiting:
    """One task's wait on a wake: its abort callback (it leaves the wait when the task is
    cancelled), and what a deadline needs to cut it short."""

    __slots__ = ("deadline", "task", "wake")

    def __init__(self, wake: Wake, task: trio.lowlevel.Task, deadline: float) -> None:
        self.wake = wake
        self.task: trio.lowlevel.Task | None = task
        self.deadline = deadline

    def __lt__(self, other: Waiting) -> bool:
        return self.deadline < other.deadline

    def __call__(self, _: Any) -> trio.lowlevel.Abort:
        if self.task is not None:
            self.wake._drop(self.task)
        return trio.lowlevel.Abort.SUCCEEDED

    def cut(self) -> None:
        """Wake the task now if it still waits (its wake stays unset)."""
        if self.task is not None:
            self.wake.cut(self.task)
