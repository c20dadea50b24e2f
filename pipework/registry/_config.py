"""The gateway configuration file: TOML in, a checked :class:`GatewayConfig` out.

::

    config = load_config("gateway.toml")          # ConfigError listing every problem
    backends = config.backends()                   # one HTTP client per service, once open
    registry = build_registry(config, backends)    # pipes, one chain per route, routes
    pool = WeightedPool.from_config(config.pool_config())

Loading checks everything a server would trip over later -- types, unknown keys, unknown
services and pipes, graph cycles, reserves above ``max_workers``, Python import paths --
and reports all of it at once, each problem with its key path and line. See
docs/configuration.md for the schema.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final

import httpx

from ..backends._http import Backends
from ..backends._http_spec import Service
from ..dispatcher._weighted_config import PoolConfig, PoolConfigError
from ..pipes._pipe import REQUEST_KEY, Pipe
from ._config_boards import BackplaneSettings, BoardConfig, read_boards
from ._config_edge import EdgeConfig, read_edge
from ._config_env import check_environment
from ._config_limits import LimitSettings, read_limit_names, read_rate_limits
from ._config_lines import scan_lines
from ._config_pipes import (
    HttpPipeConfig,
    PipeConfig,
    PythonPipeConfig,
    build_order,
    read_pipes,
)
from ._config_problems import Collector, ConfigError, KeyPath, Problem, describe_value
from ._config_proxy import ProxyConfig, read_proxies
from ._config_read import Table, report_unknown
from ._config_routes import RouteConfig, is_proxy, read_routes
from ._config_sections import PoolSettings, ServerConfig, read_pool, read_server, read_services
from ._config_store import StoreSettings, read_store
from ._config_tracing import TracingSettings, read_tracing
from ._registry import Registry

__all__ = [
    "BoardConfig",
    "ConfigError",
    "GatewayConfig",
    "HttpPipeConfig",
    "PipeConfig",
    "PoolSettings",
    "Problem",
    "ProxyConfig",
    "PythonPipeConfig",
    "RouteConfig",
    "ServerConfig",
    "StoreSettings",
    "TracingSettings",
    "build_registry",
    "config_from_dict",
    "load_config",
    "loads_config",
]

SECTIONS: Final = (
    "server",
    "pool",
    "store",
    "services",
    "pipes",
    "routes",
    "boards",
    "auth",
    "cors",
    "rate_limits",
    "tracing",
)
_TOML_POSITION: Final = re.compile(r"\s*\(at line (\d+), column (\d+)\)$")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """A checked gateway configuration. ``warnings`` holds what is legal but suspicious
    (a pipe no route uses, a token written in the file)."""

    source: str
    server: ServerConfig
    pool: PoolSettings
    services: Mapping[str, Service]
    pipes: Mapping[str, PipeConfig]
    routes: Mapping[str, RouteConfig]
    warnings: tuple[Problem, ...] = ()
    boards: Mapping[str, BoardConfig] = field(default_factory=lambda: MappingProxyType({}))
    store: StoreSettings = field(default_factory=StoreSettings)
    #: ``[boards]``' own keys: what carries the boards' writes between processes.
    backplane: BackplaneSettings = field(default_factory=BackplaneSettings)
    #: The proxy routes (``[routes.NAME]`` with ``proxy``), in the file's order.
    proxies: Mapping[str, ProxyConfig] = field(default_factory=lambda: MappingProxyType({}))
    #: Who may call each route and from which origins (``[auth]``, ``[cors]``).
    edge: EdgeConfig = field(default_factory=EdgeConfig)
    #: ``[rate_limits]``: the limits and their store.
    rate_limits: LimitSettings = field(default_factory=LimitSettings)
    #: The limits each route meets, by route name: its own, then its services' (a proxy
    #: route's service; the services a chain route's HTTP pipes call).
    limited_routes: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    #: ``[tracing]``: OpenTelemetry spans, read at start-up (docs/tracing.md).
    tracing: TracingSettings = field(default_factory=TracingSettings)

    def pool_config(self) -> PoolConfig:
        """The weighted pool's configuration: ``WeightedPool.from_config(...)``."""
        return self.pool.pool_config()

    def timeouts(self) -> tuple[float, ...]:
        """Every time limit the file sets (services', pipes', routes', the server's
        default): the metrics' histograms get a bucket at each (see ``Metrics``)."""
        found = {self.server.default_timeout}
        found.update(service.timeout for service in self.services.values())
        found.update(p.timeout for p in self.pipes.values() if p.timeout is not None)
        found.update(r.route.timeout for r in self.routes.values() if r.route.timeout is not None)
        found.update(p.route.timeout for p in self.proxies.values() if p.route.timeout is not None)
        return tuple(sorted(found))

    def backends(self, *, transport: httpx.AsyncBaseTransport | None = None) -> Backends:
        """The (not yet open) HTTP clients of every service: ``async with`` it.
        ``transport`` replaces the network for all of them (see :class:`Backends`)."""
        return Backends(self.services, transport=transport)

    def summary(self) -> dict[str, Any]:
        """What the file declares, in a few numbers (for logs, ``check`` and reloads)."""
        return {
            "source": self.source,
            "services": len(self.services),
            "pipes": len(self.pipes),
            "routes": len(self.routes),
            "proxy_routes": len(self.proxies),
            "boards": len(self.boards),
            "rate_limits": len(self.rate_limits.limits),
            "max_workers": self.pool.max_workers,
            "reserved": sum(w.reserve for w in self.pool.keys.values()),
            "warnings": [str(w) for w in self.warnings],
        }


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> GatewayConfig:
    """Read and check the gateway file at ``path``; raises :class:`ConfigError`. With
    ``environ``, the variables the file names are checked in it too
    (:mod:`._config_env`)."""
    source = os.fspath(path)
    try:
        with open(path, "rb") as file:
            text = file.read().decode("utf-8")
    except OSError as exc:
        problem = Problem("", f"cannot read the file: {exc.strerror or exc}")
        raise ConfigError([problem], source) from None
    except UnicodeDecodeError as exc:
        problem = Problem("", f"the file is not UTF-8 text: {exc.reason}")
        raise ConfigError([problem], source) from None
    return loads_config(text, source=source, environ=environ)


def loads_config(
    text: str, *, source: str = "<string>", environ: Mapping[str, str] | None = None
) -> GatewayConfig:
    """Check the gateway configuration in ``text``; raises :class:`ConfigError`."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([_syntax_problem(str(exc), text)], source) from None
    return config_from_dict(data, source=source, lines=scan_lines(text), environ=environ)


def _syntax_problem(message: str, text: str) -> Problem:
    found = _TOML_POSITION.search(message)
    if found is not None:
        line, column = int(found.group(1)), int(found.group(2))
        return Problem("", f"invalid TOML: {message[: found.start()]} (column {column})", line)
    if message.endswith("(at end of document)"):
        what = message.removesuffix("(at end of document)").strip()
        return Problem(
            "", f"invalid TOML: {what} at the end of the file", text.rstrip().count("\n") + 1
        )
    return Problem("", f"invalid TOML: {message}")


def config_from_dict(
    data: Mapping[str, Any],
    *,
    source: str = "<dict>",
    lines: Mapping[KeyPath, int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """Check a configuration already parsed from TOML (``lines`` maps key paths to line
    numbers, for the messages; ``environ``: check the variables it names there too);
    raises :class:`ConfigError`."""
    c = Collector(lines)
    if not isinstance(data, Mapping):
        c.error((), f"expected a table, got {describe_value(data)}")
        raise ConfigError(c.problems(), source)
    for key in data:
        if key not in SECTIONS:
            report_unknown(c, (key,), key, SECTIONS)
    server = read_server(c, data.get("server"))
    settings, pool_keys = read_pool(c, data.get("pool"))
    store = read_store(c, data.get("store"))
    tracing = read_tracing(c, data.get("tracing"))
    services, service_weights = read_services(c, data.get("services"), settings)
    declared_services = _names(data.get("services"))
    for key in list(pool_keys):
        if key in declared_services:
            c.error(
                ("pool", "keys", key),
                f"{key!r} is a service: set its weights in [services.{key}]",
            )
            del pool_keys[key]
    settings = replace(settings, keys={**service_weights, **pool_keys})
    _check_reserves(c, settings)
    if not c.failed(("pool",)) and not c.failed(("services",)):
        try:
            settings.pool_config()
        except PoolConfigError as exc:
            c.error(("pool", "max_workers"), str(exc))
    pipes = read_pipes(c, data.get("pipes"), declared_services)
    declared_pipes = _names(data.get("pipes"))
    routes, used = read_routes(c, data.get("routes"), declared_pipes)
    proxies, proxy_used = read_proxies(
        c, data.get("routes"), declared_pipes, declared_services, routes
    )
    used |= proxy_used
    # A pipe named as a used pipe's fallback is used too.
    used |= {p.fallback for n, p in pipes.items() if n in used and isinstance(p.fallback, str)}
    _check_request_use(c, pipes, routes, proxies)
    boards, backplane = read_boards(c, data.get("boards"))
    edge = read_edge(c, data, source)
    routes = {name: _with_edge(rc, edge) for name, rc in routes.items()}
    rate_limits = read_rate_limits(c, data.get("rate_limits"))
    limited = _limited_routes(c, data, rate_limits, pipes, routes, proxies)
    if environ is not None:
        check_environment(
            c, environ, server=server, store=store, backplane=backplane, boards=boards
        )
    _warn_unused(c, data, declared_services, declared_pipes, used)
    config = GatewayConfig(
        source,
        server,
        settings,
        MappingProxyType(services),
        MappingProxyType(dict(pipes)),
        MappingProxyType(routes),
        boards=MappingProxyType(boards),
        store=store,
        backplane=backplane,
        proxies=MappingProxyType(proxies),
        edge=edge,
        rate_limits=rate_limits,
        limited_routes=MappingProxyType(limited),
        tracing=tracing,
    )
    if not c.has_errors:
        try:
            build_registry(config, config.backends())  # whatever slipped through, now
        except (PoolConfigError, ValueError) as exc:
            c.error((), str(exc))
    if c.has_errors:
        raise ConfigError(c.problems(), source)
    return replace(config, warnings=c.problems())


def _with_edge(rc: RouteConfig, edge: EdgeConfig) -> RouteConfig:
    """The route with its authentication and CORS policy on it (what the container reads)."""
    auth, cors = edge.auth.get(rc.route.name), edge.cors.get(rc.route.name)
    if auth is None and cors is None:
        return rc
    # The pool key goes on with the auth it needs (read_routes checked the route has one).
    pool_key = rc.pool_key if auth is not None else None
    return replace(rc, route=replace(rc.route, auth=auth, cors=cors, pool_key=pool_key))


def _limited_routes(
    c: Collector,
    data: Mapping[str, Any],
    settings: LimitSettings,
    pipes: Mapping[str, PipeConfig],
    routes: Mapping[str, RouteConfig],
    proxies: Mapping[str, ProxyConfig],
) -> dict[str, tuple[str, ...]]:
    """Read every route's and service's ``rate_limits`` and resolve them, by route: its own
    limits, then those of the services it reaches. A limit nobody names is a warning."""
    section = data.get("rate_limits")
    declared = (
        [k for k, v in section.items() if isinstance(v, dict)] if isinstance(section, dict) else []
    )
    known = settings.limits
    named: dict[tuple[str, str], tuple[str, ...]] = {}
    for section in ("routes", "services"):
        tables = data.get(section)
        for name, spec in tables.items() if isinstance(tables, dict) else ():
            if isinstance(spec, dict) and "rate_limits" in spec:
                t = Table(c, (section, name), spec)
                named[(section, name)] = read_limit_names(c, t, known, declared)
    limited: dict[str, tuple[str, ...]] = {}
    for name, rc in routes.items():
        run = [*rc.pipes, *_fallbacks(pipes, rc.pipes)]
        services = [p.call.service for n in run if isinstance(p := pipes.get(n), HttpPipeConfig)]
        limited[name] = _limits_of(named, name, services)
    for name, pc in proxies.items():
        limited[name] = _limits_of(named, name, [pc.route.service])
    used = {limit for names in named.values() for limit in names}
    for name in known:
        if name not in used:
            c.warn(("rate_limits", name), "no route or service names this limit")
    return {route: names for route, names in limited.items() if names}


def _limits_of(
    named: Mapping[tuple[str, str], tuple[str, ...]], route: str, services: Iterable[str]
) -> tuple[str, ...]:
    found = list(named.get(("routes", route), ()))
    for service in dict.fromkeys(services):
        found.extend(named.get(("services", service), ()))
    return tuple(dict.fromkeys(found))


def _check_reserves(c: Collector, settings: PoolSettings) -> None:
    """Reserves above max_workers, reported even when other weights have problems."""
    reserved = {k: w.reserve for k, w in settings.keys.items() if w.reserve}
    total = sum(reserved.values())
    if total > settings.max_workers and not c.failed(("pool", "max_workers")):
        parts = ", ".join(f"{k}={r}" for k, r in reserved.items())
        c.error(
            ("pool", "max_workers"),
            f"reserves add up to {total} ({parts}) but max_workers is {settings.max_workers}; "
            "lower a reserve or raise max_workers",
        )


def _check_request_use(
    c: Collector,
    pipes: Mapping[str, PipeConfig],
    routes: Mapping[str, RouteConfig],
    proxies: Mapping[str, ProxyConfig],
) -> None:
    """What the pipes read of the request (the headers they pass on, its body as it came)
    against the routes that run them."""
    for name, rc in routes.items():
        run = [*rc.pipes, *_fallbacks(pipes, rc.pipes)]
        uses = [(p, u) for p in run if p in pipes and (u := pipes[p].request_use)]
        route, where = rc.route, ("routes", name)
        senders = [p for p, use in uses if use.body]
        if senders and route.body != "raw":
            c.error(
                (*where, "chain"),
                f"pipe {senders[0]!r} sends the request's body as it came (body_from = "
                '"request"); set body = "raw" on this route to keep it',
            )
        if not uses and route.body != "raw":
            continue
        if REQUEST_KEY in route.params:
            c.error(
                (*where, "path"),
                f"path parameter {{{REQUEST_KEY}}} would take the state key where this route "
                "keeps what its pipes read of the request; rename it",
            )
        if rc.result is None:
            c.warn(
                where,
                f"this route answers the whole state, which holds {REQUEST_KEY!r} (the headers "
                "its pipes pass on, its raw body); set result to the key to answer",
            )
    for name, pc in proxies.items():
        run = [*pc.pipes, *_fallbacks(pipes, pc.pipes)]
        senders = [p for p in run if p in pipes and (u := pipes[p].request_use) and u.body]
        if senders:
            c.error(
                ("routes", name),
                f'pipe {senders[0]!r} sends the request\'s body (body_from = "request"), but '
                "a proxy route's chains run on the request's head: its body streams to the "
                "service",
            )


def _fallbacks(pipes: Mapping[str, PipeConfig], names: Iterable[str]) -> list[str]:
    """The pipes named as fallbacks of ``names``: they run in a route as those do."""
    return [f for n in names if n in pipes and isinstance(f := pipes[n].fallback, str)]


def _names(section: Any) -> list[str]:
    return [k for k in section if isinstance(k, str)] if isinstance(section, dict) else []


def _warn_unused(
    c: Collector,
    data: Mapping[str, Any],
    services: list[str],
    pipes: list[str],
    used: set[str],
) -> None:
    # Only for entries without errors: a warning on a broken entry adds nothing.
    for name in pipes:
        if name not in used and not c.failed(("pipes", name)):
            c.warn(("pipes", name), "no route uses this pipe")
    referenced: set[str] = set()
    section = data.get("pipes")
    for spec in section.values() if isinstance(section, dict) else ():
        if isinstance(spec, dict):
            referenced.update(v for k in ("service", "key") if isinstance(v := spec.get(k), str))
    routes = data.get("routes")
    for spec in routes.values() if isinstance(routes, dict) else ():
        if is_proxy(spec):
            referenced.update(v for k in ("proxy", "key") if isinstance(v := spec.get(k), str))
    for name in services:
        if name not in referenced and not c.failed(("services", name)):
            c.warn(("services", name), "no pipe calls this service or uses it as its key")
    if not isinstance(data.get("routes"), dict) or not data["routes"]:
        c.warn(("routes",), "no routes: the gateway would serve only its own endpoints")


def build_registry(
    config: GatewayConfig, backends: Backends, registry: Registry | None = None
) -> Registry:
    """Register every pipe, one chain per route (named after it), and the routes; and the
    chains of the proxy routes (``NAME`` before the proxy step, ``NAME.after`` after it).

    HTTP pipes call through ``backends``, which must be open while they run. Pass a
    ``registry`` to add to an existing one."""
    registry = registry if registry is not None else Registry()
    built: dict[str, Pipe] = {}
    for pipe in build_order(config.pipes):
        built[pipe.name] = registry.add_pipe(pipe.build(backends, built))
    for rc in config.routes.values():
        registry.chain(
            rc.route.name, rc.chain, timeout=rc.route.timeout, key=rc.key, result=rc.result
        )
        registry.add_route(rc.route)
    for pc in config.proxies.values():
        route = pc.route
        for name, chain in ((route.chain, pc.chain), (route.after, pc.after)):
            if name is not None and chain is not None:
                registry.chain(name, chain)
    return registry
