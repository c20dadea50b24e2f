"""Prometheus metrics: every family pipework exports, in one place.

Each :class:`Metrics` owns a ``CollectorRegistry`` (never the global one), so several
engines in one process never collide and tests read exact values. Two kinds of family:

- *events* (histograms and counters the engine and container update as things happen):
  pipe and job durations and outcomes, pool wait times, backend calls;
- *state* read at scrape time from the components' ``statistics()`` (the collectors of
  :mod:`pipework._metrics_state`): queue depth, jobs by status, the pool's per-key counters
  and weights.

Label values are bounded: chain (route) and pipe names come from registration, pool keys are
the configured ones plus ``default`` for every other key, outcomes and reasons are fixed
sets. Never a job id or a raw path. Components added later (push board, resource pools, a
Redis store) add their families here in the same style.

**Several processes** (``pipework serve --workers N``): prometheus-client's multiprocess
mode, on when ``PROMETHEUS_MULTIPROC_DIR`` names a directory before prometheus-client is
first imported (the supervising process sets it for its workers). Event families then live
in per-process files there; the state families, read from this process's components, are
written there too (:meth:`Metrics.publish`, every second and at each scrape); and a scrape
reads every process's files into a fresh registry (:meth:`Metrics.node_exposition`), so
one scrape reports the whole node. Counters and histograms are summed over the processes,
the dead ones included (their counts happened). Gauges of a per-process component whose
values only make sense next to each other (the event queue, the worker pool) keep one
series per live process, with a ``pid`` label; the other gauges (jobs, parked requests,
board and resource pool counts) are summed over the live processes.
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as _values
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from ._exposition import Exposition
from ._metrics_state import (
    PoolReport,
    ResourcePoolCollector,
    ServiceCollector,
    StateCollector,
    Statistics,
)

__all__ = [
    "CONTENT_TYPE",
    "MULTIPROC_ENV",
    "TIMEOUT_MARGIN",
    "Metrics",
    "multiprocess_directory",
    "timeout_buckets",
]

#: The variable naming prometheus-client's multiprocess directory.
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
#: State families whose gauges are per process (one series each, ``pid`` label).
_PER_PROCESS: Final = (
    "pipework_event_queue_",
    "pipework_pool_",
    # Each process balances with its own view of a service's hosts and breaker.
    "pipework_backend_host_",
    "pipework_backend_breaker_",
)


def multiprocess_directory() -> str | None:
    """The multiprocess directory when this process writes its metrics there: the variable
    is set and prometheus-client saw it when first imported (it chooses its value store
    then)."""
    path = os.environ.get(MULTIPROC_ENV)
    if path and getattr(_values.ValueClass, "_multiprocess", False):
        return path
    return None


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: from sub-millisecond pipes to minute-long jobs; jobs that suspend for a callback
# may take an hour. Quantiles are interpolated inside a bucket, so a wide bucket above a
# common timeout makes calls that end at that timeout look much slower than they were
# (with 1 then 2.5, calls cut at 1 s estimate p99 = 2.49 s): the buckets are finer around
# the usual timeouts, and Metrics(timeouts=...) adds a bucket at each configured timeout and
# one just above it, where calls cut at that timeout land.
_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    1.25,
    1.5,
    2,
    2.5,
    3,
    5,
    7.5,
    10,
    15,
    30,
    60,
    300,
)
_JOB_BUCKETS = (*_BUCKETS, 600, 1800, 3600)
#: How far past its timeout a cut call may end (the cancel's delivery, the clean-up) and
#: still land in the timeout's own bucket.
TIMEOUT_MARGIN = 0.05


def timeout_buckets(
    timeouts: Iterable[float], base: Iterable[float] = _BUCKETS
) -> tuple[float, ...]:
    """``base`` plus, for each timeout, itself and itself plus :data:`TIMEOUT_MARGIN`."""
    bounds = set(base)
    for timeout in timeouts:
        if timeout > 0 and math.isfinite(timeout):
            bounds.update((float(timeout), round(timeout * (1 + TIMEOUT_MARGIN), 6)))
    return tuple(sorted(bounds))


def _observer(child: Any) -> Callable[[float], None]:
    """``child.observe`` for one labelled histogram child, cheaper: the bucket is found by
    bisection instead of a scan over every bound, and an in-process child's values (a float
    behind a lock each) become plain floats, since only the event loop's thread writes them
    (a scrape in another thread reads a float, which needs no lock). The same counts, the
    same values; any other layout (multiprocess mode) takes the child's own ``observe``."""
    bounds: list[float] = getattr(child, "_upper_bounds", [])  # the child's own layout
    buckets: list[Any] = getattr(child, "_buckets", [])
    if not (
        bounds
        and len(bounds) == len(buckets)
        and bounds == sorted(bounds)
        and all(type(v) is _values.MutexValue for v in (child._sum, *buckets))
    ):
        return child.observe  # type: ignore[no-any-return]  # prometheus-client's child is untyped
    total = child._sum = _PlainValue(child._sum.get())
    buckets[:] = [_PlainValue(v.get()) for v in buckets]

    def observe(amount: float) -> None:
        total.value += amount
        if amount == amount:  # NaN lands in no bucket, as in observe()
            buckets[bisect_left(bounds, amount)].value += 1

    return observe


class _PlainValue:
    """prometheus-client's value interface over a plain float (see :func:`_observer`)."""

    __slots__ = ("exemplar", "value")

    def __init__(self, value: float) -> None:
        self.value = value
        self.exemplar: Any = None

    def inc(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def get(self) -> float:
        return self.value

    def set_exemplar(self, exemplar: Any) -> None:
        self.exemplar = exemplar

    def get_exemplar(self) -> Any:
        return self.exemplar


class Metrics:
    """The metric families of one engine (and the container serving it).

    ``timeouts``: the configured time limits (services', pipes', routes'), each of which
    gets a bucket of its own and one just above it in the pipe and backend histograms, so
    that calls cut at a timeout are estimated at it, not at the next round number.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, timeouts: Iterable[float] = ()
    ) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._exposition = Exposition()  # each series' name and labels, written once
        r = self.registry
        buckets = timeout_buckets(timeouts)
        self.pipe_duration = Histogram(
            "pipework_pipe_duration_seconds",
            "Time one pipe run took, by pipe and outcome (ok, error, timeout, suspended, "
            "cancelled).",
            ["pipe", "outcome"],
            buckets=buckets,
            registry=r,
        )
        self.job_duration = Histogram(
            "pipework_job_duration_seconds",
            "Time from submission to the end of a job, by route (chain) and outcome (the "
            "job's final status).",
            ["route", "outcome"],
            buckets=timeout_buckets(timeouts, _JOB_BUCKETS),
            registry=r,
        )
        self.pool_wait = Histogram(
            "pipework_pool_wait_seconds",
            "Time a step waited for a worker slot, by pool key (granted or rejected).",
            ["key"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.parked = Gauge(
            "pipework_parked_requests",
            "HTTP requests parked waiting for their job.",
            registry=r,
            multiprocess_mode="livesum",  # the node's parked requests
        )
        self.backend_calls = Counter(
            "pipework_backend_calls_total",
            "Calls to backend services, by service and outcome (ok, error, cancelled).",
            ["service", "outcome"],
            registry=r,
        )
        self.backend_errors = Counter(
            "pipework_backend_errors_total",
            "Failed backend calls by service and kind (status, connect, broken, timeout).",
            ["service", "kind"],
            registry=r,
        )
        self.backend_latency = Histogram(
            "pipework_backend_latency_seconds",
            "Backend call latency by service and outcome (ok, error, timeout, cancelled).",
            ["service", "outcome"],
            buckets=buckets,
            registry=r,
        )
        self.route_responses = Counter(
            "pipework_route_responses",
            "HTTP responses of the routes, by route and status class (2xx, 3xx, 4xx, 5xx), "
            "refusals before any job included.",
            ["route", "status_class"],
            registry=r,
        )
        self.http_responses = Counter(
            "pipework_http_responses",
            "HTTP responses of the container's own endpoints (jobs, callbacks, admin, healthz, "
            "readyz, metrics; unmatched: no route), by endpoint and status class.",
            ["endpoint", "status_class"],
            registry=r,
        )
        self.proxy_responses = Counter(
            "pipework_proxy_responses",
            "Answers of the proxy routes, by route, service and status code sent to the "
            "client (none: the client left before any answer).",
            ["route", "service", "status"],
            registry=r,
        )
        self.proxy_duration = Histogram(
            "pipework_proxy_duration_seconds",
            "Time a proxied request took, to the answer's last byte, by route and service.",
            ["route", "service"],
            buckets=buckets,
            registry=r,
        )
        self.proxy_bytes = Counter(
            "pipework_proxy_bytes",
            "Body bytes relayed by the proxy routes, by route and direction (up: to the "
            "service, down: to the client).",
            ["route", "direction"],
            registry=r,
        )
        self.rate_limit_decisions = Counter(
            "pipework_rate_limit_decisions",
            "Requests a rate limit decided on, by limit and decision (allowed, limited; "
            "error: its store could not be asked, and the limit's failure policy decided).",
            ["limit", "decision"],
            registry=r,
        )
        self.detached_failures = Counter(
            "pipework_detached_failures_total",
            "Detached (fire-and-forget) graph nodes that failed, by route (chain).",
            ["route"],
            registry=r,
        )
        self.degraded = Counter(
            "pipework_degraded_total",
            "Pipes a job did without (optional ones skipped, others answered by their "
            "fallback), by route (chain), pipe and reason (refused, deadline, no_slot, "
            "error, timeout).",
            ["route", "pipe", "reason"],
            registry=r,
        )
        self.resource_pool_wait = Histogram(
            "pipework_resource_pool_wait_seconds",
            "Time a borrower waited for a resource of a resource pool (lent or timed out).",
            ["pool"],
            buckets=_BUCKETS,
            registry=r,
        )
        self._collector: StateCollector | None = None
        self._resource_pools: ResourcePoolCollector | None = None
        self._services: ServiceCollector | None = None
        #: The collectors read at scrape time (what :meth:`publish` writes out).
        self._states: list[Collector] = []
        #: Set when several processes share the metrics (see the module's docstring).
        self.multiprocess_dir = multiprocess_directory()
        self._published: dict[tuple[str, ...], Any] = {}
        # labels() costs more than observe(): keep each labelled child once it exists.
        self._children: dict[tuple[object, tuple[str, ...]], Callable[[float], None]] = {}

    def observe(self, family: Histogram, labels: tuple[str, ...], value: float) -> None:
        """``family.labels(*labels).observe(value)``, with the child cached."""
        self.observer(family, labels)(value)

    def observer(self, family: Histogram, labels: tuple[str, ...]) -> Callable[[float], None]:
        """The cached ``observe`` of one labelled child: a hot path keeps it and calls it
        with no label lookup at all."""
        observe = self._children.get((family, labels))
        if observe is None:
            observe = self._children[(family, labels)] = _observer(family.labels(*labels))
        return observe

    def watch(
        self,
        *,
        queue: Statistics,
        jobs: Callable[[], Mapping[str, int]],
        pool: PoolReport | None,
        key_label: Callable[[str], str],
    ) -> None:
        """Read these components' state at every scrape (once per Metrics); ``pool``: the
        worker pool when it reports its keys (None: no pool families)."""
        if self._collector is not None:
            self.remove_state(self._collector)
        self._collector = StateCollector(queue, jobs, pool, key_label)
        self.add_state(self._collector)

    def add_state(self, collector: Collector) -> None:
        """Read ``collector`` at every scrape (a component's state families)."""
        self.registry.register(collector)
        self._states.append(collector)

    def remove_state(self, collector: Collector) -> None:
        self.registry.unregister(collector)
        self._states.remove(collector)

    def watch_resource_pool(self, name: str, pool: Statistics) -> None:
        """Read a resource pool's ``statistics()`` at every scrape, as ``pool=name``.

        A second pool under a name already watched replaces the first (a restarted pool)."""
        if self._resource_pools is None:
            self._resource_pools = ResourcePoolCollector()
            self.add_state(self._resource_pools)
        self._resource_pools.pools[name] = pool

    def unwatch_resource_pool(self, name: str, pool: Statistics) -> None:
        """Stop reading the pool (it shut down); its families keep their other pools."""
        if self._resource_pools is not None and self._resource_pools.pools.get(name) is pool:
            del self._resource_pools.pools[name]

    def watch_service(self, name: str, read: Callable[[], Any]) -> None:
        """Read a backend service's resilience statistics (``ServiceStatistics``, from
        ``read()``) at every scrape, as ``service=name``. A second reader under a name
        already watched replaces the first (a reload's plan)."""
        if self._services is None:
            self._services = ServiceCollector()
            self.add_state(self._services)
        self._services.services[name] = read

    def unwatch_service(self, name: str, read: Callable[[], Any]) -> None:
        """Stop reading the service, if ``read`` is still the one watched."""
        if self._services is not None and self._services.services.get(name) is read:
            del self._services.services[name]

    def exposition(self) -> bytes:
        """The text exposition format, as ``GET /metrics`` serves it: this process's
        families, or with several processes the node's (:meth:`publish` first, then
        :meth:`node_exposition`)."""
        if self.multiprocess_dir is not None:
            self.publish()
            return self.node_exposition()
        return self._exposition.render(self.registry)

    def publish(self) -> None:
        """Write the state families' current values to this process's files in the
        multiprocess directory (nothing without one)."""
        if self.multiprocess_dir is None:
            return
        for collector in self._states:
            for family in collector.collect():
                kind = family.type
                if kind not in ("gauge", "counter"):
                    continue
                mode = ""
                if kind == "gauge":
                    mode = "liveall" if family.name.startswith(_PER_PROCESS) else "livesum"
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    names = tuple(sorted(sample.labels))
                    values = tuple(sample.labels[n] for n in names)
                    key = (kind, mode, sample.name, *names, "", *values)
                    value = self._published.get(key)
                    if value is None:
                        value = self._published[key] = _values.ValueClass(
                            kind,
                            family.name,
                            sample.name,
                            names,
                            values,
                            family.documentation,
                            multiprocess_mode=mode,
                        )
                    value.set(sample.value)

    def node_exposition(self) -> bytes:
        """Every process's families, read from the multiprocess directory into a fresh
        registry (file reads: call it from a thread)."""
        if self.multiprocess_dir is None:
            raise RuntimeError(f"{MULTIPROC_ENV} is not in effect in this process")
        registry = CollectorRegistry()
        # prometheus-client leaves it unannotated
        MultiProcessCollector(registry, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]  # untyped in prometheus-client
        return generate_latest(registry)
