"""What a try's outcome says about its host: the outcome itself (:class:`Outcome`), passive
outlier ejection (:class:`OutlierDetector`) and active health thresholds
(:func:`apply_check`). Sans-IO: the time is passed in; nothing here waits.

**Outlier ejection follows Envoy's** (architecture overview, "Outlier detection",
https://www.envoyproxy.io/docs/envoy/latest/intro/arch_overview/upstream/outlier, and
``DetectorImpl::ejectHost`` in ``source/common/upstream/outlier_detection_impl.cc``), in its
split mode (``split_external_local_origin_errors``), where an answer and a transport failure
are counted apart:

* ``consecutive_5xx`` counts answers with a 5xx status in a row; any other answer resets it;
* ``consecutive_gateway_failure`` counts 502, 503 and 504 answers in a row; any other answer
  (a 500 included) resets it. Envoy detects it at 5 but does not enforce it by default
  (``enforcing_consecutive_gateway_failure = 0``); here 0 turns it off, and is the default;
* ``consecutive_local_origin_failure`` counts transport failures in a row (no connection, a
  reset, a timeout, a broken answer); any answer resets it, since the host was reached.

When a count reaches its threshold it starts again from zero (so the next bout needs as many
again) and the host is ejected -- unless it already is, or the cap says no. **The cap** is
Envoy's exact rule: a host is ejected only if the share of hosts *already* ejected is below
``max_ejection_percent`` (``100 * ejected / hosts < max_ejection_percent``). So one host can
always be ejected when none is (unless the percentage is 0), and the count can pass the
percentage by at most the one ejection that crossed it: with 10 % of 3 hosts, one.

**The ejection time** is ``base_ejection_time * multiplier``, at most ``max_ejection_time``:
the multiplier grows by one at each ejection (while the product is still below the maximum,
as Envoy's) and shrinks by one for every ``interval`` the host has spent back in service
since its last ejection ended. Envoy sweeps every ``interval`` to return hosts and decrement
multipliers; here both are computed when next needed (:meth:`OutlierDetector.refresh`), so a
host returns exactly when its time is up.

Unlike Envoy, a passing active health check does not end an ejection: the check asks a
health path, the ejection came from the traffic itself, and both must agree before the host
takes calls again.

**Active health** (:func:`apply_check`): ``unhealthy_threshold`` failed checks in a row make
a healthy host unhealthy, ``healthy_threshold`` passed checks in a row make it healthy
again. A host starts healthy -- a gateway serves from the first second, without waiting for
a round of checks -- but on probation, as HAProxy starts a server: its first failed check
takes it out at once. Its first passed check ends the probation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final

from ._balance_core import Host
from ._resilience_spec import HealthSpec, OutlierSpec

__all__ = [
    "GATEWAY_STATUSES",
    "Failure",
    "Outcome",
    "OutlierDetector",
    "apply_check",
]

GATEWAY_STATUSES: Final = frozenset({502, 503, 504})


class Failure(Enum):
    """A try that ended without an answer. How the driver's errors map:
    ``ConnectFailed`` or a connect-phase timeout is ``CONNECT`` (nothing was sent); a
    connection broken before any byte of the answer is ``RESET``; a try's time running out
    waiting for the answer is ``TIMEOUT``; an answer cut short or invalid is ``BROKEN``."""

    CONNECT = "connect"
    RESET = "reset"
    TIMEOUT = "timeout"
    BROKEN = "broken"


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one try ended: an answer with ``status``, a ``failure``, or ``cancelled`` (the
    caller stopped it: a try that lost to another's answer, a call given up) -- which is no
    failure of the host's and counts in no failure count, outlier rule or breaker. Only a
    try that lost to another's answer says something: its host's latency estimate takes
    the time it had waited as a lower bound (``Host.observe_at_least``)."""

    status: int | None = None
    failure: Failure | None = None
    cancelled: bool = False

    def __post_init__(self) -> None:
        given = (self.status is not None) + (self.failure is not None) + self.cancelled
        if given != 1:
            raise ValueError("an outcome is exactly one of: a status, a failure, cancelled")

    @classmethod
    def answer(cls, status: int) -> Outcome:
        return cls(status=status)

    @classmethod
    def failed(cls, failure: Failure) -> Outcome:
        return cls(failure=failure)

    @classmethod
    def cancel(cls) -> Outcome:
        return cls(cancelled=True)

    @property
    def is_error(self) -> bool:
        """A failure or a 5xx answer: what the breaker and the failure counts count."""
        return self.failure is not None or (self.status is not None and self.status >= 500)

    def __str__(self) -> str:
        if self.status is not None:
            return f"status {self.status}"
        if self.failure is not None:
            return self.failure.value
        return "cancelled"


class OutlierDetector:
    """Passive ejection over one service's hosts (see the module docstring)."""

    def __init__(self, spec: OutlierSpec) -> None:
        self.spec = spec
        self._next_return = math.inf  # the earliest ejection end, to skip idle refreshes

    def observe(
        self, host: Host, outcome: Outcome, now: float, hosts: Sequence[Host]
    ) -> str | None:
        """Count ``outcome`` on ``host``; eject it if a rule fires and the cap allows.
        Returns the rule that ejected it (``consecutive_5xx``, ...), else None."""
        spec = self.spec
        fired: str | None = None
        if outcome.status is not None:
            host.consecutive_local = 0
            if outcome.status >= 500:
                host.consecutive_5xx += 1
                if outcome.status in GATEWAY_STATUSES:
                    host.consecutive_gateway += 1
                else:
                    host.consecutive_gateway = 0
            else:
                host.consecutive_5xx = host.consecutive_gateway = 0
            if spec.consecutive_5xx and host.consecutive_5xx >= spec.consecutive_5xx:
                host.consecutive_5xx = 0
                fired = "consecutive_5xx"
            if (
                spec.consecutive_gateway_failure
                and host.consecutive_gateway >= spec.consecutive_gateway_failure
            ):
                host.consecutive_gateway = 0
                fired = fired or "consecutive_gateway_failure"
        elif outcome.failure is not None:
            host.consecutive_local += 1
            limit = spec.consecutive_local_origin_failure
            if limit and host.consecutive_local >= limit:
                host.consecutive_local = 0
                fired = "consecutive_local_origin_failure"
        if fired is None or host.ejected or not self.may_eject(hosts):
            return None
        self._eject(host, now)
        return fired

    def may_eject(self, hosts: Sequence[Host]) -> bool:
        """Envoy's cap: the share already ejected is below ``max_ejection_percent``."""
        ejected = sum(1 for h in hosts if h.ejected_until is not None)
        return 100.0 * ejected / len(hosts) < self.spec.max_ejection_percent

    def ejection_time(self, multiplier: int) -> float:
        return min(self.spec.base_ejection_time * multiplier, self.spec.max_ejection_time)

    def _eject(self, host: Host, now: float) -> None:
        spec = self.spec
        # The multiplier shrinks by one per interval spent back in service since the host's
        # last ejection ended, then grows by one for this ejection, while below the maximum.
        served = now - host.returned_at
        if host.ejection_multiplier and math.isfinite(served):
            decay = int(served // spec.interval)
            host.ejection_multiplier = max(0, host.ejection_multiplier - decay)
        if spec.base_ejection_time * host.ejection_multiplier < spec.max_ejection_time:
            host.ejection_multiplier += 1
        host.ejections += 1
        until = now + self.ejection_time(host.ejection_multiplier)
        host.ejected_until = until
        self._next_return = min(self._next_return, until)

    def refresh(self, hosts: Sequence[Host], now: float) -> list[Host]:
        """Return to service every host whose ejection time is up; returns them."""
        if now < self._next_return:
            return []
        returned: list[Host] = []
        upcoming = math.inf
        for host in hosts:
            until = host.ejected_until
            if until is None:
                continue
            if until <= now:
                host.ejected_until = None
                host.returned_at = until
                returned.append(host)
            else:
                upcoming = min(upcoming, until)
        self._next_return = upcoming
        return returned

    def forget(self, hosts: Sequence[Host]) -> None:
        """The host set changed (a reload): recompute the earliest return."""
        ends = [h.ejected_until for h in hosts if h.ejected_until is not None]
        self._next_return = min(ends, default=math.inf)


def apply_check(host: Host, spec: HealthSpec, passed: bool) -> bool | None:
    """Fold one active check into ``host``'s health; returns its new health if it changed,
    else None (see the module docstring for the thresholds and the probation)."""
    probation, host.on_probation = host.on_probation, False
    if passed:
        host.health_failed = 0
        host.health_passed += 1
        if not host.healthy and host.health_passed >= spec.healthy_threshold:
            host.healthy = True
            host.health_passed = 0
            return True
        return None
    host.health_passed = 0
    host.health_failed += 1
    if host.healthy and (probation or host.health_failed >= spec.unhealthy_threshold):
        host.healthy = False
        host.health_failed = 0
        return False
    return None
