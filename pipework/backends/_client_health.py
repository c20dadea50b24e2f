"""A service client's active health checks: every ``health.interval``, ``GET health.path``
on each host, on a connection of its own (never queued behind the traffic, never counted as
a try), its result told to the service's core (:meth:`~._hosts_core.ServiceCore.health_check`).

Separate from the calls (:mod:`._client_tries`): a check is no call of the core's, and
runs as a task of its own beside them.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Final

import httpx
import trio

from ._client_hosts import ClientHosts, port_of
from ._failures import TransportFailure
from ._pool import Pool, ResponseTooLarge

__all__ = ["HealthChecks"]

#: A health check's answer is read only to its status; a body past this is not read.
_CHECK_MAX_BYTES: Final = 64 * 1024


class HealthChecks(ClientHosts):
    """The health checks of a :class:`ClientHosts`' service (see the module)."""

    async def check_health(self) -> None:
        """Check every host of the service every ``health.interval``, forever (cancel to
        stop): ``GET health.path`` on a connection of its own -- never queued behind the
        traffic, never counted as a try -- passes with an expected status within
        ``health.timeout``. Each result goes to :meth:`ServiceCore.health_check`."""
        while not self._closed:
            spec = self.core.resilience.health
            if spec is None:
                return
            started = trio.current_time()
            async with trio.open_nursery() as nursery:
                for host in self.core.hosts:
                    nursery.start_soon(self._check, host.url)
            await trio.sleep_until(started + spec.interval)

    async def _check(self, url: str) -> None:
        spec = self.core.resilience.health
        if spec is None:
            return
        parsed = httpx.URL(url)
        pool = self._checks.get(url)
        if pool is None:
            try:
                host = self.core.host(url).spec
            except KeyError:  # removed by a reload before this check began
                return
            pool = self._checks[url] = Pool(
                parsed.host,
                port_of(parsed),
                max_connections=1,
                connect_timeout=spec.timeout,
                ssl_context=self.ssl_context,
                server_name=self._server_name(host),
            )
        headers = [
            (b"Host", link.netloc if (link := self._links.get(url)) else parsed.netloc),
            (b"User-Agent", self._headers["user-agent"][1].encode()),
        ]
        # After the host's path prefix, as the calls' paths (docs/configuration.md).
        target = parsed.raw_path.rstrip(b"/") + spec.path.encode()
        try:
            answer = await pool.request(
                b"GET",
                target,
                headers,
                deadline=trio.current_time() + spec.timeout,
                max_bytes=_CHECK_MAX_BYTES,
            )
        except ResponseTooLarge as exc:
            passed = exc.status in spec.expected_statuses
        except TransportFailure:
            passed = False
        else:
            passed = answer.status in spec.expected_statuses
        with suppress(KeyError):  # removed by a reload while it was checked
            self.core.health_check(url, trio.current_time(), passed=passed)
        self.report()
