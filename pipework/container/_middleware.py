"""What every request passes through, around the handlers: the ASGI guard in front of Quart,
the hooks before and after each handler, and the error handlers.

- :class:`RequestGuard` (ASGI, before Quart parses anything): a request whose header names,
  header values or raw target could not have come through HTTP/1.1 is a 400 problem.
- before each handler (:meth:`Middleware.before_request`): the request's id
  (``X-Request-ID`` when well-formed, else a new one), its W3C trace context
  (``traceparent``, ``tracestate``, ``baggage``: :mod:`pipework._http._trace`), the
  header-size limit (431) and the target's encoding (400 unless UTF-8 once
  percent-decoded);
- after each (:meth:`Middleware.after_request`): the response counters, by route or
  endpoint and status class, the access log line, and ``X-Request-ID``;
- errors: a :class:`Problem` as problem+json; werkzeug's HTTP errors as problems that say
  which method and path; a pipework error by its ``http_status``; anything else a 500 that
  shows nothing and logs everything under the request's id.

One hook each way: Quart awaits every hook through its own wrapper, per request.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Coroutine, Iterable, Mapping, Sequence
from typing import Any, Final
from urllib.parse import unquote_to_bytes

from quart import Request, Response, has_websocket_context, request, websocket
from quart.typing import ResponseTypes
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from .._errors import Overloaded, PipeworkError
from .._http._bodies import dumps_json
from .._http._cors import CorsPolicy, PreflightRefused
from .._http._problems import PROBLEM_JSON, Problem, encode_problem, problem_for_exception
from .._http._request_ids import request_id
from .._http._trace import baggage, traceparent, tracestate
from .._logging import outage
from .._metrics import Metrics
from ..dispatcher._job import new_correlation_id
from ..proxy._access import (
    ALWAYS_REDACTED,
    DEFAULT_REDACTED,
    access_logger,
    client_address,
    header,
    log_access,
    redacted_query,
    trace_id,
    upstreams,
)
from ..proxy._forwarding import Network
from ._request import Incoming, current_g, current_request, incoming, read_headers

__all__ = [
    "CORS_ENDPOINTS",
    "Middleware",
    "RequestGuard",
    "correlation_id",
    "preflight_answer",
    "problem_for_http",
    "render_problem",
]

_log = logging.getLogger("pipework.container")

# The metrics' endpoint label for the container's own rules (their endpoint names, as
# ``_app`` adds them).
_ENDPOINTS: Final = {
    "job": "jobs",
    "cancel_job": "jobs",
    "job_result": "jobs",
    "job_signal": "jobs",
    "callback": "callbacks",
    "admin_pool": "admin",
    "admin_key": "admin",
    "admin_key_clear": "admin",
    "admin_reload": "admin",
    "admin_limits": "admin",
    "admin_limit": "admin",
    "admin_limit_clear": "admin",
}
#: The endpoints of the rules that hand every other path to the routes' own map.
CATCH_ALL: Final = ("routes_root", "routes")
#: The container's own endpoints that ``ContainerConfig.cors`` opens to other origins: the
#: job, board and jobs-page ones (not the admin API, the probes or the metrics).
CORS_ENDPOINTS: Final = frozenset(
    {
        "job",
        "cancel_job",
        "job_result",
        "job_signal",
        "jobs_events",
        "job_events",
        "jobs_page",
        "board_create",
        "board_read",
        "board_update",
        "board_delete",
    }
)

# W3C Trace Context: version-trace_id-parent_id-flags; all-zero ids are invalid.
#: Answers that carry no content (RFC 9110 §15.3.5, §15.4.5): nothing to label.
_NO_CONTENT: Final = frozenset({204, 304})


class Middleware:
    """The hooks and error handlers for every request; :meth:`install` puts them (and the
    :class:`RequestGuard`) on the app."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        max_header_bytes: int,
        access_log: bool,
        trusted: Sequence[Network] = (),
        redact: Collection[str] = DEFAULT_REDACTED,
        cors: CorsPolicy | None = None,
    ) -> None:
        self.metrics = metrics
        self.cors = cors  # the container's own endpoints' (CORS_ENDPOINTS)
        self.max_header_bytes = max_header_bytes
        self.access_log = access_log
        #: The access log: the proxies whose forwarding headers name the client, and the
        #: query parameters whose values it hides (lower-case names).
        self.trusted = tuple(trusted)
        self.redact = frozenset(name.lower() for name in redact) | ALWAYS_REDACTED
        # The counters' children, found once per label pair (a labels() call takes a lock).
        self._counters: dict[tuple[str, int], Any] = {}

    def install(self, app: QuartTrio) -> None:
        app.asgi_app = RequestGuard(app.asgi_app)  # type: ignore[method-assign]  # Quart's documented middleware seam
        app.before_request(self.before_request)
        app.after_request(self.after_request)
        # The container's own websockets (a board's follow): their access line too.
        app.before_websocket(self.before_websocket)
        app.after_websocket(self.after_websocket)
        app.register_error_handler(Problem, self.on_problem)
        app.register_error_handler(HTTPException, self.on_http_error)
        app.register_error_handler(Exception, self.on_error)

    # -- hooks ---------------------------------------------------------------------------

    async def before_request(self) -> None:
        _take_correlation_id()
        self._check_headers()
        _check_target()

    async def after_request(self, response: Response) -> Response:
        self._count_response(response)
        response.headers["X-Request-ID"] = correlation_id()
        ctx = incoming()
        cors = None if ctx is None else ctx.cors
        if cors is None and self.cors is not None:
            rule = current_request().url_rule
            if rule is not None and rule.endpoint in CORS_ENDPOINTS:
                cors = self.cors
        if cors is not None and current_request().method != "OPTIONS":
            add_cors_headers(response, cors, None if ctx is None else ctx.origin)
        if response.status_code in _NO_CONTENT:
            # Quart labels every response (text/html, length 0); one without content has
            # nothing to describe, and a 204 may not carry a length (RFC 9110 §8.6).
            del response.headers["Content-Type"]
            del response.headers["Content-Length"]
        return response

    def _count_response(self, response: Response) -> None:
        """Count every response (refusals before any job too) by endpoint, route and
        status class, and write the access log line."""
        req, ctx = current_request(), incoming()
        route = "" if ctx is None else ctx.route
        status = response.status_code
        counter = self._counters.get((route, status // 100))
        if counter is None:
            counter = self._counter(req, route, status)
        counter.inc()
        if self.access_log and access_logger.isEnabledFor(logging.INFO):
            self._log_access(req, ctx, route, response)

    async def before_websocket(self) -> None:
        current_g().websocket_started = time.perf_counter()

    async def after_websocket(self, response: ResponseTypes | None) -> ResponseTypes | None:
        """A websocket's access line, once it ends: 101 when it was accepted, else its
        refusal's status."""
        if self.access_log and access_logger.isEnabledFor(logging.INFO):
            scope = websocket.scope
            headers = scope["headers"]
            peer = scope.get("client")
            started = current_g().get("websocket_started")
            rule = websocket.url_rule
            log_access(
                {
                    "client": client_address(
                        None if peer is None else peer[0], headers, self.trusted
                    ),
                    "method": "GET",
                    "path": websocket.path,
                    "query": redacted_query(scope.get("query_string", b""), self.redact),
                    "status": 101 if response is None else response.status_code,
                    "duration": None
                    if started is None
                    else round(time.perf_counter() - started, 6),
                    "user_agent": header(headers, b"user-agent"),
                    "endpoint": None if rule is None else rule.endpoint,
                    "correlation_id": correlation_id(),
                    "trace_id": trace_id(headers),
                }
            )
        return response

    def _log_access(
        self, req: Request, ctx: Incoming | None, route: str, response: Response
    ) -> None:
        scope = req.scope
        headers = scope["headers"]
        peer = scope.get("client")
        request_id = correlation_id()
        duration = None if ctx is None else round(time.perf_counter() - ctx.started, 6)
        received = None if ctx is None else ctx.body_bytes
        if received is None:
            declared = header(headers, b"content-length")
            received = int(declared) if declared is not None and declared.isdigit() else None
        parent = None if ctx is None else ctx.traceparent
        log_access(
            {
                "client": client_address(None if peer is None else peer[0], headers, self.trusted),
                "method": req.method,
                "path": req.path,
                "query": redacted_query(scope.get("query_string", b""), self.redact),
                "status": response.status_code,
                "duration": duration,
                "bytes_in": received,
                "bytes_out": response.content_length,  # None for a stream
                "user_agent": header(headers, b"user-agent"),
                "route": route or None,
                "endpoint": None if route else _endpoint(req),
                "correlation_id": request_id,
                "trace_id": None if parent is None else parent.split("-")[1],
                **upstreams(request_id),
            }
        )

    def _counter(self, req: Request, route: str, status: int) -> Any:
        metrics = self.metrics
        if route:
            counter = metrics.route_responses.labels(route, f"{status // 100}xx")
            self._counters[(route, status // 100)] = counter
            return counter
        # Keyed by route only: the endpoint of a request without one depends on its rule.
        return metrics.http_responses.labels(_endpoint(req), f"{status // 100}xx")

    def _check_headers(self) -> None:
        # hypercorn bounds only headers that arrive in pieces; this bounds them all.
        ctx = incoming()
        size = 0 if ctx is None else ctx.header_bytes
        if size > self.max_header_bytes:
            raise Problem(
                431,
                "Request Header Fields Too Large",
                f"the request's headers take {size} bytes, over the limit of "
                f"{self.max_header_bytes}",
                slug="headers-too-large",
            )

    # -- errors --------------------------------------------------------------------------

    async def on_problem(self, problem: Problem) -> Response:
        _, path = _method_and_path()
        return render_problem(problem, correlation_id=correlation_id(), instance=path)

    async def on_http_error(self, exc: HTTPException) -> Response:
        problem = problem_for_http(exc)
        method, path = _method_and_path()
        # werkzeug's descriptions are written for people at a browser
        if exc.code == 404:
            problem.detail = f"no route for {method} {path}"
        elif exc.code == 405:
            problem.detail = f"{method} is not allowed on {path}; see Allow"
        return await self.on_problem(problem)

    async def on_error(self, exc: Exception) -> Response:
        method, path = _method_and_path()
        if isinstance(exc, PipeworkError):
            if isinstance(exc, Overloaded):  # its numbers are for the operator, not the client
                # A store away: its outage's two lines say it, with the count of these.
                dependency = getattr(exc, "dependency", None)
                out = dependency is not None and outage(dependency).count("requests refused")
                _log.log(
                    logging.DEBUG if out else logging.WARNING,
                    "refused %s %s (correlation id %s): %s",
                    method,
                    path,
                    correlation_id(),
                    exc,
                )
            return await self.on_problem(problem_for_exception(exc))
        # A bug in the container or a hook, not a job's failure: log all of it, show none.
        _log.error(
            "unhandled error on %s %s (correlation id %s)",
            method,
            path,
            correlation_id(),
            exc_info=exc,
        )
        detail = "the server failed; its log has the details under this correlation id"
        return await self.on_problem(Problem(500, "Internal Server Error", detail))


def _endpoint(req: Request) -> str:
    """The container's own endpoint a request without a route went to (the metrics' label):
    ``unmatched`` when no rule took its method and path (404, 405)."""
    rule = req.url_rule
    if rule is None or rule.endpoint in CATCH_ALL:
        return "unmatched"
    endpoint: str = rule.endpoint
    return _ENDPOINTS.get(endpoint, endpoint)


def add_cors_headers(response: Response, cors: CorsPolicy, origin: str | None) -> None:
    """The real answer's CORS headers (``Vary: Origin`` joined to any ``Vary`` there)."""
    for name, value in cors.response_headers(origin):
        if name == "Vary":
            response.vary.add(value)
        else:
            response.headers[name] = value


def preflight_answer(cors: CorsPolicy | None, headers: Mapping[str, str]) -> Response:
    """The answer to a CORS preflight (a 204 with the policy's headers), or a 403 problem
    saying what the policy (None: no cross-origin calls at all) does not allow."""
    origin = headers["origin"]
    method = headers["access-control-request-method"]
    if cors is None:
        raise Problem(
            403,
            "Forbidden",
            f"{method.strip()} on this path may not be called from another origin (no CORS "
            "policy covers it)",
            slug="cors-refused",
            headers={"Vary": "Origin"},
        )
    try:
        found = cors.preflight(origin, method, headers.get("access-control-request-headers"))
    except PreflightRefused as exc:
        raise Problem(
            403, "Forbidden", str(exc), slug="cors-refused", headers={"Vary": "Origin"}
        ) from None
    response = Response("", status=204)
    for name, value in found:
        response.headers[name] = value
    return response


def render_problem(problem: Problem, *, correlation_id: str, instance: str) -> Response:
    body = encode_problem(problem, correlation_id=correlation_id, instance=instance)
    response = Response(body, status=problem.status, content_type=PROBLEM_JSON)
    for name, value in problem.headers.items():
        response.headers[name] = value
    response.headers["Cache-Control"] = "no-store"
    return response


def problem_for_http(exc: HTTPException) -> Problem:
    """The problem for an HTTP error raised by routing or body handling (404, 405, 413...)."""
    status = exc.code or 500
    headers = {
        name: value
        for name, value in exc.get_headers()
        if name.lower() not in {"content-type", "content-length"}
    }
    detail = exc.description or ""
    # werkzeug's default descriptions are written for HTML pages; keep them, minus markup.
    return Problem(status, exc.name, detail.replace("<", "").replace(">", ""), headers=headers)


# -- the ASGI guard ------------------------------------------------------------------------

# RFC 9110: a header name is a token; a value holds no control character but HTAB.
_HEADER_NAME: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_HEADER_VALUE: Final = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*\Z")
# The raw request target: visible ASCII (anything else must be percent-encoded).
_TARGET: Final = re.compile(rb"[\x21-\x7e]*\Z")


class RequestGuard:
    """In front of Quart: refuse a request whose header names, header values or raw
    target could not have come through HTTP/1.1 (h11 refuses them; another server might
    not), with a 400 problem, before Quart parses them (it would fail on them with a 500)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, scope: Any, receive: Any, send: Any) -> Coroutine[Any, Any, None]:
        # Returns the awaitable instead of awaiting it: no frame of its own per request.
        if scope.get("type") == "http":
            why = _malformed_request(scope)
            if why is not None:
                return _send_problem(send, 400, "Bad Request", why, "malformed-request")
        result: Coroutine[Any, Any, None] = self.app(scope, receive, send)
        return result


def _malformed_request(scope: Mapping[str, Any]) -> str | None:
    for name, value in scope.get("headers", ()):
        if not _HEADER_NAME.match(name):
            return "a request header has a name that is not an HTTP token"
        if not _HEADER_VALUE.match(value):
            return "a request header's value holds a control character"
    raw_path = scope.get("raw_path")
    if isinstance(raw_path, bytes) and not _TARGET.match(raw_path):
        return "the request's path holds characters that must be percent-encoded"
    if not _TARGET.match(scope.get("query_string", b"")):
        return "the request's query holds characters that must be percent-encoded"
    return None


async def _send_problem(send: Any, status: int, title: str, detail: str, slug: str) -> None:
    request_id = new_correlation_id()
    problem = Problem(status, title, detail, slug=slug)
    body = dumps_json(problem.document(correlation_id=request_id, instance="/")).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-request-id", request_id.encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


# -- the request's own -----------------------------------------------------------------


def _check_target() -> None:
    """One rule for the request target: its path and its query, once percent-decoded, are
    UTF-8, or the request is a 400. (The server would turn ``%FF`` in a path into U+FFFD
    and the query parser would keep it as ``%FF``: neither is what the client meant.)"""
    scope = current_request().scope
    raw_path = scope.get("raw_path")
    path = (
        raw_path
        if isinstance(raw_path, bytes)
        else scope.get("path", "").encode("utf-8", "surrogatepass")
    )
    query = scope.get("query_string", b"")
    for part, what in ((path, "path"), (query.replace(b"+", b" "), "query")):
        if part.isascii() and b"%" not in part:
            continue  # nothing to decode: ASCII is UTF-8
        try:
            unquote_to_bytes(part).decode("utf-8")
        except UnicodeDecodeError:
            raise Problem(
                400,
                "Bad request target",
                f"the request's {what} is not UTF-8 once percent-decoded",
                slug="bad-encoding",
            ) from None


def _method_and_path() -> tuple[str, str]:
    """What is being answered; a websocket handshake (a board follow refused before it is
    accepted) has no ``request``, and its refusal is an HTTP answer all the same."""
    if has_websocket_context():
        return "GET", websocket.path
    return request.method, request.path


def correlation_id() -> str:
    """This request's id (``X-Request-ID``): the client's when well-formed, else a new one."""
    ctx = current_g()
    value = ctx.get("correlation_id")
    if value is None:
        value = ctx.correlation_id = new_correlation_id()
    return str(value)


def _take_trace_lists(record: Incoming, raw: Iterable[tuple[bytes, bytes]]) -> None:
    """``tracestate`` (with a ``traceparent``) and ``baggage``, every line of each."""
    states: list[str] = []
    baggages: list[str] = []
    for name, value in raw:
        lowered = name.lower()
        if lowered == b"tracestate":
            states.append(value.decode("latin-1"))
        elif lowered == b"baggage":
            baggages.append(value.decode("latin-1"))
    if record.traceparent is not None:
        record.tracestate = tracestate(states)
    record.baggage = baggage(baggages)


def _take_correlation_id() -> None:
    ctx = current_g()
    started = time.perf_counter()
    headers, size = read_headers(current_request().scope["headers"])
    ctx.pipework = record = Incoming(started, headers, size)
    # W3C trace context: passed on to the backends as sent, when well-formed.
    if "traceparent" in headers:
        record.traceparent = traceparent(headers["traceparent"])
    if "baggage" in headers or ("tracestate" in headers and record.traceparent is not None):
        _take_trace_lists(record, current_request().scope["headers"])
    given = headers.get("x-request-id")
    ctx.correlation_id = request_id(given)
