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

This module wires the parts together and owns their lifecycle: the routes' view
(``_modes``), the job, board and admin APIs, what every request passes through
(``_middleware``) and the probes (``_readiness``).
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

import trio
from quart import Request, Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, NotFound
from werkzeug.routing import Map, MapAdapter, Rule

from .. import _tracing
from .._http._auth import RouteAuth
from .._http._cors import CorsPolicy, is_preflight
from .._http._ratelimit import RateLimits
from .._metrics import Metrics
from ..board import Backplane, Boards, BoardSpec
from ..board._api import BoardApi, add_board_rules
from ..board._jobs import JOB_BOARD, JobBoard
from ..board._metrics import BoardCollector
from ..dispatcher._engine import Engine
from ..proxy import ProxyLayer, ProxySet, ProxyTable
from ..proxy._access import DEFAULT_REDACTED
from ..proxy._forwarding import trusted_networks
from ._admin import AdminApi, Reload, admin_token
from ._admin_services import Upstreams
from ._callbacks import CallbackSigner, SecretKeeper
from ._collector import tuned_collector
from ._downloads import DownloadsApi, add_download_rules
from ._idempotency import IdempotencyTable
from ._jobs_api import JobsApi
from ._middleware import CATCH_ALL, CORS_ENDPOINTS, Middleware, preflight_answer
from ._modes import Submissions
from ._parking import Parking
from ._quart import App
from ._readiness import CANARY_CHAIN, Probes, healthz
from ._request import incoming
from ._result_files import FileResults
from ._routes import Route, routes_of
from ._server import HTTP1_SERVERS, BoundAddress, Http1Server, serve

__all__ = ["CANARY_CHAIN", "Container", "ContainerConfig", "create_app"]

_log = logging.getLogger("pipework.container")

# Hypercorn's own grace beyond ours: time for the 503s to reach the clients.
_FLUSH_MARGIN: Final = 1.0
_NO_PARAMS: Final[Mapping[str, str]] = {}


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
      else the one a shared job store keeps, else the one ``serve --workers N`` hands its
      workers, else random per start: see :mod:`._callbacks`); ``public_url``: the base of
      callback URLs as backends reach this server (else the address it listens on).
    - ``expose_errors``: show every pipe exception's message to clients (development).
    - ``admin_token``: the admin API's bearer token (else ``PIPEWORK_ADMIN_TOKEN``; with
      neither, the admin API is off).
    - ``access_log``: one line per request on the ``pipework.access`` logger (the client,
      method, path and query, status, sizes, duration, route, upstream service and host,
      request and trace ids, pid: :mod:`pipework.proxy._access`);
      ``access_log_redact``: the query parameters whose values it hides (``sig``, the
      callback URLs' signature, always).
    - ``gc_threshold``: the garbage collector's young threshold while serving (None, the
      default: the interpreter's, since the process is the embedding program's);
      ``SERVING_GC_THRESHOLD`` is what ``pipework serve`` uses. See :mod:`._collector` for
      why a server holding many connections wants it far above the default.
    - ``gc_freeze``: freeze the heap while serving (``gc.freeze()``), so that collections no
      longer scan what start-up made (False, the default: the process is the embedding
      program's; ``pipework serve`` freezes). A reload freezes again (:mod:`._collector`).
    - ``trusted_proxies``: addresses and networks (``"10.0.0.0/8"``) whose
      ``X-Forwarded-*`` and ``Forwarded`` headers proxy routes pass on, appending to them;
      from any other client those headers are replaced.
    - ``http1_server``: who serves cleartext HTTP/1.1, ``"lean"`` (pipework's own server)
      or ``"hypercorn"``; None: :func:`~._server.serve`'s default (docs/configuration.md).
    - ``cors``: which other origins' pages may call the job, board and jobs-page endpoints
      from a browser (None: none; each route has its own policy).
    - ``jobs_auth``: who calls the download centre's endpoints (``GET /jobs``,
      ``POST /jobs/downloads``, ``GET /jobs/events``): they then list the jobs of the
      caller's identity besides its tickets' (``Identity.owner``, recorded by the
      authenticated async routes), and answer 401 without the credential. None: tickets
      only.
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
    access_log_redact: tuple[str, ...] = DEFAULT_REDACTED
    gc_threshold: int | None = None
    gc_freeze: bool = False
    trusted_proxies: tuple[str, ...] = ()
    cors: CorsPolicy | None = None
    http1_server: Http1Server | None = None
    jobs_auth: RouteAuth | None = None

    def __post_init__(self) -> None:
        for name in ("body_time_limit", "default_timeout", "readiness_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ContainerConfig.{name} must be positive")
        for name in ("max_body", "max_header_bytes", "shutdown_grace", "cancel_wait"):
            if getattr(self, name) < 0:
                raise ValueError(f"ContainerConfig.{name} must not be negative")
        if self.gc_threshold is not None and self.gc_threshold < 1:
            raise ValueError("ContainerConfig.gc_threshold must be positive (or None)")
        trusted_networks(self.trusted_proxies)  # ValueError naming the bad entry
        if self.http1_server is not None and self.http1_server not in HTTP1_SERVERS:
            raise ValueError(
                f"ContainerConfig.http1_server must be one of {', '.join(HTTP1_SERVERS)} "
                f"(or None), not {self.http1_server!r}"
            )


class Container:
    """Serves ``engine``'s routes (default: those registered on its registry), the job
    API, signed callbacks, ``/healthz`` and ``/readyz``. ``app`` is the QuartTrio app.
    ``backplane`` carries the boards' writes (default: this process alone; a
    ``RedisBackplane`` shares them with every process on the same Redis and prefix).
    ``upstreams``: the backend services whose hosts the admin API shows, drains and
    restores (a gateway's ``Backends``; :meth:`set_upstreams` swaps them at a reload)."""

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
        proxies: ProxySet | None = None,
        upstreams: Upstreams | None = None,
        rate_limits: RateLimits | None = None,
    ) -> None:
        self.engine = engine
        self.rate_limits = rate_limits
        self._proxies = proxies or ProxySet(ProxyTable(()))
        self.config = config = config or ContainerConfig()
        self.set_routes(routes_of(engine.registry) if routes is None else routes)
        self.signer = signer or CallbackSigner.from_config(
            config.callback_secret, base_url=config.public_url or ""
        )
        engine.set_callback_factory(self.signer.url)
        self.parking = Parking(engine.metrics.parked)
        self.middleware = Middleware(
            engine.metrics,
            max_header_bytes=config.max_header_bytes,
            access_log=config.access_log,
            trusted=trusted_networks(config.trusted_proxies),
            redact=config.access_log_redact,
            cors=config.cors,
        )
        self.probes = Probes(engine, self.parking, readiness_timeout=config.readiness_timeout)
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
        self.submissions.rate_limits = rate_limits
        self.jobs = JobsApi(
            engine,
            self.signer,
            max_body=config.max_body,
            body_time_limit=config.body_time_limit,
            cancel_wait=config.cancel_wait,
            expose_errors=config.expose_errors,
        )
        self.downloads = DownloadsApi(
            engine,
            self.signer,
            expose_errors=config.expose_errors,
            max_body=config.max_body,
            body_time_limit=config.body_time_limit,
            auth=config.jobs_auth,
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
        # GET /jobs/events follows the identity's jobs as GET /jobs lists them.
        self.board_api.caller = self.downloads.caller
        self.jobs.identities = self.downloads
        self.board_api.owned = self.downloads.owned_views
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
                upstreams=upstreams,
            )
        )
        if self.admin is not None:
            self.admin.rate_limits = rate_limits
        self.app = self._build_app()

    def add_file_results(self, results: FileResults) -> None:
        """List and serve the files ``results`` says its jobs made, in the download centre
        (``GET /jobs``, ``/jobs/{id}/file``, ``/jobs/files.zip``; docs/http-api.md)."""
        self.downloads.providers.append(results)

    # -- serving -------------------------------------------------------------------------

    async def serve(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        fd: int | None = None,
        shutdown_trigger: trio.Event | None = None,
        hypercorn_options: Mapping[str, object] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until ``shutdown_trigger`` is set (then shut down gracefully) or until
        cancelled; ``task_status.started()`` reports the bound address. ``fd``: serve on
        this inherited listening socket instead of binding ``host:port``. ``ssl_context``:
        serve HTTPS with it (:func:`~._server.serve`)."""
        options: dict[str, object] = {
            "h11_max_incomplete_size": self.config.max_header_bytes,
            "h2_max_header_list_size": self.config.max_header_bytes,
            **(hypercorn_options or {}),
        }
        stop = trio.Event()
        store = self.engine.store
        if isinstance(store, SecretKeeper) and await self.signer.share(store):
            # Every process on this store signs alike (not logged: the secret itself).
            _log.info(
                "callback URLs are signed with the secret the job store keeps for every "
                "process sharing it ([server] callback_secret_env chooses one instead)"
            )
        with tuned_collector(self.config.gc_threshold, freeze=self.config.gc_freeze):
            await self._serve(
                host, port, fd, stop, shutdown_trigger, options, ssl_context, task_status
            )

    async def _serve(
        self,
        host: str,
        port: int,
        fd: int | None,
        stop: trio.Event,
        shutdown_trigger: trio.Event | None,
        options: dict[str, object],
        ssl_context: ssl.SSLContext | None,
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
                    ssl_context=ssl_context,
                    http1=self.config.http1_server,
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
        app = App(__name__, static_folder=None)
        # Quart's own cap, above every route's: the routes' limits are checked while reading.
        app.config["MAX_CONTENT_LENGTH"] = self._largest_body()
        # Proxy routes are served in front of Quart, behind the guard the middleware puts
        # in front of everything.
        self.proxy_layer = ProxyLayer(
            app.asgi_app,
            self._proxies,
            pool=self.engine.pool,
            chains=self.engine,
            metrics=self.engine.metrics,
            trusted=trusted_networks(self.config.trusted_proxies),
            access_log=self.config.access_log,
            redact=self.config.access_log_redact,
            rate_limits=self.rate_limits,
        )
        app.asgi_app = self.proxy_layer  # type: ignore[assignment]  # Quart's documented middleware seam
        self.middleware.install(app)
        # In front of everything, when tracing is on: a server span per request.
        app.asgi_app = _tracing.ACTIVE.wrap_asgi(app.asgi_app)  # type: ignore[method-assign]  # Quart's documented middleware seam
        # Routes are matched by our own map, behind one catch-all rule, so that a reload can
        # swap them in one step; the container's own paths are Quart rules and win.
        # OPTIONS is answered from the routes' own map, with the Allow a 405 would have.
        methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
        self.submissions.match = self._match
        for rule, endpoint in zip(("/", "/<path:_rest>"), CATCH_ALL, strict=True):
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
        add_download_rules(app, self.downloads)
        add_board_rules(app, self.board_api)
        app.before_serving(self._start_boards)
        app.after_serving(self._stop_boards)
        app.add_url_rule("/healthz", "healthz", healthz, methods=["GET"])
        app.add_url_rule("/readyz", "readyz", self.probes.readyz, methods=["GET"])
        app.add_url_rule("/metrics", "metrics", self.probes.metrics, methods=["GET"])
        if self.admin is not None:
            admin = self.admin
            app.add_url_rule("/admin/pool", "admin_pool", admin.pool, methods=["GET"])
            app.add_url_rule("/admin/pool/keys/<key>", "admin_key", admin.set_key, methods=["PUT"])
            app.add_url_rule(
                "/admin/pool/keys/<key>", "admin_key_clear", admin.clear_key, methods=["DELETE"]
            )
            app.add_url_rule("/admin/reload", "admin_reload", admin.reload, methods=["POST"])
            app.add_url_rule(
                "/admin/rate_limits", "admin_limits", admin.rate_limits_view, methods=["GET"]
            )
            app.add_url_rule(
                "/admin/rate_limits/<name>", "admin_limit", admin.set_rate_limit, methods=["PUT"]
            )
            app.add_url_rule(
                "/admin/rate_limits/<name>",
                "admin_limit_clear",
                admin.clear_rate_limit,
                methods=["DELETE"],
            )
            app.add_url_rule("/admin/services", "admin_services", admin.services, methods=["GET"])
            app.add_url_rule(
                "/admin/services/<name>", "admin_service", admin.service, methods=["GET"]
            )
            app.add_url_rule(
                "/admin/services/<name>/hosts/<host>/drain",
                "admin_drain",
                admin.drain,
                methods=["POST"],
            )
            app.add_url_rule(
                "/admin/services/<name>/hosts/<host>/restore",
                "admin_restore",
                admin.restore,
                methods=["POST"],
            )
        # OPTIONS on the container's own paths: Quart's automatic answer would list the
        # catch-all's methods too; these are the paths' own (and a route's on the same path).
        own = [
            Rule(r.rule, endpoint=r.endpoint, methods=r.methods)
            for r in app.url_map.iter_rules()
            if r.endpoint not in CATCH_ALL and not r.websocket
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

    def set_proxies(self, proxies: ProxySet) -> None:
        """Swap the proxy routes and their clients in (a reload)."""
        self.proxy_layer.set_proxies(proxies)

    def set_rate_limits(self, limits: RateLimits | None) -> None:
        """The rate limits in force from the next request on (a reload), in one step."""
        self.rate_limits = limits
        self.submissions.rate_limits = limits
        self.proxy_layer.rate_limits = limits
        if self.admin is not None:
            self.admin.rate_limits = limits

    def set_upstreams(self, upstreams: Upstreams | None) -> None:
        """The backend services the admin API drains hosts of, from now on (a reload)."""
        if self.admin is not None:
            self.admin.upstreams = upstreams

    def set_boards(self, specs: Iterable[BoardSpec]) -> dict[str, list[str]]:
        """Serve the boards ``specs`` declare from now on (a reload's swap), in one step;
        the job board stays. See :meth:`Boards.reconfigure` for what followers see."""
        job_board = self.boards.specs[JOB_BOARD]
        return self.boards.reconfigure([*specs, job_board])

    def _largest_body(self) -> int:
        return max([self.config.max_body, *(r.max_body or 0 for r in self.routes)])

    def _match(self, req: Request) -> tuple[Route, Mapping[str, str]] | Response:
        # Raises werkzeug's NotFound / MethodNotAllowed, rendered as problem+json.
        if req.method == "OPTIONS":
            allowed = self._matcher.allowed_methods(req.path)
            if not allowed:
                raise NotFound()
            ctx = incoming()
            if ctx is not None and is_preflight("OPTIONS", ctx.headers):
                return self._route_preflight(req.path, ctx.headers)
            return Response("", status=204, headers={"Allow": ", ".join(allowed)})
        name = self._static.get((req.method, req.path))
        params: Mapping[str, str] = _NO_PARAMS
        if name is None:
            name, params = self._matcher.match(req.path, method=req.method)
        route = self._by_name[name]
        ctx = incoming()
        if ctx is not None:
            ctx.route = name
            ctx.cors = route.cors
        tracing = _tracing.ACTIVE
        if tracing.on:  # the request's server span, named by its route
            tracing.rename(f"{req.method} {route.rule}")
            tracing.annotate("http.route", route.rule)
            tracing.annotate("pipework.route", name)
        return route, params

    def _route_preflight(self, path: str, headers: Mapping[str, str]) -> Response:
        """A CORS preflight on a route's path, answered by the policy of the route it asks
        about; no job, no authentication (a preflight carries no credentials)."""
        method = headers["access-control-request-method"].strip()
        try:
            name, _ = self._matcher.match(path, method=method)
        except HTTPException:
            name = None
        cors = None if name is None else self._by_name[name].cors
        if name is not None:
            ctx = incoming()
            if ctx is not None:
                ctx.route = name
        return preflight_answer(cors, headers)

    async def _own_options(self) -> Response:
        path = request.path
        ctx = incoming()
        cors = self.middleware.cors  # the file's, as of the last reload
        if ctx is not None and is_preflight("OPTIONS", ctx.headers):
            method = ctx.headers["access-control-request-method"].strip()
            try:
                endpoint, _ = self._own_paths.match(path, method=method)
            except HTTPException:
                endpoint = None
            return preflight_answer(cors if endpoint in CORS_ENDPOINTS else None, ctx.headers)
        allowed = {*self._own_paths.allowed_methods(path), *self._matcher.allowed_methods(path)}
        allowed.discard("OPTIONS")  # as on a route's path: the methods a 405 would list
        return Response("", status=204, headers={"Allow": ", ".join(sorted(allowed))})


#: With several processes, how often each writes its state families for the others' scrapes.
_PUBLISH_EVERY: Final = 1.0


async def _publish_metrics(metrics: Metrics) -> None:
    while True:
        metrics.publish()
        await trio.sleep(_PUBLISH_EVERY)


def create_app(
    engine: Engine, routes: Iterable[Route] | None = None, config: ContainerConfig | None = None
) -> QuartTrio:
    """The QuartTrio app for ``engine`` (serve it with any ASGI server on trio)."""
    return Container(engine, routes, config).app
