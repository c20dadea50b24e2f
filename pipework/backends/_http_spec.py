"""What an HTTP backend call is made of: a :class:`Service` (where and how to connect) and
an :class:`HttpCall` (what to send and where the answer goes). Plain frozen data, checked
when made; :mod:`._http` does the calling.
"""

from __future__ import annotations

import math
import re
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

import httpx

from .._errors import RegistrationError
from .._headers import HOP_BY_HOP, WILDCARD, pass_problem, passed
from ..pipes._pipe import REQUEST_KEY, RequestUse
from ..pipes._state import as_raw
from ._http_template import BodyTemplate, Template, TemplateError, parse_body
from ._resilience_spec import (
    BREAKER_OFF,
    CONNECT_RETRY,
    OUTLIER_OFF,
    Balance,
    BreakerSpec,
    HealthSpec,
    HedgeSpec,
    HostSpec,
    OutlierSpec,
    Resilience,
    RetrySpec,
)
from ._tls import client_context

__all__ = [
    "DEFAULT_ACCEPT",
    "FORBIDDEN_HEADERS",
    "HOP_BY_HOP",
    "METHODS",
    "HttpCall",
    "Service",
    "check_base_url",
    "check_header_name",
    "check_header_value",
    "check_pass_header",
    "check_same_api",
    "forwarded_headers",
    "is_token",
    "passed_headers",
    "raw_body",
]

#: Headers a pipe may not set: hop-by-hop ones, and those that would redirect or reframe the
#: request (the host comes only from the service's base_url; httpx frames the body).
FORBIDDEN_HEADERS: Final = HOP_BY_HOP | {"host", "content-length"}
METHODS: Final = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
DEFAULT_ACCEPT: Final = frozenset(range(200, 300))

_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
# RFC 9110 field-value, in ASCII (httpx encodes header values as ASCII): visible characters
# with single spaces or tabs between them, none at either end.
_FIELD_VALUE: Final = re.compile(r"(?:[\x21-\x7e](?:[ \t]*[\x21-\x7e])*)?\Z")


def check_header_name(name: str) -> str | None:
    """Why ``name`` cannot be a header a pipe sets, or None if it can."""
    if not _TOKEN.match(name):
        return f"{name!r} is not a valid header name"
    lowered = name.lower()
    if lowered in HOP_BY_HOP or lowered.startswith("proxy-"):
        return f"{name!r} is a hop-by-hop header; pipework never forwards those"
    if lowered == "host":
        return "'Host' cannot be set: the host comes only from the service's base_url"
    if lowered == "content-length":
        return "'Content-Length' cannot be set: it is computed from the body"
    return None


def check_pass_header(name: str) -> str | None:
    """Why ``name`` cannot be one of a call's ``pass_headers``, or None if it can."""
    if name != WILDCARD and not _TOKEN.match(name):
        return f"{name!r} is not a valid header name (or '*' for every end-to-end one)"
    return pass_problem(name)


def is_token(name: str) -> bool:
    """Whether ``name`` is an RFC 9110 token (what a header name must be)."""
    return _TOKEN.match(name) is not None


def check_header_value(name: str, value: str) -> str | None:
    """Why ``value`` cannot be sent as header ``name`` (RFC 9110), or None if it can."""
    if _FIELD_VALUE.match(value):
        return None
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F for c in value):
        return f"header {name!r} may not hold control characters"
    if value != value.strip(" \t"):
        return f"header {name!r} may not start or end with whitespace"
    return f"header {name!r} may hold only visible ASCII characters, spaces and tabs"


def check_base_url(url: str) -> str | None:
    """Why ``url`` cannot be a service's base URL, or None if it can."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        return f"{url!r} is not a valid URL: {exc}"
    if parsed.scheme not in ("http", "https"):
        return f"{url!r} must start with http:// or https://"
    if not parsed.host:
        return f"{url!r} names no host"
    if parsed.userinfo:
        return f"{url!r} holds credentials; send them with the service's headers instead"
    if parsed.query or parsed.fragment or "?" in url or "#" in url:
        return f"{url!r} may not have a query or fragment; set them on the pipes"
    return None


@dataclass(frozen=True, slots=True)
class Service:
    """A backend service: every call to it goes to one of its hosts (plus the pipe's path).

    The hosts are ``base_url`` alone, or ``hosts`` (URLs or :class:`HostSpec` with weights;
    one of the two, not both), all with the same scheme and path. ``balance`` chooses among
    them (``p2c``, ``round_robin``, ``random``); ``health``, ``outlier``, ``breaker``,
    ``retry`` and ``hedge`` set how the service stays available when hosts fail (see
    docs/resilience.md). None, a file without the table, keeps a service as it was before
    it had hosts: no health checks and no hedging; the breaker off; only a failed
    connection retried, once; outlier ejection with Envoy's defaults only for a service of
    several hosts (one host has nowhere else to go). ``resolve``: every so many seconds,
    each host given by name becomes one host per address the name resolves to (each with
    the name's weight, its requests still naming the name as ``Host``); None: the name is
    resolved by each new connection, as before.

    ``timeout`` bounds one whole call in seconds (and always the job's remaining time);
    ``connect_timeout`` the connection set-up. ``max_connections`` is the size of its
    connection pool, which should be at least the concurrency its pool weights allow;
    ``max_keepalive`` idle connections are kept for ``keepalive_expiry`` seconds.
    ``headers`` go with every call; ``max_response_bytes`` caps an answer's (decoded) body.
    ``request_id_header`` carries the job's correlation id (the request's ``X-Request-ID``)
    on every call (``None``: not sent); a W3C ``traceparent`` the request came with goes
    along too.

    An ``https://`` service's connections are TLS (:mod:`._tls`): its certificate checked
    against ``ca_bundle`` (a PEM file; the system's CAs without one) and against
    ``server_name`` (each host's own name without one), unless ``verify`` is false;
    ``client_cert`` and ``client_key`` (PEM files, together) are presented to a backend
    that asks for one (mutual TLS).
    """

    name: str
    base_url: str = ""
    timeout: float = 10.0
    connect_timeout: float | None = None
    max_connections: int = 10
    max_keepalive: int | None = None
    keepalive_expiry: float = 5.0
    headers: Mapping[str, str] = field(default_factory=dict)
    max_response_bytes: int = 10 * 1024 * 1024
    request_id_header: str | None = "X-Request-ID"
    hosts: tuple[HostSpec, ...] = ()
    balance: Balance = "p2c"
    health: HealthSpec | None = None
    outlier: OutlierSpec | None = None
    breaker: BreakerSpec | None = None
    retry: RetrySpec | None = None
    hedge: HedgeSpec | None = None
    resolve: float | None = None
    ca_bundle: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = None
    verify: bool = True

    def __post_init__(self) -> None:
        where = f"service {self.name!r}"
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        if not self.name:
            raise RegistrationError("a service needs a non-empty name")
        hosts = tuple(HostSpec(h) if isinstance(h, str) else h for h in self.hosts)
        object.__setattr__(self, "hosts", hosts)
        if self.base_url and hosts:
            raise RegistrationError(f"{where}: set base_url or hosts, not both")
        if not self.base_url and not hosts:
            raise RegistrationError(f"{where}: set its base_url, or its hosts")
        for host in self.endpoints:
            problem = check_base_url(host.url)
            if problem is not None:
                name = "base_url" if self.base_url else "host"
                raise RegistrationError(f"{where}: {name} {problem}")
        problem = check_same_api(tuple(h.url for h in hosts))
        if problem is not None:
            raise RegistrationError(f"{where}: {problem}")
        try:
            self.resilience  # noqa: B018 -- checks the hosts and settings together
        except RegistrationError as exc:
            raise RegistrationError(f"{where}: {exc}") from None
        for name, value in (
            ("timeout", self.timeout),
            ("connect_timeout", self.connect_timeout),
            ("resolve", self.resolve),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise RegistrationError(f"{where}: {name} must be a positive number, got {value}")
        if self.max_connections < 1:
            raise RegistrationError(f"{where}: max_connections must be at least 1")
        if self.max_keepalive is not None and self.max_keepalive < 0:
            raise RegistrationError(f"{where}: max_keepalive must be 0 or more")
        if not (math.isfinite(self.keepalive_expiry) and self.keepalive_expiry >= 0):
            raise RegistrationError(f"{where}: keepalive_expiry must be 0 or more")
        if (self.client_cert is None) != (self.client_key is None):
            raise RegistrationError(f"{where}: set client_cert and client_key together")
        if self.url.scheme != "https" and self.tls_settings():
            raise RegistrationError(
                f"{where}: {', '.join(self.tls_settings())} apply to an https:// service only"
            )
        if self.max_response_bytes < 0:
            raise RegistrationError(f"{where}: max_response_bytes must be 0 or more")
        extra = () if self.request_id_header is None else (self.request_id_header,)
        for name in (*self.headers, *extra):
            problem = check_header_name(name)
            if problem is not None:
                raise RegistrationError(f"{where}: {problem}")

    @property
    def endpoints(self) -> tuple[HostSpec, ...]:
        """Every host of the service: ``hosts``, or ``base_url`` as one host of weight 1."""
        return self.hosts or (HostSpec(self.base_url),)

    @property
    def resilience(self) -> Resilience:
        """The hosts and settings the service's sans-IO core (``ServiceCore``) runs on,
        with what a setting left None means (see the class docstring)."""
        endpoints = self.endpoints
        outlier = self.outlier
        if outlier is None:
            outlier = OutlierSpec() if len(endpoints) > 1 else OUTLIER_OFF
        return Resilience(
            endpoints,
            self.balance,
            self.health,
            outlier,
            BREAKER_OFF if self.breaker is None else self.breaker,
            CONNECT_RETRY if self.retry is None else self.retry,
            self.hedge,
        )

    def tls_settings(self) -> tuple[str, ...]:
        """The names of the TLS settings given (not left as their defaults)."""
        given = [
            name
            for name in ("ca_bundle", "client_cert", "client_key", "server_name")
            if getattr(self, name) is not None
        ]
        return (*given, *(() if self.verify else ("verify",)))

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context of an ``https://`` service's connections (None for ``http://``),
        from its files; raises :class:`~._tls.TlsFileError` for one that cannot be used."""
        if self.url.scheme != "https":
            return None
        return client_context(
            ca_bundle=self.ca_bundle,
            client_cert=self.client_cert,
            client_key=self.client_key,
            verify=self.verify,
        )

    @property
    def url(self) -> httpx.URL:
        """The first host's URL (the only one's, for a service with a ``base_url``)."""
        return httpx.URL(self.endpoints[0].url)

    def limits(self) -> httpx.Limits:
        keepalive = self.max_connections if self.max_keepalive is None else self.max_keepalive
        return httpx.Limits(
            max_connections=self.max_connections,
            max_keepalive_connections=min(keepalive, self.max_connections),
            keepalive_expiry=self.keepalive_expiry,
        )


def check_same_api(urls: tuple[str, ...]) -> str | None:
    """Why ``urls`` (each a valid base URL) cannot be the hosts of one service, or None: they
    must share the scheme and the path, being copies of one API."""
    if len(urls) < 2:
        return None
    first = httpx.URL(urls[0])
    for url in urls[1:]:
        other = httpx.URL(url)
        if other.scheme != first.scheme:
            return f"hosts {urls[0]!r} and {url!r} differ in scheme; a service's hosts share one"
        if other.raw_path.rstrip(b"/") != first.raw_path.rstrip(b"/"):
            return (
                f"hosts {urls[0]!r} and {url!r} differ in path; a service's hosts serve one "
                "API under one path (make them two services if they are not)"
            )
    return None


@dataclass(frozen=True, slots=True)
class HttpCall:
    """One call to ``service``: ``method`` on ``path`` (a path template, appended to the
    base URL's path), with ``query``, ``headers`` and a JSON ``body`` filled from state.

    ``pass_headers`` names the request headers passed on from the job's request (recorded
    in ``state["request"]["headers"]``; ``"*"``: every end-to-end one but credentials, see
    :mod:`pipework._headers`). ``forward_headers`` names a state key holding a dict of
    headers to pass on (hop-by-hop ones, Host and Content-Length are dropped). Headers
    meet in this order, each over the ones before: the service's, passed, forwarded, the
    call's own ``headers``, then the request id and the trace context.

    ``body_from`` sends a raw body (bytes with their content type) instead of JSON:
    ``"request"`` the request's own, as it came, any other name the raw value at that state
    key. The answer's body (JSON parsed, else text, None when empty; with ``raw`` its bytes
    with their content type, whatever they are) is written to ``state[into]`` (None: not
    kept); a status outside ``accept`` is a :class:`~pipework.BackendError`.
    """

    service: str
    path: Template
    method: str = "GET"
    query: tuple[tuple[str, Template], ...] = ()
    headers: tuple[tuple[str, Template], ...] = ()
    body: BodyTemplate | None = None
    forward_headers: str | None = None
    into: str | None = None
    accept: frozenset[int] = DEFAULT_ACCEPT
    pass_headers: frozenset[str] = frozenset()
    body_from: str | None = None
    raw: bool = False

    def __post_init__(self) -> None:
        method = self.method.upper()
        if method not in METHODS:
            raise RegistrationError(
                f"HTTP method {self.method!r} is not one of {', '.join(METHODS)}"
            )
        object.__setattr__(self, "method", method)
        for name, _ in self.headers:
            problem = check_header_name(name)
            if problem is not None:
                raise RegistrationError(problem)
        if not self.accept:
            raise RegistrationError("accept needs at least one status")
        if isinstance(self.pass_headers, str):
            raise RegistrationError("pass_headers is a collection of header names, not one")
        for name in self.pass_headers:
            problem = check_pass_header(name)
            if problem is not None:
                raise RegistrationError(f"pass_headers: {problem}")
        object.__setattr__(
            self, "pass_headers", frozenset(name.lower() for name in self.pass_headers)
        )
        if self.body_from is not None:
            if self.body is not None:
                raise RegistrationError(
                    "a call sends a JSON body or a raw one (body_from), not both"
                )
            if not self.body_from:
                raise RegistrationError(
                    "body_from names 'request' (the request's body) or a state key"
                )

    @property
    def request_use(self) -> RequestUse | None:
        """What the call reads of its job's request (None: only the state)."""
        body = self.body_from == REQUEST_KEY
        if not self.pass_headers and not body:
            return None
        return RequestUse(self.pass_headers, body)

    @classmethod
    def of(
        cls,
        service: str,
        path: str,
        *,
        method: str = "GET",
        query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Any = None,
        forward_headers: str | None = None,
        into: str | None = None,
        accept: frozenset[int] = DEFAULT_ACCEPT,
        pass_headers: Iterable[str] = (),
        body_from: str | None = None,
        raw: bool = False,
    ) -> HttpCall:
        """Build a call from template strings, parsed here: one that cannot be parsed raises
        :class:`~pipework.TemplateSyntaxError` (a ``ValueError``) saying where."""
        return cls(
            service,
            Template.parse_path(path),
            method,
            tuple((k, Template.parse(v)) for k, v in (query or {}).items()),
            tuple((k, Template.parse(v)) for k, v in (headers or {}).items()),
            parse_body(body) if body is not None else None,
            forward_headers,
            into,
            accept,
            _names(pass_headers),
            body_from,
            raw,
        )

    def describe_accept(self) -> str:
        return describe_statuses(self.accept)


def _names(names: Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):  # a string is iterable too, as its letters
        raise RegistrationError(f"pass_headers is a list of header names, not one: [{names!r}]")
    return frozenset(names)


def describe_statuses(statuses: frozenset[int]) -> str:
    """``2xx`` for whole classes, else the numbers: ``2xx, 404``."""
    parts: list[str] = []
    rest = set(statuses)
    for hundred in range(100, 600, 100):
        block = set(range(hundred, hundred + 100))
        if block <= rest:
            parts.append(f"{hundred // 100}xx")
            rest -= block
    parts.extend(str(s) for s in sorted(rest))
    order = {p: (int(p[0]) * 100 if p.endswith("xx") else int(p)) for p in parts}
    return ", ".join(sorted(parts, key=order.__getitem__))


def forwarded_headers(state: Mapping[str, Any], key: str) -> dict[str, str]:
    """The headers in ``state[key]`` that may travel on: no hop-by-hop ones (including any
    the ``Connection`` header names), no Host or Content-Length."""
    given = state.get(key)
    if given is None:
        return {}
    if not isinstance(given, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in given.items()
    ):
        raise TemplateError(f"state value {key!r} must be a table of header names to strings")
    named = {
        token.strip().lower()
        for k, v in given.items()
        if k.lower() == "connection"
        for token in v.split(",")
    }
    kept: dict[str, str] = {}
    for name, value in given.items():
        # Checked here, before anything is sent: a header httpx or h11 would refuse is the
        # client's mistake (400), never a failure of the backend (which it would count).
        if not is_token(name):
            raise TemplateError(f"forwarded header name {name!r} is not a valid header name")
        lowered = name.lower()
        if lowered in FORBIDDEN_HEADERS or lowered.startswith("proxy-") or lowered in named:
            continue
        problem = check_header_value(name, value)
        if problem is not None:
            raise TemplateError(f"forwarded {problem}")
        kept[name] = value
    return kept


def passed_headers(state: Mapping[str, Any], names: frozenset[str]) -> dict[str, str]:
    """The request headers a call passes on under its ``pass_headers`` (``names``), from
    the job's request record (``state["request"]["headers"]``, ``[name, value]`` pairs),
    by lower-case name; a header that came in several lines is one, its values joined as
    RFC 9110 §5.3 says (``Cookie``'s with ``; ``, RFC 6265 §5.4). Nothing without a record:
    the job was not started by a route's request."""
    record = state.get(REQUEST_KEY)
    given = record.get("headers") if isinstance(record, Mapping) else None
    if given is None:
        return {}
    where = f"state value '{REQUEST_KEY}.headers'"
    if not isinstance(given, list | tuple):
        raise TemplateError(f"{where} must be an array of [name, value] pairs")
    pairs: list[tuple[str, str]] = []
    for pair in given:
        if (
            not isinstance(pair, list | tuple)
            or len(pair) != 2
            or not all(isinstance(part, str) for part in pair)
        ):
            raise TemplateError(f"{where} must be an array of [name, value] pairs of strings")
        name, value = pair
        # Checked here, before anything is sent: a header httpx or h11 would refuse is the
        # request's mistake (400), never a failure of the backend (which it would count).
        if not is_token(name):
            raise TemplateError(f"passed header name {name!r} is not a valid header name")
        pairs.append((name, value))
    kept: dict[str, str] = {}
    for name, value in passed(pairs, names):
        problem = check_header_value(name, value)
        if problem is not None:
            raise TemplateError(f"passed {problem}")
        if name in kept:
            value = kept[name] + ("; " if name == "cookie" else ", ") + value
        kept[name] = value
    return kept


def raw_body(state: Mapping[str, Any], body_from: str) -> tuple[bytes, str | None]:
    """The bytes and content type a call with ``body_from`` sends: the request's body
    (``"request"``) or the raw value at that state key."""
    if body_from == REQUEST_KEY:
        record = state.get(REQUEST_KEY)
        value = record.get("body") if isinstance(record, Mapping) else None
        if value is None:
            raise TemplateError(
                "the call sends the request's body (body_from = 'request'), but the job has "
                "none: its route must keep raw bodies (body = 'raw')"
            )
        where = "the request's body"
    else:
        if body_from not in state:
            raise TemplateError(f"state has no {body_from!r} (the call's body_from)")
        value = state[body_from]
        where = f"state value {body_from!r}"
    raw = as_raw(value)
    if raw is None:
        raise TemplateError(
            f"{where} is not a raw body (a table of content_type and data, the bytes); "
            "an HTTP pipe with raw = true keeps its answer as one"
        )
    content_type, data = raw
    if content_type is not None:
        problem = check_header_value("Content-Type", content_type)
        if problem is not None:
            raise TemplateError(f"{where}: {problem}")
    return data, content_type
