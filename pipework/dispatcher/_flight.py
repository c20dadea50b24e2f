"""What this process holds of the jobs it runs now: the records its steps and in-step
branches work on, their cancel scopes, the in-step stages and their unstored branches.

The step boundary, the pipe runner, suspension, the parallel stages and the context's
operations all read and change these, so they live in one plain object every part is
handed, rather than in any one part: nothing here does I/O or decides anything.
"""

from __future__ import annotations

from typing import Protocol

import trio

from ._events import RunJob
from ._job import Job

__all__ = ["Claim", "Flight", "InStepJoin"]


class InStepJoin(Protocol):
    """A parallel stage running in its parent's step, as the other parts see it."""

    #: The join went to the parent's record: branch ends reach it as events.
    durable: bool

    @property
    def over(self) -> bool:
        """Resolved in the step: a branch that ends now changes nothing."""
        ...

    async def outlive(self, branch: Job) -> None:
        """A suspending branch becomes a child job of its own."""
        ...

    async def report(self, branch: Job) -> None:
        """An in-step branch ended."""
        ...

    async def report_late(self, branch: Job) -> None:
        """An in-step branch ended after the stage turned durable."""
        ...


class Claim:
    """A slot held for a new job's first step (``Steps.hold_first``); ``event``: the
    step's, once claimed; ``cancelled``: the job was cancelled before its step started."""

    __slots__ = ("cancelled", "event", "granted", "held")

    def __init__(self, held: object, granted: float) -> None:
        self.held = held
        self.granted = granted
        self.event: RunJob | None = None
        self.cancelled = False


class Flight:
    __slots__ = (
        "branch_errors",
        "claiming",
        "in_step",
        "left_to_join",
        "running",
        "scopes",
        "unstored",
    )

    def __init__(self) -> None:
        #: The record each running step (or in-step branch) works on: its pipes report to it.
        self.running: dict[str, Job] = {}
        #: The scope each of them runs in (its runner's): a cancel goes through it.
        self.scopes: dict[str, trio.CancelScope] = {}
        #: Parallel stages running inside their parent's step, by join id (_instep.py)...
        self.in_step: dict[str, InStepJoin] = {}
        #: ...and the ids of their branches that have no record in the store.
        self.unstored: set[str] = set()
        #: Parents whose in-step stage turned durable: their step no longer owns the record.
        self.left_to_join: set[str] = set()
        #: Exception objects of ended branches, until their join takes them.
        self.branch_errors: dict[str, BaseException] = {}
        #: New jobs whose creator holds a slot for their first step, by id.
        self.claiming: dict[str, Claim] = {}

    def in_step_branch(self, job_id: str) -> Job | None:
        """The record of a branch running in its parent's step (it is in no store)."""
        return self.running.get(job_id) if job_id in self.unstored else None
