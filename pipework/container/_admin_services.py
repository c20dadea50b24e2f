"""The admin API's hand on the backend services' hosts: read each host's state, drain a host
and restore it (``/admin/services/...``, see :class:`~._admin.AdminApi`).

The container does not import the backends: it declares here what it needs of them
(:class:`Upstreams`, and the shape of what it reads), and whoever builds the container
hands it an implementation -- the gateway its current plan's ``Backends``, swapped in at
each reload. The state read is the services' resilience cores' (docs/resilience.md).

A host is named in a path by its address as its URL writes it, ``host:port``
(``search-1:9200``): a service's hosts share scheme and path, so the address tells them
apart, and it needs no escaping in a path.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

from .._http._problems import Problem

__all__ = [
    "BreakerView",
    "HostView",
    "ServiceView",
    "Upstreams",
    "address",
    "find_host",
    "find_service",
    "host_document",
    "service_document",
    "services_document",
]


class HostView(Protocol):
    """One host of a service, as its core sees it now."""

    @property
    def url(self) -> str: ...
    @property
    def weight(self) -> int: ...
    @property
    def state(self) -> str: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def ejected(self) -> bool: ...
    @property
    def draining(self) -> bool: ...
    @property
    def outstanding(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def failures(self) -> int: ...
    @property
    def latency(self) -> float | None: ...
    @property
    def ejections(self) -> int: ...
    @property
    def ejected_for(self) -> float: ...


class BreakerView(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def opened(self) -> int: ...
    @property
    def retry_after(self) -> float: ...


class ServiceView(Protocol):
    """One service's hosts and breaker now."""

    @property
    def balance(self) -> str: ...
    @property
    def hosts(self) -> Sequence[HostView]: ...
    @property
    def available(self) -> int: ...
    @property
    def panic(self) -> bool: ...
    @property
    def breaker(self) -> BreakerView: ...


class Upstreams(Protocol):
    """The backend services, as the admin API drives them (``Backends`` is one)."""

    def resilience(self) -> Mapping[str, ServiceView | None]:
        """Every declared service by name; None for one whose calls do not go through a
        resilience core (nothing to drain)."""
        ...

    def drain(self, service: str, url: str) -> bool:
        """No new tries to host ``url``, those out finish; False if it was drained."""
        ...

    def restore(self, service: str, url: str) -> bool:
        """Host ``url`` back in rotation; False if it was not drained."""
        ...


def address(url: str) -> str:
    """How a path names the host of ``url``: its ``host:port`` as the URL writes it."""
    return urlsplit(url).netloc


def find_service(upstreams: Upstreams | None, name: str) -> ServiceView:
    """The service ``name``'s state, or the problem an operator reads: 404 for a service
    the gateway does not declare, 409 for one without a resilience core."""
    services = upstreams.resilience() if upstreams is not None else {}
    if name not in services:
        close = difflib.get_close_matches(name, sorted(services), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise Problem(
            404,
            "Not Found",
            f"no service {name!r}{hint} (declared: {', '.join(sorted(services)) or 'none'})",
            slug="admin-unknown-service",
        )
    found = services[name]
    if found is None:
        raise Problem(
            409,
            "Conflict",
            f"service {name!r} is not called through pipework's own client (the backends "
            "were given an httpx transport): it has no hosts to drain or restore",
            slug="admin-service-not-balanced",
        )
    return found


def find_host(service: str, view: ServiceView, host: str) -> HostView:
    """The host of ``view`` that ``host`` names (its ``host:port``; case does not matter
    in a host name), or 404 listing the service's hosts."""
    wanted = host.lower()
    for one in view.hosts:
        if address(one.url).lower() == wanted:
            return one
    names = [address(h.url) for h in view.hosts]
    close = difflib.get_close_matches(host, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise Problem(
        404,
        "Not Found",
        f"service {service!r} has no host {host!r}{hint} (its hosts, by host:port: "
        f"{', '.join(names)})",
        slug="admin-unknown-host",
    )


def host_document(h: HostView) -> dict[str, Any]:
    return {
        "host": address(h.url),
        "url": h.url,
        "weight": h.weight,
        "state": h.state,
        "healthy": h.healthy,
        "ejected": h.ejected,
        "draining": h.draining,
        "outstanding": h.outstanding,
        "requests": h.requests,
        "failures": h.failures,
        "latency": h.latency,
        "ejections": h.ejections,
        "ejected_for": h.ejected_for,
    }


def service_document(view: ServiceView | None) -> dict[str, Any]:
    if view is None:
        return {"balanced": False, "hosts": []}
    b = view.breaker
    return {
        "balanced": True,
        "balance": view.balance,
        "available": view.available,
        "panic": view.panic,
        "breaker": {
            "state": b.state,
            "reason": b.reason,
            "opened": b.opened,
            "retry_after": b.retry_after,
        },
        "hosts": [host_document(h) for h in view.hosts],
    }


def services_document(upstreams: Upstreams | None) -> dict[str, Any]:
    services = upstreams.resilience() if upstreams is not None else {}
    return {"services": {name: service_document(services[name]) for name in sorted(services)}}
