"""Routes: which HTTP method and path start which chain, and how the request waits for it.

A :class:`Route` is plain, frozen data checked when it is made, so a bad declaration fails
at start-up with its name in the message, never on the first request. The container turns
each one into a URL rule, and serves the paths under :data:`RESERVED_PREFIXES` itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, get_args, runtime_checkable

from .._errors import RegistrationError
from .._http._auth import RouteAuth
from .._http._cors import CorsPolicy
from .._http._paths import RESERVED_PREFIXES as RESERVED_PREFIXES
from .._http._paths import covering_prefix

__all__ = [
    "RESERVED_PREFIXES",
    "BodyKind",
    "Mode",
    "OnDisconnect",
    "Route",
    "RouteSource",
    "RouteTable",
    "pool_key_problem",
    "routes_of",
]

Mode = Literal["sync", "async", "stream", "auto"]
OnDisconnect = Literal["cancel", "continue"]
BodyKind = Literal["object", "raw"]

_MODES: Final = get_args(Mode)
_ON_DISCONNECT: Final = get_args(OnDisconnect)
_BODIES: Final = get_args(BodyKind)
_METHODS: Final = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})

_PARAM = re.compile(r"\{([^{}]*)\}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Literal path text: RFC 3986 path characters, minus what URL rules treat as syntax.
_LITERAL = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*\Z")


@dataclass(frozen=True, slots=True)
class Route:
    """``method path`` submits a job on ``chain``; ``mode`` says how the request waits.

    - ``path`` may hold ``{name}`` parameters (one path segment each); their values join
      the job state.
    - ``mode``: ``sync`` parks until the chain ends, ``async`` answers 202 at once,
      ``stream`` sends chunks as pipes emit them, ``auto`` parks up to ``sync_wait``
      seconds and then answers 202 for the same job.
    - ``timeout`` bounds the job (None: the chain's, else the engine's, else the
      container's default). ``on_disconnect`` says what a client hanging up while
      parked does to its job. ``max_body`` caps the request body in bytes (None: the
      container's limit).
    - ``body``: ``object`` (a JSON object or msgpack map whose members join the state) or
      ``raw`` (any type, kept as it came: its bytes and content type in
      ``state["request"]["body"]``).
    - ``auth``: who may call it (API keys, JWTs; None: anyone), checked before any job
      exists; the identity joins the state under ``"identity"``. ``cors``: which other
      origins' pages may call it from a browser (None: none).
    - ``pool_key``: ``"identity"`` or ``"claim:NAME"`` (with ``auth``): the job's steps
      that would run under the chain's key run under ``tenant:VALUE`` instead, VALUE the
      caller's identity or that claim (docs/edge-policy.md); None: the chain's key.
    """

    name: str
    method: str
    path: str
    chain: str
    mode: Mode = "sync"
    timeout: float | None = None
    sync_wait: float = 10.0
    on_disconnect: OnDisconnect = "cancel"
    max_body: int | None = None
    body: BodyKind = "object"
    auth: RouteAuth | None = field(default=None, compare=False)
    cors: CorsPolicy | None = field(default=None, compare=False)
    pool_key: str | None = None

    def __post_init__(self) -> None:
        where = f"route {self.name!r}"
        if not self.name:
            raise RegistrationError("a route needs a non-empty name")
        method = self.method.upper()
        if method not in _METHODS:
            raise RegistrationError(
                f"{where}: method {self.method!r} is not one of {', '.join(sorted(_METHODS))}"
            )
        object.__setattr__(self, "method", method)
        _check_path(self.path, where)
        if not self.chain:
            raise RegistrationError(f"{where}: name the chain it runs")
        if self.mode not in _MODES:
            raise RegistrationError(f"{where}: mode {self.mode!r} is not one of {_MODES}")
        if self.on_disconnect not in _ON_DISCONNECT:
            raise RegistrationError(
                f"{where}: on_disconnect {self.on_disconnect!r} is not one of {_ON_DISCONNECT}"
            )
        if self.mode == "stream" and self.on_disconnect == "continue":
            raise RegistrationError(
                f"{where}: a stream's chunks have nowhere to go once its client is gone; "
                "use on_disconnect='cancel' or mode 'auto'"
            )
        if self.timeout is not None and not self.timeout > 0:
            raise RegistrationError(f"{where}: timeout must be positive, got {self.timeout}")
        if not self.sync_wait >= 0:
            raise RegistrationError(f"{where}: sync_wait must be >= 0, got {self.sync_wait}")
        if self.max_body is not None and self.max_body < 0:
            raise RegistrationError(f"{where}: max_body must be >= 0, got {self.max_body}")
        if self.body not in _BODIES:
            raise RegistrationError(f"{where}: body {self.body!r} is not one of {_BODIES}")
        if self.pool_key is not None:
            problem = pool_key_problem(self.pool_key)
            if problem is not None:
                raise RegistrationError(f"{where}: {problem}")
            if self.auth is None:
                raise RegistrationError(
                    f"{where}: pool_key {self.pool_key!r} needs auth: only an "
                    "authenticated caller has an identity or claims to choose a key by"
                )

    @property
    def params(self) -> tuple[str, ...]:
        """The names of the path parameters, in order."""
        return tuple(_PARAM.findall(self.path))

    @property
    def rule(self) -> str:
        """The path as a URL rule (``/users/<user_id>``)."""
        return _PARAM.sub(lambda m: f"<{m.group(1)}>", self.path)

    @property
    def shape(self) -> tuple[str, str]:
        """Method and path with parameter names erased: two routes with one shape clash."""
        return self.method, _PARAM.sub("{}", self.path)


def pool_key_problem(source: object) -> str | None:
    """What is wrong with a route's ``pool_key`` (None: nothing)."""
    if source == "identity" or (
        isinstance(source, str) and source.startswith("claim:") and source != "claim:"
    ):
        return None
    return f'pool_key must be "identity" or "claim:NAME", got {source!r}'


def _check_path(path: str, where: str) -> None:
    if not path.startswith("/"):
        raise RegistrationError(f"{where}: path {path!r} must start with '/'")
    names = _PARAM.findall(path)
    for name in names:
        if not _IDENTIFIER.match(name):
            raise RegistrationError(
                f"{where}: path parameter {{{name}}} must be a Python identifier"
            )
    if len(set(names)) != len(names):
        raise RegistrationError(f"{where}: path {path!r} repeats a parameter name")
    literal = _PARAM.sub("", path)
    if not _LITERAL.match(literal):
        raise RegistrationError(
            f"{where}: path {path!r} has characters a URL path cannot hold unescaped"
        )
    for segment in path.split("/"):
        if _PARAM.search(segment) and _PARAM.fullmatch(segment) is None:
            raise RegistrationError(
                f"{where}: a path parameter must be a whole segment, not {segment!r}"
            )
    prefix = covering_prefix(path, RESERVED_PREFIXES)
    if prefix is not None:
        raise RegistrationError(
            f"{where}: path {path!r} is under {prefix}, which the container serves itself"
        )


class RouteTable:
    """Routes by name, in declaration order; names and method+path shapes are unique."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}

    def add(self, route: Route) -> Route:
        if route.name in self._routes:
            raise RegistrationError(f"a route named {route.name!r} is already registered")
        for other in self._routes.values():
            if other.shape == route.shape:
                raise RegistrationError(
                    f"route {route.name!r} ({route.method} {route.path}) clashes with "
                    f"route {other.name!r} ({other.method} {other.path})"
                )
        self._routes[route.name] = route
        return route

    def get(self, name: str) -> Route:
        try:
            return self._routes[name]
        except KeyError:
            known = ", ".join(self._routes) or "none"
            raise RegistrationError(f"unknown route {name!r} (registered: {known})") from None

    def __iter__(self) -> Iterator[Route]:
        return iter(self._routes.values())

    def __len__(self) -> int:
        return len(self._routes)

    def as_dict(self) -> dict[str, Route]:
        return dict(self._routes)


@runtime_checkable
class RouteSource(Protocol):
    """Anything that keeps routes by name, as :class:`pipework.Registry` does."""

    @property
    def routes(self) -> Mapping[str, Route]: ...


def routes_of(registry: object) -> tuple[Route, ...]:
    """The routes ``registry`` keeps, in declaration order (none if it keeps no routes, as a
    plain :class:`~pipework.Catalogue`)."""
    return tuple(registry.routes.values()) if isinstance(registry, RouteSource) else ()
