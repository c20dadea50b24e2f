"""A stream route's answer: its job's chunks as server-sent events, as they come.

Separate from the routes' view (:mod:`._modes`), which only starts it: the stream is the
response's body, read by the server after the view has returned, and waits in a cancel
scope of :class:`~._parking.Parking` per chunk.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from .._http._bodies import dumps_json
from .._http._problems import Problem
from ._modes_core import deadline_passed, shutting_down

if TYPE_CHECKING:
    from ._modes import Submissions

__all__ = ["EventStream", "sse_event"]


class EventStream:
    """A streamed job as server-sent events: ``chunk`` per emitted chunk, then ``end``
    (status and result) or ``error`` (a problem document). Closing it early (the client
    went away) cancels the job."""

    def __init__(
        self,
        submissions: Submissions,
        job_id: str,
        deadline: float,
        correlation_id: str,
        instance: str,
    ) -> None:
        self._submissions = submissions
        self._engine = submissions.engine
        self._parking = submissions.parking
        self._job_id = job_id
        self._deadline = deadline
        self._correlation_id = correlation_id
        self._instance = instance
        self._chunks = self._engine.stream(job_id)
        self._first: bytes | None = None
        self._done = False
        self._settled = False
        self._sent = 0

    async def start(self) -> None:
        """Wait for the first event; a job that fails before any chunk raises its problem,
        so the client gets a plain error response instead of a stream."""
        self._first = await self._pull(first=True)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        if self._done:
            raise StopAsyncIteration
        return await self._pull(first=False)

    async def _pull(self, *, first: bool) -> bytes:
        with self._parking.scope(self._deadline):
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                return await self._end(first)
            except Exception as exc:
                return await self._failed(exc, first)
            else:
                return await self._chunk(chunk, first)
        # The scope ran out: the job's deadline passed, or the shutdown's grace did.
        self._done = True
        await self._submissions.cancel_quietly(self._job_id)
        drained = self._parking.drained
        return self._error(shutting_down() if drained else deadline_passed(self._job_id), first)

    async def _chunk(self, chunk: Any, first: bool) -> bytes:
        try:
            data = dumps_json(chunk)
        except Problem as problem:
            self._done = True
            await self._submissions.cancel_quietly(self._job_id)
            return self._error(problem, first)
        self._sent += 1
        return sse_event("chunk", data, event_id=self._sent)

    async def _end(self, first: bool) -> bytes:
        self._done = self._settled = True
        view = await self._engine.status(self._job_id)
        end: dict[str, Any] = {"status": view.status, "result": view.result}
        if view.degraded:  # the headers are long gone: the end says what was degraded
            end["degraded"] = dict(view.degraded)
        try:
            return sse_event("end", dumps_json(end))
        except Problem as problem:
            return self._error(problem, first)

    async def _failed(self, exc: Exception, first: bool) -> bytes:
        self._done = self._settled = True
        return self._error(await self._submissions.failure(self._job_id, exc), first)

    def _error(self, problem: Problem, first: bool) -> bytes:
        if first:
            raise problem
        document = problem.document(correlation_id=self._correlation_id, instance=self._instance)
        return sse_event("error", dumps_json(document))

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            if not self._settled:
                await self._submissions.cancel_quietly(self._job_id)
            await self._chunks.aclose()  # Engine.stream's async generator


def sse_event(event: str, json_text: str, *, event_id: int | None = None) -> bytes:
    """One server-sent event; ``json_text`` is one line (compact JSON never breaks lines)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {event}\ndata: {json_text}\n\n".encode()
