"""Proxy routes: which requests pass through to a service as they are, and the target sent on.

A :class:`ProxyRoute` is frozen data checked when it is made, as a chain route is: a bad
declaration fails at start-up with the route's name in the message. A
:class:`ProxyTable` matches a request to one; it does no I/O.

Rules (each tied to a test in tests/test_proxy_route.py):

- **A prefix owns whole segments.** ``/api`` covers ``/api``, ``/api/`` and ``/api/x``,
  never ``/apix``; ``/api/`` and ``/api`` are the same prefix; ``/`` covers every path.
- **Matching is on the decoded path** (the ASGI ``path``), **the target on the raw one**
  (``raw_path``): the percent-encoding the client sent is kept, and the query goes on byte
  for byte. Stripping or rewriting the prefix replaces only the raw bytes that decode to
  it, and the rest must start at a literal ``/`` (an encoded slash there is refused).
- **Dot segments are refused** (``.`` and ``..``, encoded or not): a backend resolving
  ``/api/../admin`` would serve a path outside the route's prefix, so no such target is
  ever sent (:class:`BadTarget`; the handler answers 400).
- **The longest prefix whose route takes the method wins.** When prefixes cover the path
  but none of their routes takes the method, the answer is a :class:`ProxyMiss` carrying
  the methods that would have been taken (a 405 with ``Allow``).
- **The container's own paths are never proxied**, not even under the prefix ``/``
  (``PROXY_RESERVED_PREFIXES``): a prefix under them is refused, and the table answers
  None for them so the container serves them.
- **Listing ``GET`` lets ``HEAD`` through too**, as every HTTP server treats them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Final, Literal, get_args
from urllib.parse import unquote_to_bytes

from .._errors import RegistrationError
from .._http._paths import PROXY_RESERVED_PREFIXES, covering_prefix, under

__all__ = [
    "BadTarget",
    "HostPolicy",
    "ProxyMiss",
    "ProxyRoute",
    "ProxyTable",
    "Shadow",
    "check_prefix",
    "check_rewrite",
    "is_method",
    "shadowing",
]

HostPolicy = Literal["service", "keep"]
#: How a proxy prefix covers a chain route's path: every request it takes, or some of them.
Shadow = Literal["all", "some"]

_HOSTS: Final = get_args(HostPolicy)
# RFC 9110 §5.6.2: a method is a token.
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
# Literal path text: RFC 3986 path characters; a prefix is matched against the decoded
# path, so it holds no percent-encoding.
_PREFIX: Final = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/]*\Z")
# A rewrite is sent as it is written: path characters and valid percent-encodings.
_REWRITE: Final = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/]|%[0-9A-Fa-f]{2})*\Z")
_HEX: Final = frozenset(b"0123456789abcdefABCDEF")
_PARAM: Final = re.compile(r"\{[^{}]*\}\Z")


class BadTarget(ValueError):
    """A request path no target may be built from for this route: it holds dot segments,
    or its raw form does not start with the route's prefix at a literal ``/``."""


@dataclass(frozen=True, slots=True)
class ProxyMiss:
    """Prefixes cover the path, but none of their routes takes the method: answer 405 with
    ``Allow: <allow>`` (sorted, upper-case)."""

    allow: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """Requests under ``prefix`` (with a method in ``methods``; None: any) pass through to
    ``service``.

    - ``strip_prefix`` sends ``/api/x`` as ``/x`` (and ``/api`` as ``/``); ``rewrite``
      replaces the prefix (``"/v2"``: ``/api/x`` as ``/v2/x``); not both.
    - ``host``: the ``Host`` sent is the service's (``"service"``) or the client's
      (``"keep"``).
    - ``key`` is the pool key whose slot the call holds (None: the service's name; see
      :attr:`pool_key`).
    - ``timeout`` bounds the whole exchange, ``connect_timeout`` the connection,
      ``first_byte_timeout`` the wait for the answer's head once the request is sent,
      ``idle_timeout`` each wait for a body chunk either way (None: the defaults the
      handler applies). ``max_body`` caps the request body in bytes (None: no cap).
    - ``chain`` runs on the request's head before it is passed on, ``after`` on the
      answer's head (chain names; None: none). ``websocket``: upgrade requests are proxied
      as websockets.

    ``prefix`` is kept without its trailing slash (``"/"`` stays ``"/"``); ``methods`` is
    kept upper-case, with ``HEAD`` added when ``GET`` is listed.
    """

    name: str
    service: str
    prefix: str
    methods: frozenset[str] | None = None
    strip_prefix: bool = False
    rewrite: str | None = None
    host: HostPolicy = "service"
    key: str | None = None
    timeout: float | None = None
    connect_timeout: float | None = None
    first_byte_timeout: float | None = None
    idle_timeout: float | None = None
    max_body: int | None = None
    chain: str | None = None
    after: str | None = None
    websocket: bool = True
    # The prefix as matched ("" for "/"), and what replaces its raw bytes in the target
    # (None: the raw path goes on unchanged).
    _match: str = field(init=False, repr=False, compare=False)
    _replace: bytes | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RegistrationError("a proxy route needs a non-empty name")
        where = f"proxy route {self.name!r}"
        if not isinstance(self.service, str) or not self.service:
            raise RegistrationError(f"{where}: name the service it passes requests to")
        prefix = check_prefix(self.prefix, where)
        object.__setattr__(self, "prefix", prefix)
        object.__setattr__(self, "_match", "" if prefix == "/" else prefix)
        object.__setattr__(self, "methods", _methods(self.methods, where))
        if not isinstance(self.strip_prefix, bool):
            raise RegistrationError(f"{where}: strip_prefix must be True or False")
        replace: bytes | None = b"" if self.strip_prefix else None
        if self.rewrite is not None:
            if self.strip_prefix:
                raise RegistrationError(
                    f"{where}: strip_prefix and rewrite both replace the prefix; set one"
                )
            rewrite = check_rewrite(self.rewrite, where)
            object.__setattr__(self, "rewrite", rewrite)
            replace = b"" if rewrite == "/" else rewrite.encode("ascii")
        object.__setattr__(self, "_replace", replace)
        if self.host not in _HOSTS:
            raise RegistrationError(f"{where}: host {self.host!r} is not one of {_HOSTS}")
        for name in ("key", "chain", "after"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RegistrationError(f"{where}: {name} must be a non-empty string or None")
        for name in ("timeout", "connect_timeout", "first_byte_timeout", "idle_timeout"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RegistrationError(f"{where}: {name} must be a number of seconds or None")
            if not (math.isfinite(value) and value > 0):
                raise RegistrationError(f"{where}: {name} must be positive, got {value}")
        if self.max_body is not None and (
            isinstance(self.max_body, bool)
            or not isinstance(self.max_body, int)
            or self.max_body < 0
        ):
            raise RegistrationError(
                f"{where}: max_body must be a number of bytes (>= 0) or None, got {self.max_body!r}"
            )
        if not isinstance(self.websocket, bool):
            raise RegistrationError(f"{where}: websocket must be True or False")

    @property
    def pool_key(self) -> str:
        """The pool key whose slot a call holds: ``key``, else the service's name."""
        return self.key if self.key is not None else self.service

    def covers(self, path: str) -> bool:
        """Whether the decoded ``path`` is under this route's prefix."""
        return path.startswith("/") if not self._match else under(path, self._match)

    def takes(self, method: str) -> bool:
        """Whether this route takes ``method`` (an upper-case token)."""
        return self.methods is None or method in self.methods

    def target(self, raw_path: bytes, query: bytes) -> bytes:
        """The request target sent on: ``raw_path`` with the prefix mapped (its
        percent-encoding kept), then ``?`` and ``query`` byte for byte when there is one.

        Raises :class:`BadTarget` for a path with dot segments, or one whose raw form
        does not start with the prefix at a literal ``/``."""
        if not raw_path.startswith(b"/"):
            raise BadTarget(f"the path {_show(raw_path)} does not start with '/'")
        if b"." in raw_path or b"%" in raw_path:  # no dot segment can hide otherwise
            for segment in unquote_to_bytes(raw_path).split(b"/"):
                if segment in (b".", b".."):
                    raise BadTarget(
                        f"the path {_show(raw_path)} has a '.' or '..' segment; "
                        "send it with dot segments resolved"
                    )
        path = raw_path
        if self._replace is not None:
            path = self._replace + self._rest(raw_path) or b"/"
        return path + b"?" + query if query else path

    def _rest(self, raw: bytes) -> bytes:
        """What follows the bytes of ``raw`` that decode to the prefix."""
        prefix = self._match.encode("ascii")
        n = len(prefix)
        if raw.startswith(prefix) and (len(raw) == n or raw[n] == 0x2F):
            return raw[n:]  # the prefix written plainly: the usual case
        i = 0
        for expected in prefix:
            if i + 2 < len(raw) and raw[i] == 0x25 and raw[i + 1] in _HEX and raw[i + 2] in _HEX:
                got, i = int(raw[i + 1 : i + 3], 16), i + 3
            elif i < len(raw):
                got, i = raw[i], i + 1
            else:
                got = -1
            if got != expected:
                raise BadTarget(f"the path {_show(raw)} is not under {self.prefix}")
        rest = raw[i:]
        if rest and rest[0] != 0x2F:
            raise BadTarget(
                f"the path {_show(raw)} continues {self.prefix} with {_show(rest[:3])}, "
                "not '/'; write the slash after the prefix unencoded"
            )
        return rest


def check_prefix(prefix: object, where: str) -> str:
    """``prefix`` normalised (no trailing slash but for ``/``); RegistrationError if it is
    not a literal path outside the container's own."""
    if not isinstance(prefix, str):
        raise RegistrationError(f"{where}: prefix must be a string, got {prefix!r}")
    if not prefix.startswith("/"):
        raise RegistrationError(f"{where}: prefix {prefix!r} must start with '/'")
    if not _PREFIX.match(prefix):
        raise RegistrationError(
            f"{where}: prefix {prefix!r} may hold only the characters of a URL path, "
            "unencoded (it is matched against the decoded path)"
        )
    normal = prefix[:-1] if len(prefix) > 1 and prefix.endswith("/") else prefix
    _check_segments(normal, "prefix", prefix, where)
    reserved = covering_prefix(normal, PROXY_RESERVED_PREFIXES)
    if reserved is not None:
        raise RegistrationError(
            f"{where}: prefix {prefix!r} is under {reserved}, which the container serves itself"
        )
    return normal


def check_rewrite(rewrite: object, where: str) -> str:
    """``rewrite`` normalised as a prefix is; RegistrationError if it is no path."""
    if not isinstance(rewrite, str):
        raise RegistrationError(f"{where}: rewrite must be a string, got {rewrite!r}")
    if not rewrite.startswith("/"):
        raise RegistrationError(f"{where}: rewrite {rewrite!r} must start with '/'")
    if not _REWRITE.match(rewrite):
        raise RegistrationError(
            f"{where}: rewrite {rewrite!r} may hold only the characters of a URL path "
            "and %XX escapes"
        )
    normal = rewrite[:-1] if len(rewrite) > 1 and rewrite.endswith("/") else rewrite
    _check_segments(unquote_to_bytes(normal).decode("latin-1"), "rewrite", rewrite, where)
    return normal


def _check_segments(normal: str, what: str, given: str, where: str) -> None:
    if normal == "/":
        return
    for segment in normal.split("/")[1:]:
        if not segment:
            raise RegistrationError(f"{where}: {what} {given!r} has an empty segment ('//')")
        if segment in (".", ".."):
            raise RegistrationError(f"{where}: {what} {given!r} has a {segment!r} segment")


def is_method(text: str) -> bool:
    """Whether ``text`` is an HTTP method name (a token, RFC 9110 §9.1)."""
    return _TOKEN.match(text) is not None


def _methods(methods: object, where: str) -> frozenset[str] | None:
    if methods is None:
        return None
    if isinstance(methods, str | bytes) or not isinstance(methods, Iterable):
        raise RegistrationError(
            f"{where}: methods must be a set of method names or None (any), got {methods!r}"
        )
    found: set[str] = set()
    for method in methods:
        if not isinstance(method, str) or not is_method(method):
            raise RegistrationError(f"{where}: {method!r} is not an HTTP method token")
        found.add(method.upper())
    if not found:
        raise RegistrationError(f"{where}: methods is empty; list some, or None for any")
    if "GET" in found:
        found.add("HEAD")
    return frozenset(found)


def _show(raw: bytes) -> str:
    text = raw.decode("ascii", "backslashreplace")
    return repr(text if len(text) <= 80 else text[:77] + "...")


def shadowing(prefix: str, path: str) -> Shadow | None:
    """How the proxy ``prefix`` covers a chain route's ``path`` (with ``{name}``
    segments): ``"all"`` of its requests, ``"some"`` (a parameter segment can take the
    prefix's text), or None."""
    if covering_prefix(path, PROXY_RESERVED_PREFIXES) is not None:
        return None  # the table never proxies the container's own paths
    wanted = [] if prefix == "/" else prefix.rstrip("/").split("/")[1:]
    segments = path.split("/")[1:]
    if not wanted:  # "/": every path, but a parameter may name one of the container's
        return "some" if _PARAM.match(segments[0]) else "all"
    if len(segments) < len(wanted):
        return None
    shadow: Shadow = "all"
    for want, segment in zip(wanted, segments, strict=False):
        if segment == want:
            continue
        if _PARAM.match(segment):
            shadow = "some"
            continue
        return None
    return shadow


class ProxyTable:
    """Proxy routes by prefix. Names are unique; two routes with one prefix clash when a
    method could reach both (a route taking any method clashes with every other)."""

    def __init__(self, routes: Iterable[ProxyRoute] = ()) -> None:
        self._routes: dict[str, ProxyRoute] = {}
        self._by_prefix: dict[str, list[ProxyRoute]] = {}
        # Whether a prefix covers the container's paths: only "/" can.
        self._guarded = False
        for route in routes:
            self.add(route)

    def add(self, route: ProxyRoute) -> ProxyRoute:
        """Add ``route``; RegistrationError if its name is taken or it clashes."""
        if route.name in self._routes:
            raise RegistrationError(f"a proxy route named {route.name!r} is already registered")
        same = self._by_prefix.setdefault(route._match, [])
        for other in same:
            if route.methods is None or other.methods is None or route.methods & other.methods:
                both = (
                    "any method"
                    if route.methods is None or other.methods is None
                    else ", ".join(sorted(route.methods & other.methods))
                )
                raise RegistrationError(
                    f"proxy route {route.name!r} clashes with proxy route {other.name!r}: "
                    f"both take {both} under {route.prefix}"
                )
        same.append(route)
        self._routes[route.name] = route
        self._guarded = self._guarded or any(map(route.covers, PROXY_RESERVED_PREFIXES))
        return route

    def match(self, path: str, method: str) -> ProxyRoute | ProxyMiss | None:
        """The route for the decoded ``path`` and ``method``: the longest prefix covering
        ``path`` whose route takes ``method``; a :class:`ProxyMiss` if prefixes cover it but
        none takes the method; None if no prefix covers it (the container serves it)."""
        if not self._by_prefix or not path.startswith("/"):
            return None
        if self._guarded and covering_prefix(path, PROXY_RESERVED_PREFIXES) is not None:
            return None
        method = method.upper()
        allow: set[str] = set()
        end = len(path)
        while True:
            for route in self._by_prefix.get(path[:end], ()):
                if route.methods is None or method in route.methods:
                    return route
                allow.update(route.methods)
            if end == 0:
                break
            end = path.rfind("/", 0, end)
        return ProxyMiss(tuple(sorted(allow))) if allow else None

    def get(self, name: str) -> ProxyRoute:
        try:
            return self._routes[name]
        except KeyError:
            known = ", ".join(self._routes) or "none"
            raise RegistrationError(f"unknown proxy route {name!r} (registered: {known})") from None

    def __iter__(self) -> Iterator[ProxyRoute]:
        return iter(self._routes.values())

    def __len__(self) -> int:
        return len(self._routes)

    def __bool__(self) -> bool:
        return bool(self._routes)
