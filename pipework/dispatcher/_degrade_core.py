"""Degradation, decided: when a pipe its job can do without is skipped or answered by its
fallback instead of run. No I/O, no clock but the times handed in.

A pipe marked ``optional`` or given a ``fallback`` (``Pipe.degradable``) is **degraded**
for one of these reasons (:data:`REASONS`), the first that holds, in this order:

==========  ==================================================================  ==========
reason      when                                                                decided
==========  ==================================================================  ==========
refused     its key refuses calls now (a circuit breaker open: ``Refusals``)    before
deadline    the time left in its stage is below what it usually takes           before
no_slot     its key has no slot free at once, where its job would wait          at a grant
error       it raised an error                                                  after
timeout     its own ``timeout`` ran out (a stage's or the job's fails as ever)  after
==========  ==================================================================  ==========

"Before" reasons are asked (:func:`reason_before`) when the pipe is about to run, and where a
step would hand its job off to the pipe's key; ``no_slot`` where a step would otherwise wait
for a slot of that key. **What it usually takes** is :class:`Estimates`: per pipe, an
exponentially weighted mean of the durations of its runs that ended well or at its own
timeout; a pipe that has not run yet has none, and is never degraded for ``deadline``. Each
skip for ``deadline`` decays the mean (:meth:`Estimates.skipped`), so a once-slow pipe is
tried again.

A degraded pipe's name and reason go to its job's state, under ``"degraded"``
(:func:`mark`): ``{pipe: reason}``, merged across parallel branches as a dict update.
"""

from __future__ import annotations

import math
from typing import Any, Final, Literal, TypeAlias, get_args

from ..pipes._merge import Delta, delta
from ..pipes._pipe import DEGRADED_KEY

__all__ = [
    "REASONS",
    "Estimates",
    "Reason",
    "degraded_delta",
    "mark",
    "reason_after",
    "reason_before",
]

Reason: TypeAlias = Literal["refused", "deadline", "no_slot", "error", "timeout"]
REASONS: Final[tuple[Reason, ...]] = get_args(Reason)

#: The weight of a new sample in a pipe's mean duration: about the last ten runs count.
ALPHA: Final = 0.2


class Estimates:
    """What each pipe usually takes, by name: the mean of its recent durations."""

    __slots__ = ("_means",)

    def __init__(self) -> None:
        self._means: dict[str, float] = {}

    def observe(self, name: str, seconds: float) -> None:
        """One run of pipe ``name`` took ``seconds`` (it ended well, or at its timeout)."""
        if not seconds >= 0 or seconds == math.inf:
            raise ValueError(f"a duration is a finite number of seconds, got {seconds!r}")
        mean = self._means.get(name)
        self._means[name] = seconds if mean is None else mean + ALPHA * (seconds - mean)

    def usual(self, name: str) -> float | None:
        """What pipe ``name`` usually takes, or None before its first run."""
        return self._means.get(name)

    def skipped(self, name: str) -> None:
        """Pipe ``name`` was degraded for ``deadline``: its mean decays by the weight of a
        sample, so a pipe that was once slow is tried (and measured) again after a few
        skips rather than skipped for ever."""
        mean = self._means.get(name)
        if mean is not None:
            self._means[name] = mean * (1 - ALPHA)


def reason_before(refusing: bool, remaining: float, usual: float | None) -> Reason | None:
    """Why a pipe about to run is degraded instead (None: it runs). ``refusing``: its key
    refuses calls now; ``remaining``: the seconds left in its stage; ``usual``: what it
    usually takes (None: not known yet)."""
    if refusing:
        return "refused"
    if usual is not None and remaining < usual:
        return "deadline"
    return None


def mark(state: dict[str, Any], name: str, reason: Reason) -> None:
    """Record in ``state`` that pipe ``name`` was degraded for ``reason``. The record is a
    new dict (never changed in place: a branch's snapshot may share the parent's); a value
    there that is not a dict is replaced, since the key is the engine's."""
    found = state.get(DEGRADED_KEY)
    marks = dict(found) if isinstance(found, dict) else {}
    marks[name] = reason
    state[DEGRADED_KEY] = marks


def reason_after(failed: bool, timed_out: bool) -> Reason | None:
    """Why a branch its job can do without, which has ended, is degraded (None: it is not).
    ``failed``: it failed (not cancelled, not out of its stage's or its job's time, not
    suspended: those are never degraded); ``timed_out``: by a timeout of its own (its
    ``timeout``, or one of its pipes')."""
    if not failed:
        return None
    return "timeout" if timed_out else "error"


def degraded_delta(
    parent: dict[str, Any],
    start: dict[str, Any],
    fallback: dict[str, Any],
    name: str,
    reason: Reason,
) -> Delta:
    """What a branch ``name`` degraded for ``reason`` hands its stage instead of what it
    did, against ``parent``'s state: the state it started from (``start``: the parent's,
    with what a graph node's ancestors produced), its ``fallback`` (may be empty) and its
    mark, nothing else (whatever the branch wrote is dropped whole)."""
    after = dict(start)
    after.update(fallback)
    mark(after, name, reason)
    return delta(parent, after)
