"""The W3C trace context a request came with (``traceparent``, ``tracestate``,
``baggage``) goes with every backend call of its job, branches included, through either
backend client and on every job store; malformed fields are dropped, never repaired."""

from __future__ import annotations

from typing import Any

import pytest

from pipework._http._trace import baggage, traceparent, tracestate

from ._pipe_gateway import CLIENTS, GO_ROUTE, TRACEPARENT, call_once, gateway, one_pipe
from ._recording_backend import recording_backend


@pytest.mark.parametrize("client", CLIENTS)
async def test_the_trace_context_goes_with_every_call(client: str) -> None:
    async with recording_backend() as backend:
        text = one_pipe(backend.url, "")
        headers = [
            ("traceparent", TRACEPARENT),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("baggage", "userId=alice, isProduction=false;p=1"),
            ("TraceState", "rojo=00f067aa0ba902b7"),
        ]
        answer, [seen] = await call_once(client, text, backend, headers)
    assert answer.status_code == 200, answer.text
    assert seen.values("traceparent") == [TRACEPARENT]
    assert seen.values("tracestate") == ["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"]
    assert seen.values("baggage") == ["userId=alice,isProduction=false;p=1"]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        # tracestate belongs to its traceparent: none without one, or with a broken one
        ([("tracestate", "congo=t61rcWkgMzE")], {}),
        ([("traceparent", "garbage"), ("tracestate", "congo=1")], {}),
        # baggage stands alone
        ([("baggage", "k=v")], {"baggage": ["k=v"]}),
        # malformed fields are dropped, never repaired
        ([("traceparent", TRACEPARENT), ("tracestate", "Upper=1")], {"traceparent": [TRACEPARENT]}),
        ([("traceparent", TRACEPARENT), ("tracestate", "a=1,a=2")], {"traceparent": [TRACEPARENT]}),
        ([("baggage", "no equals sign")], {}),
        ([("baggage", 'k="quoted"')], {}),
    ],
)
async def test_a_malformed_trace_context_is_not_passed_on(
    headers: list[tuple[str, str]], expected: dict[str, list[str]]
) -> None:
    async with recording_backend() as backend:
        answer, [seen] = await call_once("lean", one_pipe(backend.url, ""), backend, headers)
    assert answer.status_code == 200, answer.text
    found = {
        name: seen.values(name)
        for name in ("traceparent", "tracestate", "baggage")
        if seen.values(name)
    }
    assert found == expected


async def test_branches_carry_the_trace_context_on_every_store(each_store: type[Any]) -> None:
    """A job's trace context is part of its record: its branches (child jobs) carry it,
    on a store that hands out copies read back from msgpack, and on Redis."""
    async with recording_backend() as backend:
        pipes = """
[pipes.call]
service = "api"
path = "/echo"
into = "echo"

[pipes.other]
service = "api"
path = "/echo"
into = "other"
"""
        # Each branch nests a stage of its own, so the engine runs it as a child job.
        chain = '[{ all_of = [[{ any_of = ["call"] }], [{ any_of = ["other"] }]] }]'
        text = gateway(backend.url, pipes, GO_ROUTE.format(chain=chain))
        headers = [("traceparent", TRACEPARENT), ("tracestate", "a=1"), ("baggage", "b=2")]
        answer, seen = await call_once("lean", text, backend, headers)
    assert answer.status_code == 200, answer.text
    assert len(seen) == 2
    for each in seen:
        assert each.values("traceparent") == [TRACEPARENT]
        assert each.values("tracestate") == ["a=1"]
        assert each.values("baggage") == ["b=2"]


def test_trace_fields_are_checked_as_the_w3c_writes_them() -> None:
    assert traceparent(f" {TRACEPARENT.upper()} ") == TRACEPARENT
    assert traceparent("00-" + "0" * 32 + "-b7ad6b7169203331-01") is None
    assert tracestate(["a=1", " , b@sys=2 "]) == "a=1,b@sys=2"
    assert tracestate([",".join(f"k{i}=v" for i in range(33))]) is None
    assert tracestate(["a=1,b=x=y"]) is None
    assert tracestate([""]) is None
    assert baggage(["a = 1 ; meta", "b=%20"]) == "a = 1 ; meta,b=%20"
    assert baggage([",".join(f"k{i}=v" for i in range(65))]) is None
    assert baggage(["k=" + "v" * 8200]) is None
