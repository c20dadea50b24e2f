"""Host names re-resolved (``[services.NAME] resolve = SECONDS``): each host given by name
becomes one host per address the name resolves to, so the balancer, health checks and
outlier ejection see every replica behind one DNS name (as Envoy's ``STRICT_DNS`` cluster
does). Each address keeps the name's weight and sends the name as its ``Host``."""

from __future__ import annotations

import ipaddress

import httpx
import trio

from ._resilience_spec import HostSpec

__all__ = ["is_address", "resolved_hosts", "same_names"]


def is_address(host: str) -> bool:
    """Whether ``host`` is an IP address already (nothing to resolve)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolved_hosts(endpoints: tuple[HostSpec, ...]) -> tuple[HostSpec, ...]:
    """``endpoints`` with each host name replaced by its addresses (sorted, each URL once:
    the first name that reaches an address names it). OSError (``socket.gaierror``) when a
    name does not resolve: the caller keeps the hosts it has."""
    found: dict[str, HostSpec] = {}
    for spec in endpoints:
        url = httpx.URL(spec.url)
        if is_address(url.host):
            found.setdefault(spec.url, spec)
            continue
        port = url.port if url.port is not None else 80
        infos = await trio.socket.getaddrinfo(url.host, port, type=trio.socket.SOCK_STREAM)
        authority = url.netloc.decode("ascii")
        for address in sorted({str(info[4][0]) for info in infos}):
            resolved = str(url.copy_with(host=address))
            found.setdefault(resolved, HostSpec(resolved, spec.weight, authority=authority))
    return tuple(found.values())


def same_names(hosts: tuple[HostSpec, ...], endpoints: tuple[HostSpec, ...]) -> bool:
    """Whether ``hosts`` were resolved from ``endpoints``: every host names one of them
    (by ``Host`` and weight) and every name is there. A reload that keeps the names keeps
    the addresses found, with all their hosts learnt."""
    names = {(httpx.URL(e.url).netloc.decode("ascii"), e.weight) for e in endpoints}
    named = {(h.authority or httpx.URL(h.url).netloc.decode("ascii"), h.weight) for h in hosts}
    return named == names
