"""What this process holds of the jobs it runs now (:class:`Flight`: the records its steps
and in-step branches work on, their cancel scopes, the in-step stages and their unstored
branches, the run's clock and nursery), and what the engine plugs in (:class:`Hooks`).

The step boundary, the pipe runner, suspension, finishing, the parallel stages and the
context's operations all read and change these, so they live in plain objects every part
is handed, rather than in any one part: nothing here does I/O or decides anything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from ._events import RunJob
from ._job import Job

__all__ = ["Claim", "Flight", "Hooks", "InStepJoin"]


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
        "clock",
        "in_step",
        "left_to_join",
        "nursery",
        "running",
        "scopes",
        "unstored",
    )

    def __init__(self) -> None:
        #: The trio clock, read without ``trio.current_time``'s two calls of indirection
        #: (the same reading: that asks this clock); bound to the run's clock while the
        #: dispatcher runs.
        self.clock: Callable[[], float] = trio.current_time
        #: The dispatcher's nursery while it runs: steps, branches and callbacks run in it.
        self.nursery: trio.Nursery | None = None
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

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run ``fn(*args)`` in the dispatcher's nursery (RuntimeError once it stopped)."""
        if self.nursery is None:
            raise RuntimeError("the dispatcher is not running")
        self.nursery.start_soon(fn, *args)


class Hooks:
    """What the engine and an HTTP container plug into the dispatcher."""

    __slots__ = (
        "callback_factory",
        "cancel_elsewhere",
        "changed",
        "emit_elsewhere",
        "observers",
        "on_finished",
    )

    def __init__(self) -> None:
        #: Called with a job's record after each change of its status or progress.
        self.changed: Callable[[Job], None] = lambda job: None
        #: Whoever ``changed`` reports to: while empty, ``changed`` does nothing, and the
        #: steps of every job skip the call (the engine hands in its list of observers).
        self.observers: list[Any] = []
        #: Called with each top-level job once it is final (the engine retires idle plans).
        self.on_finished: Callable[[Job], None] | None = None
        #: Set by an HTTP container: (job id, signal, ttl) -> a signed callback URL.
        self.callback_factory: Callable[[str, str, float], str] | None = None
        #: Set when a job's steps may run in other processes: a cancel of a job not running
        #: here is told to them, and a streamed job's chunks go to where its reader is
        #: (True when taken; False leaves them in the record).
        self.cancel_elsewhere: Callable[[str], None] | None = None
        self.emit_elsewhere: Callable[[str, Any], Awaitable[bool]] | None = None
