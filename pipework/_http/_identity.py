"""Who a request is, once something at the edge has established it: the one place where
authentication leaves its answer and where rate limits (and anything after them) read it.

The place is the ASGI scope's ``"pipework.identity"`` entry (:data:`IDENTITY`), the same
dict for a proxy route (served in front of Quart) and a chain route (Quart's
``request.scope``). Its value is a mapping:

- ``"id"``: a string naming who the request is (a JWT's ``sub``, an API key's name);
- ``"claims"``: a mapping of the claims that came with it (a JWT's payload; empty for an
  API key).

Whatever authenticates a request sets the entry before the rate limits are checked (see
docs/edge-policy.md for the order); a request nobody authenticated has no entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "IDENTITY",
    "POOL_KEY_PREFIX",
    "claim_of",
    "identity_of",
    "pool_key_of",
    "set_identity",
]

#: The ASGI scope's key for the request's identity mapping.
IDENTITY: Final = "pipework.identity"
#: What starts a pool key chosen by a request's identity or claim (a route's ``pool_key``):
#: a service's or a named key's name has no ``:``, so a caller can never choose one.
POOL_KEY_PREFIX: Final = "tenant:"


def set_identity(
    scope: dict[str, Any] | Any, ident: str, claims: Mapping[str, Any] | None = None
) -> None:
    """Record that the request of ``scope`` is ``ident``, with ``claims``."""
    scope[IDENTITY] = {"id": ident, "claims": dict(claims or {})}


def identity_of(scope: Mapping[str, Any]) -> str | None:
    """The request's identity (``"id"``), or None when nothing established one."""
    found = scope.get(IDENTITY)
    if not isinstance(found, Mapping):
        return None
    ident = found.get("id")
    return ident if isinstance(ident, str) and ident else None


def claim_of(scope: Mapping[str, Any], name: str) -> str | None:
    """The claim ``name`` as text (a string, or a number or boolean written as JSON
    would), or None: no identity, no such claim, or one that is a list or an object."""
    found = scope.get(IDENTITY)
    claims = found.get("claims") if isinstance(found, Mapping) else None
    if not isinstance(claims, Mapping):
        return None
    value = claims.get(name)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value) if value != "" else None
    return None


def pool_key_of(scope: Mapping[str, Any], source: str) -> str | None:
    """The pool key ``source`` chooses for the request of ``scope``: ``"identity"`` (its
    identity) or ``"claim:NAME"`` (that claim, read as :func:`claim_of` reads it), behind
    :data:`POOL_KEY_PREFIX`; None when the request has no such identity or claim."""
    if source == "identity":
        value = identity_of(scope)
    else:
        value = claim_of(scope, source.removeprefix("claim:"))
    return None if value is None else POOL_KEY_PREFIX + value
