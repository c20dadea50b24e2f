"""Tracing (docs/tracing.md): the spans a request makes -- its server span, a span per step
and per pipe, a client span per backend call with its tries as events -- their parentage
and attributes, the trace context the backends receive, on each job store; and tracing
off costs nothing: no layer, no OpenTelemetry imported."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import AsyncIterator, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import trio
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

import pipework as pw
from pipework import WeightedPool, build_registry, loads_config
from pipework.container import serve

from ._tracing_spans import by_kind, children, in_memory_tracing, named, one, parent_of
from .test_container_harness import serving

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
