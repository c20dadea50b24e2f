"""Branch runners: the tasks in-step branches run in, each kept for further branches.

An in-step branch needs a task and a cancel scope of its own (the join cancels a loser, a
pipe's timeout rides on the scope, :meth:`Engine.cancel` takes a branch's id), and the two
cost about as much as the rest of the branch. As :mod:`._runners` does for steps, a runner
enters one scope and runs branches in it one after another, parking between them; a branch
handed to a parked runner costs one wake-up, no spawn and no scope. A scope that was
cancelled (a loser, a timeout, a cancel) is spent: its runner enters a fresh one.

What a branch sees is what a task spawned for it would see: it runs in a copy of the context
of the task that started it (as ``start_soon`` makes), and in its runner's nursery, the
dispatcher's, so that a loser slow to stop holds nobody up.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sized
from typing import Any, Final, Protocol

import trio

from ..pipes._pipe import Pipe
from ._job import Job

__all__ = ["BranchRunners"]

#: Parked runners kept at most; a runner finding this many parked ends instead. A pass of
#: the dispatcher starts up to 32 steps; at four branches a stage, a pass's branches park
#: while the next pass's start, so twice that many (measured on ``all_of(4)``: with 128,
#: 29% of branches still spawned a runner; with 256, 3%).
IDLE_MAX: Final = 256


class Stage(Protocol):
    """What runs a branch (an in-step stage)."""

    async def run_branch(
        self, scope: trio.CancelScope, branch: Job, flat: tuple[Pipe, ...] | None
    ) -> None: ...


class _Runner:
    """A runner, and the branch handed to it while it was parked."""

    __slots__ = ("branch", "flat", "stage", "task")

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.stage: Stage | None = None
        self.branch: Job | None = None
        self.flat: tuple[Pipe, ...] | None = None


class BranchRunners:
    """Runs branches on parked runners. ``stages``: the in-step stages running; a runner
    parks only while there is one (whose branches may want it), and :meth:`release` ends
    the parked ones once there is none: with no parallel stage running, no runner waits."""

    def __init__(self, stages: Sized) -> None:
        self._stages = stages
        #: Parked runners, the most recently parked last (its memory is the warmest).
        self.idle: list[_Runner] = []

    def release(self) -> None:
        """End the parked runners (called when the last in-step stage ends)."""
        idle, self.idle = self.idle, []
        for runner in idle:
            runner.stage = None  # wakes with nothing to run: it ends
            trio.lowlevel.reschedule(runner.task)

    def start(
        self, nursery: trio.Nursery, stage: Stage, branch: Job, flat: tuple[Pipe, ...] | None
    ) -> None:
        """Run ``stage.run_branch(scope, branch, flat)`` on a parked runner if there is one,
        else on a new one. The branch runs in ``scope``, its runner's, entered and uncancelled
        when it starts; it sets the scope's deadline back to infinity before it ends, unless
        the scope was cancelled, and lets a cancellation of the scope travel out of it."""
        idle = self.idle
        if idle:
            runner = idle.pop()
            runner.stage, runner.branch, runner.flat = stage, branch, flat
            # The context a task spawned here would get: a copy of the caller's.
            runner.task.context = contextvars.copy_context()
            trio.lowlevel.reschedule(runner.task)
        else:
            nursery.start_soon(self._run, stage, branch, flat)

    async def _run(
        self, stage: Stage | None, branch: Job | None, flat: tuple[Pipe, ...] | None
    ) -> None:
        task = trio.lowlevel.current_task()
        runner = _Runner(task)
        idle = self.idle

        def abort(_: Any) -> trio.lowlevel.Abort:
            idle.remove(runner)  # only a parked runner can be cancelled while it waits
            return trio.lowlevel.Abort.SUCCEEDED

        while True:
            scope = trio.CancelScope()
            with scope:
                while not scope.cancel_called:
                    if stage is None:
                        if len(idle) >= IDLE_MAX or not self._stages:
                            return
                        # Parked holding no branch's context (the next one brings its own).
                        task.context = contextvars.Context()
                        idle.append(runner)
                        await trio.lowlevel.wait_task_rescheduled(abort)
                        stage, branch, flat = runner.stage, runner.branch, runner.flat
                        if stage is None:
                            return  # released
                        runner.stage = runner.branch = runner.flat = None
                    assert branch is not None
                    run, stage = stage, None  # a branch is run once, however it ends
                    try:
                        await run.run_branch(scope, branch, flat)
                    finally:
                        # Parked, it holds nothing of the branch it ran.
                        del run
                        branch = flat = None
            # The scope was cancelled for its branch (the branch ended it): a fresh one.
