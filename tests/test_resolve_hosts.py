"""Host names re-resolved (``[services.NAME] resolve``): every address behind a name becomes a
host of its own, its requests still naming the name as ``Host``; a name that stops resolving
keeps the hosts there are; a reload keeps the addresses found. Names are answered by a
resolver of the test's own (trio's custom hostname resolver), the backends listen on
127.0.0.1 and 127.0.0.2 with one port, as two replicas behind one DNS name would."""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from pipework import ConfigError, loads_config
from pipework.backends._resilience_spec import HostSpec
from pipework.backends._resolve import resolved_hosts, same_names

from .test_admin_hosts import until
from .test_backend_pool import RawBackend
from .test_resilience_io import client, get, service

HANG_GUARD = 60.0
NAME = "replicas.test"


class Resolver(trio.abc.HostnameResolver):
    """Answers ``NAME`` with ``addresses`` (a gaierror when there are none); any other name
    as the system does."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.asked = 0

    async def getaddrinfo(
        self,
        host: bytes | None,
        port: bytes | str | int | None,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[tuple[Any, ...]]:
        if host not in (NAME.encode(), NAME):
            return await trio.to_thread.run_sync(
                socket.getaddrinfo, host, port, family, type, proto, flags
            )
        self.asked += 1
        if not self.addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        number = int(port) if port is not None else 0
        return [
            (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (a, number))
            for a in self.addresses
        ]

    async def getnameinfo(self, sockaddr: tuple[Any, ...], flags: int) -> tuple[str, str]:
        raise NotImplementedError


@asynccontextmanager
async def resolving(resolver: Resolver) -> AsyncIterator[Resolver]:
    previous = trio.socket.set_custom_hostname_resolver(resolver)
    try:
        yield resolver
    finally:
        trio.socket.set_custom_hostname_resolver(previous)


@asynccontextmanager
async def replicas() -> AsyncIterator[tuple[RawBackend, RawBackend, int]]:
    """Two backends on one port: 127.0.0.1 and 127.0.0.2."""
    first, second = RawBackend(), RawBackend()
    async with trio.open_nursery() as nursery:
        for _ in range(20):  # the port found on .2 may be taken on .1: try another
            b = trio.socket.socket()
            await b.bind(("127.0.0.2", 0))
            port = b.getsockname()[1]
            a = trio.socket.socket()
            try:
                await a.bind(("127.0.0.1", port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                a.close()
                b.close()
                continue
            break
        else:
            pytest.fail("no port free on both 127.0.0.1 and 127.0.0.2")
        for sock, backend in ((a, first), (b, second)):
            sock.listen(16)
            listener = trio.SocketListener(sock)
            nursery.start_soon(trio.serve_listeners, backend.handle, [listener])
        yield first, second, port
        nursery.cancel_scope.cancel()


async def test_a_name_becomes_its_addresses_with_the_names_host_and_weight() -> None:
    async with resolving(Resolver("10.0.0.2", "10.0.0.1")):
        hosts = await resolved_hosts(
            (HostSpec(f"http://{NAME}:8080/v1", 3), HostSpec("http://10.0.0.9:8080/v1"))
        )
    assert hosts == (
        HostSpec("http://10.0.0.1:8080/v1", 3, authority=f"{NAME}:8080"),
        HostSpec("http://10.0.0.2:8080/v1", 3, authority=f"{NAME}:8080"),
        HostSpec("http://10.0.0.9:8080/v1"),
    )
    assert same_names(
        hosts, (HostSpec(f"http://{NAME}:8080/v1", 3), HostSpec("http://10.0.0.9:8080/v1"))
    )
    assert not same_names(hosts, (HostSpec(f"http://{NAME}:8080/v1", 2),))


async def test_calls_spread_over_every_address_and_follow_the_name_as_it_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="pipework.backends")
    with trio.fail_after(HANG_GUARD):
        async with (
            resolving(Resolver("127.0.0.1", "127.0.0.2")) as resolver,
            replicas() as (first, second, port),
            client(service([f"http://{NAME}:{port}"], resolve=0.05)) as c,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(c.resolve_hosts)
            await until(lambda: len(c.core.hosts) == 2)
            for _ in range(4):
                await get(c)
            assert (len(first.seen), len(second.seen)) == (2, 2)
            assert {s.headers["host"] for s in first.seen + second.seen} == {f"{NAME}:{port}"}

            # The name now answers with one address: the other host leaves the rotation.
            resolver.addresses = ["127.0.0.2"]
            await until(lambda: [h.url for h in c.core.hosts] == [f"http://127.0.0.2:{port}"])
            for _ in range(3):
                await get(c)
            assert (len(first.seen), len(second.seen)) == (2, 5)

            # It stops resolving: the hosts stay, and the log says so once.
            resolver.addresses = []
            asked = resolver.asked
            await until(lambda: resolver.asked >= asked + 3)
            assert [h.url for h in c.core.hosts] == [f"http://127.0.0.2:{port}"]
            await get(c)
            assert len(second.seen) == 6
            nursery.cancel_scope.cancel()
    warnings = [r for r in caplog.records if "did not resolve" in r.getMessage()]
    assert len(warnings) == 1


async def test_a_client_adopting_a_core_keeps_the_addresses_it_found() -> None:
    async with (
        resolving(Resolver("127.0.0.1", "127.0.0.2")),
        replicas() as (_, _, port),
        client(service([f"http://{NAME}:{port}"], resolve=60.0)) as old,
        client(service([f"http://{NAME}:{port}"], resolve=60.0)) as new,
    ):
        with trio.move_on_after(HANG_GUARD) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(old.resolve_hosts)
                await until(lambda: len(old.core.hosts) == 2)
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
        found = [h.url for h in old.core.hosts]
        new.adopt(old.core)
        assert [h.url for h in new.core.hosts] == found


def test_resolve_is_read_from_the_file_and_checked_where_it_is_written() -> None:
    config = loads_config('[services.api]\nhosts = ["http://replicas.test:80"]\nresolve = 15\n')
    assert config.services["api"].resolve == 15.0
    with pytest.raises(ConfigError, match=r"services\.api\.resolve"):
        loads_config('[services.api]\nbase_url = "http://replicas.test"\nresolve = 0\n')


def test_an_https_service_has_hosts_and_resilience_as_an_http_one() -> None:
    config = loads_config(
        '[services.api]\nhosts = ["https://a.test", "https://b.test"]\nresolve = 10\n'
        "[services.api.breaker]\n[services.api.hedge]\ndelay = 0.1\n"
    )
    service = config.services["api"]
    assert [h.url for h in service.endpoints] == ["https://a.test", "https://b.test"]
    assert service.breaker is not None
    assert service.hedge is not None
    assert [w for w in config.warnings if w.path.startswith("services.api.")] == []
