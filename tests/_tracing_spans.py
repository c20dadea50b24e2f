"""Tracing for the tests: the SDK's tracing with spans kept in memory, installed as the
process's for the body of the ``async with``, and a few ways to read the spans."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pipework import _tracing
from pipework._tracing_otel import OtelTracing, build

__all__ = ["by_kind", "children", "in_memory_tracing", "named", "one", "parent_of"]


@contextmanager
def in_memory_tracing() -> Iterator[tuple[OtelTracing, InMemorySpanExporter]]:
    """Tracing on (every trace sampled), each span exported as it ends."""
    exporter = InMemorySpanExporter()
    tracing = build(span_exporter=exporter, batch=False, sample_ratio=1.0)
    previous = _tracing.install(tracing)
    try:
        yield tracing, exporter
    finally:
        _tracing.install(previous)
        tracing.shutdown()


def by_kind(spans: Sequence[ReadableSpan], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind is kind]


def named(spans: Sequence[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def one(spans: Sequence[ReadableSpan]) -> ReadableSpan:
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def parent_of(span: ReadableSpan) -> int | None:
    return None if span.parent is None else span.parent.span_id


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    return [s for s in spans if parent_of(s) == parent.context.span_id]
