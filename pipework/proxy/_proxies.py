"""The proxy routes in force and their services (:class:`ProxySet`), as one value.

Apart from :mod:`._asgi` because every part of the proxy layer takes the set an exchange
started with (the HTTP exchange, the websocket), and the container and the registry build
and swap it without the layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .._http._auth import RouteAuth
from .._http._cors import CorsPolicy
from ._route import ProxyTable
from ._upstream import Upstream

__all__ = ["ProxySet"]


@dataclass(frozen=True, slots=True)
class ProxySet:
    """The proxy routes in force and their services: swapped whole on reload. ``clients``
    maps a service's name to its :class:`Upstream`."""

    table: ProxyTable
    clients: dict[str, Upstream] = field(default_factory=dict)
    #: Who may call each route (by route name; absent: anyone), checked before a slot.
    auth: Mapping[str, RouteAuth] = field(default_factory=dict)
    #: Which other origins' pages may call each route (by route name; absent: the gateway
    #: leaves CORS, preflights included, to the service).
    cors: Mapping[str, CorsPolicy] = field(default_factory=dict)
