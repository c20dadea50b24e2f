"""The HTTP container: a QuartTrio app that serves an engine's routes and its job API.

The engine is not owned here: the caller runs it (``async with engine:``) around the
container, so jobs outlive the server by exactly as much as the caller decides::

    async with engine:
        container = Container(engine)                 # routes from engine.registry
        async with trio.open_nursery() as nursery:
            address = await nursery.start(partial(container.serve, shutdown_trigger=stop))

``Container.serve`` runs hypercorn (through :func:`pipework.container._server.serve`) and
owns the graceful shutdown: when ``shutdown_trigger`` is set it stops accepting, lets
parked requests finish within ``shutdown_grace`` seconds, answers the rest 503 and
cancels their jobs, then returns.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote_to_bytes

import trio
from quart import Request, Response, has_websocket_context, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.routing import Map, MapAdapter, Rule

from .._errors import Overloaded, PipeworkError
from .._http._bodies import JSON, dumps_json
from .._http._problems import Problem, problem_for_exception, problem_for_http, render_problem
from .._metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .._metrics import Metrics
from ..board import Backplane, Boards, BoardSpec
from ..board._api import BoardApi, add_board_rules
from ..board._jobs import JOB_BOARD, JobBoard
from ..board._metrics import BoardCollector
from ..dispatcher._engine import PROBE_CHAIN, Engine
from ..dispatcher._job import new_correlation_id
from ._admin import AdminApi, Reload, admin_token
from ._callbacks import CallbackSigner
from ._collector import SERVING_GC_THRESHOLD, tuned_collector
from ._idempotency import IdempotencyTable
from ._jobs_api import JobsApi
from ._modes import Parking, Submissions
from ._modes_core import shutting_down
from ._request import Incoming, current_g, current_request, incoming, read_headers
from ._routes import Route, routes_of
from ._server import BoundAddress, serve

__all__ = ["CANARY_CHAIN", "Container", "ContainerConfig", "create_app"]

_log = logging.getLogger("pipework.container")
#: One line per request: method, path, status, duration (to the response's headers; a
#: stream's body goes on after it) and request id.
_access_log = logging.getLogger("pipework.access")

# The metrics' endpoint label for the container's own rules.
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
}

#: The chain ``/readyz`` runs to prove a job gets through the queue and a worker: the
#: engine's own (:meth:`Engine.probe`), in no registry, so reloads leave it in place.
CANARY_CHAIN: Final = PROBE_CHAIN

# Accepted X-Request-ID values; anything else is replaced, so logs stay parseable.
_REQUEST_ID: Final = re.compile(r"[A-Za-z0-9._~:/+=@-]{1,128}\Z")
# W3C Trace Context: version-trace_id-parent_id-flags; all-zero ids are invalid.
_TRACEPARENT: Final = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\Z")
_ZERO_IDS: Final = re.compile(r"^..-0{32}-|-0{16}-")
# Hypercorn's own grace beyond ours: time for the 503s to reach the clients.
_FLUSH_MARGIN: Final = 1.0
_NO_PARAMS: Final[Mapping[str, str]] = {}
#: The endpoints of the rules that hand every other path to the routes' own map.
_CATCH_ALL: Final = ("routes_root", "routes")
#: Answers that carry no content (RFC 9110 §15.3.5, §15.4.5): nothing to label.
_NO_CONTENT: Final = frozenset({204, 304})


@dataclass(frozen=True, slots=True)
class ContainerConfig:
    """How the container serves (every limit has a default a gateway can run with).

    - ``max_body``: request body limit in bytes (routes may set their own); 413 beyond.
    - ``max_header_bytes``: request headers in bytes; 431 beyond.
    - ``body_time_limit``: seconds a client may take to send its body; 408 after.
    - ``default_timeout``: job time limit when neither route, chain nor engine sets one.
    - ``shutdown_grace``: seconds parked requests get to finish once shutdown starts.
    - ``readiness_timeout``: seconds the ``/readyz`` canary job may take.
    - ``cancel_wait``: seconds ``DELETE /jobs/{id}`` waits for the job to end.
    - ``idempotency_keys``: how many Idempotency-Keys are remembered at most.
    - ``callback_secret``: HMAC key for callback URLs (else ``PIPEWORK_CALLBACK_SECRET``,
      else random per start); ``public_url``: the base of callback URLs as backends
      reach this server (else the address it listens on).
    - ``expose_errors``: show every pipe exception's message to clients (development).
    - ``admin_token``: the admin API's bearer token (else ``PIPEWORK_ADMIN_TOKEN``; with
      neither, the admin API is off).
    - ``access_log``: one line per request on the ``pipework.access`` logger (method,
      path, status, duration, request id).
    - ``gc_threshold``: the garbage collector's young threshold while serving (None: the
      interpreter's); see :mod:`._collector` for why a server holding many connections
      wants it far above the default.
    """

    max_body: int = 1024 * 1024
    max_header_bytes: int = 16 * 1024
    body_time_limit: float = 30.0
    default_timeout: float = 30.0
    shutdown_grace: float = 10.0
    readiness_timeout: float = 2.0
    cancel_wait: float = 2.0
    idempotency_keys: int = 10_000
    callback_secret: str | bytes | None = None
    public_url: str | None = None
    expose_errors: bool = False
    admin_token: str | None = None
    access_log: bool = True
    gc_threshold: int | None = SERVING_GC_THRESHOLD

    def __post_init__(self) -> None:
        for name in ("body_time_limit", "default_timeout", "readiness_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ContainerConfig.{name} must be positive")
        for name in ("max_body", "max_header_bytes", "shutdown_grace", "cancel_wait"):
            if getattr(self, name) < 0:
                raise ValueError(f"ContainerConfig.{name} must not be negative")
        if self.gc_threshold is not None and self.gc_threshold < 1:
            raise ValueError("ContainerConfig.gc_threshold must be positive (or None)")


class Container:
    """Serves ``engine``'s routes (default: those registered on its registry), the job
    API, signed callbacks, ``/healthz`` and ``/readyz``. ``app`` is the QuartTrio app.
    ``backplane`` carries the boards' writes (default: this process alone; a
    ``RedisBackplane`` shares them with every process on the same Redis and prefix)."""

    def __init__(
        self,
        engine: Engine,
        routes: Iterable[Route] | None = None,
        config: ContainerConfig | None = None,
        *,
        signer: CallbackSigner | None = None,
        reload: Reload | None = None,
        boards: Iterable[BoardSpec] = (),
        backplane: Backplane | None = None,
    ) -> None:
        self.engine = engine
        self.config = config = config or ContainerConfig()
        self._counters: dict[tuple[str, int], Any] = {}
        self.set_routes(routes_of(engine.registry) if routes is None else routes)
        self.signer = signer or CallbackSigner.from_config(
            config.callback_secret, base_url=config.public_url or ""
        )
        engine.set_callback_factory(self.signer.url)
        self.parking = Parking(engine.metrics.parked)
        self.submissions = Submissions(
            engine,
            self.parking,
            IdempotencyTable(config.idempotency_keys),
            default_timeout=config.default_timeout,
            max_body=config.max_body,
            body_time_limit=config.body_time_limit,
            # Idempotency keys last as long as their jobs stay readable.
            retain_seconds=float(getattr(engine.store, "retain_seconds", 3600.0)),
            expose_errors=config.expose_errors,
        )
        self.jobs = JobsApi(
            engine,
            self.signer,
            max_body=config.max_body,
            body_time_limit=config.body_time_limit,
            cancel_wait=config.cancel_wait,
            expose_errors=config.expose_errors,
        )
        self.boards = Boards(boards, backplane=backplane)
        self.job_board = JobBoard(self.boards, expose_errors=config.expose_errors)
        self.board_api = BoardApi(
            self.boards,
            self.job_board,
            engine,
            max_body=config.max_body,
            body_time_limit=config.body_time_limit,
        )
        token = admin_token(config.admin_token)
        self.admin = (
            None
            if token is None
            else AdminApi(
                engine,
                token,
                reload,
                max_body=config.max_body,
                body_time_limit=config.body_time_limit,
            )
        )
        self.app = self._build_app()

    # -- serving -------------------------------------------------------------------------

    async def serve(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        fd: int | None = None,
        shutdown_trigger: trio.Event | None = None,
        hypercorn_options: Mapping[str, object] | None = None,
        task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until ``shutdown_trigger`` is set (then shut down gracefully) or until
        cancelled; ``task_status.started()`` reports the bound address. ``fd``: serve on
        this inherited listening socket instead of binding ``host:port``."""
        options: dict[str, object] = {
            "h11_max_incomplete_size": self.config.max_header_bytes,
            "h2_max_header_list_size": self.config.max_header_bytes,
            **(hypercorn_options or {}),
        }
        stop = trio.Event()
        with tuned_collector(self.config.gc_threshold):
            await self._serve(host, port, fd, stop, shutdown_trigger, options, task_status)

    async def _serve(
        self,
        host: str,
        port: int,
        fd: int | None,
        stop: trio.Event,
        shutdown_trigger: trio.Event | None,
        options: dict[str, object],
        task_status: trio.TaskStatus[BoundAddress],
    ) -> None:
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(
                    serve,
                    self.app,
                    host=host,
                    port=port,
                    fd=fd,
                    shutdown_trigger=stop,
                    graceful_timeout=self.config.shutdown_grace + _FLUSH_MARGIN,
                    hypercorn_options=options,
                )
            )
            if not self.signer.base_url:
                self.signer.base_url = address.url
            task_status.started(address)
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger.wait()
            self.begin_shutdown()
            stop.set()

    def begin_shutdown(self) -> None:
        """Refuse new jobs (503) and give parked requests ``shutdown_grace`` seconds."""
        _log.info("shutting down: %d parked requests", self.parking.parked)
        self.parking.drain(self.config.shutdown_grace)

    # -- the app -------------------------------------------------------------------------

    def _build_app(self) -> QuartTrio:
        app = QuartTrio(__name__, static_folder=None)
        app.asgi_app = _RequestGuard(app.asgi_app)  # type: ignore[method-assign]  # Quart's documented middleware seam
        # Quart's own cap, above every route's: the routes' limits are checked while reading.
        app.config["MAX_CONTENT_LENGTH"] = self._largest_body()
        # One hook each way: Quart awaits every hook through its own wrapper, per request.
        app.before_request(self._before_request)
        app.after_request(self._after_request)
        app.register_error_handler(Problem, self._on_problem)
        app.register_error_handler(HTTPException, self._on_http_error)
        app.register_error_handler(Exception, self._on_error)
        # Routes are matched by our own map, behind one catch-all rule, so that a reload can
        # swap them in one step; the container's own paths are Quart rules and win.
        # OPTIONS is answered from the routes' own map, with the Allow a 405 would have.
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        self.submissions.match = self._match
        for rule, endpoint in zip(("/", "/<path:_rest>"), _CATCH_ALL, strict=True):
            app.add_url_rule(
                rule,
                endpoint,
                self.submissions.serve,
                methods=methods,
                provide_automatic_options=False,
            )
        jobs = self.jobs
        app.add_url_rule("/jobs/<job_id>", "job", jobs.status, methods=["GET"])
        app.add_url_rule("/jobs/<job_id>", "cancel_job", jobs.cancel, methods=["DELETE"])
        app.add_url_rule("/jobs/<job_id>/result", "job_result", jobs.result, methods=["GET"])
        app.add_url_rule(
            "/jobs/<job_id>/signals/<name>", "job_signal", jobs.signal, methods=["POST"]
        )
        app.add_url_rule("/callbacks/<job_id>/<name>", "callback", jobs.callback, methods=["POST"])
        add_board_rules(app, self.board_api)
        app.before_serving(self._start_boards)
        app.after_serving(self._stop_boards)
        app.add_url_rule("/healthz", "healthz", _healthz, methods=["GET"])
        app.add_url_rule("/readyz", "readyz", self._readyz, methods=["GET"])
        app.add_url_rule("/metrics", "metrics", self._metrics, methods=["GET"])
        if self.admin is not None:
            admin = self.admin
            app.add_url_rule("/admin/pool", "admin_pool", admin.pool, methods=["GET"])
            app.add_url_rule("/admin/pool/keys/<key>", "admin_key", admin.set_key, methods=["PUT"])
            app.add_url_rule(
                "/admin/pool/keys/<key>", "admin_key_clear", admin.clear_key, methods=["DELETE"]
            )
            app.add_url_rule("/admin/reload", "admin_reload", admin.reload, methods=["POST"])
        # OPTIONS on the container's own paths: Quart's automatic answer would list the
        # catch-all's methods too; these are the paths' own (and a route's on the same path).
        own = [
            Rule(r.rule, endpoint=r.endpoint, methods=r.methods)
            for r in app.url_map.iter_rules()
            if r.endpoint not in _CATCH_ALL and not r.websocket
        ]
        self._own_paths = Map(own).bind("localhost")
        app.make_default_options_response = self._own_options  # type: ignore[method-assign]  # Quart's hook for OPTIONS
        return app

    async def _start_boards(self) -> None:
        self._boards_scope = scope = trio.CancelScope()
        # The parked requests' deadlines: served from now until the app stops.
        self._parking_scope = trio.CancelScope()
        await self.app.nursery.start(self._serve_parking, self._parking_scope)
        self._unobserve = self.job_board.attach(self.engine.observe)
        self._board_metrics = BoardCollector(self.boards)
        metrics = self.engine.metrics
        metrics.add_state(self._board_metrics)

        async def run() -> None:
            with scope:
                async with trio.open_nursery() as nursery:
                    if metrics.multiprocess_dir is not None:
                        nursery.start_soon(_publish_metrics, metrics)
                    await self.boards.run()

        self.app.nursery.start_soon(run)

    async def _serve_parking(
        self, scope: trio.CancelScope, *, task_status: trio.TaskStatus[None]
    ) -> None:
        with scope:
            await self.parking.run(task_status=task_status)

    async def _stop_boards(self) -> None:
        self._boards_scope.cancel()
        self._parking_scope.cancel()
        self._unobserve()
        self.engine.metrics.remove_state(self._board_metrics)

    async def _metrics(self) -> Response:
        metrics = self.engine.metrics
        if metrics.multiprocess_dir is None:
            body = metrics.exposition()
        else:  # the whole node's: this process's state first, then every process's files
            metrics.publish()
            body = await trio.to_thread.run_sync(metrics.node_exposition)
        return Response(body, content_type=METRICS_CONTENT_TYPE)

    def set_routes(self, routes: Iterable[Route]) -> None:
        """Serve ``routes`` from the next request on (a reload's swap), in one step."""
        routes = tuple(routes)
        for route in routes:
            self.engine.registry.get_chain(route.chain)  # fails now, with the known names
        rules = [Rule(r.rule, endpoint=r.name, methods=[r.method]) for r in routes]
        self._matcher: MapAdapter = Map(rules, strict_slashes=False).bind("localhost")
        # A path without parameters is its own answer: the map is asked only for the rest
        # (its static rules win over parameterised ones, so the answer is the same).
        self._static = {(r.method, r.rule): r.name for r in routes if "<" not in r.rule}
        self._by_name = {route.name: route for route in routes}
        self.routes = routes
        app = getattr(self, "app", None)
        if app is not None:  # Quart's own cap stays above every route's limit
            app.config["MAX_CONTENT_LENGTH"] = self._largest_body()

    def set_boards(self, specs: Iterable[BoardSpec]) -> dict[str, list[str]]:
        """Serve the boards ``specs`` declare from now on (a reload's swap), in one step;
        the job board stays. See :meth:`Boards.reconfigure` for what followers see."""
        job_board = self.boards.specs[JOB_BOARD]
        return self.boards.reconfigure([*specs, job_board])

    def _largest_body(self) -> int:
        return max([self.config.max_body, *(r.max_body or 0 for r in self.routes)])

    async def _own_options(self) -> Response:
        path = request.path
        allowed = {*self._own_paths.allowed_methods(path), *self._matcher.allowed_methods(path)}
        allowed.discard("OPTIONS")  # as on a route's path: the methods a 405 would list
        return Response("", status=204, headers={"Allow": ", ".join(sorted(allowed))})

    def _match(self, req: Request) -> tuple[Route, Mapping[str, str]] | Response:
        # Raises werkzeug's NotFound / MethodNotAllowed, rendered as problem+json.
        if req.method == "OPTIONS":
            allowed = self._matcher.allowed_methods(req.path)
            if not allowed:
                raise NotFound()
            return Response("", status=204, headers={"Allow": ", ".join(allowed)})
        name = self._static.get((req.method, req.path))
        params: Mapping[str, str] = _NO_PARAMS
        if name is None:
            name, params = self._matcher.match(req.path, method=req.method)
        ctx = incoming()
        if ctx is not None:
            ctx.route = name
        return self._by_name[name], params

    async def _before_request(self) -> None:
        _take_correlation_id()
        self._check_headers()
        _check_target()

    async def _after_request(self, response: Response) -> Response:
        self._count_response(response)
        response.headers["X-Request-ID"] = _correlation_id()
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
        # The counters' children, found once per label pair (a labels() call takes a lock).
        counter = self._counters.get((route, status // 100))
        if counter is None:
            counter = self._counter(req, route, status)
        counter.inc()
        if self.config.access_log and _access_log.isEnabledFor(logging.INFO):
            started = None if ctx is None else ctx.started
            duration = None if started is None else round(time.perf_counter() - started, 6)
            _access_log.info(
                "%s %s %d %.3fs request_id=%s",
                req.method,
                req.path,
                status,
                duration or 0.0,
                _correlation_id(),
                extra={
                    "event": "request",
                    "method": req.method,
                    "path": req.path,
                    "status": status,
                    "duration": duration,
                    "correlation_id": _correlation_id(),
                    "route": route or None,
                },
            )

    def _counter(self, req: Request, route: str, status: int) -> Any:
        metrics = self.engine.metrics
        if route:
            counter = metrics.route_responses.labels(route, f"{status // 100}xx")
            self._counters[(route, status // 100)] = counter
            return counter
        rule = req.url_rule
        if rule is None or rule.endpoint in ("routes", "routes_root"):
            endpoint = "unmatched"  # no route for this method and path (404, 405)
        else:
            endpoint = _ENDPOINTS.get(rule.endpoint, rule.endpoint)
        # Keyed by route only: the endpoint of a request without one depends on its rule.
        return metrics.http_responses.labels(endpoint, f"{status // 100}xx")

    def _check_headers(self) -> None:
        # hypercorn bounds only headers that arrive in pieces; this bounds them all.
        ctx = incoming()
        size = 0 if ctx is None else ctx.header_bytes
        if size > self.config.max_header_bytes:
            raise Problem(
                431,
                "Request Header Fields Too Large",
                f"the request's headers take {size} bytes, over the limit of "
                f"{self.config.max_header_bytes}",
                slug="headers-too-large",
            )

    async def _readyz(self) -> Response:
        if self.parking.draining:
            raise shutting_down()
        limit = self.config.readiness_timeout
        try:
            await self.engine.probe(limit)
        except Overloaded as exc:
            raise problem_for_exception(exc) from None
        except trio.TooSlowError:
            raise Problem(
                503,
                "Not ready",
                f"the canary job did not get through the queue and a worker in {limit:g}s",
                slug="not-ready",
                headers={"Retry-After": "1"},
            ) from None
        return _json({"status": "ready"})

    # -- errors --------------------------------------------------------------------------

    async def _on_problem(self, problem: Problem) -> Response:
        _, path = _method_and_path()
        return render_problem(problem, correlation_id=_correlation_id(), instance=path)

    async def _on_http_error(self, exc: HTTPException) -> Response:
        problem = problem_for_http(exc)
        method, path = _method_and_path()
        # werkzeug's descriptions are written for people at a browser
        if exc.code == 404:
            problem.detail = f"no route for {method} {path}"
        elif exc.code == 405:
            problem.detail = f"{method} is not allowed on {path}; see Allow"
        return await self._on_problem(problem)

    async def _on_error(self, exc: Exception) -> Response:
        method, path = _method_and_path()
        if isinstance(exc, PipeworkError):
            if isinstance(exc, Overloaded):  # its numbers are for the operator, not the client
                _log.warning(
                    "refused %s %s (correlation id %s): %s",
                    method,
                    path,
                    _correlation_id(),
                    exc,
                )
            return await self._on_problem(problem_for_exception(exc))
        # A bug in the container or a hook, not a job's failure: log all of it, show none.
        _log.error(
            "unhandled error on %s %s (correlation id %s)",
            method,
            path,
            _correlation_id(),
            exc_info=exc,
        )
        detail = "the server failed; its log has the details under this correlation id"
        return await self._on_problem(Problem(500, "Internal Server Error", detail))


# RFC 9110: a header name is a token; a value holds no control character but HTAB.
_HEADER_NAME: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_HEADER_VALUE: Final = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*\Z")
# The raw request target: visible ASCII (anything else must be percent-encoded).
_TARGET: Final = re.compile(rb"[\x21-\x7e]*\Z")


class _RequestGuard:
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
    correlation_id = new_correlation_id()
    problem = Problem(status, title, detail, slug=slug)
    body = dumps_json(problem.document(correlation_id=correlation_id, instance="/")).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        (b"x-request-id", correlation_id.encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


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


#: With several processes, how often each writes its state families for the others' scrapes.
_PUBLISH_EVERY: Final = 1.0


async def _publish_metrics(metrics: Metrics) -> None:
    while True:
        metrics.publish()
        await trio.sleep(_PUBLISH_EVERY)


async def _healthz() -> Response:
    return _json({"status": "ok"})


def _json(value: Any, status: int = 200) -> Response:
    return Response(dumps_json(value), status=status, content_type=JSON)


def _method_and_path() -> tuple[str, str]:
    """What is being answered; a websocket handshake (a board follow refused before it is
    accepted) has no ``request``, and its refusal is an HTTP answer all the same."""
    if has_websocket_context():
        return "GET", websocket.path
    return request.method, request.path


def _correlation_id() -> str:
    ctx = current_g()
    value = ctx.get("correlation_id")
    if value is None:
        value = ctx.correlation_id = new_correlation_id()
    return str(value)


def _take_correlation_id() -> None:
    ctx = current_g()
    started = time.perf_counter()
    headers, size = read_headers(current_request().scope["headers"])
    ctx.pipework = record = Incoming(started, headers, size)
    # W3C trace context: passed on to the backends as sent, when well-formed.
    trace = headers.get("traceparent")
    if trace is not None:
        trace = trace.strip().lower()
        if _TRACEPARENT.match(trace) and not _ZERO_IDS.search(trace):
            record.traceparent = trace
    given = headers.get("x-request-id")
    ctx.correlation_id = (
        given if given is not None and _REQUEST_ID.match(given) else new_correlation_id()
    )


def create_app(
    engine: Engine, routes: Iterable[Route] | None = None, config: ContainerConfig | None = None
) -> QuartTrio:
    """The QuartTrio app for ``engine`` (serve it with any ASGI server on trio)."""
    return Container(engine, routes, config).app
