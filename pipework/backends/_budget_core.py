"""Retries and hedges, sans-IO: which outcomes may be tried again, the retry budget, the
backoff, and the latency window hedging reads its p95 from. Randomness comes only from the
``random.Random`` passed in.

**The budget is Envoy's** (``RetryBudget`` in the cluster's circuit breakers,
https://www.envoyproxy.io/docs/envoy/latest/api-v3/config/cluster/v3/circuit_breaker.proto):
the retries in flight may be at most ``budget_percent`` of the active requests (rounded
down), but always ``min_concurrency`` -- so a quiet service can still retry, and a
struggling busy one sees at most a fifth more load from retries, never a multiple. Here the
active requests are the calls in progress (each counted once, however many tries it makes),
and a hedge counts as a retry. A retry holds its place in the budget from the moment it is
granted, its backoff included, until its try ends.

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
    #: Retries (and hedges) the budget would allow in flight now.
    allowed: int
    retries: int
    hedges: int
    #: Retries and hedges refused because the budget was spent.
    exhausted: int


class RetryBudget:
    """Envoy's retry budget over one service's calls (see the module docstring)."""

    def __init__(self, spec: RetrySpec) -> None:
        self.spec = spec
        self.active = 0  # calls in progress
        self.in_flight = 0  # retries and hedges granted and not yet ended
        self.retries = 0
        self.hedges = 0
        self.exhausted = 0

    def allowed(self) -> int:
        share = math.floor(self.spec.budget_percent * self.active / 100.0)
        return max(self.spec.min_concurrency, share)

    def acquire(self, *, hedge: bool = False) -> bool:
        """Take a place for one retry (or hedge); False (counted) when the budget is spent."""
        if self.in_flight >= self.allowed():
            self.exhausted += 1
            return False
        self.in_flight += 1
        if hedge:
            self.hedges += 1
        else:
            self.retries += 1
        return True

    def release(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("retry budget released more often than acquired")
        self.in_flight -= 1

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(
            active_calls=self.active,
            retries_in_flight=self.in_flight,
            allowed=self.allowed(),
            retries=self.retries,
            hedges=self.hedges,
            exhausted=self.exhausted,
        )


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
