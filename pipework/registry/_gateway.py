"""A gateway built from a config file: pool, backends, engine and container, reloadable.

``Gateway(path).run(...)`` is what ``pipework serve FILE`` runs. A reload (``POST
/admin/reload`` or SIGHUP) reads and checks the file again first: a bad file changes
nothing and the caller gets every problem. A good one is built completely — its backends
opened, its pipes and chains registered — and only then swapped in, in one step with no
await: the engine's plan (new jobs run the new chains, accepted jobs keep theirs), the
routes, the pool's weights and the push boards (followers of an unchanged board stay
connected; see :meth:`Container.set_boards`). A replaced plan's backends (its httpx
clients and their connections) stay open while jobs accepted on it still run, and are
closed once the last of them ends (:meth:`Engine.wait_plan_retired`); whatever is left
closes at shutdown.
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any

import trio

from .. import _tracing
from .._errors import ConfigError, ConfigProblem
from .._http._ratelimit import RateLimits
from .._metrics import Metrics
from .._tls import TlsFileError
from ..backends._http import Backends
from ..container._app import Container, ContainerConfig
from ..container._collector import refreeze
from ..container._server import BoundAddress
from ..container._tls import CertificateSwitch, ServerTls, server_context
from ..dispatcher._engine import Engine
from ..dispatcher._weighted import WeightedPool
from ..proxy import ProxySet, ProxyTable, Upstream
from ._config import GatewayConfig, build_registry, load_config
from ._config_pipes import HttpPipeConfig

__all__ = ["Gateway"]

_log = logging.getLogger("pipework.gateway")


def _container_config(config: GatewayConfig) -> ContainerConfig:
    s = config.server
    return ContainerConfig(
        max_body=s.max_body,
        max_header_bytes=s.max_header_bytes,
        body_time_limit=s.body_time_limit,
        default_timeout=s.default_timeout,
        shutdown_grace=s.shutdown_grace,
        public_url=s.public_url,
        admin_token=s.admin_token_value(os.environ),
        callback_secret=s.callback_secret_value(os.environ),
        trusted_proxies=tuple(str(network) for network in s.trusted_proxies),
        gc_threshold=s.gc_threshold or None,
        gc_freeze=s.gc_freeze,
        http1_server=s.http1_server,
        access_log_redact=s.access_log_redact,
        cors=config.edge.server_cors,
        jobs_auth=config.edge.jobs_auth,
    )


def _proxies(config: GatewayConfig, backends: Backends) -> ProxySet:
    """The file's proxy routes and their services, streaming through the lean clients of
    ``backends`` (open)."""
    routes = [p.route for p in config.proxies.values()]
    names = {r.name for r in routes}
    return ProxySet(
        ProxyTable(routes),
        {r.service: _upstream(backends, r.service) for r in routes},
        auth={n: a for n, a in config.edge.auth.items() if n in names},
        cors={n: p for n, p in config.edge.cors.items() if n in names},
    )


def _upstream(backends: Backends, name: str) -> Upstream:
    service = backends.services[name]
    return Upstream(
        name,
        backends.lean(name),
        service.url.netloc,
        service.timeout,
        service.connect_timeout,
        service.request_id_header,
    )


class _ServiceRefusals:
    """The engine's :class:`~pipework.dispatcher.Refusals` for a gateway: a key refuses calls
    when every service its HTTP pipes call does (a breaker open, every host drained), read
    from the plan in force. A key shared with a service that still answers never refuses:
    a pipe is degraded only when its call could not be made."""

    def __init__(self) -> None:
        self.backends: Backends | None = None
        self.services: dict[str, frozenset[str]] = {}

    def follow(self, config: GatewayConfig, backends: Backends) -> None:
        """The plan in force: its backends and which services each key calls."""
        services: dict[str, set[str]] = {}
        for pipe in config.pipes.values():
            if isinstance(pipe, HttpPipeConfig):
                services.setdefault(pipe.key, set()).add(pipe.call.service)
        self.services = {key: frozenset(names) for key, names in services.items()}
        self.backends = backends

    def refusing(self, key: str) -> bool:
        backends, services = self.backends, self.services.get(key)
        if backends is None or not services:
            return False
        return all(backends.refusing(name) for name in services)


def _rate_limits(
    config: GatewayConfig,
    metrics: Metrics,
    old: RateLimits | None,
    old_config: GatewayConfig | None,
) -> RateLimits | None:
    """The plan's rate limits (None: it declares none), with the state of ``old``'s limits
    that stay the same, and ``old``'s store when the file still names the same one."""
    settings = config.rate_limits
    if not settings.limits:
        return None
    same = (
        old is not None and old_config is not None and settings.same_store(old_config.rate_limits)
    )
    store = old.store if old is not None and same else settings.build_store(os.environ)
    limits = RateLimits.build(
        settings.limits.values(),
        config.limited_routes,
        store=store,
        metrics=metrics,
        trusted=config.server.trusted_proxies,
        fail_open=settings.fail_open,
    )
    kept = limits.adopt(old)
    if old is not None:
        _log.info("rate limits: kept the state of %s", ", ".join(kept) or "none")
    return limits


async def _stop_tracing(tracing: _tracing.Tracing, previous: _tracing.Tracing) -> None:
    """The spans still batched exported (the SDK's thread, with its own timeout), and the
    process's tracing as it was."""
    _tracing.install(previous)
    with trio.CancelScope(shield=True):  # cleanup: the last spans are the shutdown's
        await trio.to_thread.run_sync(tracing.shutdown)


class Gateway:
    """Serves the gateway the file at ``path`` declares, until ``stop`` is set."""

    def __init__(self, path: str, *, overrides: Mapping[str, Any] | None = None) -> None:
        self.path = path
        #: Container settings that win over the file's (the command line's).
        self.overrides = dict(overrides or {})
        # ConfigError before anything starts, unset variables the file names included.
        self.config = load_config(path, environ=os.environ)
        self.engine: Engine | None = None
        self.container: Container | None = None
        self._pool: WeightedPool | None = None
        self._stack: AsyncExitStack | None = None
        self._retiring: trio.Nursery | None = None
        self._backends: Backends | None = None  # the current plan's
        self._refusals = _ServiceRefusals()
        self._rate_limits: RateLimits | None = None
        self._lock = trio.Lock()
        #: The server's certificates, swapped by a reload (None: plain HTTP).
        self.tls: CertificateSwitch | None = None

    async def run(
        self,
        *,
        host: str | None = None,
        port: int | None = None,
        fd: int | None = None,
        stop: trio.Event,
        task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        config = self.config
        for warning in config.warnings:
            _log.warning("%s", warning.format(config.source))
        pool = self._pool = WeightedPool.from_config(config.pool_config())
        tls = config.server.tls
        self.tls = None if tls is None else CertificateSwitch(tls)
        async with AsyncExitStack() as stack:
            self._stack = stack
            # Before the container is built: its ASGI layer is chosen with it. Off, the
            # process's tracing is left as it is (none, unless the program set its own).
            if config.tracing.is_on(os.environ):
                tracing = config.tracing.build(os.environ)
                previous = _tracing.install(tracing)
                stack.push_async_callback(_stop_tracing, tracing, previous)
            backends = self._backends = await stack.enter_async_context(config.backends())
            store, queue = config.store.build(queue_capacity=config.pool.queue_capacity)
            engine = self.engine = Engine(
                pool=pool,
                registry=build_registry(config, backends),
                store=store,
                queue=queue,
                queue_capacity=config.pool.queue_capacity,
                default_timeout=config.server.default_timeout,
                # Histogram buckets at the file's timeouts (a reload keeps these buckets).
                metrics=Metrics(timeouts=config.timeouts()),
                refusals=self._refusals,
            )
            self._refusals.follow(config, backends)
            backends.metrics = engine.metrics
            limits = self._rate_limits = _rate_limits(config, engine.metrics, None, None)
            stack.push_async_callback(self._close_limit_store)
            async with engine, trio.open_nursery() as retiring:
                self._retiring = retiring
                await retiring.start(backends.check_health)
                container = self.container = Container(
                    engine,
                    config=replace(_container_config(config), **self.overrides),
                    reload=self.reload,
                    boards=[b.spec(os.environ) for b in config.boards.values()],
                    backplane=config.backplane.build(os.environ),
                    proxies=_proxies(config, backends),
                    upstreams=backends,
                    rate_limits=limits,
                )
                await container.serve(
                    host=host or config.server.host,
                    port=config.server.port if port is None else port,
                    fd=fd,
                    shutdown_trigger=stop,
                    ssl_context=None if self.tls is None else self.tls.context,
                    task_status=task_status,
                )
                retiring.cancel_scope.cancel()  # the stack closes what is still open

    async def _close_limit_store(self) -> None:
        if self._rate_limits is not None:
            await self._rate_limits.store.aclose()

    @staticmethod
    async def _retire(
        engine: Engine,
        generation: int,
        backends: Backends | None,
        container: Container,
        proxies: ProxySet,
    ) -> None:
        """Close plan ``generation``'s backends once its last job and its last proxied
        exchange have ended."""
        await engine.wait_plan_retired(generation)
        await container.proxy_layer.wait_released(proxies)
        if backends is not None:
            await backends.__aexit__(None, None, None)  # the stack's own exit is then a no-op
            _log.info("closed the backends of plan %d", generation)
        refreeze()  # the old plan is garbage now: frozen, it would never be collected

    def _certificates(self, config: GatewayConfig) -> tuple[ServerTls, ssl.SSLContext] | None:
        """The server's TLS files of ``config``, read again into a context for the swap;
        None when nothing can change without a restart (logged). A file that cannot be
        used refuses the reload (ConfigError), as ``check`` would."""
        switch, tls = self.tls, config.server.tls
        if switch is None or tls is None:
            if (switch is None) != (tls is None):
                _log.warning("reload: [server] TLS is turned on or off only at a restart")
            return None
        problem = switch.restart_needed(tls)
        if problem is not None:
            _log.warning("reload: [server] %s; the certificates stay as they were", problem)
            return None
        try:
            context = server_context(tls)
        except TlsFileError as exc:
            raise ConfigError(
                [ConfigProblem(f"server.{exc.key}", exc.message)], config.source
            ) from None
        return tls, context

    async def reload(self) -> dict[str, Any]:
        """Check the file again and swap it in; raises ConfigError (changing nothing)."""
        engine, container, pool, stack = self.engine, self.container, self._pool, self._stack
        retiring = self._retiring
        if engine is None or container is None or pool is None or stack is None or not retiring:
            raise RuntimeError("the gateway is not serving yet")
        async with self._lock:  # one reload at a time: each builds on the plan in force
            config = await trio.to_thread.run_sync(
                functools.partial(load_config, self.path, environ=os.environ)
            )
            pool_config = config.pool_config()  # validated before anything changes
            certificates = self._certificates(config)  # read before anything changes
            backends = await stack.enter_async_context(config.backends())
            backends.metrics = engine.metrics
            registry = build_registry(config, backends)
            boards = [b.spec(os.environ) for b in config.boards.values()]
            proxies = _proxies(config, backends)
            old_limits = self._rate_limits
            limits = _rate_limits(config, engine.metrics, old_limits, self.config)
            # The swap: no await from here on, so no request sees half of it.
            generation = engine.swap_registry(registry)
            if certificates is not None and self.tls is not None:
                self.tls.use(*certificates)  # new connections only: open ones keep theirs
            # Hosts that stay keep their health, ejections and breaker; the checks go on.
            backends.adopt(self._backends)
            container.set_upstreams(backends)  # drains now reach the cores via the new plan
            self._refusals.follow(config, backends)
            retiring.start_soon(backends.check_health)
            replaced = container.proxy_layer.proxies
            container.set_routes(registry.routes.values())
            container.set_proxies(proxies)
            container.middleware.cors = config.edge.server_cors
            container.downloads.auth = config.edge.jobs_auth
            live_limits = container.admin.live_limits if container.admin is not None else None
            limits_dropped = live_limits.rebase(limits) if live_limits is not None else []
            container.set_rate_limits(limits)
            self._rate_limits = limits
            if old_limits is not None and (limits is None or limits.store is not old_limits.store):
                retiring.start_soon(old_limits.store.aclose)
            board_changes = container.set_boards(boards)
            # Weights set live stand unless the file changed them (LiveWeights says how).
            live = container.admin.live if container.admin is not None else None
            kept, dropped = live.rebase(pool_config) if live is not None else (pool_config, [])
            weights = pool.reconfigure(kept)
            if config.backplane != self.config.backplane:
                # Followers hold this backplane's positions: it changes with a restart only.
                _log.warning("reload: [boards] backplane settings change only at a restart")
            if config.tracing != self.config.tracing:
                _log.warning("reload: [tracing] settings change only at a restart")
            self.config = config
            retiring.start_soon(
                self._retire, engine, generation - 1, self._backends, container, replaced
            )
            self._backends = backends
        for warning in config.warnings:
            _log.warning("%s", warning.format(config.source))
        for sentence in dropped:
            _log.warning("reload: live weight %s", sentence)
        for sentence in limits_dropped:
            _log.warning("reload: live rate limit %s", sentence)
        for change, names in board_changes.items():
            if names:
                _log.info("reload: boards %s: %s", change, ", ".join(names))
        _log.info("reloaded %s: plan %d, pool config %d", self.path, generation, weights)
        overrides = live.overrides() if live is not None else {}
        return {
            **config.summary(),
            "plan_generation": generation,
            "config_generation": weights,
            "overrides": overrides,
            "overrides_dropped": dropped,
            "rate_limit_overrides_dropped": limits_dropped,
            "boards_changed": board_changes,
        }
