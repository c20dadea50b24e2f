"""The container's connection per request (``container/_quart.py``), driven through ASGI
with a trio memory channel as the server's ``receive``, as hypercorn's is: what is queued
with the request is taken before the handler runs, and the rest by the reader task."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import trio
import trio.testing

import pipework as pw
from pipework.container import Container, ContainerConfig

from .test_container_harness import HANG_GUARD, SECRET

Message = dict[str, Any]


def make_engine() -> pw.Engine:
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def keep(ctx: pw.Context) -> None:
        return None

    engine.chain("keep", keep)
    registry.route("keep", path="/keep", chain="keep")
    return engine


def scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/keep",
        "raw_path": b"/keep",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 80),
        "extensions": {},
    }


async def serve(
    messages: Sequence[Message], later: Sequence[Message] = ()
) -> tuple[list[Message], int]:
    """The answer's messages to a request whose ``messages`` are queued before the app
    runs and ``later`` ones sent once it waits; and how many jobs it made."""
    config = ContainerConfig(callback_secret=SECRET, shutdown_grace=0.5)
    engine = make_engine()
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    with trio.fail_after(HANG_GUARD):
        async with engine:
            app: Any = Container(engine, config=config).app  # driven with plain dicts
            into, out = trio.open_memory_channel[Message](10)
            for message in messages:
                into.send_nowait(message)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(app, scope(), out.receive, send)
                await trio.testing.wait_all_tasks_blocked()
                for message in later:
                    into.send_nowait(message)
            jobs = len(await engine.store.list())
    return sent, jobs


def answered(sent: list[Message]) -> tuple[int, Any]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


async def test_a_body_queued_with_the_request_is_read() -> None:
    body = {"type": "http.request", "body": b'{"a": 1}', "more_body": False}
    sent, jobs = await serve([body])
    assert answered(sent) == (200, {"a": 1})
    assert jobs == 1


async def test_a_body_in_pieces_is_read_on_by_the_reader() -> None:
    first = {"type": "http.request", "body": b'{"a": ', "more_body": True}
    rest = {"type": "http.request", "body": b"1}", "more_body": False}
    sent, _ = await serve([first], [rest])
    assert answered(sent) == (200, {"a": 1})


async def test_a_body_not_queued_yet_is_read_by_the_reader() -> None:
    body = {"type": "http.request", "body": b'{"a": 1}', "more_body": False}
    sent, _ = await serve([], [body])
    assert answered(sent) == (200, {"a": 1})


async def test_a_hang_up_queued_before_the_handler_runs_ends_the_request_unanswered() -> None:
    sent, jobs = await serve([{"type": "http.disconnect"}])
    assert sent == []
    assert jobs == 0
