"""Events: every transition of a job is one of these, carried by the event queue.

They are frozen and small (ids and names, never state), so a shared queue can carry them as
msgpack; the dispatcher maps each type to its handler through one table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..pipes._join import Outcome

__all__ = ["BranchDone", "Event", "Expire", "Resume", "RunJob", "job_of"]


@dataclass(frozen=True, slots=True)
class RunJob:
    """Run the job from its cursor (a new submission, a hand-off to another key, a branch,
    or a parent after its join)."""

    job_id: str


@dataclass(frozen=True, slots=True)
class Resume:
    """A suspended job got its signal; the payload is already in its state."""

    job_id: str
    signal: str


@dataclass(frozen=True, slots=True)
class Expire:
    """A suspended job's timer fired. ``version`` guards against a timer that lost a race
    with a resume: it only acts if the job is still in the suspension that set it."""

    job_id: str
    version: int


@dataclass(frozen=True, slots=True)
class BranchDone:
    """A branch of a parallel stage ended; ``outcome`` is ok, error, cancelled or timed_out.

    It carries everything the join needs — which join, the stage's path, the delta of an ok
    branch, the error of a failed one (type, message, where, status) — because the branch's
    own record is dropped once it has reported."""

    parent_id: str
    branch_id: str
    index: int
    outcome: Outcome
    delta: Any = None
    join_id: str = ""
    stage: tuple[int, ...] = ()
    error: tuple[str, str, str, int] | None = None


Event = RunJob | Resume | Expire | BranchDone


def job_of(event: Event) -> str:
    """The job an event is about: a branch's end is about the parent it reports to."""
    return event.parent_id if isinstance(event, BranchDone) else event.job_id
