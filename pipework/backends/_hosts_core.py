"""Upstream resilience for one service, as a sans-IO core: which host a try goes to, what
its outcome changes, whether to retry or hedge, and whether to call at all. No I/O and no
clock -- every method takes the time (trio's, in the driver) -- and no randomness but the
``random.Random`` given, so a seed and a sequence of times replay every decision.

The driver's loop, for one call::

    call = core.begin(now, method="GET", deadline=deadline)
    if isinstance(call, Refusal): answer 503 with Retry-After: call.retry_after
    try:
        attempt = call.attempt(now)                 # None: no host at all (every one drained)
        ...send on attempt.host.tag (its pool), within attempt.deadline; meanwhile, at
           call.hedge_at(), call.hedge(now) may give a second attempt to run beside it...
        verdict = call.finish(attempt, now, Outcome.answer(status))    # or .failed(...)
        "answer": that outcome is the call's (cancel any other attempt);
        "retry":  sleep verdict.delay, then call.attempt(now) again;
        "drop":   not the call's outcome (another attempt is still out, or it came late).
    finally:
        call.end(now)                               # every attempt still out: cancelled

The parts, each in its own module: one call's tries, retries and hedges (``_call_core``,
with the rules that decide them), the hosts and balancers (``_balance_core``), outcomes,
outlier ejection and health thresholds (``_outlier_core``), the circuit breaker
(``_breaker_core``), the retry budget, backoff and latency window (``_budget_core``).

**Which hosts may take a try.** A host is *available* when it is healthy, not ejected and
not draining; the balancer chooses among the available ones not yet tried by this call.
When every available host was tried, a retry goes to one of them again. When no host is
available at all -- every one ejected or unhealthy -- the core *panics*, as Envoy does
below its panic threshold: it balances over every host not draining, as if all were
healthy, because failing every call outright is worse than trying hosts that may have
recovered (the breaker, which opened when the last host went out, keeps that to its
probes). Envoy panics already when fewer than half the hosts are healthy; here the
survivors take the load, since the ejection cap keeps most hosts in, the adaptive limit
backs off if they cannot take it, and retries move calls off a host that fails. Draining
hosts are never chosen; with every host draining there is no host, and calls are refused.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from ._balance_core import Balancer, Host, make_balancer
from ._breaker_core import Breaker, BreakerState, BreakerStatistics
from ._budget_core import BudgetStatistics, LatencyWindow, RetryBudget
from ._call_core import Attempt, Call, Refusal, Verdict
from ._outlier_core import Failure, Outcome, OutlierDetector, apply_check
from ._resilience_spec import IDEMPOTENT_METHODS, Resilience

__all__ = [
    "NO_HOST_RETRY_AFTER",
    "Attempt",
    "BreakerChanged",
    "Call",
    "Event",
    "Failure",
    "HealthChanged",
    "HostEjected",
    "HostReturned",
    "HostStatistics",
    "Outcome",
    "Refusal",
    "ServiceCore",
    "ServiceStatistics",
    "Verdict",
]

#: Retry-After when every host is drained: an operator has to act.
NO_HOST_RETRY_AFTER: Final = 30.0
#: A failed try's latency sample is at least this many times the host's estimate, so a
#: host that fails fast never looks fast to p2c.
_FAILURE_PENALTY: Final = 2.0


# -- events ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostEjected:
    url: str
    rule: str
    until: float
    ejections: int


@dataclass(frozen=True, slots=True)
class HostReturned:
    url: str


@dataclass(frozen=True, slots=True)
class HealthChanged:
    url: str
    healthy: bool


@dataclass(frozen=True, slots=True)
class BreakerChanged:
    state: str
    reason: str | None
    retry_after: float


Event = HostEjected | HostReturned | HealthChanged | BreakerChanged


# -- statistics --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HostStatistics:
    """One host at one moment. ``state``: ``draining``, ``ejected``, ``unhealthy`` or
    ``available`` (the first that applies)."""

    url: str
    weight: int
    state: str
    healthy: bool
    ejected: bool
    draining: bool
    outstanding: int
    requests: int
    failures: int
    latency: float | None
    ejections: int
    ejection_multiplier: int
    ejected_for: float
    consecutive_5xx: int
    consecutive_gateway_failure: int
    consecutive_local_origin_failure: int


@dataclass(frozen=True, slots=True)
class ServiceStatistics:
    """One service at one moment: its hosts, breaker, retry budget and latencies.
    ``panic``: no host is available, so tries go to any host not draining."""

    service: str
    balance: str
    hosts: tuple[HostStatistics, ...]
    available: int
    panic: bool
    calls: int
    refused: Mapping[str, int]
    breaker: BreakerStatistics
    budget: BudgetStatistics
    latency_p50: float | None
    latency_p95: float | None


# -- the service -------------------------------------------------------------------------


class ServiceCore:
    """The resilience decisions of one service (see the module docstring)."""

    def __init__(
        self,
        name: str,
        resilience: Resilience,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.name = name
        self.rng = rng if rng is not None else random.Random()
        self.resilience = resilience
        self.hosts: tuple[Host, ...] = tuple(Host(spec) for spec in resilience.hosts)
        self.balancer: Balancer = make_balancer(resilience.balance, self.rng)
        self.outliers = OutlierDetector(resilience.outlier)
        self.breaker = Breaker(resilience.breaker)
        self.budget = RetryBudget(resilience.retry)
        self.latencies = LatencyWindow()
        self.calls = 0
        self.refused = {"circuit_open": 0, "circuit_probing": 0, "no_host": 0}
        self._events: list[Event] = []
        self._breaker_seen = (self.breaker.state, self.breaker.epoch)

    # -- calls -------------------------------------------------------------------------------

    def begin(
        self,
        now: float,
        *,
        method: str = "GET",
        deadline: float = math.inf,
        resend: bool = False,
        hedge: bool | None = None,
    ) -> Call | Refusal:
        """A call to this service, or why not. ``resend``: the caller lets a
        non-idempotent ``method`` be sent again (a route's opt-in). ``hedge``: whether the
        call may hedge (None: when the service has a ``hedge`` setting)."""
        self._refresh(now)
        if all(h.draining for h in self.hosts):
            return self._refuse(
                "no_host",
                NO_HOST_RETRY_AFTER,
                f"every host of service {self.name!r} is drained; restore one to call it",
            )
        permit = self.breaker.admit(now)
        self._watch_breaker(now)
        if not permit.allowed:
            state = self.breaker.state
            reason: Literal["circuit_open", "circuit_probing"] = (
                "circuit_open" if state is BreakerState.OPEN else "circuit_probing"
            )
            why = f"service {self.name!r} is failing: its circuit breaker is {state.value}"
            return self._refuse(reason, permit.retry_after, f"{why}; calls are refused for now")
        may_resend = (
            method.upper() in IDEMPOTENT_METHODS
            or resend
            or not self.resilience.retry.idempotent_only
        )
        wants_hedge = self.resilience.hedge is not None if hedge is None else hedge
        self.calls += 1
        self.budget.begin(now)
        return Call(self, permit, deadline, may_resend, wants_hedge)

    def refusing(self, now: float) -> bool:
        """Whether :meth:`begin` would refuse a call now (every host drained, or the breaker
        refusing), without changing anything: what degradation asks before a pipe runs."""
        return all(h.draining for h in self.hosts) or self.breaker.refusing(now)

    def refuse(self, now: float) -> Refusal | None:
        """:meth:`begin`'s refusal of a call now, counted as that one is; None, with nothing
        changed, when :meth:`begin` would let the call in. What a proxied request asks
        before it waits for its slot of the pool key: a call that can only be refused
        takes none."""
        if not self.refusing(now):
            return None
        refusal = self.begin(now)
        assert isinstance(refusal, Refusal), "refusing() said begin() refuses"
        return refusal

    def pick(self, now: float, exclude: Iterable[Host] = (), *, repeat: bool = True) -> Host | None:
        """A host for a try: an available one not in ``exclude``; else (with ``repeat``) an
        available one again; else, in panic, any host not draining likewise. None when
        every host is draining (or, without ``repeat``, every candidate is excluded)."""
        self._refresh(now)
        skip = set(exclude)
        available = [h for h in self.hosts if h.available]
        pool = available or [h for h in self.hosts if not h.draining]
        fresh = [h for h in pool if h not in skip]
        candidates = fresh or (pool if repeat else [])
        if not candidates:
            return None
        return self.balancer.choose(candidates, now)

    def record(self, attempt: Attempt, now: float, outcome: Outcome) -> None:
        """Count a try's outcome everywhere it counts. :meth:`Call.finish` calls it; a
        driver calls that instead."""
        host = attempt.host
        host.outstanding -= 1
        if attempt.kind != "first":
            self.budget.release()
        error = None if outcome.cancelled else outcome.is_error
        self.breaker.record(attempt.call.permit, now, error=error)
        elapsed = max(0.0, now - attempt.started)
        if outcome.cancelled:
            if attempt.call.answered and host in self.hosts:
                # It lost to another try's answer: its own would have taken this long at
                # least. Not a failure, but a slow host whose tries all lose to hedges must
                # not look fast to the balancer for never answering.
                host.observe_at_least(now, elapsed)
        elif host in self.hosts:
            if outcome.is_error:
                host.failures += 1
                basis = host.latency(now) or self._typical_latency(now) or elapsed
                host.observe(now, max(elapsed, _FAILURE_PENALTY * basis))
            else:
                host.observe(now, elapsed)
                self.latencies.add(elapsed)
            self._refresh(now)
            rule = self.outliers.observe(host, outcome, now, self.hosts)
            if rule is not None:
                assert host.ejected_until is not None
                until, count = host.ejected_until, host.ejections
                self._events.append(HostEjected(host.url, rule, until, count))
                self._check_hosts(now)
        self._watch_breaker(now)

    # -- hosts -------------------------------------------------------------------------------

    def host(self, url: str) -> Host:
        for host in self.hosts:
            if host.url == url:
                return host
        raise KeyError(f"service {self.name!r} has no host {url!r}")

    def health_check(self, url: str, now: float, *, passed: bool) -> None:
        """One active health check of host ``url`` passed or failed."""
        spec = self.resilience.health
        if spec is None:
            raise RuntimeError(f"service {self.name!r} has no health checks configured")
        host = self.host(url)
        changed = apply_check(host, spec, passed)
        if changed is not None:
            self._events.append(HealthChanged(url, changed))
            if not changed:
                self._check_hosts(now)

    def drain(self, url: str, now: float) -> None:
        """Take host ``url`` out of rotation: no new tries; those out finish."""
        self.host(url).draining = True
        self._check_hosts(now)

    def restore(self, url: str, now: float) -> None:
        """Put a drained host back in rotation."""
        self.host(url).draining = False

    def reconfigure(self, resilience: Resilience, now: float) -> None:
        """Swap the settings in. A host whose URL stays keeps all it learnt -- health,
        ejection, latency, drain; new hosts start fresh; removed hosts' tries still out
        finish uncounted. The breaker keeps its state unless its settings changed."""
        known = {h.url: h for h in self.hosts}
        hosts: list[Host] = []
        for spec in resilience.hosts:
            host = known.get(spec.url) or Host(spec)
            host.spec = spec
            hosts.append(host)
        self.hosts = tuple(hosts)
        old, self.resilience = self.resilience, resilience
        if resilience.balance != old.balance:
            self.balancer = make_balancer(resilience.balance, self.rng)
        self.outliers = OutlierDetector(resilience.outlier)
        self.outliers.forget(self.hosts)
        if resilience.breaker != old.breaker:
            # A later epoch: the permits of calls still out belong to the old breaker.
            self.breaker = Breaker(resilience.breaker, epoch=self.breaker.epoch + 1)
            self._breaker_seen = (self.breaker.state, self.breaker.epoch)
        self.budget.spec = resilience.retry
        self._refresh(now)

    # -- reading -----------------------------------------------------------------------------

    def pop_events(self) -> list[Event]:
        """What changed since the last call (ejections, returns, health, breaker), oldest
        first, for logs and metrics."""
        events, self._events = self._events, []
        return events

    def statistics(self, now: float) -> ServiceStatistics:
        self._refresh(now)
        hosts = tuple(_host_statistics(h, now) for h in self.hosts)
        available = sum(1 for h in self.hosts if h.available)
        return ServiceStatistics(
            service=self.name,
            balance=self.resilience.balance,
            hosts=hosts,
            available=available,
            panic=available == 0,
            calls=self.calls,
            refused=MappingProxyType(dict(self.refused)),
            breaker=self.breaker.statistics(now),
            budget=self.budget.statistics(now),
            latency_p50=self.latencies.quantile(0.5),
            latency_p95=self.latencies.quantile(0.95),
        )

    # -- internals ---------------------------------------------------------------------------

    def _refresh(self, now: float) -> None:
        for host in self.outliers.refresh(self.hosts, now):
            self._events.append(HostReturned(host.url))

    def _typical_latency(self, now: float) -> float | None:
        """The mean latency estimate of the hosts that have one."""
        known = [x for h in self.hosts if (x := h.latency(now)) is not None]
        return sum(known) / len(known) if known else None

    def _check_hosts(self, now: float) -> None:
        """The last available host just went out: the breaker opens."""
        serving = [h for h in self.hosts if not h.draining]
        if serving and not any(h.available for h in serving):
            self.breaker.no_host(now)
            self._watch_breaker(now)

    def _watch_breaker(self, now: float) -> None:
        b = self.breaker
        if (b.state, b.epoch) != self._breaker_seen:
            self._breaker_seen = (b.state, b.epoch)
            self._events.append(BreakerChanged(b.state.value, b.reason, b.retry_after(now)))

    def _refuse(
        self,
        reason: Literal["circuit_open", "circuit_probing", "no_host"],
        retry_after: float,
        message: str,
    ) -> Refusal:
        self.refused[reason] += 1
        return Refusal(reason, retry_after, message)


def _host_statistics(h: Host, now: float) -> HostStatistics:
    if h.draining:
        state = "draining"
    elif h.ejected:
        state = "ejected"
    elif not h.healthy:
        state = "unhealthy"
    else:
        state = "available"
    return HostStatistics(
        url=h.url,
        weight=h.weight,
        state=state,
        healthy=h.healthy,
        ejected=h.ejected,
        draining=h.draining,
        outstanding=h.outstanding,
        requests=h.requests,
        failures=h.failures,
        latency=h.latency(now),
        ejections=h.ejections,
        ejection_multiplier=h.ejection_multiplier,
        ejected_for=0.0 if h.ejected_until is None else max(0.0, h.ejected_until - now),
        consecutive_5xx=h.consecutive_5xx,
        consecutive_gateway_failure=h.consecutive_gateway,
        consecutive_local_origin_failure=h.consecutive_local,
    )
