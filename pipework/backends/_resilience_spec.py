"""How a service stays available over several hosts: the hosts with their weights, how calls
are balanced over them, and the settings of health checks, outlier ejection, the circuit
breaker, retries and hedging. Plain frozen data, checked when made (``RegistrationError``
says what is wrong); the rules that use it are in the sans-IO cores (``_hosts_core.py`` and
the modules it names), and their meaning in docs/resilience.md.

This module imports no I/O library (no trio, h11 or httpx): the cores build on it. URLs are
checked as URLs by :class:`~._http_spec.Service`, which has httpx at hand.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, Literal, TypeAlias

from .._errors import RegistrationError

__all__ = [
    "BALANCES",
    "BREAKER_OFF",
    "CONNECT_RETRY",
    "IDEMPOTENT_METHODS",
    "MAX_WEIGHT",
    "OUTLIER_OFF",
    "Balance",
    "BreakerSpec",
    "HealthSpec",
    "HedgeSpec",
    "HostSpec",
    "OutlierSpec",
    "Resilience",
    "RetrySpec",
]

Balance: TypeAlias = Literal["p2c", "round_robin", "random"]
BALANCES: Final[tuple[Balance, ...]] = ("p2c", "round_robin", "random")
#: The heaviest weight a host may have: weights are relative, and a typo of 10000 is likelier
#: than a fleet whose hosts differ that much.
MAX_WEIGHT: Final = 1000
#: Methods a call may be sent again with (RFC 9110 §9.2.2): the backend acting twice on one
#: of these leaves it as acting once would.
IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS", "TRACE"})


def _positive(where: str, name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise RegistrationError(f"{where}: {name} must be a positive number, got {value}")


def _at_least(where: str, name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise RegistrationError(f"{where}: {name} must be at least {minimum}, got {value}")


def _percent(where: str, name: str, value: float, *, zero: bool) -> None:
    low_ok = value >= 0 if zero else value > 0
    if not (math.isfinite(value) and low_ok and value <= 100):
        low = "0" if zero else "above 0"
        raise RegistrationError(f"{where}: {name} must be from {low} to 100, got {value}")


def _statuses(where: str, name: str, statuses: Iterable[int]) -> frozenset[int]:
    found = frozenset(statuses)
    bad = sorted(s for s in found if not 100 <= s <= 599)
    if bad:
        raise RegistrationError(f"{where}: {name} holds {bad[0]}, not a status (100 to 599)")
    return found


@dataclass(frozen=True, slots=True)
class HostSpec:
    """One host of a service: its base URL and its ``weight`` (1 to :data:`MAX_WEIGHT`),
    relative to the other hosts': a host of weight 2 is meant to take twice the calls.
    ``authority``: the ``Host`` its requests name when the URL holds one address of a
    host name (re-resolved, ``Service.resolve``); None: the URL's own."""

    url: str
    weight: int = 1
    authority: str | None = None

    def __post_init__(self) -> None:
        if not self.url:
            raise RegistrationError("a host needs a URL")
        if not 1 <= self.weight <= MAX_WEIGHT:
            raise RegistrationError(
                f"host {self.url!r}: weight must be from 1 to {MAX_WEIGHT}, got {self.weight}"
            )


@dataclass(frozen=True, slots=True)
class HealthSpec:
    """Active health checks: every ``interval`` seconds each host is asked ``GET path``; an
    answer in ``expected_statuses`` within ``timeout`` passes. ``unhealthy_threshold`` checks
    failed in a row take a healthy host out, ``healthy_threshold`` passed in a row bring it
    back. A host starts healthy but on probation: its first failed check takes it out."""

    path: str
    interval: float = 5.0
    timeout: float = 1.0
    healthy_threshold: int = 2
    unhealthy_threshold: int = 3
    expected_statuses: frozenset[int] = field(default_factory=lambda: frozenset(range(200, 300)))

    def __post_init__(self) -> None:
        where = "health"
        if not self.path.startswith("/"):
            raise RegistrationError(f"{where}: path must start with '/', got {self.path!r}")
        _positive(where, "interval", self.interval)
        _positive(where, "timeout", self.timeout)
        if self.timeout > self.interval:
            raise RegistrationError(
                f"{where}: timeout ({self.timeout:g} s) must not exceed interval "
                f"({self.interval:g} s): a check would still run when the next one is due"
            )
        _at_least(where, "healthy_threshold", self.healthy_threshold, 1)
        _at_least(where, "unhealthy_threshold", self.unhealthy_threshold, 1)
        statuses = _statuses(where, "expected_statuses", self.expected_statuses)
        if not statuses:
            raise RegistrationError(f"{where}: expected_statuses needs at least one status")
        object.__setattr__(self, "expected_statuses", statuses)


@dataclass(frozen=True, slots=True)
class OutlierSpec:
    """Passive outlier ejection, after Envoy's (its split mode: answers and transport
    failures counted apart). A host is ejected after ``consecutive_5xx`` answers with a 5xx
    status in a row, ``consecutive_gateway_failure`` answers of 502, 503 or 504 in a row, or
    ``consecutive_local_origin_failure`` transport failures in a row (no connection, a reset,
    a timeout); 0 turns that rule off. An ejection lasts ``base_ejection_time`` times the
    host's ejection multiplier (one more per ejection, one less per ``interval`` spent back
    in service), at most ``max_ejection_time``. At most ``max_ejection_percent`` of the
    hosts are ejected at once, but always at least one may be (0: nothing is ever ejected).
    """

    consecutive_5xx: int = 5
    consecutive_gateway_failure: int = 0
    consecutive_local_origin_failure: int = 5
    base_ejection_time: float = 30.0
    max_ejection_time: float = 300.0
    max_ejection_percent: float = 10.0
    interval: float = 10.0

    def __post_init__(self) -> None:
        where = "outlier"
        for name in (
            "consecutive_5xx",
            "consecutive_gateway_failure",
            "consecutive_local_origin_failure",
        ):
            _at_least(where, name, getattr(self, name), 0)
        _positive(where, "base_ejection_time", self.base_ejection_time)
        _positive(where, "max_ejection_time", self.max_ejection_time)
        _positive(where, "interval", self.interval)
        if self.max_ejection_time < self.base_ejection_time:
            raise RegistrationError(
                f"{where}: max_ejection_time ({self.max_ejection_time:g} s) must be at least "
                f"base_ejection_time ({self.base_ejection_time:g} s)"
            )
        _percent(where, "max_ejection_percent", self.max_ejection_percent, zero=True)


@dataclass(frozen=True, slots=True)
class BreakerSpec:
    """The service's circuit breaker. It opens when no host is left to serve, or when at
    least ``failure_percent`` of the tries of the last ``window`` seconds failed (once there
    were ``minimum_calls`` of them). Open, it refuses calls at once for ``wait`` seconds;
    then ``half_open_calls`` probe calls go through: one failure opens it again, that many
    successes close it. ``enabled = False``: never opens."""

    enabled: bool = True
    failure_percent: float = 50.0
    minimum_calls: int = 20
    window: float = 10.0
    wait: float = 5.0
    half_open_calls: int = 3

    def __post_init__(self) -> None:
        where = "breaker"
        _percent(where, "failure_percent", self.failure_percent, zero=False)
        _at_least(where, "minimum_calls", self.minimum_calls, 1)
        _positive(where, "window", self.window)
        _positive(where, "wait", self.wait)
        _at_least(where, "half_open_calls", self.half_open_calls, 1)


@dataclass(frozen=True, slots=True)
class RetrySpec:
    """Retries: up to ``attempts`` tries in all (1: no retry), each to another host when
    there is one. A try is retried after a failed connection (nothing was sent: any method),
    or, for idempotent methods (all methods with ``idempotent_only = False`` or a caller's
    opt-in), after a reset before any byte of the answer, a ``per_try_timeout``, or an answer
    whose status is in ``statuses``. Retries (hedges included) stay within the budget, which
    bounds them twice: in flight, at most ``budget_percent`` of the calls in progress, but
    always ``min_concurrency``; in volume, in any ``budget_window`` seconds at most the
    larger of ``budget_percent`` of the calls begun in them and ``min_retries_per_second``
    per second (and the one retry that finds the budget not yet spent). Before each retry a
    pause drawn from [0, min(backoff_max, backoff_base * 2^n)] (full jitter).

    ``connect_only``: only a failed connection is retried -- what a service without a
    ``retry`` table does (:data:`CONNECT_RETRY`), as nginx and HAProxy retry by default."""

    attempts: int = 2
    statuses: frozenset[int] = frozenset({502, 503, 504})
    budget_percent: float = 20.0
    min_concurrency: int = 3
    min_retries_per_second: float = 1.0
    budget_window: float = 10.0
    backoff_base: float = 0.025
    backoff_max: float = 0.25
    per_try_timeout: float | None = None
    idempotent_only: bool = True
    connect_only: bool = False

    def __post_init__(self) -> None:
        where = "retry"
        _at_least(where, "attempts", self.attempts, 1)
        object.__setattr__(self, "statuses", _statuses(where, "statuses", self.statuses))
        _percent(where, "budget_percent", self.budget_percent, zero=True)
        _at_least(where, "min_concurrency", self.min_concurrency, 0)
        if not (math.isfinite(self.min_retries_per_second) and self.min_retries_per_second >= 0):
            raise RegistrationError(
                f"{where}: min_retries_per_second must be 0 or more, "
                f"got {self.min_retries_per_second}"
            )
        _positive(where, "budget_window", self.budget_window)
        _positive(where, "backoff_base", self.backoff_base)
        _positive(where, "backoff_max", self.backoff_max)
        if self.backoff_max < self.backoff_base:
            raise RegistrationError(
                f"{where}: backoff_max ({self.backoff_max:g} s) must be at least "
                f"backoff_base ({self.backoff_base:g} s)"
            )
        _positive(where, "per_try_timeout", self.per_try_timeout)
        if self.connect_only and self.statuses:
            raise RegistrationError(
                f"{where}: connect_only retries a failed connection only, so statuses "
                f"must be empty, got {sorted(self.statuses)}"
            )


@dataclass(frozen=True, slots=True)
class HedgeSpec:
    """Hedging: when a try has no answer after ``delay`` seconds (``"p95"``: the 95th
    percentile of the service's recent latencies), another try goes to another host; the
    first answer wins. At most ``max_extra`` hedges per call, each counted against the retry
    budget. Only idempotent calls hedge, as only they retry."""

    delay: float | Literal["p95"] = "p95"
    max_extra: int = 1

    def __post_init__(self) -> None:
        where = "hedge"
        if self.delay != "p95":
            if isinstance(self.delay, str):
                raise RegistrationError(
                    f'{where}: delay must be a number of seconds or "p95", got {self.delay!r}'
                )
            _positive(where, "delay", self.delay)
        _at_least(where, "max_extra", self.max_extra, 1)


#: The breaker of a service without a ``breaker`` table: it never opens.
BREAKER_OFF: Final = BreakerSpec(enabled=False)
#: The retries of a service without a ``retry`` table: a failed connection, once.
CONNECT_RETRY: Final = RetrySpec(statuses=frozenset(), connect_only=True)
#: The outlier ejection of a service of one host without an ``outlier`` table: none.
OUTLIER_OFF: Final = OutlierSpec(
    consecutive_5xx=0, consecutive_gateway_failure=0, consecutive_local_origin_failure=0
)


@dataclass(frozen=True, slots=True)
class Resilience:
    """Everything the sans-IO core of one service needs: its hosts (at least one, each URL
    once) and the settings above. ``health`` and ``hedge`` are off when None; the other
    settings default to every mechanism on with its own defaults. What a service without
    a table gets instead (the breaker off, a failed connection retried once, no ejection
    of a lone host) is ``Service.resilience``'s choice (docs/resilience.md)."""

    hosts: tuple[HostSpec, ...]
    balance: Balance = "p2c"
    health: HealthSpec | None = None
    outlier: OutlierSpec = OutlierSpec()
    breaker: BreakerSpec = BreakerSpec()
    retry: RetrySpec = RetrySpec()
    hedge: HedgeSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", tuple(self.hosts))
        if not self.hosts:
            raise RegistrationError("a service needs at least one host")
        seen: set[str] = set()
        for host in self.hosts:
            if host.url in seen:
                raise RegistrationError(f"host {host.url!r} is listed twice")
            seen.add(host.url)
        if self.balance not in BALANCES:
            raise RegistrationError(
                f"balance must be one of {', '.join(BALANCES)}, got {self.balance!r}"
            )
