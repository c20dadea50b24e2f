"""A service's circuit breaker, sans-IO: every method takes the time.

The states and what moves between them (the table is :data:`TRANSITIONS`)::

    closed ──(failure rate ≥ failure_percent over the window, ≥ minimum_calls)──▶ open
    closed ──(no host left to serve: every one ejected or unhealthy)───────────▶ open
    open ────(wait seconds passed, noticed on the next call)───────────────────▶ half_open
    (its statistics read half_open as soon as the wait has passed, call or not)
    half_open ──(a probe failed)───────────────────────────────────────────────▶ open
    half_open ──(half_open_calls probes succeeded)─────────────────────────────▶ closed

**What it counts.** Every *try* (not every call: a call that succeeded on its retry still
had a failed try, and the breaker guards the backend) whose outcome is an error -- a
transport failure or a 5xx answer -- is a failure; any other answer a success; a cancelled
try nothing. Tries are counted in a sliding window of ``window`` seconds made of ten
buckets, so a burst of failures leaves the window a bucket at a time, and the rate is only
judged once the window holds ``minimum_calls`` tries. Outcomes of tries begun in an earlier
state (before the breaker last changed) are dropped: the window starts empty on closing.

**Open** answers "refuse now, retry after *x*", *x* being the rest of ``wait``. **Half
open** lets ``half_open_calls`` probes through (each a call of one try: no retry, no
hedge); more are refused for a second meanwhile. The first failed probe opens the breaker
again for another ``wait``; ``half_open_calls`` successful ones close it. A cancelled probe
gives its permit back, so never more than ``half_open_calls`` probes are in flight or
counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Final

from ._resilience_spec import BreakerSpec

__all__ = [
    "BUSY_PROBING_RETRY_AFTER",
    "TRANSITIONS",
    "Breaker",
    "BreakerState",
    "BreakerStatistics",
    "Permit",
]

#: Retry-After while the half-open probes are out: they take about one call's time.
BUSY_PROBING_RETRY_AFTER: Final = 1.0
_BUCKETS: Final = 10


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


#: Every allowed change, with what causes it.
TRANSITIONS: Final[dict[tuple[BreakerState, BreakerState], str]] = {
    (BreakerState.CLOSED, BreakerState.OPEN): "failure rate or no host left",
    (BreakerState.OPEN, BreakerState.HALF_OPEN): "wait passed",
    (BreakerState.HALF_OPEN, BreakerState.OPEN): "a probe failed",
    (BreakerState.HALF_OPEN, BreakerState.CLOSED): "half_open_calls probes succeeded",
}


@dataclass(frozen=True, slots=True)
class Permit:
    """The breaker's answer for one call: ``allowed`` (a ``probe`` when half open), or not,
    with ``retry_after`` seconds. ``epoch`` ties the call's outcomes to the state that let
    it through."""

    allowed: bool
    probe: bool = False
    retry_after: float = 0.0
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class BreakerStatistics:
    state: str
    #: Why it last opened: ``failure_rate``, ``no_host`` or ``probe_failed`` (None: never).
    reason: str | None
    opened: int
    retry_after: float
    window_calls: int
    window_failures: int
    probes_in_flight: int
    probes_passed: int


class Breaker:
    """One service's breaker (see the module docstring)."""

    def __init__(self, spec: BreakerSpec, *, epoch: int = 0) -> None:
        self.spec = spec
        self.state = BreakerState.CLOSED
        self.epoch = epoch
        self.reason: str | None = None
        self.opened = 0  # times it opened
        self._until = -math.inf  # open: when it may go half open
        self._probes = 0  # half open: probes in flight
        self._passed = 0  # half open: probes that succeeded
        self._width = spec.window / _BUCKETS
        # Each bucket: [its slot number (time // width), tries, failures].
        self._buckets: list[list[int]] = [[-1, 0, 0] for _ in range(_BUCKETS)]

    # -- calls ----------------------------------------------------------------------------

    def refusing(self, now: float) -> bool:
        """Whether :meth:`admit` would refuse a call now; asks without changing anything
        (an open breaker whose wait is over would let a probe through)."""
        if not self.spec.enabled:
            return False
        if self.state is BreakerState.OPEN:
            return now < self._until
        if self.state is BreakerState.HALF_OPEN:
            return self._probes + self._passed >= self.spec.half_open_calls
        return False

    def admit(self, now: float) -> Permit:
        """May a call go through now? A half-open permit is a probe."""
        if not self.spec.enabled:
            return Permit(True, epoch=self.epoch)
        if self.state is BreakerState.OPEN:
            if now < self._until:
                return Permit(False, retry_after=self.retry_after(now))
            self._move(BreakerState.HALF_OPEN)
        if self.state is BreakerState.HALF_OPEN:
            if self._probes + self._passed >= self.spec.half_open_calls:
                return Permit(False, retry_after=BUSY_PROBING_RETRY_AFTER)
            self._probes += 1
            return Permit(True, probe=True, epoch=self.epoch)
        return Permit(True, epoch=self.epoch)

    def record(self, permit: Permit, now: float, *, error: bool | None) -> None:
        """One try's outcome under ``permit``: ``error`` True or False, None if it was
        cancelled (a probe's permit is given back)."""
        if not permit.allowed or permit.epoch != self.epoch or not self.spec.enabled:
            return  # begun in an earlier state: it says nothing about this one
        if self.state is BreakerState.HALF_OPEN:
            if not permit.probe:
                return
            self._probes -= 1
            if error is None:
                return
            if error:
                self._open(now, "probe_failed")
            else:
                self._passed += 1
                if self._passed >= self.spec.half_open_calls:
                    self._move(BreakerState.CLOSED)
            return
        if self.state is BreakerState.CLOSED and error is not None:
            calls, failures = self._count(now, error)
            spec = self.spec
            if calls >= spec.minimum_calls and failures * 100 >= spec.failure_percent * calls:
                self._open(now, "failure_rate")

    def no_host(self, now: float) -> None:
        """Every host is out (ejected or unhealthy): a closed breaker opens."""
        if self.spec.enabled and self.state is BreakerState.CLOSED:
            self._open(now, "no_host")

    # -- reading ----------------------------------------------------------------------------

    def retry_after(self, now: float) -> float:
        if self.state is BreakerState.OPEN:  # never above the wait, rounding included
            return min(self.spec.wait, max(0.0, self._until - now))
        return 0.0

    def statistics(self, now: float) -> BreakerStatistics:
        calls, failures = self._totals(now)
        state = self.state
        if state is BreakerState.OPEN and now >= self._until:
            # Over its wait, the next call is a probe: report that, not a refusal nobody
            # would meet (a quiet service makes no call to move it on).
            state = BreakerState.HALF_OPEN
        return BreakerStatistics(
            state=state.value,
            reason=self.reason,
            opened=self.opened,
            retry_after=self.retry_after(now),
            window_calls=calls,
            window_failures=failures,
            probes_in_flight=self._probes,
            probes_passed=self._passed,
        )

    # -- internals -------------------------------------------------------------------------

    def _open(self, now: float, reason: str) -> None:
        self._move(BreakerState.OPEN)
        self.reason = reason
        self.opened += 1
        self._until = now + self.spec.wait

    def _move(self, to: BreakerState) -> None:
        if (self.state, to) not in TRANSITIONS:
            raise RuntimeError(f"breaker cannot go from {self.state.value} to {to.value}")
        self.state = to
        self.epoch += 1
        self._probes = self._passed = 0
        if to is BreakerState.CLOSED:
            for bucket in self._buckets:
                bucket[:] = [-1, 0, 0]

    def _count(self, now: float, error: bool) -> tuple[int, int]:
        slot = math.floor(now / self._width)
        bucket = self._buckets[slot % _BUCKETS]
        if bucket[0] != slot:
            bucket[:] = [slot, 0, 0]
        bucket[1] += 1
        bucket[2] += error
        return self._totals(now)

    def _totals(self, now: float) -> tuple[int, int]:
        slot = math.floor(now / self._width)
        calls = failures = 0
        for start, n, bad in self._buckets:
            if slot - _BUCKETS < start <= slot:
                calls += n
                failures += bad
        return calls, failures
