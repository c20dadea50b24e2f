"""The ``[server]``, ``[pool]`` and ``[services.NAME]`` sections of a gateway file."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal

from .._errors import RegistrationError
from .._http._identity import POOL_KEY_PREFIX
from .._tls import TlsFileError
from ..backends._http_spec import Service, check_base_url, check_header_name
from ..container._collector import SERVING_GC_THRESHOLD
from ..container._tls import CLIENT_AUTH, ClientAuth, ServerTls, server_context
from ..dispatcher._weighted_config import Adaptive, PoolConfig, PoolConfigError, Weights
from ..proxy._access import DEFAULT_REDACTED
from ..proxy._forwarding import Network, trusted_networks
from ._config_problems import Collector, KeyPath, describe_value
from ._config_read import Table, check_name, open_table
from ._config_resilience import RESILIENCE_KEYS, read_resilience

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "PoolSettings",
    "ServerConfig",
    "read_pool",
    "read_server",
    "read_services",
]

TLS_KEYS: Final = ("tls_cert", "tls_key", "tls_client_ca", "tls_client_auth")
SERVICE_TLS_KEYS: Final = ("ca_bundle", "client_cert", "client_key", "server_name", "verify")

#: Connection pool size for a service with no limit: httpx slows down with big pools.
DEFAULT_MAX_CONNECTIONS: Final = 32

SERVER_KEYS: Final = (
    "host",
    "port",
    "max_body",
    "max_header_bytes",
    "body_time_limit",
    "default_timeout",
    "shutdown_grace",
    "admin_token",
    "admin_token_env",
    "public_url",
    "callback_secret_env",
    "trusted_proxies",
    "gc_threshold",
    "gc_freeze",
    "http1_server",
    "access_log_redact",
    # The job, board and jobs-page endpoints' CORS policy: read by _config_edge.
    "cors",
    # Who lists their jobs in the download centre (an [auth.NAME]): read by _config_edge.
    "jobs_auth",
    *TLS_KEYS,
)
#: ``[server] http1_server``'s values (``pipework.container._server.HTTP1_SERVERS``).
Http1Server = Literal["lean", "hypercorn"]
HTTP1_SERVERS: Final[tuple[Http1Server, ...]] = ("lean", "hypercorn")
POOL_KEYS: Final = (
    "max_workers",
    "wait_timeout",
    "max_waiting",
    "queue_capacity",
    "max_passed_over",
    "max_keys",
    "keys",
)
WEIGHT_KEYS: Final = ("reserve", "limit", "max_waiting", "wait_timeout", "adaptive")
ADAPTIVE_KEYS: Final = ("min_limit", "max_limit", "increase", "backoff", "latency_tolerance")
SERVICE_KEYS: Final = (
    "base_url",
    "timeout",
    "connect_timeout",
    "max_connections",
    "max_keepalive",
    "keepalive_expiry",
    "headers",
    "max_response_bytes",
    "request_id_header",
    "rate_limits",
    *SERVICE_TLS_KEYS,
    *RESILIENCE_KEYS,
    *WEIGHT_KEYS,
)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """``[server]``: where the container listens and its limits. The names match
    :class:`~pipework.ContainerConfig` where both have them."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_body: int = 1024 * 1024
    max_header_bytes: int = 16 * 1024
    body_time_limit: float = 30.0
    default_timeout: float = 30.0
    shutdown_grace: float = 10.0
    admin_token: str | None = None
    admin_token_env: str | None = None
    public_url: str | None = None
    callback_secret_env: str | None = None
    #: Peers whose ``X-Forwarded-*`` and ``Forwarded`` fields proxy routes keep (and
    #: append to); every other peer's are replaced.
    trusted_proxies: tuple[Network, ...] = ()
    #: The garbage collector's young threshold while serving; 0 keeps the interpreter's.
    #: ``pipework serve`` owns its process, so it raises it by default (operations.md).
    gc_threshold: int = SERVING_GC_THRESHOLD
    #: Freeze the heap while serving (``gc.freeze()``): collections no longer scan what
    #: start-up made. On by default for the same reason (operations.md).
    gc_freeze: bool = True
    #: Who serves cleartext HTTP/1.1: "lean" (pipework's own server) or "hypercorn";
    #: None: ``serve``'s default.
    http1_server: Http1Server | None = None
    #: HTTPS (and mutual TLS) when set: ``tls_cert``, ``tls_key``, ``tls_client_ca``,
    #: ``tls_client_auth``; its files are read again on a reload.
    tls: ServerTls | None = None
    #: The query parameters whose values the access log hides.
    access_log_redact: tuple[str, ...] = DEFAULT_REDACTED

    def admin_token_value(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The admin bearer token (from the file or the environment); None: no admin API."""
        if self.admin_token is not None:
            return self.admin_token
        if self.admin_token_env is None:
            return None
        return (os.environ if environ is None else environ).get(self.admin_token_env) or None

    def callback_secret_value(self, environ: Mapping[str, str] | None = None) -> str | None:
        if self.callback_secret_env is None:
            return None
        return (os.environ if environ is None else environ).get(self.callback_secret_env) or None


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """``[pool]``: the weighted worker pool and the event queue. ``keys`` holds the weights
    of every named key: each service's, and those of ``[pool.keys.NAME]``."""

    max_workers: int = 64
    wait_timeout: float = 10.0
    max_waiting: int = 1000
    queue_capacity: int = 10_000
    max_passed_over: int = 8
    max_keys: int = 10_000
    keys: Mapping[str, Weights] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", MappingProxyType(dict(self.keys)))

    def pool_config(self) -> PoolConfig:
        """The :class:`PoolConfig` for ``WeightedPool.from_config``."""
        return PoolConfig(
            max_workers=self.max_workers,
            keys=self.keys,
            default=Weights(max_waiting=self.max_waiting),
            wait_timeout=self.wait_timeout,
            max_passed_over=self.max_passed_over,
            max_keys=self.max_keys,
        )


def read_server(c: Collector, value: Any) -> ServerConfig:
    path: KeyPath = ("server",)
    t = open_table(c, path, {} if value is None else value, SERVER_KEYS)
    if t is None:
        return ServerConfig()
    d = ServerConfig()
    token = t.string("admin_token", None)
    token_env = t.string("admin_token_env", None)
    if token is not None and token_env is not None:
        c.error(t.at("admin_token"), "set admin_token or admin_token_env, not both")
    elif token is not None:
        c.warn(
            t.at("admin_token"),
            "a token written in the file is readable by whoever reads the file; "
            "prefer admin_token_env",
        )
    public_url = t.string("public_url", None)
    if public_url is not None:
        problem = check_base_url(public_url)
        if problem is not None:
            c.error(t.at("public_url"), problem)
    return ServerConfig(
        host=t.string("host", d.host),
        port=t.integer("port", d.port, minimum=0, maximum=65535),
        max_body=t.integer("max_body", d.max_body, minimum=0),
        max_header_bytes=t.integer("max_header_bytes", d.max_header_bytes, minimum=1),
        body_time_limit=t.number("body_time_limit", d.body_time_limit),
        default_timeout=t.number("default_timeout", d.default_timeout),
        shutdown_grace=t.number("shutdown_grace", d.shutdown_grace, positive=False),
        admin_token=token,
        admin_token_env=token_env,
        public_url=public_url,
        callback_secret_env=t.string("callback_secret_env", None),
        trusted_proxies=_trusted_proxies(t),
        gc_threshold=t.integer("gc_threshold", d.gc_threshold, minimum=0),
        gc_freeze=t.boolean("gc_freeze", d.gc_freeze),
        http1_server=_http1_server(t),
        tls=_server_tls(t),
        access_log_redact=_names(t, "access_log_redact", d.access_log_redact),
    )


def _http1_server(t: Table) -> Http1Server | None:
    chosen = t.string("http1_server", None, choices=HTTP1_SERVERS)
    # One of the choices (checked above), spelled as the type says.
    return next((name for name in HTTP1_SERVERS if name == chosen), None)


def _names(t: Table, key: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """An array of non-empty strings (query parameter names), each problem at its index."""
    if key not in t:
        return default
    value = t.data[key]
    if not isinstance(value, list):
        t.c.error(t.at(key), f"expected an array of names, got {describe_value(value)}")
        return default
    found: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            t.c.error((*t.at(key), i), f"expected a name, got {describe_value(item)}")
        else:
            found.append(item)
    return tuple(found)


def _server_tls(t: Table) -> ServerTls | None:
    """``tls_*``: both files or neither, the client CA only with them; the files are loaded
    into a context here, so that ``check`` finds what serving would."""
    cert, key = t.string("tls_cert", None), t.string("tls_key", None)
    client_ca = t.string("tls_client_ca", None)
    chosen = t.string("tls_client_auth", "required", choices=CLIENT_AUTH)
    client_auth: ClientAuth = "optional" if chosen == "optional" else "required"
    if cert is None and key is None:
        for name in ("tls_client_ca", "tls_client_auth"):
            if name in t:
                t.c.error(t.at(name), f"{name} needs tls_cert and tls_key: the server's own")
        return None
    if cert is None or key is None:
        missing, given = ("tls_cert", "tls_key") if cert is None else ("tls_key", "tls_cert")
        t.c.error(t.at(given), f"{given} needs {missing}: set both, or neither for plain HTTP")
        return None
    if "tls_client_auth" in t and client_ca is None:
        t.c.warn(
            t.at("tls_client_auth"),
            "tls_client_auth does nothing without tls_client_ca: no client certificate is "
            "asked for",
        )
    tls = ServerTls(cert, key, client_ca, client_auth)
    try:
        server_context(tls)
    except TlsFileError as exc:
        t.c.error(t.at(exc.key), exc.message)
        return None
    return tls


def _trusted_proxies(t: Table) -> tuple[Network, ...]:
    """``trusted_proxies``: addresses and CIDR blocks, each checked where it is."""
    if "trusted_proxies" not in t:
        return ()
    value = t.data["trusted_proxies"]
    if not isinstance(value, list):
        t.c.error(
            t.at("trusted_proxies"),
            f"expected an array of addresses and CIDR blocks, got {describe_value(value)}",
        )
        return ()
    found: list[Network] = []
    for i, item in enumerate(value):
        where = (*t.at("trusted_proxies"), i)
        if not isinstance(item, str):
            t.c.error(where, f"expected an address or CIDR block, got {describe_value(item)}")
            continue
        try:
            (network,) = trusted_networks([item])
        except ValueError as exc:
            t.c.error(where, str(exc))
            continue
        if network.prefixlen == 0:
            t.c.warn(
                where,
                f"{item} trusts every address: any client can then set the client address "
                "a backend sees (X-Forwarded-For, Forwarded)",
            )
        found.append(network)
    return tuple(found)


def read_pool(c: Collector, value: Any) -> tuple[PoolSettings, dict[str, Weights]]:
    """The pool's settings and the weights of ``[pool.keys.NAME]``."""
    path: KeyPath = ("pool",)
    t = open_table(c, path, {} if value is None else value, POOL_KEYS)
    if t is None:
        return PoolSettings(), {}
    d = PoolSettings()
    settings = PoolSettings(
        max_workers=t.integer("max_workers", d.max_workers, minimum=1),
        wait_timeout=t.number("wait_timeout", d.wait_timeout),
        max_waiting=t.integer("max_waiting", d.max_waiting, minimum=0),
        queue_capacity=t.integer("queue_capacity", d.queue_capacity, minimum=1),
        max_passed_over=t.integer("max_passed_over", d.max_passed_over, minimum=1),
        max_keys=t.integer("max_keys", d.max_keys, minimum=1),
    )
    keys: dict[str, Weights] = {}
    for name, spec in (t.table("keys") or {}).items():
        where = (*t.at("keys"), name)
        weights = read_weights(c, where, spec, WEIGHT_KEYS, settings.max_waiting)
        if _key_name(c, where, name) and weights is not None:
            keys[name] = weights
    return settings, keys


def _key_name(c: Collector, where: KeyPath, name: str) -> bool:
    """A named key: a name as any other, or a tenant's (``tenant:VALUE``, the key a
    route's ``pool_key`` chooses for a caller whose identity or claim is VALUE)."""
    if name.startswith(POOL_KEY_PREFIX):
        if name != POOL_KEY_PREFIX and name.isprintable():
            return True
        c.error(
            where,
            f"a tenant's key is {POOL_KEY_PREFIX!r} followed by the identity or claim "
            f"(printable text), got {name!r}",
        )
        return False
    return check_name(c, where, name, "key")


def read_weights(
    c: Collector, path: KeyPath, value: Any, known: tuple[str, ...], max_waiting: int
) -> Weights | None:
    t = open_table(c, path, value, known)
    if t is None:
        return None
    return _weights(t, max_waiting)


def _weights(t: Table, max_waiting: int) -> Weights | None:
    reserve = t.integer("reserve", 0, minimum=0)
    limit = t.integer("limit", None, minimum=0)
    adaptive = _adaptive(t)
    try:
        return Weights(
            reserve=reserve,
            limit=limit,
            max_waiting=t.integer("max_waiting", max_waiting, minimum=0),
            wait_timeout=t.number("wait_timeout", None),
            adaptive=adaptive,
        )
    except PoolConfigError as exc:
        t.c.error(t.at("reserve"), str(exc))
        return None


def _adaptive(t: Table) -> Adaptive | None:
    if "adaptive" not in t:
        return None
    a = open_table(t.c, t.at("adaptive"), t.data["adaptive"], ADAPTIVE_KEYS)
    if a is None:
        return None
    d = Adaptive()
    min_limit = a.integer("min_limit", d.min_limit, minimum=1)
    max_limit = a.integer("max_limit", d.max_limit, minimum=1)
    if max_limit is not None and max_limit < min_limit:
        a.c.error(a.at("max_limit"), f"must be at least min_limit ({min_limit}), got {max_limit}")
    backoff = a.number("backoff", d.backoff)
    if not backoff < 1:
        a.c.error(
            a.at("backoff"), f"must be below 1 (the share of the limit kept), got {backoff:g}"
        )
    tolerance = a.number("latency_tolerance", d.latency_tolerance)
    if tolerance is not None and not tolerance > 1:
        a.c.error(a.at("latency_tolerance"), f"must be above 1, got {tolerance:g}")
    increase = a.number("increase", d.increase)
    if a.c.failed(a.path):
        return None
    try:
        return Adaptive(min_limit, max_limit, increase, backoff, tolerance)
    except PoolConfigError as exc:
        t.c.error(t.at("adaptive"), str(exc))
        return None


@dataclass(slots=True)
class _ServiceDraft:
    table: Table
    weights: Weights


def read_services(
    c: Collector, value: Any, settings: PoolSettings
) -> tuple[dict[str, Service], dict[str, Weights]]:
    """Every service, and its weights (keyed by the service's name)."""
    path: KeyPath = ("services",)
    if value is None:
        return {}, {}
    if not isinstance(value, dict):
        c.error(path, "expected a table of services, one [services.NAME] each")
        return {}, {}
    drafts: dict[str, _ServiceDraft] = {}
    broken: list[tuple[str, Table]] = []
    for name, spec in value.items():
        where = (*path, name)
        t = open_table(c, where, spec, SERVICE_KEYS)
        if t is None:
            continue
        named = check_name(c, where, name, "service")
        weights = _weights(t, settings.max_waiting)
        if weights is not None and named:
            drafts[name] = _ServiceDraft(t, weights)
        else:
            broken.append((name, t))
    shared = settings.max_workers - sum(d.weights.reserve for d in drafts.values())
    services = {}
    for name, draft in drafts.items():
        service = _service(name, draft, settings.max_workers if shared < 0 else shared)
        if service is not None:
            services[name] = service
    for name, t in broken:
        # A bad name or bad weights are not the service's only problems: its other keys
        # are checked too (with default weights), so one check reports them all.
        _service(name, _ServiceDraft(t, Weights()), settings.max_workers)
    return services, {name: d.weights for name, d in drafts.items()}


def _service(name: str, draft: _ServiceDraft, shared: int) -> Service | None:
    t, weights = draft.table, draft.weights
    c = t.c
    headers = t.string_table("headers")
    for header in headers:
        problem = check_header_name(header)
        if problem is not None:
            c.error((*t.at("headers"), header), problem)
    # The most slots this service's key can hold is its reserve plus the shared pool,
    # capped by its limit. With a limit, the pool must cover that many concurrent calls;
    # without one, at least the reserve (the rest wait on httpx, modestly sized by default).
    most = weights.reserve + shared
    if weights.limit:
        most = min(most, weights.limit)
        needed, what = most, f"the {most} worker slots its limit lets it hold"
    else:
        needed, what = weights.reserve, f"its reserve of {weights.reserve}"
    if weights.limit:
        default = needed
    else:
        default = max(1, weights.reserve, min(most, DEFAULT_MAX_CONNECTIONS))
    connections = t.integer("max_connections", None, minimum=1)
    if connections is not None and connections < needed:
        c.error(
            t.at("max_connections"),
            f"{connections} is below {what}: calls beyond {connections} would hold a "
            f"worker slot while waiting for a connection; raise it to {needed} or more",
        )
    timeout = t.number("timeout", 10.0)
    fields: dict[str, Any] = read_resilience(t, timeout)
    fields |= {
        "timeout": timeout,
        "connect_timeout": t.number("connect_timeout", None),
        "max_connections": connections or default,
        "max_keepalive": t.integer("max_keepalive", None, minimum=0),
        "keepalive_expiry": t.number("keepalive_expiry", 5.0, positive=False),
        "max_response_bytes": t.integer("max_response_bytes", 10 * 1024 * 1024, minimum=0),
        # false: no correlation id header on this service's calls.
        "request_id_header": None
        if t.data.get("request_id_header") is False
        else t.string("request_id_header", "X-Request-ID"),
        **_service_tls(t, fields),
    }
    if c.failed(t.path):
        return None
    try:
        service = Service(name, headers=headers, **fields)
    except RegistrationError as exc:  # every check above should have caught it first
        c.error(t.path, str(exc))
        return None
    try:
        if service.ca_bundle is not None or service.client_cert is not None:
            service.ssl_context()  # its files are read here: check finds what serving would
    except TlsFileError as exc:
        c.error(t.at(exc.key), exc.message)
        return None
    return service


def _service_tls(t: Table, fields: dict[str, Any]) -> dict[str, Any]:
    """``ca_bundle``, ``client_cert``/``client_key``, ``server_name``, ``verify``: for an
    ``https://`` service only (its files are checked once it is whole)."""
    tls = {
        "ca_bundle": t.string("ca_bundle", None),
        "client_cert": t.string("client_cert", None),
        "client_key": t.string("client_key", None),
        "server_name": t.string("server_name", None),
        "verify": t.boolean("verify", True),
    }
    given = [key for key in SERVICE_TLS_KEYS if key in t]
    if not given:
        return tls
    hosts = fields["hosts"]
    urls = [fields["base_url"]] if fields["base_url"] else [h.url for h in hosts]
    if urls and not any(url.lower().startswith("https://") for url in urls):
        for key in given:
            t.c.error(t.at(key), f"{key} applies to an https:// service only")
        return tls
    for key, other in (("client_cert", "client_key"), ("client_key", "client_cert")):
        if key in t and other not in t:
            t.c.error(t.at(key), f"{key} needs {other}: set both for a client certificate")
    if not tls["verify"]:
        t.c.warn(
            t.at("verify"),
            "verify = false accepts any certificate, so anyone between the gateway and the "
            "service can read and change its calls; prefer ca_bundle with the service's CA",
        )
        if tls["ca_bundle"] is not None:
            t.c.warn(t.at("ca_bundle"), "ca_bundle does nothing with verify = false")
    return tls
