"""The state families: collectors that read the components' ``statistics()`` at scrape time.

The engine's queue depth, its jobs by status and the worker pool's per-key counters and
weights; the backend services' hosts and breakers; the resource pools. Apart from
:mod:`pipework._metrics` (the event families the engine updates as things happen, and the
registry they share) because these hold no values of their own: each ``collect`` builds its
families afresh from what a component reports, and :class:`~pipework._metrics.Metrics` only
registers them and, with several processes, publishes what they read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "PoolReport",
    "ResourcePoolCollector",
    "ServiceCollector",
    "StateCollector",
    "Statistics",
]


class Statistics(Protocol):
    def statistics(self) -> Any: ...


class PoolReport(Protocol):
    """A worker pool that reports its keys (the dispatcher's ``ReportingPool``, which the
    engine resolves once; the metrics read its fields by name, never probe them)."""

    @property
    def config(self) -> Any: ...

    def statistics(self) -> Any: ...


class StateCollector(Collector):
    def __init__(
        self,
        queue: Statistics,
        jobs: Callable[[], Mapping[str, int]],
        pool: PoolReport | None,
        key_label: Callable[[str], str],
    ) -> None:
        self._queue = queue
        self._jobs = jobs
        self._pool = pool
        self._label = key_label

    def describe(self) -> list[Metric]:
        return []  # unchecked: families appear as the components report them

    def collect(self) -> Iterator[Metric]:
        q = self._queue.statistics()
        yield _gauge("pipework_event_queue_depth", "Events accepted and not yet started.", q.depth)
        yield _gauge(
            "pipework_event_queue_capacity", "New submissions the queue takes.", q.capacity
        )
        refused = CounterMetricFamily(
            "pipework_event_queue_refused", "Submissions refused because the queue was full."
        )
        refused.add_metric([], q.refused)
        yield refused
        accepted = CounterMetricFamily(
            "pipework_event_queue_accepted",
            "Events taken in (submissions and events of accepted jobs).",
        )
        accepted.add_metric([], q.accepted)
        yield accepted
        jobs = GaugeMetricFamily(
            "pipework_jobs", "Jobs in the job pool by status.", labels=["status"]
        )
        for status, count in self._jobs().items():
            jobs.add_metric([status], count)
        yield jobs
        if self._pool is not None:
            yield from _pool_families(self._pool, self._label)


#: A host's states, one series each (1 for the one it is in).
_HOST_STATES: Final = ("available", "unhealthy", "ejected", "draining")
_BREAKER_STATES: Final = ("closed", "open", "half_open")


class ServiceCollector(Collector):
    """The resilience families of the backend services (docs/resilience.md): per host and
    per service, read from each service core's statistics at scrape time."""

    def __init__(self) -> None:
        self.services: dict[str, Callable[[], Any]] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        host = ["service", "host"]
        requests = CounterMetricFamily(
            "pipework_backend_host_requests",
            "Tries sent to each host of a service (retries and hedges included).",
            labels=host,
        )
        failures = CounterMetricFamily(
            "pipework_backend_host_failures",
            "Tries to each host that failed: a 5xx answer or no answer.",
            labels=host,
        )
        ejections = CounterMetricFamily(
            "pipework_backend_host_ejections",
            "Times each host was ejected by outlier detection.",
            labels=host,
        )
        latency = GaugeMetricFamily(
            "pipework_backend_host_latency_seconds",
            "Each host's latency estimate (peak EWMA, what p2c balances on).",
            labels=host,
        )
        outstanding = GaugeMetricFamily(
            "pipework_backend_host_outstanding",
            "Tries out to each host now.",
            labels=host,
        )
        healthy = GaugeMetricFamily(
            "pipework_backend_host_healthy",
            "1 while the host passes its active health checks (or has none), else 0.",
            labels=host,
        )
        state = GaugeMetricFamily(
            "pipework_backend_host_state",
            "1 for the state each host is in: available, unhealthy, ejected, draining.",
            labels=[*host, "state"],
        )
        breaker = GaugeMetricFamily(
            "pipework_backend_breaker_state",
            "1 for the state of each service's circuit breaker: closed, open, half_open.",
            labels=["service", "state"],
        )
        opened = CounterMetricFamily(
            "pipework_backend_breaker_opened",
            "Times each service's circuit breaker opened.",
            labels=["service"],
        )
        retries = CounterMetricFamily(
            "pipework_backend_retries",
            "Extra tries sent by kind: retry, hedge.",
            labels=["service", "kind"],
        )
        exhausted = CounterMetricFamily(
            "pipework_backend_retry_budget_exhausted",
            "Retries and hedges not sent because the retry budget was spent.",
            labels=["service"],
        )
        refused = CounterMetricFamily(
            "pipework_backend_refused",
            "Calls refused before a try by reason: circuit_open, circuit_probing, no_host.",
            labels=["service", "reason"],
        )
        for name, read in sorted(self.services.items()):
            stats = read()
            for h in stats.hosts:
                labels = [name, h.url]
                requests.add_metric(labels, h.requests)
                failures.add_metric(labels, h.failures)
                ejections.add_metric(labels, h.ejections)
                if h.latency is not None:
                    latency.add_metric(labels, h.latency)
                outstanding.add_metric(labels, h.outstanding)
                healthy.add_metric(labels, 1 if h.healthy else 0)
                for one in _HOST_STATES:
                    state.add_metric([*labels, one], 1 if h.state == one else 0)
            for one in _BREAKER_STATES:
                breaker.add_metric([name, one], 1 if stats.breaker.state == one else 0)
            opened.add_metric([name], stats.breaker.opened)
            retries.add_metric([name, "retry"], stats.budget.retries)
            retries.add_metric([name, "hedge"], stats.budget.hedges)
            exhausted.add_metric([name], stats.budget.exhausted)
            for reason, count in sorted(stats.refused.items()):
                refused.add_metric([name, reason], count)
        yield from (requests, failures, ejections, latency, outstanding, healthy, state)
        yield from (breaker, opened, retries, exhausted, refused)


class ResourcePoolCollector(Collector):
    """The state families of the resource pools, one ``pool`` label value each."""

    def __init__(self) -> None:
        self.pools: dict[str, Statistics] = {}

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "size": "Resources the pool is configured to hold.",
            "capacity": "Resources the pool holds now (below size while replacements are due).",
            "idle": "Resources ready to lend.",
            "borrowed": "Resources lent out now.",
            "waiting": "Borrowers waiting for a resource.",
        }
        counters = {
            "replacements": "Resources made to replace one that failed.",
            "replacement_failures": "Attempts to make a replacement that failed (retried "
            "with backoff).",
        }
        families: list[GaugeMetricFamily | CounterMetricFamily] = []
        rows = [(name, pool.statistics()) for name, pool in sorted(self.pools.items())]
        for field, doc in gauges.items():
            family = GaugeMetricFamily(f"pipework_resource_pool_{field}", doc, labels=["pool"])
            for name, stats in rows:
                family.add_metric([name], getattr(stats, field))
            families.append(family)
        for field, doc in counters.items():
            counter = CounterMetricFamily(f"pipework_resource_pool_{field}", doc, labels=["pool"])
            source = "failures" if field == "replacement_failures" else field
            for name, stats in rows:
                counter.add_metric([name], getattr(stats, source))
            families.append(counter)
        yield from families


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], value)
    return family


def _new_row() -> dict[str, Any]:
    return {
        "reserved": 0,
        "shared": 0,
        "waiting": 0,
        "oldest": 0.0,
        "reserve": 0,
        "limit": None,
        "effective": None,
        "admitted": 0,
        "rejected": {},
        "debt": 0,
        "adaptive": None,
    }


def _pool_families(pool: PoolReport, label: Callable[[str], str]) -> Iterator[Metric]:
    stats = pool.statistics()
    keys: Mapping[str, Any] = stats.keys
    in_use = GaugeMetricFamily(
        "pipework_pool_in_use",
        "Worker slots held, by key and kind (reserved or shared).",
        labels=["key", "kind"],
    )
    waiting = GaugeMetricFamily(
        "pipework_pool_waiting", "Steps waiting for a slot.", labels=["key"]
    )
    oldest = GaugeMetricFamily(
        "pipework_pool_oldest_wait_seconds",
        "How long the oldest waiter has waited.",
        labels=["key"],
    )
    reserve = GaugeMetricFamily(
        "pipework_pool_reserve", "Slots reserved for the key.", labels=["key"]
    )
    limit = GaugeMetricFamily(
        "pipework_pool_limit", "The key's static limit (-1: none).", labels=["key"]
    )
    effective = GaugeMetricFamily(
        "pipework_pool_effective_limit",
        "The limit in force: the smaller of the static and adaptive ones (-1: none).",
        labels=["key"],
    )
    debt = GaugeMetricFamily(
        "pipework_pool_debt",
        "Slots held above the key's limit after a reconfiguration lowered it (they drain; "
        "admitted work is never revoked).",
        labels=["key"],
    )
    adaptive = GaugeMetricFamily(
        "pipework_pool_adaptive_limit",
        "The key's adaptive (AIMD) limit (-1: the key has none).",
        labels=["key"],
    )
    admitted = CounterMetricFamily(
        "pipework_pool_admitted", "Steps granted a slot.", labels=["key"]
    )
    rejected = CounterMetricFamily(
        "pipework_pool_rejected", "Steps refused a slot, by reason.", labels=["key", "reason"]
    )
    rows: dict[str, dict[str, Any]] = {}
    for name, k in keys.items():
        row = rows.setdefault(label(name), _new_row())
        row["reserved"] += k.in_use_reserved
        row["shared"] += k.in_use_shared
        row["waiting"] += k.waiting
        row["oldest"] = max(row["oldest"], k.oldest_wait)
        row["admitted"] += k.admitted
        row["debt"] += k.debt
        for reason, count in k.rejected.items():
            row["rejected"][reason] = row["rejected"].get(reason, 0) + count
        if k.configured or label(name) == name:
            row["reserve"], row["limit"], row["effective"] = k.reserve, k.limit, k.effective_limit
            row["adaptive"] = k.adaptive_limit
    forgotten = stats.forgotten_admitted
    if forgotten or stats.keys_forgotten:
        # Unnamed keys the pool forgot while idle (its max_keys) counted on their row still:
        # a counter never goes down.
        row = rows.setdefault("default", _new_row())
        row["admitted"] += forgotten
        for reason, count in stats.forgotten_rejected.items():
            row["rejected"][reason] = row["rejected"].get(reason, 0) + count
    # Unnamed keys each get the default weights: show them on the "default" row.
    default = pool.config.default
    row = rows.setdefault("default", _new_row())
    row["reserve"], row["limit"] = default.reserve, default.limit
    row["effective"] = default.limit
    for key, row in sorted(rows.items()):
        in_use.add_metric([key, "reserved"], row["reserved"])
        in_use.add_metric([key, "shared"], row["shared"])
        waiting.add_metric([key], row["waiting"])
        oldest.add_metric([key], row["oldest"])
        reserve.add_metric([key], row["reserve"])
        limit.add_metric([key], -1 if row["limit"] is None else row["limit"])
        effective.add_metric([key], -1 if row["effective"] is None else row["effective"])
        admitted.add_metric([key], row["admitted"])
        debt.add_metric([key], row["debt"])
        adaptive.add_metric([key], -1 if row["adaptive"] is None else row["adaptive"])
        for reason in ("queue_full", "wait_timeout", "deadline", "paused"):
            rejected.add_metric([key, reason], row["rejected"].get(reason, 0))
    yield from (
        in_use,
        waiting,
        oldest,
        reserve,
        limit,
        effective,
        debt,
        adaptive,
        admitted,
        rejected,
    )
    yield _gauge(
        "pipework_pool_config_generation",
        "Which pool configuration is in force (bumped by every reconfiguration).",
        stats.config_generation,
    )
    yield _gauge("pipework_pool_max_workers", "Worker slots in all.", stats.max_workers)
    yield _gauge(
        "pipework_pool_shared_slots",
        "The shared pool: max_workers minus every reserve.",
        stats.shared_pool,
    )
