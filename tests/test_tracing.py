"""Tracing (docs/tracing.md): the spans a request makes -- its server span, a span per step
and per pipe, a client span per backend call with its tries as events -- their parentage
and attributes, the trace context the backends receive, on each job store; and tracing
off costs nothing: no layer, no OpenTelemetry imported."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import sys
from collections.abc import AsyncIterator, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import trio
import trio.testing
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

import pipework as pw
from pipework import WeightedPool, _tracing, build_registry, loads_config
from pipework.backends._resilience_spec import HedgeSpec
from pipework.container import serve

from ._proxy_gateway import gateway as proxy_gateway
from ._proxy_gateway import gateway_file as proxy_gateway_file
from ._tracing_spans import by_kind, children, in_memory_tracing, named, one, parent_of
from .test_backend_pool import echo
from .test_container_harness import serving
from .test_resilience_io import client as resilience_client
from .test_resilience_io import get, hold, hosts
from .test_resilience_io import service as resilience_service

HANG_GUARD = 20.0
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@dataclass
class Backend:
    """Answers ``{"ok": true}``, ``/flaky`` a 503 the first time; keeps each request's
    path and trace headers."""

    url: str = ""
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    flaky_calls: int = 0

    async def app(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"].replace("lifespan.", "")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        path = scope["path"]
        headers = {n.decode(): v.decode() for n, v in scope["headers"]}
        self.seen.append((path, headers))
        status = 200
        if path == "/flaky":
            self.flaky_calls += 1
            status = 503 if self.flaky_calls == 1 else 200
        body = b'{"ok":true}'
        out = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def backend() -> AsyncIterator[Backend]:
    made = Backend()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            functools.partial(serve, cast(Any, made.app), host="127.0.0.1", port=0)
        )
        made.url = address.url
        try:
            yield made
        finally:
            nursery.cancel_scope.cancel()


def composed(url: str, chain: str, key: str = "") -> str:
    """Two services on one backend, ``b`` retrying a 503; a route running ``chain``. With
    ``key``, both pipes take slots of that key (else each its service's)."""
    keyed = f'key = "{key}"' if key else ""
    return f"""
[pool]
max_workers = 8

[services.a]
base_url = "{url}"

[services.b]
base_url = "{url}"

[services.b.retry]
backoff_base = 0.001

[pipes.call_a]
service = "a"
path = "/steady"
into = "a"
{keyed}

[pipes.call_b]
service = "b"
path = "/flaky"
into = "b"
{keyed}

[routes.both]
method = "GET"
path = "/both"
chain = {chain}
"""


@asynccontextmanager
async def gateway(text: str) -> AsyncIterator[httpx.AsyncClient]:
    config = loads_config(text)
    backends = config.backends()
    engine = pw.Engine(
        registry=build_registry(config, backends),
        pool=WeightedPool.from_config(config.pool_config()),
    )
    async with backends, serving(engine) as served:
        yield served.client


REQUEST_HEADERS = {
    "traceparent": TRACEPARENT,
    "tracestate": "congo=t61rcWkgMzE",
    "baggage": "userId=alice",
}


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


def attribute(span: ReadableSpan, key: str) -> Any:
    assert span.attributes is not None
    return span.attributes.get(key)


ALL_OF = '[{ all_of = ["call_a", "call_b"] }]'
#: Each branch nests a stage of its own: the engine runs it as a child job, its own steps.
FORKED = '[{ all_of = [[{ any_of = ["call_a"] }], [{ any_of = ["call_b"] }]] }]'


async def traced(chain: str, key: str = "") -> tuple[Sequence[ReadableSpan], Backend, str]:
    """The spans of one request to the composed route, what the backend saw, the job id."""
    with trio.fail_after(HANG_GUARD), in_memory_tracing() as (_, exported):
        async with backend() as found:
            async with gateway(composed(found.url, chain, key)) as c:
                answer = await c.get("/both", headers=REQUEST_HEADERS)
            assert answer.status_code == 200, answer.text
        return exported.get_finished_spans(), found, answer.headers["X-Job-Id"]


def check_composed(
    spans: Sequence[ReadableSpan], found: Backend, job_id: str
) -> list[ReadableSpan]:
    """The tree every run of the composed route makes; returns its step spans."""
    # Every span is in the client's trace.
    assert {f"{s.context.trace_id:032x}" for s in spans if s.context} == {TRACE_ID}
    server = one(by_kind(spans, SpanKind.SERVER))
    assert server.name == "GET /both"
    assert parent_of(server) == int(CLIENT_SPAN, 16)  # the client's span
    assert attribute(server, "pipework.route") == "both"
    assert attribute(server, "http.route") == "/both"
    assert attribute(server, "http.response.status_code") == 200
    assert attribute(server, "pipework.job_id") == job_id
    assert [e.name for e in server.events] == ["job queued"]
    # The job's steps run in the engine's tasks, children of the request's span all the same.
    steps = named(spans, "step ")
    assert server.context is not None
    assert all(parent_of(step) == server.context.span_id for step in steps)
    top = [s for s in steps if attribute(s, "pipework.job_id") == job_id]
    assert top
    assert attribute(top[-1], "pipework.status") == "done"
    step_ids = {s.context.span_id for s in steps if s.context}
    calls = {}
    for pipe in named(spans, "pipe "):
        assert parent_of(pipe) in step_ids
        assert attribute(pipe, "pipework.outcome") == "ok"
        call = one(children(spans, pipe))
        assert call.kind is SpanKind.CLIENT
        calls[pipe.name.removeprefix("pipe ")] = call
    assert set(calls) == {"call_a", "call_b"}
    assert calls["call_a"].name == "GET a"
    assert attribute(calls["call_b"], "pipework.service") == "b"
    assert attribute(calls["call_b"], "http.response.status_code") == 200
    # One try for call_a; call_b's first answered 503 and was retried.
    assert [attribute_of(e, "pipework.try") for e in calls["call_a"].events] == ["first"]
    tries = calls["call_b"].events
    assert [attribute_of(e, "pipework.try") for e in tries] == ["first", "retry"]
    assert [attribute_of(e, "http.response.status_code") for e in tries] == [503, 200]
    assert [attribute_of(e, "pipework.verdict") for e in tries] == ["retry", "answer"]
    # The backends see the client span as their caller's, the tracestate and baggage too.
    by_path: dict[str, list[dict[str, str]]] = {}
    for path, headers in found.seen:
        by_path.setdefault(path, []).append(headers)
    assert len(by_path["/flaky"]) == 2
    for path, call in (("/steady", calls["call_a"]), ("/flaky", calls["call_b"])):
        for headers in by_path[path]:
            assert headers["traceparent"] == f"00-{TRACE_ID}-{span_id(call)}-01"
            assert headers["tracestate"] == "congo=t61rcWkgMzE"
            assert headers["baggage"] == "userId=alice"
    return steps


async def test_a_composed_route_traces_its_request_step_pipes_and_backend_calls() -> None:
    """``all_of`` of two calls under the route's own key runs in the job's one step: both
    pipes are its children."""
    spans, found, job_id = await traced(ALL_OF, key="default")
    [step] = check_composed(spans, found, job_id)
    assert attribute(step, "pipework.job_id") == job_id
    assert {s.name for s in children(spans, step)} == {"pipe call_a", "pipe call_b"}


async def test_forked_branches_on_every_store_are_children_of_the_request(
    each_store: type[Any],
) -> None:
    """Branches under other keys run as child jobs, each in steps of its own, on a store
    that copies records, and on Redis: the traceparent in the record carries the
    request's span to them."""
    spans, found, job_id = await traced(FORKED)
    steps = check_composed(spans, found, job_id)
    branches = [s for s in steps if attribute(s, "pipework.parent_job_id") == job_id]
    assert len({attribute(s, "pipework.job_id") for s in branches}) == 2
    # The pipes run in the steps of the branches' own child jobs (one stage deeper).
    deeper = {s.context.span_id for s in steps if s.context and s not in branches}
    assert {parent_of(p) for p in named(spans, "pipe ")} <= deeper


def attribute_of(event: Any, key: str) -> Any:
    return event.attributes.get(key)


async def test_a_failed_call_marks_its_spans_failed() -> None:
    text = composed("http://127.0.0.1:9", '["call_a"]')  # nothing listens on the discard port
    with trio.fail_after(HANG_GUARD), in_memory_tracing() as (_, exported):
        async with gateway(text) as c:
            answer = await c.get("/both")
        assert answer.status_code == 502, answer.text
        spans = exported.get_finished_spans()
    server = one(by_kind(spans, SpanKind.SERVER))
    assert server.status.status_code is StatusCode.ERROR
    assert attribute(server, "http.response.status_code") == 502
    assert parent_of(server) is None  # no traceparent came: a new trace
    call = one(by_kind(spans, SpanKind.CLIENT))
    assert call.status.status_code is StatusCode.ERROR
    pipe = one(named(spans, "pipe "))
    assert attribute(pipe, "pipework.outcome") == "error"
    assert parent_of(call) == pipe.context.span_id if pipe.context else False


def test_with_tracing_off_nothing_of_opentelemetry_is_imported() -> None:
    """The gateway built and serving's layers chosen with tracing off (the default)."""
    code = """
import sys
import pipework as pw
from pipework import build_registry, loads_config
from pipework.container import Container
config = loads_config('''
[services.a]
base_url = "http://127.0.0.1:9"
[pipes.p]
service = "a"
path = "/"
[routes.r]
path = "/r"
chain = ["p"]
''')
engine = pw.Engine(registry=build_registry(config, config.backends()))
app = Container(engine).app
assert type(app.asgi_app).__name__ == "RequestGuard", type(app.asgi_app)
found = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not found, found
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


# -- proxy routes ------------------------------------------------------------------------


async def test_a_proxied_request_has_a_server_and_a_client_span(tmp_path: Path) -> None:
    routes = '[routes.api]\nproxy = "echo"\nprefix = "/api"\nstrip_prefix = true\n'
    with trio.fail_after(HANG_GUARD), in_memory_tracing() as (_, exported):
        async with backend() as found:
            text = proxy_gateway_file(found, routes)
            async with (
                proxy_gateway(tmp_path, text) as (_, address),
                httpx.AsyncClient(base_url=address.url) as client,
            ):
                answer = await client.get("/api/x", headers=REQUEST_HEADERS)
            assert answer.status_code == 200, answer.text
        spans = exported.get_finished_spans()
    server = one(by_kind(spans, SpanKind.SERVER))
    assert server.name == "GET /api"
    assert parent_of(server) == int(CLIENT_SPAN, 16)
    assert attribute(server, "pipework.route") == "api"
    assert attribute(server, "http.response.status_code") == 200
    assert [e.name for e in server.events] == ["slot wait", "slot granted"]
    call = one(by_kind(spans, SpanKind.CLIENT))
    assert call.name == "GET echo"
    assert parent_of(call) == (server.context.span_id if server.context else None)
    assert attribute(call, "http.response.status_code") == 200
    [(path, headers)] = found.seen
    assert path == "/x"
    # The service's caller is the client span; the client's tracestate and baggage go on.
    assert headers["traceparent"] == f"00-{TRACE_ID}-{span_id(call)}-01"
    assert headers["tracestate"] == "congo=t61rcWkgMzE"
    assert headers["baggage"] == "userId=alice"


# -- the exporter, from the gateway file ---------------------------------------------------


@dataclass
class OtlpReceiver:
    """A collector's OTLP/HTTP traces endpoint, as small as it gets: every export request
    decoded (opentelemetry-proto) and kept."""

    url: str = ""
    exports: list[ExportTraceServiceRequest] = field(default_factory=list)
    arrived: trio.Event = field(default_factory=trio.Event)

    async def app(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"].replace("lifespan.", "")
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        assert scope["path"] == "/v1/traces"
        assert headers[b"content-type"] == b"application/x-protobuf"
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.exports.append(export)
        self.arrived.set()
        reply = ExportTraceServiceResponse().SerializeToString()
        out = [
            (b"content-type", b"application/x-protobuf"),
            (b"content-length", b"%d" % len(reply)),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": reply})

    def spans(self) -> list[tuple[str, Any]]:
        """Every span received, with its service's name."""
        found: list[tuple[str, Any]] = []
        for export in self.exports:
            for resource_spans in export.resource_spans:
                names = [
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ]
                for scope_spans in resource_spans.scope_spans:
                    found.extend((names[0], span) for span in scope_spans.spans)
        return found


async def test_spans_are_exported_over_otlp_as_the_gateway_file_says(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    routes = '[routes.api]\nproxy = "echo"\nprefix = "/api"\n'
    with trio.fail_after(HANG_GUARD):
        async with backend() as found, trio.open_nursery() as nursery:
            address = await nursery.start(
                functools.partial(serve, cast(Any, receiver.app), host="127.0.0.1", port=0)
            )
            receiver.url = address.url
            tracing = f"""
[tracing]
enabled = true
exporter = "otlp"
endpoint = "{receiver.url}/v1/traces"
service_name = "shop-gateway"
sample_ratio = 1.0
"""
            text = proxy_gateway_file(found, routes) + tracing
            async with proxy_gateway(tmp_path, text) as (_, gateway_address):
                async with httpx.AsyncClient(base_url=gateway_address.url) as client:
                    answer = await client.get("/api/x", headers=REQUEST_HEADERS)
                assert answer.status_code == 200, answer.text
            # The gateway stopped: what its batch held was exported on the way out.
            await receiver.arrived.wait()
            nursery.cancel_scope.cancel()
    assert _tracing.ACTIVE is _tracing.NO_TRACING  # the process's tracing is as it was
    spans = receiver.spans()
    assert {service for service, _ in spans} == {"shop-gateway"}
    by_name = {span.name: span for _, span in spans}
    assert set(by_name) == {"GET /api", "GET echo"}
    server, call = by_name["GET /api"], by_name["GET echo"]
    assert server.trace_id.hex() == TRACE_ID
    assert server.parent_span_id.hex() == CLIENT_SPAN
    assert call.parent_span_id == server.span_id
    assert server.kind == server.SPAN_KIND_SERVER
    assert call.kind == call.SPAN_KIND_CLIENT
    [(_, headers)] = found.seen
    assert headers["traceparent"] == f"00-{TRACE_ID}-{call.span_id.hex()}-01"


async def test_the_trace_id_is_readable_where_the_access_log_is_written() -> None:
    """``current_trace_id()`` in the request's hooks (where the access log is written) is
    its server span's trace id; None with tracing off."""
    seen: list[str | None] = []

    async def note(response: Any) -> Any:
        seen.append(_tracing.current_trace_id())
        return response

    with trio.fail_after(HANG_GUARD):
        for on in (True, False):
            registry = pw.Registry()
            engine = pw.Engine(registry=registry)
            engine.chain("noop", _noop)
            registry.route("noop", path="/noop", chain="noop", method="GET")
            with in_memory_tracing() if on else contextlib.nullcontext() as traced:
                async with serving(engine) as served:
                    served.container.app.after_request(note)
                    answer = await served.client.get("/noop", headers=REQUEST_HEADERS)
                assert answer.status_code == 200, answer.text
            if traced is not None:
                server = one(by_kind(traced[1].get_finished_spans(), SpanKind.SERVER))
                assert server.context is not None
                assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert seen == [TRACE_ID, None]


async def _noop(ctx: pw.Context) -> None:
    ctx.state["ok"] = True


# -- tries as events ---------------------------------------------------------------------


async def test_a_hedge_and_the_try_it_beat_are_events_of_the_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A hedge's task has a copy of its call's context: both tries end as events on the
    call's span, the slow one cancelled."""
    with in_memory_tracing() as (tracing, exported):
        async with hosts(hold, echo) as found:
            svc = resilience_service([u for _, u in found], hedge=HedgeSpec(delay=0.5))
            async with resilience_client(svc) as c:
                span = tracing.start("GET api", "client", {})
                try:
                    await get(c)
                finally:
                    span.end()
        call = one(exported.get_finished_spans())
    tries = {attribute_of(e, "pipework.try"): e for e in call.events}
    assert set(tries) == {"first", "hedge"}
    assert attribute_of(tries["hedge"], "pipework.verdict") == "answer"
    assert attribute_of(tries["hedge"], "server.address") == found[1][1]
    assert attribute_of(tries["first"], "pipework.cancelled") is True
    assert attribute_of(tries["first"], "server.address") == found[0][1]
    # The answer came first: its event precedes the cancelled try's.
    assert [attribute_of(e, "pipework.try") for e in call.events] == ["hedge", "first"]
