"""Cross-origin requests (the Fetch standard's CORS protocol), decided from values alone.

A :class:`CorsPolicy` says which origins may call a route from a browser, with which
methods and request headers, which answer headers their scripts may read, whether
credentials (cookies, ``Authorization``) go along, and how long a browser may keep a
preflight's answer. The container and the proxy ask it two things:

- :meth:`CorsPolicy.preflight`: the answer to ``OPTIONS`` with
  ``Access-Control-Request-Method`` (a browser asking before it sends), given without a
  job, without authentication (a preflight carries no credentials) and without a slot;
- :meth:`CorsPolicy.response_headers`: the headers added to the real answer.

Every answer of a route with a policy carries ``Vary: Origin`` (its headers depend on the
origin, so a cache must not hand one origin's answer to another). An origin the policy
does not list gets no ``Access-Control-*`` header: the browser then keeps the answer from
the page. CORS protects browsers' users, not the server: a request from elsewhere is still
served (authentication is what refuses it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = ["CorsPolicy", "PreflightRefused", "check_origin", "is_preflight"]

#: Request headers a browser sends without asking (the CORS-safelisted ones).
_SAFELISTED: Final = frozenset({"accept", "accept-language", "content-language", "content-type"})
_ORIGIN: Final = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+\Z")
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")


def check_origin(origin: str) -> str | None:
    """What is wrong with ``origin`` as a configured origin (None: fine)."""
    if origin == "*":
        return None
    if not _ORIGIN.match(origin) or origin != origin.lower():
        return (
            f"{origin!r} is not an origin: write scheme://host[:port] in lower case, "
            'without a path (e.g. "https://app.example.com"), or "*"'
        )
    return None


def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
    """Whether a request is a CORS preflight (``OPTIONS`` with ``Origin`` and
    ``Access-Control-Request-Method``)."""
    return (
        method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers
    )


class PreflightRefused(Exception):
    """The preflight asks for what the policy does not allow (``str()`` says what)."""


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """``origins``: those allowed (``"*"``: any); ``methods``: those a preflight may ask
    for (upper case); ``headers``: request headers beyond the safelisted ones (``"*"``:
    any); ``expose``: answer headers scripts may read; ``credentials``: whether cookies and
    ``Authorization`` may go along (not with ``"*"`` origins); ``max_age``: seconds a
    browser may keep a preflight's answer (None: its default)."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("GET", "HEAD", "POST")
    headers: tuple[str, ...] = ()
    expose: tuple[str, ...] = ()
    credentials: bool = False
    max_age: int | None = None
    _any_origin: bool = field(init=False, repr=False, compare=False)
    _origins: frozenset[str] = field(init=False, repr=False, compare=False)
    _headers: frozenset[str] = field(init=False, repr=False, compare=False)
    _any_header: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for origin in self.origins:
            problem = check_origin(origin)
            if problem is not None:
                raise ValueError(problem)
        any_origin = "*" in self.origins
        if any_origin and self.credentials:
            raise ValueError(
                'credentials = true needs the origins listed: a browser refuses "*" with '
                "credentials"
            )
        for name in (*self.headers, *self.expose):
            if name != "*" and not _TOKEN.match(name):
                raise ValueError(f"{name!r} is not a header name")
        for method in self.methods:
            if not _TOKEN.match(method):
                raise ValueError(f"{method!r} is not a method")
        if self.max_age is not None and self.max_age < 0:
            raise ValueError("max_age must not be negative")
        object.__setattr__(self, "methods", tuple(m.upper() for m in self.methods))
        object.__setattr__(self, "_any_origin", any_origin)
        object.__setattr__(self, "_origins", frozenset(self.origins))
        object.__setattr__(self, "_headers", frozenset(h.lower() for h in self.headers))
        object.__setattr__(self, "_any_header", "*" in self.headers)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self._any_origin or origin in self._origins)

    def _allow_origin(self, origin: str) -> list[tuple[str, str]]:
        # "*" only when any origin is allowed and no credentials go along; else the origin
        # itself (with Vary: Origin, so caches keep one answer per origin).
        value = "*" if self._any_origin and not self.credentials else origin
        found = [("Access-Control-Allow-Origin", value)]
        if self.credentials:
            found.append(("Access-Control-Allow-Credentials", "true"))
        return found

    def response_headers(self, origin: str | None) -> list[tuple[str, str]]:
        """The headers the real answer to a request from ``origin`` gets."""
        found = [("Vary", "Origin")]
        if origin is None or not self.allows(origin):
            return found
        found += self._allow_origin(origin)
        if self.expose:
            found.append(("Access-Control-Expose-Headers", ", ".join(self.expose)))
        return found

    def preflight(
        self, origin: str, method: str, request_headers: str | None
    ) -> list[tuple[str, str]]:
        """The headers of a ``204`` answering a preflight; raises :class:`PreflightRefused`
        saying what the policy does not allow."""
        if not self.allows(origin):
            raise PreflightRefused(f"origin {origin} may not call this route")
        method = method.strip()
        if method not in self.methods:
            raise PreflightRefused(
                f"method {method} is not allowed from another origin here; allowed: "
                + ", ".join(self.methods)
            )
        asked = _names(request_headers)
        refused = (
            [h for h in asked if h not in self._headers and h not in _SAFELISTED]
            if not self._any_header
            else []
        )
        if refused:
            allowed = ", ".join(self.headers) or "none beyond the safelisted ones"
            raise PreflightRefused(
                f"request header {refused[0]} is not allowed from another origin here; "
                f"allowed: {allowed}"
            )
        found = [("Vary", "Origin, Access-Control-Request-Method, Access-Control-Request-Headers")]
        found += self._allow_origin(origin)
        found.append(("Access-Control-Allow-Methods", ", ".join(self.methods)))
        if asked:
            found.append(("Access-Control-Allow-Headers", ", ".join(asked)))
        if self.max_age is not None:
            found.append(("Access-Control-Max-Age", str(self.max_age)))
        return found


def _names(value: str | None) -> list[str]:
    if not value:
        return []
    return [name.strip().lower() for name in value.split(",") if name.strip()]


def header_pairs(pairs: Iterable[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """``pairs`` as ASGI header pairs."""
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in pairs]
