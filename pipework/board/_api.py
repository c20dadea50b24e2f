"""The push board over HTTP: ``/boards/{board}/{id}``, ``/jobs/{id}/events`` and the jobs page.

Writes: ``POST /boards/{board}`` creates (201, ``Location``, the new id), ``PUT`` replaces a
resource's state, ``DELETE`` deletes it and closes its followers after a final ``delete``
event. ``GET`` reads, or follows:

- SSE when the client accepts ``text/event-stream``: each event carries ``id:`` (its
  version), so a reconnect's ``Last-Event-ID`` (or ``?since=``) resumes exactly there; a
  comment holds idle connections open through proxies (the board beats every
  ``keepalive`` seconds, and a stream that sent nothing since the last beat gets one); no
  response timeout cuts it;
- long-poll with ``?since=VERSION`` and/or ``?wait=SECONDS``: answered at once when the
  follower is behind (with every event it missed), else at the first change or after the
  wait, with ``{"events": [...], "position": ...}``;
- a websocket on the same path: one JSON text message per event.

Who may: a board's ``write_token`` for writes (none configured: no HTTP writes), its
``read_token`` or ``public_read`` for reads, as ``Authorization: Bearer``; reads also take
``?token=`` because browsers cannot set headers on EventSource or websocket requests.
Past a follower limit: 503 with Retry-After. A follower whose send fails is dropped.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from typing import Any, Final

import trio
from quart import Response, request, websocket

from .._errors import JobNotFound
from .._http._bodies import JSON, decode, dumps_json, read_body
from .._http._credentials import bearer_token, same_secret
from .._http._jobs import authorize, job_document, job_token
from .._http._problems import Problem
from ..dispatcher._engine import Engine
from ..dispatcher._job import JobView, hash_token
from ..dispatcher._status import TERMINAL
from ._core import BoardFull, Event, Kind, ResourceExists, ResourceNotFound, Version
from ._driver import Boards, BoardSpec, BoardUnavailable, Change, Follower
from ._jobs import JOB_BOARD, JobBoard
from ._page import jobs_page

__all__ = ["BoardApi", "sse_event", "sse_events"]

_log = logging.getLogger("pipework.boards")

_RETRY_AFTER: Final = "5"
#: The most jobs one multi-job stream (the jobs page) may follow.
MAX_TICKETS: Final = 200
_TERMINAL_NAMES: Final = frozenset(s.value for s in TERMINAL)
_VISIBLE_ASCII: Final = re.compile(r"[\x21-\x7e]+\Z")


def sse_event(event: Event) -> bytes:
    """One event in the SSE wire format (its data is one JSON line), encoded once and
    shared by every follower it goes to."""
    wire = event.encoded.get("sse")
    if wire is None:
        wire = event.encoded["sse"] = (
            f"id: {event.version}\nevent: {event.kind.value}\n"
            f"data: {dumps_json(event.to_wire())}\n\n"
        ).encode()
    return wire


def sse_events(events: tuple[Event, ...]) -> bytes:
    """Several events in one chunk (one event's bytes as they are: no copy)."""
    if len(events) == 1:
        return sse_event(events[0])
    return b"".join(map(sse_event, events))


def _sse_response(body: AsyncIterator[bytes]) -> Response:
    response = Response(body, content_type="text/event-stream")
    response.timeout = None  # Quart would cut the stream at RESPONSE_TIMEOUT otherwise
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # proxies: flush each event
    return response


def _json(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps_json(value), status=status, content_type=JSON, headers=headers)


def _bearer(headers: Any) -> str | None:
    return bearer_token(headers.get("Authorization"))


def _full(exc: BoardFull) -> Problem:
    return Problem(
        503,
        "Too many followers",
        f"{exc}; try again later",
        slug="followers-full",
        headers={"Retry-After": _RETRY_AFTER},
        reason=exc.reason,
    )


def _since(args: Any, headers: Any) -> Version | None:
    return Version.parse(headers.get("Last-Event-ID") or args.get("since"))


async def _stream(follower: Follower, ends: Any = None) -> AsyncGenerator[bytes, None]:
    """SSE bytes for the follower until its resources are deleted (or ``ends(event)``),
    with a keep-alive comment when the board's beat finds it idle; a send that fails (the
    client left) drops it."""
    finished = False
    try:
        yield b": following\n\n"  # headers and a first byte now: the client knows it is on
        while True:
            taken = await follower.next()
            if taken is None:
                yield b": keep-alive\n\n"
                continue
            yield sse_events(taken.events)
            if taken.closed or (ends is not None and any(ends(e) for e in taken.events)):
                finished = True
                return
    finally:
        follower.close(dropped=not finished)


async def _once(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk


def _job_ended(event: Event) -> bool:
    return event.kind is Kind.DELETE or (
        isinstance(event.data, dict) and event.data.get("status") in _TERMINAL_NAMES
    )


class BoardApi:
    """The handlers behind ``/boards`` and ``/jobs/{id}/events``."""

    def __init__(
        self,
        boards: Boards,
        job_board: JobBoard,
        engine: Engine,
        *,
        max_body: int,
        body_time_limit: float,
    ) -> None:
        self.boards = boards
        self.job_board = job_board
        self.engine = engine
        self.max_body = max_body
        self.body_time_limit = body_time_limit
        #: The download centre's authentication of ``GET /jobs/events`` (the container's
        #: ``DownloadsApi.caller``: the caller's owner string, None without ``jobs_auth``,
        #: a 401 without the credential) and the jobs an owner has (``owned_views``).
        self.caller: Callable[[], Awaitable[str | None]] | None = None
        self.owned: Callable[[str], Awaitable[list[JobView]]] | None = None

    # -- who may -------------------------------------------------------------------------

    def _spec(self, board: str) -> BoardSpec:
        spec = self.boards.specs.get(board)
        if spec is None or board == JOB_BOARD:
            raise Problem(404, "Board not found", f"no board {board!r}", slug="board-not-found")
        return spec

    def _may_write(self, spec: BoardSpec) -> None:
        if spec.write_token is None:
            raise Problem(
                403,
                "Forbidden",
                f"board {spec.name!r} takes no writes over HTTP: it has no write token",
                slug="board-read-only",
            )
        if not same_secret(_bearer(request.headers), spec.write_token):
            raise Problem(
                401,
                "Unauthorized",
                f"writing to board {spec.name!r} needs its write token as a bearer token",
                slug="board-token",
                headers={"WWW-Authenticate": 'Bearer realm="pipework boards"'},
            )

    @staticmethod
    def _may_read(spec: BoardSpec, headers: Any, args: Any) -> None:
        if spec.public_read:
            return
        given = _bearer(headers) or args.get("token")
        if same_secret(given, spec.read_token) or same_secret(given, spec.write_token):
            return
        raise Problem(
            401,
            "Unauthorized",
            f"reading board {spec.name!r} needs its read token",
            slug="board-token",
            headers={"WWW-Authenticate": 'Bearer realm="pipework boards"'},
        )

    @staticmethod
    def _not_found(board: str, resource: str) -> Problem:
        return Problem(
            404,
            "Resource not found",
            f"board {board!r} has no resource {resource!r}",
            slug="resource-not-found",
        )

    async def _body(self) -> Any:
        data = await read_body(request, limit=self.max_body, time_limit=self.body_time_limit)
        return decode(data, request.mimetype or None, what="resource state")

    # -- writes --------------------------------------------------------------------------

    async def _write(self, change: Change) -> Version:
        try:
            return await self.boards.write(change)
        except BoardUnavailable as exc:
            # Where the backplane is, and why, is the operators' business: the log's.
            _log.warning("a write to board %r was refused: %s", change.board, exc)
            raise Problem(
                503,
                "Board unavailable",
                f"board {change.board!r} cannot take writes now; nothing was written: "
                "retry later (see Retry-After)",
                slug="board-unavailable",
                headers={"Retry-After": _RETRY_AFTER},
            ) from exc

    async def create(self, board: str) -> Response:
        spec = self._spec(board)
        self._may_write(spec)
        data = await self._body()
        self._spec(board)  # a reload may have removed it while the body came
        resource = secrets.token_urlsafe(12)
        try:
            version = await self._write(Change(board, "create", resource, data))
        except BoardFull as exc:
            raise Problem(
                503,
                "Board full",
                f"{exc}; delete some first",
                slug="board-full",
                headers={"Retry-After": _RETRY_AFTER},
            ) from None
        except ResourceExists:  # 96 random bits: a collision is a bug, not a client error
            raise RuntimeError("a new resource id collided") from None
        location = f"/boards/{board}/{resource}"
        return _json(
            {"id": resource, "version": str(version), "data": data},
            201,
            {"Location": location, "ETag": f'"{version}"'},
        )

    async def update(self, board: str, resource: str) -> Response:
        spec = self._spec(board)
        self._may_write(spec)
        data = await self._body()
        self._spec(board)  # a reload may have removed it while the body came
        try:
            version = await self._write(Change(board, "update", resource, data))
        except ResourceNotFound:
            raise self._not_found(board, resource) from None
        return _json(
            {"id": resource, "version": str(version), "data": data},
            headers={"ETag": f'"{version}"'},
        )

    async def delete(self, board: str, resource: str) -> Response:
        spec = self._spec(board)
        self._may_write(spec)
        try:
            await self._write(Change(board, "delete", resource))
        except ResourceNotFound:
            raise self._not_found(board, resource) from None
        return Response(b"", status=204)

    # -- reads and follows ---------------------------------------------------------------

    async def read(self, board: str, resource: str) -> Response:
        spec = self._spec(board)
        self._may_read(spec, request.headers, request.args)
        if resource not in self.boards.cores[board]:
            raise self._not_found(board, resource)
        if request.accept_mimetypes.best == "text/event-stream":
            return self._follow_sse(spec, resource)
        if "since" in request.args or "wait" in request.args:
            return await self._long_poll(spec, resource)
        version, data = self.boards.read(board, resource)
        return _json(
            {"id": resource, "version": str(version), "data": data},
            headers={"ETag": f'"{version}"'},
        )

    def _follow(self, board: str, resources: Iterable[str], since: Version | None) -> Follower:
        try:
            return self.boards.follow(board, resources, since)
        except BoardFull as exc:
            raise _full(exc) from None

    def _follow_sse(self, spec: BoardSpec, resource: str) -> Response:
        follower = self._follow(spec.name, [resource], _since(request.args, request.headers))
        return _sse_response(_stream(follower))

    async def _long_poll(self, spec: BoardSpec, resource: str) -> Response:
        since_text = request.args.get("since")
        since = Version.parse(since_text)
        if since_text and since is None:
            raise Problem(400, "Bad since", f"since={since_text!r} is not a version (E-N)")
        try:
            wait = min(float(request.args.get("wait", spec.long_poll)), spec.long_poll)
        except ValueError:
            raise Problem(400, "Bad wait", "wait must be a number of seconds") from None
        wait = max(wait, 0.0)
        events: tuple[Event, ...] = ()
        with self._follow(spec.name, [resource], since) as follower:
            taken = follower.take()
            if not taken.events:
                with trio.move_on_after(wait):
                    taken = await follower.wait()
            events = taken.events
        position = events[-1].version if events else since or follower.position
        return _json({"events": [e.to_wire() for e in events], "position": str(position)})

    async def follow_websocket(self, board: str, resource: str) -> None:
        spec = self._spec(board)
        self._may_read(spec, websocket.headers, websocket.args)
        if resource not in self.boards.cores[board]:
            raise self._not_found(board, resource)
        follower = self._follow(board, [resource], _since(websocket.args, websocket.headers))
        finished = False
        try:
            await websocket.accept()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_ignore_messages)
                while True:
                    taken = await follower.wait()
                    for event in taken.events:
                        await websocket.send(dumps_json(event.to_wire()))
                    if taken.closed:
                        finished = True
                        break
                nursery.cancel_scope.cancel()
        finally:
            follower.close(dropped=not finished)
        await websocket.close(1000)

    # -- jobs ----------------------------------------------------------------------------

    def _on_board(self, view: Any, token: str | None) -> None:
        self.job_board.publish(view, None if token is None else hash_token(token))
        self.engine.watch(view.id)  # its steps may run in another process

    async def job_events(self, job_id: str) -> Response:
        """``GET /jobs/{id}/events``: the job's document on every change, ending with its
        final state (at once, if it has ended already)."""
        token = job_token(request.headers)
        view = await authorize(self.engine, job_id, token)
        self._on_board(view, token)
        try:
            follower = self._follow(JOB_BOARD, [job_id], _since(request.args, request.headers))
        except ResourceNotFound:  # finished and being dropped from the board this instant
            final = Event(job_id, Kind.RESYNC, self.job_board.core.position, job_document(view))
            response = _sse_response(_once(sse_event(final)))
        else:
            response = _sse_response(_stream(follower, _job_ended))
        response.headers["X-Job-Id"] = job_id
        return response

    async def jobs_events(self) -> Response:
        """``GET /jobs/events``: several jobs in one stream, each named by ``id:token`` in
        ``X-Job-Tickets`` (comma-separated), and with ``jobs_auth`` the caller's identity's
        newest jobs; what the jobs page follows. Jobs that are unknown or whose token does
        not match get one ``missing`` event each."""
        owner = None if self.caller is None else await self.caller()
        tickets = [t.strip() for t in request.headers.get("X-Job-Tickets", "").split(",")]
        tickets = [t for t in tickets if t]
        if len(tickets) > MAX_TICKETS:
            raise _bad_tickets(f"it names {len(tickets)} jobs; at most {MAX_TICKETS} per stream")
        for number, ticket in enumerate(tickets, 1):
            # Ids and tokens are ASCII: such a ticket names no job, and its id, read as
            # latin-1 like every header, would come back garbled in a missing event.
            if not _VISIBLE_ASCII.match(ticket):
                raise _bad_tickets(
                    f"ticket {number} is not visible ASCII; a ticket is ID:TOKEN, the job's "
                    "X-Job-Id and X-Job-Token"
                )
        found: list[str] = []
        missing: list[str] = []
        if owner is not None and self.owned is not None:
            for view in await self.owned(owner):
                self.job_board.publish(view, None)
                self.engine.watch(view.id)
                found.append(view.id)
        for ticket in tickets:
            job_id, _, token = ticket.partition(":")
            try:
                view = await self.engine.authorize(job_id, token)
            except JobNotFound:
                missing.append(job_id)
                continue
            self._on_board(view, token)
            found.append(job_id)
        found = list(dict.fromkeys(found))
        follower = (
            self._follow(JOB_BOARD, found, _since(request.args, request.headers)) if found else None
        )

        async def body() -> AsyncIterator[bytes]:
            for job_id in missing:
                yield f"event: missing\ndata: {dumps_json({'id': job_id})}\n\n".encode()
            if follower is not None:
                # Closed with this body: a nested generator left suspended would otherwise
                # be finalized by the garbage collector, its follower never closed in time.
                async with aclosing(_stream(follower)) as stream:
                    async for chunk in stream:
                        yield chunk

        return _sse_response(body())


async def _ignore_messages() -> None:
    """Read what a follower's client sends, and drop it. Left unread, a few dozen messages
    fill the app's queues, and the server stops reading the connection: the client's close
    frame would never be answered."""
    while True:
        await websocket.receive()


def _bad_tickets(why: str) -> Problem:
    return Problem(
        400, "Bad job tickets", f"X-Job-Tickets cannot be followed: {why}", slug="bad-job-tickets"
    )


def add_board_rules(app: Any, api: BoardApi) -> None:
    """The board's paths on the container's app (Quart rules: they win over routes)."""
    app.add_url_rule("/boards/<board>", "board_create", api.create, methods=["POST"])
    app.add_url_rule("/boards/<board>/<resource>", "board_read", api.read, methods=["GET"])
    app.add_url_rule("/boards/<board>/<resource>", "board_update", api.update, methods=["PUT"])
    app.add_url_rule("/boards/<board>/<resource>", "board_delete", api.delete, methods=["DELETE"])
    app.add_websocket("/boards/<board>/<resource>", "board_ws", api.follow_websocket)
    app.add_url_rule("/jobs/events", "jobs_events", api.jobs_events, methods=["GET"])
    app.add_url_rule("/jobs/<job_id>/events", "job_events", api.job_events, methods=["GET"])
    app.add_url_rule("/ui/jobs", "jobs_page", jobs_page, methods=["GET"])
