"""``GET /metrics``'s text, written with each series' name and labels kept between scrapes:
byte for byte what prometheus-client's ``generate_latest`` writes, scrape after scrape, and
handed to it for anything written differently."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import pipework as pw
from pipework._exposition import Exposition

ODD = 'back\\slash "quoted"\nnew line, zoë'


def rich() -> tuple[CollectorRegistry, Counter, Gauge]:
    registry = CollectorRegistry(auto_describe=True)
    calls = Counter(
        "calls", "Calls made.\nA second \\ line.", ["service", "outcome"], registry=registry
    )
    depth = Gauge("depth", "Queue depth.", ["queue"], registry=registry)
    took = Histogram("took_seconds", "Durations.", ["route"], buckets=(0.1, 1.0), registry=registry)
    sizes = Summary("sizes_bytes", "Sizes.", registry=registry)
    Info("build", "Build.", registry=registry).info({"version": "1.2", "odd": ODD})
    Enum("state", "State.", states=["open", "closed"], registry=registry).state("closed")
    calls.labels("a", "ok").inc(3)
    calls.labels(ODD, "error").inc()
    depth.labels("q").set(1e21)
    depth.labels("nan").set(float("nan"))
    took.labels("r").observe(0.5)
    sizes.observe(12)
    return registry, calls, depth


def test_every_kind_of_family_is_written_as_generate_latest_writes_it() -> None:
    registry, calls, depth = rich()
    exposition = Exposition()
    assert exposition.render(registry) == generate_latest(registry)
    # The next scrape: new values, a new series, one gone -- still the same text.
    calls.labels("a", "ok").inc()
    calls.labels("b", "ok").inc()
    depth.remove("nan")
    assert exposition.render(registry) == generate_latest(registry)


def test_what_is_kept_is_the_series_of_the_last_scrape() -> None:
    registry, _, depth = rich()
    exposition = Exposition()
    exposition.render(registry)
    kept = len(exposition._heads)
    depth.remove("nan")
    exposition.render(registry)
    assert len(exposition._heads) == kept - 1


class _Stamped(Collector):
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("stamped", "With a timestamp.", labels=["__reserved"])
        family.add_metric(["x"], 1.0, timestamp=1700000000.5)
        yield family


def test_a_sample_written_otherwise_hands_the_scrape_to_generate_latest() -> None:
    """A timestamp, and a reserved label name (which generate_latest escapes)."""
    registry, _, _ = rich()
    registry.register(_Stamped())
    assert Exposition().render(registry) == generate_latest(registry)


async def test_the_engines_exposition_is_generate_latests() -> None:
    engine = pw.Engine()

    @engine.pipe
    async def one(ctx: pw.Context) -> None:
        ctx.state["n"] = 1

    engine.chain("c", one)
    async with engine:
        for _ in range(3):
            await engine.run("c", {})
        first = engine.metrics.exposition()
        await engine.run("c", {})
        second = engine.metrics.exposition()
        assert second == generate_latest(engine.metrics.registry)
    assert first != second  # the counts moved, and the text with them
    assert b"pipework_" in second
