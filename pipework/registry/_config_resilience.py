"""The resilience keys of ``[services.NAME]``: ``hosts`` (or ``base_url``), ``balance``, and
the tables ``health``, ``outlier``, ``breaker``, ``retry`` and ``hedge``. Every problem is
reported with its key path; what the settings mean is in docs/resilience.md."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

from .._errors import RegistrationError
from ..backends._http_spec import check_base_url, check_same_api
from ..backends._resilience_spec import (
    BALANCES,
    MAX_WEIGHT,
    Balance,
    BreakerSpec,
    HealthSpec,
    HedgeSpec,
    HostSpec,
    OutlierSpec,
    RetrySpec,
)
from ._config_problems import describe_value
from ._config_read import Table, open_table

__all__ = [
    "BREAKER_KEYS",
    "HEALTH_KEYS",
    "HEDGE_KEYS",
    "HOST_KEYS",
    "OUTLIER_KEYS",
    "RESILIENCE_KEYS",
    "RETRY_KEYS",
    "read_resilience",
]

HOST_KEYS: Final = ("url", "weight")
HEALTH_KEYS: Final = (
    "path",
    "interval",
    "timeout",
    "healthy_threshold",
    "unhealthy_threshold",
    "expected_statuses",
)
OUTLIER_KEYS: Final = (
    "consecutive_5xx",
    "consecutive_gateway_failure",
    "consecutive_local_origin_failure",
    "base_ejection_time",
    "max_ejection_time",
    "max_ejection_percent",
    "interval",
)
BREAKER_KEYS: Final = (
    "enabled",
    "failure_percent",
    "minimum_calls",
    "window",
    "wait",
    "half_open_calls",
)
RETRY_KEYS: Final = (
    "attempts",
    "statuses",
    "budget_percent",
    "min_concurrency",
    "min_retries_per_second",
    "budget_window",
    "backoff_base",
    "backoff_max",
    "per_try_timeout",
    "idempotent_only",
)
HEDGE_KEYS: Final = ("delay", "max_extra")
#: The keys of ``[services.NAME]`` read here (``base_url`` is read here too).
RESILIENCE_KEYS: Final = (
    "hosts",
    "resolve",
    "balance",
    "health",
    "outlier",
    "breaker",
    "retry",
    "hedge",
)

_STATUS_CLASS: Final = re.compile(r"[1-5]xx\Z")

T = TypeVar("T")


def read_resilience(t: Table, timeout: float) -> dict[str, Any]:
    """The :class:`~pipework.Service` keyword arguments for its hosts and resilience
    settings, read from the service's table ``t`` (``timeout``: the service's)."""
    c = t.c
    base_url = t.string("base_url", None)
    if base_url is not None:
        problem = check_base_url(base_url)
        if problem is not None:
            c.error(t.at("base_url"), problem)
    if "hosts" in t and base_url is not None:
        c.error(t.at("hosts"), "set base_url (one host) or hosts, not both")
    elif "hosts" not in t and "base_url" not in t:
        c.error(t.at("base_url"), "required key is missing: set base_url, or hosts for several")
    fields: dict[str, Any] = {"base_url": base_url or "", "hosts": _hosts(t)}
    if "resolve" in t:
        fields["resolve"] = t.number("resolve", 30.0)
    chosen = t.string("balance", "p2c", choices=BALANCES)
    balance: Balance = next(b for b in BALANCES if b == chosen)
    fields["balance"] = balance
    fields["health"] = _health(t)
    fields["outlier"] = _outlier(t)
    fields["breaker"] = _breaker(t)
    fields["retry"] = _retry(t, timeout)
    hedge = fields["hedge"] = _hedge(t)
    if hedge is not None and len(fields["hosts"]) < 2:
        t.c.warn(
            t.at("hedge"),
            "a hedge goes to another host, and this service has one: its calls never hedge",
        )
    return fields


def _hosts(t: Table) -> tuple[HostSpec, ...]:
    if "hosts" not in t:
        return ()
    c, value = t.c, t.data["hosts"]
    where = t.at("hosts")
    if not isinstance(value, list) or not value:
        c.error(
            where,
            'expected a non-empty array of hosts: URLs, or tables { url = "...", weight = 2 }',
        )
        return ()
    hosts: list[HostSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        at = (*where, i)
        url: str | None
        if isinstance(item, str):
            url, weight = item, 1
        elif isinstance(item, dict):
            h = open_table(c, at, item, HOST_KEYS)
            assert h is not None
            url = h.string("url", None, required=True)
            weight = h.integer("weight", 1, minimum=1, maximum=MAX_WEIGHT)
            if url is None:
                continue
            at = h.at("url")
        else:
            c.error(
                at,
                f'expected a URL or a table {{ url = "...", weight = 2 }}, '
                f"got {describe_value(item)}",
            )
            continue
        problem = check_base_url(url)
        if problem is not None:
            c.error(at, problem)
        elif url in seen:
            c.error(at, f"{url!r} is listed twice (also hosts[{seen[url]}])")
        else:
            seen[url] = i
            hosts.append(HostSpec(url, weight))
    problem = check_same_api(tuple(h.url for h in hosts))
    if problem is not None:
        c.error(where, problem)
    return tuple(hosts)


def _statuses(t: Table, key: str, default: frozenset[int], *, empty: bool) -> frozenset[int]:
    if key not in t:
        return default
    value = t.data[key]
    if not isinstance(value, list) or (not value and not empty):
        t.c.error(t.at(key), 'expected a non-empty array of statuses (200, "2xx", ...)')
        return default
    found: set[int] = set()
    for i, item in enumerate(value):
        if isinstance(item, str) and _STATUS_CLASS.match(item):
            start = int(item[0]) * 100
            found.update(range(start, start + 100))
        elif isinstance(item, int) and not isinstance(item, bool) and 100 <= item <= 599:
            found.add(item)
        else:
            t.c.error(
                (*t.at(key), i),
                f'expected a status from 100 to 599 or a class like "5xx", '
                f"got {describe_value(item)}",
            )
    return frozenset(found)


def _percent(t: Table, key: str, default: float, *, zero: bool) -> float:
    value = t.number(key, default, positive=not zero)
    if value > 100:
        t.c.error(t.at(key), f"must be at most 100 (a percentage), got {value:g}")
        return default
    return value


def _sub(t: Table, key: str, known: tuple[str, ...]) -> Table | None:
    if key not in t:
        return None
    return open_table(t.c, t.at(key), t.data[key], known)


def _build(t: Table, make: Callable[..., T], **kwargs: Any) -> T | None:
    """``make(**kwargs)`` unless a problem was reported in ``t``; a check of the spec's own
    (none should be left) is reported on the table."""
    if t.c.failed(t.path):
        return None
    try:
        return make(**kwargs)
    except RegistrationError as exc:
        t.c.error(t.path, str(exc))
        return None


def _health(t: Table) -> HealthSpec | None:
    h = _sub(t, "health", HEALTH_KEYS)
    if h is None:
        return None
    path = h.string("path", None, required=True)
    if path is not None and not path.startswith("/"):
        h.c.error(h.at("path"), f"must start with '/', got {path!r}")
    d = HealthSpec("/")
    interval = h.number("interval", d.interval)
    timeout = h.number("timeout", d.timeout)
    if timeout > interval:
        h.c.error(
            h.at("timeout"),
            f"{timeout:g} s is longer than the interval ({interval:g} s): a check would "
            "still run when the next is due; lower the timeout or raise the interval",
        )
    return _build(
        h,
        HealthSpec,
        path=path,
        interval=interval,
        timeout=timeout,
        healthy_threshold=h.integer("healthy_threshold", d.healthy_threshold, minimum=1),
        unhealthy_threshold=h.integer("unhealthy_threshold", d.unhealthy_threshold, minimum=1),
        expected_statuses=_statuses(h, "expected_statuses", d.expected_statuses, empty=False),
    )


def _outlier(t: Table) -> OutlierSpec | None:
    o = _sub(t, "outlier", OUTLIER_KEYS)
    if o is None:
        return None  # Envoy's defaults for several hosts, none for one (Service.resilience)
    d = OutlierSpec()
    base = o.number("base_ejection_time", d.base_ejection_time)
    most = o.number("max_ejection_time", max(d.max_ejection_time, base))
    if most < base:
        o.c.error(
            o.at("max_ejection_time"),
            f"must be at least base_ejection_time ({base:g} s), got {most:g}",
        )
    built = _build(
        o,
        OutlierSpec,
        consecutive_5xx=o.integer("consecutive_5xx", d.consecutive_5xx, minimum=0),
        consecutive_gateway_failure=o.integer(
            "consecutive_gateway_failure", d.consecutive_gateway_failure, minimum=0
        ),
        consecutive_local_origin_failure=o.integer(
            "consecutive_local_origin_failure", d.consecutive_local_origin_failure, minimum=0
        ),
        base_ejection_time=base,
        max_ejection_time=most,
        max_ejection_percent=_percent(o, "max_ejection_percent", d.max_ejection_percent, zero=True),
        interval=o.number("interval", d.interval),
    )
    return built or d


def _breaker(t: Table) -> BreakerSpec | None:
    b = _sub(t, "breaker", BREAKER_KEYS)
    if b is None:
        return None  # off: a file without the table keeps every call going out
    d = BreakerSpec()
    built = _build(
        b,
        BreakerSpec,
        enabled=b.boolean("enabled", d.enabled),
        failure_percent=_percent(b, "failure_percent", d.failure_percent, zero=False),
        minimum_calls=b.integer("minimum_calls", d.minimum_calls, minimum=1),
        window=b.number("window", d.window),
        wait=b.number("wait", d.wait),
        half_open_calls=b.integer("half_open_calls", d.half_open_calls, minimum=1),
    )
    return built or d


def _retry(t: Table, timeout: float) -> RetrySpec | None:
    r = _sub(t, "retry", RETRY_KEYS)
    if r is None:
        return None  # a failed connection only, once (Service.resilience)
    d = RetrySpec()
    base = r.number("backoff_base", d.backoff_base)
    most = r.number("backoff_max", max(d.backoff_max, base))
    if most < base:
        r.c.error(r.at("backoff_max"), f"must be at least backoff_base ({base:g} s), got {most:g}")
    per_try = r.number("per_try_timeout", None)
    if per_try is not None and per_try >= timeout:
        r.c.warn(
            r.at("per_try_timeout"),
            f"{per_try:g} s is not below the service's timeout ({timeout:g} s): no try is "
            "ever cut short by it",
        )
    built = _build(
        r,
        RetrySpec,
        attempts=r.integer("attempts", d.attempts, minimum=1),
        statuses=_statuses(r, "statuses", d.statuses, empty=True),
        budget_percent=_percent(r, "budget_percent", d.budget_percent, zero=True),
        min_concurrency=r.integer("min_concurrency", d.min_concurrency, minimum=0),
        min_retries_per_second=r.number(
            "min_retries_per_second", d.min_retries_per_second, positive=False
        ),
        budget_window=r.number("budget_window", d.budget_window),
        backoff_base=base,
        backoff_max=most,
        per_try_timeout=per_try,
        idempotent_only=r.boolean("idempotent_only", d.idempotent_only),
    )
    return built or d


def _hedge(t: Table) -> HedgeSpec | None:
    h = _sub(t, "hedge", HEDGE_KEYS)
    if h is None:
        return None
    d = HedgeSpec()
    delay: float | str = d.delay
    if "delay" in h:
        value = h.data["delay"]
        if isinstance(value, str):
            if value != "p95":
                h.c.error(h.at("delay"), f'expected a number of seconds or "p95", got {value!r}')
        else:
            delay = h.number("delay", d.delay)
    return _build(
        h, HedgeSpec, delay=delay, max_extra=h.integer("max_extra", d.max_extra, minimum=1)
    )
