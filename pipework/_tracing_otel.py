"""Tracing through the OpenTelemetry SDK (the ``otel`` extra): imported only when tracing
is on (:func:`build`, from ``[tracing]``), never on the way to serving otherwise.

The tracer provider is pipework's own, not OpenTelemetry's global one: a program that
embeds pipework keeps its own. Spans are exported in batches by the SDK's worker thread,
off trio's; a span's end only queues it. The current span is OpenTelemetry's context
variable, which trio copies into every task a task starts (see :mod:`pipework._tracing`).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ._tracing import Attribute, Kind, Span

__all__ = ["OtelTracing", "build"]

_KINDS: Final = {
    "server": SpanKind.SERVER,
    "client": SpanKind.CLIENT,
    "internal": SpanKind.INTERNAL,
}
_PROPAGATOR: Final = TraceContextTextMapPropagator()
_SCOPE_NAME: Final = "pipework"
#: The context of a span that starts a trace (none current, whatever the task holds).
_NO_PARENT: Final = otel_context.Context()


def build(
    *,
    exporter: str = "otlp",
    endpoint: str | None = None,
    sample_ratio: float | None = None,
    service_name: str | None = None,
    span_exporter: SpanExporter | None = None,
    batch: bool = True,
) -> OtelTracing:
    """The SDK's tracing: ``exporter`` ``otlp`` (OTLP over HTTP to ``endpoint``, else to
    what ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` say, else
    localhost:4318), ``console`` (stdout) or ``none`` (spans made and propagated, nothing
    exported); ``span_exporter`` replaces it (tests: the SDK's in-memory exporter), exported
    span by span unless ``batch``. ``sample_ratio``: the share of new traces sampled (a
    request's sampled flag decides for its own); None: the ``OTEL_TRACES_SAMPLER``
    variables, else every trace. ``service_name``: else ``OTEL_SERVICE_NAME``, else
    ``pipework``."""
    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "pipework"
    sampler: Sampler | None = None
    if sample_ratio is not None:
        sampler = ParentBased(TraceIdRatioBased(sample_ratio))
    provider = TracerProvider(
        sampler=sampler,
        resource=Resource.create({"service.name": name}),
        shutdown_on_exit=False,  # shut down by the gateway, in order, not by atexit
    )
    chosen = span_exporter or _exporter(exporter, endpoint)
    if chosen is not None:
        processor: SpanProcessor = (
            BatchSpanProcessor(chosen) if batch else SimpleSpanProcessor(chosen)
        )
        provider.add_span_processor(processor)
    return OtelTracing(provider)


def _exporter(kind: str, endpoint: str | None) -> SpanExporter | None:
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind != "otlp":
        raise ValueError(f"unknown tracing exporter {kind!r}: otlp, console or none")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint)


def _traceparent(ctx: trace.SpanContext) -> str | None:
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _headers(span: trace.Span) -> tuple[str | None, str | None]:
    ctx = span.get_span_context()
    parent = _traceparent(ctx)
    if parent is None:
        return None, None
    return parent, ctx.trace_state.to_header() or None


class _OtelSpan:
    __slots__ = ("_span", "_token")

    def __init__(self, span: trace.Span, token: object) -> None:
        self._span = span
        self._token = token

    def set(self, key: str, value: Attribute) -> None:
        self._span.set_attribute(key, value)

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        self._span.add_event(name, attributes)

    def headers(self) -> tuple[str | None, str | None]:
        return _headers(self._span)

    def fail(self, description: str) -> None:
        """Mark the span failed without an exception (a 5xx answer)."""
        self._span.set_status(Status(StatusCode.ERROR, description))

    def end(self, error: BaseException | None = None) -> None:
        span = self._span
        if error is not None:
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()
        otel_context.detach(self._token)  # type: ignore[arg-type]  # attach's own token


class OtelTracing:
    """:class:`pipework._tracing.Tracing` through an SDK tracer provider."""

    on = True

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(_SCOPE_NAME)

    def start(
        self,
        name: str,
        kind: Kind,
        attributes: Mapping[str, Attribute],
        *,
        traceparent: str | None = None,
        tracestate: str | None = None,
        new_trace: bool = False,
    ) -> Span:
        return self.open(name, kind, attributes, traceparent, tracestate, new_trace)

    def open(
        self,
        name: str,
        kind: Kind,
        attributes: Mapping[str, Attribute],
        traceparent: str | None,
        tracestate: str | None,
        new_trace: bool = False,
    ) -> _OtelSpan:
        """:meth:`start`, as this module's own span (which :meth:`_OtelSpan.fail` has)."""
        parent = _NO_PARENT if new_trace else None
        if traceparent is not None:
            carrier = {"traceparent": traceparent}
            if tracestate is not None:
                carrier["tracestate"] = tracestate
            parent = _PROPAGATOR.extract(carrier)
        span = self._tracer.start_span(
            name, context=parent, kind=_KINDS[kind], attributes=attributes
        )
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        return _OtelSpan(span, token)

    def annotate(self, key: str, value: Attribute) -> None:
        trace.get_current_span().set_attribute(key, value)

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        trace.get_current_span().add_event(name, attributes)

    def rename(self, name: str) -> None:
        trace.get_current_span().update_name(name)

    def headers(self) -> tuple[str | None, str | None]:
        return _headers(trace.get_current_span())

    def trace_id(self) -> str | None:
        ctx = trace.get_current_span().get_span_context()
        return f"{ctx.trace_id:032x}" if ctx.is_valid else None

    def wrap_asgi(self, app: Any) -> Any:
        return ServerSpans(app, self)

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what its batch holds, then stops its thread


Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class ServerSpans:
    """The ASGI layer in front of the container: a server span per HTTP request, a child
    of the request's ``traceparent`` (with its ``tracestate``), current while the request
    is served; its status code from the answer's head, an error when 5xx or when the app
    raised. The route and the job are set on it by the container as they are known."""

    def __init__(self, app: Any, tracing: OtelTracing) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        traceparent: str | None = None
        states: list[str] = []
        for name, value in scope.get("headers", ()):
            lowered = name.lower()
            if lowered == b"traceparent" and traceparent is None:
                traceparent = value.decode("latin-1").strip()
            elif lowered == b"tracestate":
                states.append(value.decode("latin-1"))
        method = scope.get("method", "GET")
        attributes: dict[str, Attribute] = {
            "http.request.method": method,
            "url.path": scope.get("path", "/"),
            "url.scheme": scope.get("scheme", "http"),
            "network.protocol.version": scope.get("http_version", "1.1"),
        }
        query = scope.get("query_string", b"")
        if query:
            attributes["url.query"] = query.decode("latin-1")
        client = scope.get("client")
        if client:
            attributes["client.address"] = str(client[0])
        span = self.tracing.open(
            method, "server", attributes, traceparent, ",".join(states) if states else None
        )

        async def send_and_note(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set("http.response.status_code", status)
                if status >= 500:  # a server span fails with its 5xx answers only
                    span.set("error.type", str(status))
                    span.fail(f"answered {status}")
            await send(message)

        error: BaseException | None = None
        try:
            await self.app(scope, receive, send_and_note)
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.end(error)
