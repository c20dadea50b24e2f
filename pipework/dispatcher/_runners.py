"""Step runners: the tasks steps run in, each kept for further steps.

A step needs a cancel scope of its own: :meth:`Engine.cancel` interrupts its pipe through
it, and the pipe's deadline rides on it. Entering a scope costs about as much as spawning
the task (measured: a task per step with a scope of its own took 1.9 times a bare task).
A runner is a task that enters one scope and runs steps in it one after another: after a
step it parks, and the dispatcher hands the next step to a parked runner before it spawns a
new one. A scope that was cancelled (a job's cancel, a pipe's deadline) is spent: its
runner enters a fresh one. What a step sees is what a task of its own would see: each step
after the first runs in a fresh copy of the context the runner started with, so a context
variable a pipe sets stays with its step.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

__all__ = ["StepRunners"]

#: Parked runners kept at most; a runner finding this many parked ends instead. Twice the
#: dispatcher's batch: enough for one pass's steps while the previous pass's steps end.
IDLE_MAX: Final = 64


class _Runner:
    __slots__ = ("event", "task")

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.event: Any = None


class StepRunners:
    """Runs ``step(event, scope)`` for each event handed to :meth:`start`, in the caller's
    nursery; ``scope`` is the runner's, already entered, and uncancelled when a step starts.
    A step that sets the scope's deadline sets it back to infinity before it ends, unless
    the scope was cancelled. A step returns whether its scope may have been cancelled (it
    cancelled it, or set its deadline): False spares the runner the check, which reads the
    clock (``CancelScope.cancel_called``)."""

    def __init__(self, step: Callable[[Any, trio.CancelScope], Awaitable[bool]]) -> None:
        self._step = step
        #: Parked runners, the most recently parked last (its memory is the warmest).
        self.idle: list[_Runner] = []

    def start(self, nursery: trio.Nursery, event: Any) -> None:
        """Run a step for ``event``: on a parked runner if there is one, else a new one."""
        idle = self.idle
        if idle:
            runner = idle.pop()
            runner.event = event
            trio.lowlevel.reschedule(runner.task)
        else:
            nursery.start_soon(self._run, event)

    async def _run(self, event: Any) -> None:
        task = trio.lowlevel.current_task()
        runner = _Runner(task)
        pristine = task.context.copy()
        idle = self.idle
        step = self._step

        def abort(_: Any) -> trio.lowlevel.Abort:
            idle.remove(runner)  # only a parked runner can be cancelled while it waits
            return trio.lowlevel.Abort.SUCCEEDED

        while True:
            scope = trio.CancelScope()
            with scope:
                while True:
                    if event is None:
                        if len(idle) >= IDLE_MAX:
                            return
                        # The next step's context: trio resumes the task in whatever
                        # context it holds then.
                        task.context = pristine.copy()
                        idle.append(runner)
                        await trio.lowlevel.wait_task_rescheduled(abort)
                        event, runner.event = runner.event, None
                    current, event = event, None  # a step is run once, however it ends
                    if await step(current, scope) and scope.cancel_called:
                        break
            # The scope was cancelled for its step's job (the step ended it): a fresh one.
