"""Retries and hedges, sans-IO: which outcomes may be tried again, the retry budget, the
backoff, and the latency window hedging reads its p95 from. Randomness comes only from the
``random.Random`` passed in.

**The budget bounds retries twice**, and a retry needs both (a hedge counts as a retry):

* *In flight*, Envoy's bound (``RetryBudget`` in the cluster's circuit breakers,
  https://www.envoyproxy.io/docs/envoy/latest/api-v3/config/cluster/v3/circuit_breaker.proto):
  the retries in flight may be at most ``budget_percent`` of the active requests (rounded
  down), but always ``min_concurrency`` -- so a quiet service can still retry, and a
  struggling busy one sees at most a fifth more load from retries, never a multiple. Here the
  active requests are the calls in progress (each counted once, however many tries it
  makes). A retry holds its place from the moment it is granted, its backoff included, until
  its try ends.
* *In volume*, after Finagle's ``RetryBudget`` (``com.twitter.finagle.service.RetryBudget``:
  each request deposits ``percentCanRetry`` of a token, a retry withdraws one, a reserve of
  ``minRetriesPerSec`` over the ``ttl``, tokens living ``ttl``). The bound in flight alone
  does not bound the volume: failures that come back in a millisecond free their places so
  fast that three places let nearly every call retry. Here each call that goes out deposits
  ``budget_percent`` of a token when it begins and each retry granted withdraws one.
  Finagle's bucket lets a deposit pay for a retry until it expires, so the calls of a
  healthy minute pay for a burst of retries when everything fails: a retry at t may spend
  what calls deposited before t - ttl. This bound holds in **every** window instead: a
  retry is granted while no window of ``budget_window`` seconds ending now has spent more
  than its calls deposited -- or while the whole window ending now holds fewer retries than
  the floor, ``min_retries_per_second * budget_window``. So in any window of that length,
  retries granted are at most the larger of ``budget_percent`` of the calls begun in it and
  the floor, plus one (the retry that found the budget not yet spent, and may spend the last
  part of a token). The floor is Envoy's kind of minimum, the larger of the two, not
  Finagle's reserve added to the share: a quiet service can still retry its rare failures,
  and a busy one that fails entirely sees a fifth more load, not a fifth and the floor.

  How it is checked in constant time (amortised): with ``S(t)`` the deposits minus the
  withdrawals up to t, a window (a, t] has spent ``S(a) - S(t)`` more than it deposited; the
  most any window ending now has overspent is ``max S(a) - S(t)`` over a in [t - window, t).
  Between two withdrawals ``S`` only grows, so that maximum is ``S`` just before now or just
  before one of the withdrawals in the window: those values are kept in a deque, decreasing,
  as for a sliding-window maximum.

**What may be retried** (:func:`classify`): a try that could not connect (nothing was sent,
so any method); a reset before any byte of the answer, a try's own timeout, or an answer
whose status is listed, only when the call may be sent again -- an idempotent method, or
any method with ``idempotent_only = false`` or the caller's opt-in, since the backend may
have acted -- and never with ``connect_only`` (a service without a ``retry`` table). An
answer cut short after its first byte is never retried: part of it may already be on its
way to the client.

**Backoff** is "full jitter" (AWS's architecture blog, "Exponential Backoff And Jitter"): the
*n*-th retry (from 0) waits a uniform draw from ``[0, min(backoff_max, backoff_base * 2ⁿ)]``,
which spreads the retries of many calls that failed together.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

from ._outlier_core import Failure, Outcome
from ._resilience_spec import RetrySpec

__all__ = [
    "MIN_SAMPLES",
    "BudgetStatistics",
    "LatencyWindow",
    "RetryBudget",
    "backoff",
    "classify",
]

#: Latencies the window needs before it answers a quantile (hedging waits for them).
MIN_SAMPLES: Final = 20
#: How many recent latencies the window keeps.
WINDOW_SIZE: Final = 200


def classify(
    outcome: Outcome, spec: RetrySpec, *, may_resend: bool
) -> Literal["final", "retry", "not_idempotent"]:
    """Whether a try's outcome may be retried: ``final`` (a success, or a failure that no
    retry can fix), ``retry``, or ``not_idempotent`` (it could be, were the call one that
    may be sent again)."""
    failure = outcome.failure
    if failure is Failure.CONNECT:
        return "retry"
    if spec.connect_only:
        return "final"
    if failure in (Failure.RESET, Failure.TIMEOUT) or (
        outcome.status is not None and outcome.status in spec.statuses
    ):
        return "retry" if may_resend else "not_idempotent"
    return "final"


def backoff(spec: RetrySpec, retry: int, rng: random.Random) -> float:
    """The pause before retry number ``retry`` (0 for the first): full jitter."""
    cap = min(spec.backoff_max, spec.backoff_base * 2.0 ** min(retry, 62))
    return rng.random() * cap


@dataclass(frozen=True, slots=True)
class BudgetStatistics:
    active_calls: int
    retries_in_flight: int
    #: Retries (and hedges) the bound in flight would allow in flight now.
    allowed: int
    #: Retries (and hedges) the bound on volume would grant now, one after another.
    volume_left: int
    retries: int
    hedges: int
    #: Retries and hedges refused because the budget was spent (either bound).
    exhausted: int


#: Deposits and withdrawals are counted in hundredths of a token, so that the usual whole
#: percentages add up exactly.
_TOKEN: Final = 100.0


class RetryBudget:
    """The retry budget of one service's calls: Envoy's bound in flight and a bound on the
    volume in every window (see the module docstring). The times given never go back; an
    earlier one counts as the latest."""

    def __init__(self, spec: RetrySpec) -> None:
        self.spec = spec
        self.active = 0  # calls in progress
        self.in_flight = 0  # retries and hedges granted and not yet ended
        self.retries = 0
        self.hedges = 0
        self.exhausted = 0
        # The volume: S (the module docstring) now, at time _at, and just before _at.
        self._at = -math.inf
        self._level = 0.0
        self._before = 0.0
        #: (time of a withdrawal, S just before it), S decreasing from the left.
        self._peaks: deque[tuple[float, float]] = deque()
        #: When each retry in the window ending now was granted, for the floor.
        self._granted: deque[float] = deque()

    def begin(self, now: float) -> None:
        """A call goes out: it is in progress, and deposits its share of a token."""
        self._advance(now)
        self.active += 1
        self._level += self.spec.budget_percent

    def end(self) -> None:
        """A call is over."""
        if self.active <= 0:
            raise RuntimeError("retry budget: a call ended that never began")
        self.active -= 1

    def allowed(self) -> int:
        share = math.floor(self.spec.budget_percent * self.active / 100.0)
        return max(self.spec.min_concurrency, share)

    def volume_left(self, now: float) -> float:
        """Retries left: the larger of the tokens left in the window that has spent the
        most (of those ending now) and the floor less the retries of the window ending now.
        A retry is granted while this is 0 or more."""
        self._advance(now)
        highest = self._before
        if self._peaks:
            highest = max(highest, self._peaks[0][1])
        floor = self.spec.min_retries_per_second * self.spec.budget_window
        return max((self._level - highest) / _TOKEN, floor - len(self._granted))

    def acquire(self, now: float, *, hedge: bool = False) -> bool:
        """Take a place for one retry (or hedge) and its token; False (counted) when either
        bound is spent."""
        if self.in_flight >= self.allowed() or self.volume_left(now) < 0:
            self.exhausted += 1
            return False
        peak = self._before  # S just before now: a window may start there
        while self._peaks and self._peaks[-1][1] <= peak:
            self._peaks.pop()
        self._peaks.append((self._at, peak))
        self._granted.append(self._at)
        self._level -= _TOKEN
        self.in_flight += 1
        if hedge:
            self.hedges += 1
        else:
            self.retries += 1
        return True

    def release(self) -> None:
        """A retry's try ended (or it never began): its place in flight is free again. Its
        token stays spent: it counted as a retry."""
        if self.in_flight <= 0:
            raise RuntimeError("retry budget released more often than acquired")
        self.in_flight -= 1

    def statistics(self, now: float) -> BudgetStatistics:
        left = self.volume_left(now)
        return BudgetStatistics(
            active_calls=self.active,
            retries_in_flight=self.in_flight,
            allowed=self.allowed(),
            volume_left=math.floor(left) + 1 if left >= 0 else 0,
            retries=self.retries,
            hedges=self.hedges,
            exhausted=self.exhausted,
        )

    def _advance(self, now: float) -> None:
        if now > self._at:
            self._at = now
            self._before = self._level
        horizon = self._at - self.spec.budget_window
        peaks = self._peaks
        while peaks and peaks[0][0] <= horizon:
            peaks.popleft()  # a window starting before it would be longer than the window
        granted = self._granted
        while granted and granted[0] <= horizon:
            granted.popleft()
        if not peaks and self._before:
            # Nothing kept refers to an earlier S: count from 0 again, so S stays small.
            self._level -= self._before
            self._before = 0.0


class LatencyWindow:
    """The last ``size`` latencies, kept sorted as well, for exact quantiles over a recent
    window: an insertion costs a binary search and a short memmove, a quantile one index."""

    def __init__(self, size: int = WINDOW_SIZE) -> None:
        if size < 1:
            raise ValueError(f"a latency window holds at least one sample, got {size}")
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self._size = size

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, latency: float) -> None:
        if not latency >= 0:
            raise ValueError(f"latency must be 0 or more seconds, got {latency}")
        if len(self._recent) == self._size:
            oldest = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self._recent.append(latency)
        bisect.insort(self._sorted, latency)

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q`` quantile (0 < q ≤ 1) of the window; None until it holds
        :data:`MIN_SAMPLES` latencies."""
        n = len(self._sorted)
        if n < MIN_SAMPLES:
            return None
        return self._sorted[max(0, math.ceil(q * n) - 1)]
