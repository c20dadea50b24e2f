"""The state a service client holds, and the hosts in it: the service, its resilience core
(:mod:`._hosts_core`) and each host's :class:`HostLink` -- the keep-alive pool to it and the
``Host`` its requests carry, kept as the core's ``Host.tag`` -- made on first use and kept
in step as the hosts change: a reload's new plan (:meth:`ClientHosts.adopt`), the names a
service resolves again (:meth:`ClientHosts.resolve_hosts`), the operator's drain and restore
(the admin API). :meth:`ClientHosts.report` logs what changed in the core.

Separate from what the client does with its hosts (its calls, health checks and proxied
exchanges, each a module of its own over :class:`ClientHosts`): this is what they share.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import replace

import httpx
import trio

from ._balance_core import Host
from ._hosts_core import (
    BreakerChanged,
    HealthChanged,
    HostEjected,
    HostReturned,
    ServiceCore,
)
from ._http_spec import Service
from ._pool import Pool
from ._resilience_spec import HostSpec
from ._resolve import resolved_hosts, same_names

__all__ = ["ClientHosts", "HostLink", "port_of"]

_log = logging.getLogger("pipework.backends")


class HostLink:
    """What the client keeps for one host (its ``Host.tag``): the pool of connections to
    it and the ``Host`` header its requests carry."""

    __slots__ = ("netloc", "pool", "url")

    def __init__(self, url: str, pool: Pool, netloc: bytes) -> None:
        self.url = url
        self.pool = pool
        self.netloc = netloc


class ClientHosts:
    """A service client's service, core and hosts (see the module); the headers every
    request to the service carries (its own over the client's ``User-Agent``), its base
    path and ``Host``. :class:`~._client.ServiceClient` says what the arguments are."""

    def __init__(
        self,
        service: Service,
        user_agent: str,
        pool: Pool | None = None,
        *,
        core: ServiceCore | None = None,
        rng: random.Random | None = None,
    ) -> None:
        url = service.url
        if url.scheme not in ("http", "https"):
            raise ValueError(f"the lean client speaks http and https, not {url.scheme}")
        if pool is not None and len(service.endpoints) > 1:
            raise ValueError("a pool may be given only for a service of one host")
        self.service = service
        #: Every host's connections share it (None for http://); TlsFileError here.
        self.ssl_context = service.ssl_context()
        if core is None:
            core = ServiceCore(service.name, service.resilience, rng=rng)
        else:
            core.reconfigure(service.resilience, trio.current_time())
        self.core = core
        self._links: dict[str, HostLink] = {}
        self._checks: dict[str, Pool] = {}  # each host's health-check connection
        self._closed = False
        for host in core.hosts:
            host.tag = self._link(host, pool)
        self._base = url.raw_path.rstrip(b"/").decode("ascii")
        self._raw_base = self._base.encode("ascii")
        self._host = url.netloc
        # Service headers over the client's own, as httpx merges them; lower name -> pair.
        base: dict[str, tuple[str, str]] = {"user-agent": ("User-Agent", user_agent)}
        for name, value in service.headers.items():
            base[name.lower()] = (name, value)
        self._headers = base

    @property
    def pool(self) -> Pool:
        """The first host's pool (the only one of a service with a ``base_url``)."""
        return self._link(self.core.hosts[0]).pool

    @property
    def links(self) -> Mapping[str, HostLink]:
        """Each host's pool, by the host's URL."""
        return self._links

    def _link(self, host: Host, pool: Pool | None = None) -> HostLink:
        """The host's link, made on first use: a core carried over by a reload may pick a
        host this client's plan did not have, for the tries of the calls still on it."""
        link = self._links.get(host.url)
        if link is None:
            service = self.service
            url = httpx.URL(host.url)
            if pool is None:
                pool = Pool(
                    url.host,
                    port_of(url),
                    max_connections=service.max_connections,
                    max_idle=service.max_keepalive,
                    idle_timeout=service.keepalive_expiry,
                    connect_timeout=(
                        service.timeout
                        if service.connect_timeout is None
                        else service.connect_timeout
                    ),
                    ssl_context=self.ssl_context,
                    server_name=self._server_name(host.spec),
                )
            authority = host.spec.authority
            netloc = url.netloc if authority is None else authority.encode("ascii")
            link = self._links[host.url] = HostLink(host.url, pool, netloc)
        return link

    def _server_name(self, spec: HostSpec) -> str:
        """The name a host's certificate is checked against (and sent as SNI): the
        service's ``server_name``, else the name the host was given by -- its address
        found by ``resolve`` still goes by the name (``authority``)."""
        if self.service.server_name is not None:
            return self.service.server_name
        if spec.authority is not None:
            return httpx.URL(f"//{spec.authority}").host
        return httpx.URL(spec.url).host

    def adopt(self, core: ServiceCore) -> None:
        """Take over ``core`` (the previous plan's, on a reload) with this client's settings:
        hosts that stay keep what they learnt (:meth:`ServiceCore.reconfigure`), and the
        addresses found for host names that stay are kept until they are resolved again."""
        resilience = self.service.resilience
        if self.service.resolve is not None and same_names(core.resilience.hosts, resilience.hosts):
            resilience = replace(resilience, hosts=core.resilience.hosts)
        core.reconfigure(resilience, trio.current_time())
        self.core = core
        for host in core.hosts:
            host.tag = self._link(host)

    async def resolve_hosts(self) -> None:
        """Every ``resolve`` seconds, the hosts given by name become their addresses,
        forever (cancel to stop). A name that does not resolve keeps the hosts there are."""
        every = self.service.resolve
        failing = False
        while every is not None and not self._closed:
            try:
                hosts = await resolved_hosts(self.service.endpoints)
            except OSError as exc:
                if not failing:  # once per run of failures: each try would say the same
                    _log.warning(
                        "service %r: its host names did not resolve (%s); its hosts stay %s",
                        self.service.name,
                        exc,
                        ", ".join(h.url for h in self.core.hosts),
                    )
                failing = True
            else:
                failing = False
                if hosts != self.core.resilience.hosts:
                    self.core.reconfigure(
                        replace(self.core.resilience, hosts=hosts), trio.current_time()
                    )
                    for host in self.core.hosts:
                        host.tag = self._link(host)
                    _log.info(
                        "service %r: hosts %s",
                        self.service.name,
                        ", ".join(h.url for h in self.core.hosts),
                    )
            await trio.sleep(every)

    # -- the operator's hand (the admin API) -------------------------------------------------

    def drain(self, url: str) -> bool:
        """Take host ``url`` out of rotation: no new tries go to it, those out finish.
        False when it was drained already; KeyError for a host the service does not have."""
        host = self.core.host(url)
        changed = not host.draining
        self.core.drain(url, trio.current_time())
        name = self.service.name
        if changed:
            _log.info(
                "service %r: host %s drained; %d tries out finish", name, url, host.outstanding
            )
        if all(h.draining for h in self.core.hosts):
            _log.warning(
                "service %r: every host is drained; its calls are refused until one is restored",
                name,
            )
        self.report()  # the breaker opens if the hosts left are all out
        return changed

    def restore(self, url: str) -> bool:
        """Put a drained host back in rotation (its health and ejection still apply).
        False when it was not drained; KeyError for a host the service does not have."""
        host = self.core.host(url)
        changed = host.draining
        self.core.restore(url, trio.current_time())
        if changed:
            _log.info("service %r: host %s restored", self.service.name, url)
        self.report()
        return changed

    async def aclose(self) -> None:
        self._closed = True
        for link in list(self._links.values()):
            await link.pool.aclose()
        for pool in list(self._checks.values()):
            await pool.aclose()

    def report(self) -> None:
        """Log what changed in the service's core: a host ejected or back, a health
        change, the breaker moving (one line each, on the ``pipework.backends`` logger)."""
        name = self.service.name
        for event in self.core.pop_events():
            if isinstance(event, HostEjected):
                _log.warning(
                    "service %r: host %s ejected (%s), ejection %d, for %.3g s",
                    name,
                    event.url,
                    event.rule,
                    event.ejections,
                    max(0.0, event.until - trio.current_time()),
                )
            elif isinstance(event, HostReturned):
                _log.info("service %r: host %s is back from its ejection", name, event.url)
            elif isinstance(event, HealthChanged):
                level = logging.INFO if event.healthy else logging.WARNING
                health = "healthy" if event.healthy else "unhealthy"
                _log.log(level, "service %r: host %s is %s", name, event.url, health)
            elif isinstance(event, BreakerChanged):
                level = logging.INFO if event.state == "closed" else logging.WARNING
                _log.log(
                    level,
                    "service %r: circuit breaker %s%s",
                    name,
                    event.state,
                    "" if event.reason is None else f" ({event.reason})",
                )

    def _host_headers(
        self, headers: list[tuple[bytes, bytes]], link: HostLink
    ) -> list[tuple[bytes, bytes]]:
        """``headers`` with the service's own ``Host`` (its first host's) changed to
        ``link``'s: each host of a service gets its own name, as a call's does. A ``Host``
        the caller chose (the client's, kept) goes as it is."""
        own = self._host
        if link.netloc == own:
            return headers
        return [
            (name, self.host_for(value, link)) if name.lower() == b"host" else (name, value)
            for name, value in headers
        ]

    def host_for(self, host: bytes, link: HostLink) -> bytes:
        """The ``Host`` to send ``link``'s host for a request that carries ``host``: its own
        name for the service's (its first host's), else ``host`` as it is."""
        return link.netloc if host == self._host else host


def port_of(url: httpx.URL) -> int:
    if url.port is not None:
        return url.port
    return 443 if url.scheme == "https" else 80
