"""https:// services through the lean pool: TLS under the same keep-alive connections and
the same resilience core as http://, against real trio TLS servers with certificates made
here (trustme). Several hosts with one failing its handshake (retried, then ejected), a
backend that requires a client certificate, ``server_name`` and ``verify``, health checks,
a proxy route, and the file's settings checked as ``pipework check`` checks them. Real
time (sockets and handshakes): every wait is on a condition, bounded by the guard."""

from __future__ import annotations

import functools
import random
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import trio
import trio.testing
import trustme
from wsproto.events import TextMessage

import pipework as pw
from pipework import ConfigError, Gateway, HttpCall, Service, loads_config
from pipework.backends._client import ServiceClient
from pipework.backends._failures import ConnectFailed, TransportFailure
from pipework.backends._resilience_spec import HealthSpec, OutlierSpec
from pipework.container import BoundAddress

from ._proxy_backend import running_backend
from .test_backend_pool import Plan, RawBackend, echo
from .test_proxy_websocket import Client

HANG_GUARD = 30.0


class Pki:
    """The backends' CA (its PEM in ``ca_file``), and a CA of clients."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = trustme.CA()
        self.ca_file = directory / "backends-ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.clients = trustme.CA()

    def server_context(
        self,
        *names: str,
        ca: trustme.CA | None = None,
        client_ca: trustme.CA | None = None,
    ) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        (ca or self.ca).issue_cert(*(names or ("127.0.0.1",))).configure_cert(context)
        if client_ca is not None:
            client_ca.configure_trust(context)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_files(self) -> tuple[str, str]:
        leaf = self.clients.issue_cert("gateway@example.com")
        cert, key = self.directory / "client.pem", self.directory / "client.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        return str(cert), str(key)


@asynccontextmanager
async def tls_hosts(
    *servers: tuple[Plan, ssl.SSLContext],
) -> AsyncIterator[list[tuple[RawBackend, str]]]:
    """One TLS server per (plan, context): its backend and its https:// base URL."""
    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        stack.callback(nursery.cancel_scope.cancel)
        found = []
        for plan, context in servers:
            backend = RawBackend(plan)
            listeners = await nursery.start(
                functools.partial(
                    trio.serve_ssl_over_tcp,
                    cast(Any, backend.handle),  # it reads and writes; TLS or not
                    0,
                    context,
                    host="127.0.0.1",
                )
            )
            port = listeners[0].transport_listener.socket.getsockname()[1]
            found.append((backend, f"https://127.0.0.1:{port}"))
        yield found


def service(urls: Sequence[str], **settings: Any) -> Service:
    settings.setdefault("balance", "round_robin")
    return Service("api", hosts=tuple(pw.HostSpec(u) for u in urls), timeout=10.0, **settings)


@asynccontextmanager
async def client(svc: Service) -> AsyncIterator[ServiceClient]:
    made = ServiceClient(svc, "pipework", rng=random.Random(7))
    try:
        yield made
    finally:
        await made.aclose()


async def get(c: ServiceClient, path: str = "/") -> Any:
    return await c.call(HttpCall.of("api", path), {}, trio.current_time() + 10)


async def test_several_https_hosts_one_failing_its_handshake_retried_then_ejected(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    stranger = trustme.CA()  # a host whose certificate the service's CA did not sign
    outlier = OutlierSpec(consecutive_local_origin_failure=2, max_ejection_percent=50)
    with trio.fail_after(HANG_GUARD):
        async with tls_hosts(
            (echo, pki.server_context()),
            (echo, pki.server_context(ca=stranger)),
            (echo, pki.server_context()),
        ) as found:
            (good, _), (bad, bad_url), (other, _) = found
            svc = service([u for _, u in found], ca_bundle=str(pki.ca_file), outlier=outlier)
            async with client(svc) as c:
                for _ in range(8):
                    assert (await get(c))["index"] >= 0  # every call answered
                stats = {h.url: h for h in c.core.statistics(trio.current_time()).hosts}
                assert stats[bad_url].ejected
                assert stats[bad_url].failures == 2
                assert bad.seen == []  # nothing was sent to it: its handshake failed
                # The good hosts' connections were kept alive and reused, over TLS.
                assert good.accepted == 1
                assert other.accepted == 1
                assert len(good.seen) + len(other.seen) == 8


async def test_a_backend_that_requires_a_client_certificate(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    cert, key = pki.client_files()
    context = pki.server_context(client_ca=pki.clients)
    with trio.fail_after(HANG_GUARD):
        async with tls_hosts((echo, context)) as [(backend, url)]:
            mutual = service([url], ca_bundle=str(pki.ca_file), client_cert=cert, client_key=key)
            async with client(mutual) as c:
                assert (await get(c))["conn"] == 0
                assert (await get(c))["index"] == 1  # the same connection again
            anonymous = service([url], ca_bundle=str(pki.ca_file))
            async with client(anonymous) as c:
                # TLS 1.3 refuses the client after its side of the handshake: the refusal
                # arrives on the first read, before any byte of an answer.
                with pytest.raises(TransportFailure, match="before an answer"):
                    await get(c)
            assert len(backend.seen) == 2


async def test_server_name_and_verify(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    with trio.fail_after(HANG_GUARD):
        async with tls_hosts((echo, pki.server_context("api.internal"))) as [(_, url)]:
            named = service([url], ca_bundle=str(pki.ca_file), server_name="api.internal")
            async with client(named) as c:
                assert (await get(c))["conn"] == 0
            unnamed = service([url], ca_bundle=str(pki.ca_file))
            async with client(unnamed) as c:
                mismatch = r"TLS handshake failed.*not valid for '127\.0\.0\.1'"
                with pytest.raises(ConnectFailed, match=mismatch):
                    await get(c)
            # Without a ca_bundle the system's CAs are trusted: not this one.
            async with client(service([url], server_name="api.internal")) as c:
                with pytest.raises(ConnectFailed, match="certificate verify failed"):
                    await get(c)
            async with client(service([url], verify=False)) as c:
                assert (await get(c))["index"] == 0


async def test_health_checks_over_https(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    health = HealthSpec("/health", interval=0.5, timeout=0.5, unhealthy_threshold=1)
    with trio.fail_after(HANG_GUARD):
        async with tls_hosts(
            (echo, pki.server_context()), (echo, pki.server_context(ca=trustme.CA()))
        ) as found:
            (good, good_url), (_, bad_url) = found
            svc = service([good_url, bad_url], ca_bundle=str(pki.ca_file), health=health)
            async with client(svc) as c, trio.open_nursery() as nursery:
                nursery.start_soon(c.check_health)
                while not [s for s in good.seen if s.target == "/health"]:  # noqa: ASYNC110 - no event
                    await trio.sleep(0.01)  # the backends have no event to wait on
                while c.core.host(bad_url).healthy:  # noqa: ASYNC110 - no event to wait on
                    await trio.sleep(0.01)
                assert c.core.host(good_url).healthy
                nursery.cancel_scope.cancel()


def gateway_text(urls: list[str], settings: str) -> str:
    hosts = ", ".join(f'"{u}"' for u in urls)
    return f"""
[services.users]
hosts = [{hosts}]
timeout = 20
{settings}

[pipes.get_user]
service = "users"
path = "/users/{{user_id}}"
into = "user"

[routes.user]
method = "GET"
path = "/users/{{user_id}}"
chain = ["get_user"]
result = "user"

[routes.passthrough]
proxy = "users"
prefix = "/raw"
strip_prefix = true
"""


async def test_a_gateway_calls_and_proxies_an_https_service_with_a_client_certificate(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    cert, key = pki.client_files()
    context = pki.server_context(client_ca=pki.clients)
    settings = f'ca_bundle = "{pki.ca_file}"\nclient_cert = "{cert}"\nclient_key = "{key}"'
    with trio.fail_after(HANG_GUARD):
        async with tls_hosts((echo, context), (echo, context)) as found:
            path = tmp_path / "gateway.toml"
            path.write_text(gateway_text([u for _, u in found], settings))
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                async with httpx.AsyncClient(base_url=address.url) as http:
                    for n in range(4):
                        answer = await http.get(f"/users/{n}")
                        assert answer.status_code == 200, answer.text
                        proxied = await http.get(f"/raw/users/{n}")
                        assert proxied.status_code == 200, proxied.text
                stop.set()
            targets = sorted(s.target for b, _ in found for s in b.seen)
            assert targets == sorted([f"/users/{n}" for n in range(4)] * 2)
            assert all(b.seen for b, _ in found)  # both hosts took calls


def test_the_files_are_checked_where_they_are_named(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    cert, key = pki.client_files()
    other = tmp_path / "other.key"
    pki.clients.issue_cert("x@example.com").private_key_pem.write_to_path(str(other))

    def problems(settings: str, url: str = "https://api.test") -> list[str]:
        text = f'[services.api]\nbase_url = "{url}"\n{settings}\n'
        with pytest.raises(ConfigError) as refused:
            loads_config(text)
        return [f"{p.path}: {p.message}" for p in refused.value.errors]

    (missing,) = problems(f'ca_bundle = "{tmp_path / "nope.pem"}"')
    assert missing.startswith("services.api.ca_bundle: cannot read")
    (garbage,) = problems(f'ca_bundle = "{key}"')  # a key where certificates should be
    assert garbage.startswith("services.api.ca_bundle:")
    assert "holds no PEM certificate" in garbage
    (mismatch,) = problems(f'client_cert = "{cert}"\nclient_key = "{other}"')
    assert mismatch.startswith("services.api.client_key:")
    assert "is not the key of the certificate" in mismatch
    (alone,) = problems(f'client_cert = "{cert}"')
    assert alone.startswith("services.api.client_cert: client_cert needs client_key")
    (plain,) = problems('server_name = "api.internal"', url="http://api.test")
    assert plain == "services.api.server_name: server_name applies to an https:// service only"
    config = loads_config(
        f'[services.api]\nbase_url = "https://api.test"\nverify = false\n'
        f'client_cert = "{cert}"\nclient_key = "{key}"\n'
    )
    (warning,) = [w for w in config.warnings if w.path == "services.api.verify"]
    assert "accepts any certificate" in warning.message


async def test_a_proxy_route_streams_and_relays_websockets_to_an_https_service(
    tmp_path: Path,
) -> None:
    pki = Pki(tmp_path)
    context = pki.server_context()
    text = f"""
[services.api]
hosts = ["{{one}}", "{{two}}"]
balance = "round_robin"
ca_bundle = "{pki.ca_file}"
timeout = 10

[routes.api]
proxy = "api"
prefix = "/api"
strip_prefix = true
"""
    with trio.fail_after(HANG_GUARD):
        async with (
            running_backend(context) as one,
            running_backend(context) as two,
        ):
            assert one.url.startswith("https://")
            path = tmp_path / "gateway.toml"
            path.write_text(text.replace("{one}", one.url).replace("{two}", two.url))
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                async with httpx.AsyncClient(base_url=address.url) as http:
                    for n in range(2):
                        answer = await http.get(f"/api/echo/{n}")
                        assert answer.status_code == 200, answer.text
                        assert answer.json()["raw_path"] == f"/echo/{n}"
                async with Client.opening(address, "/api/chat") as ws:
                    await ws.accepted()
                    await ws.say(TextMessage("over tls"))
                    assert await ws.message() == "over tls"
                    await ws.say(TextMessage("close 4002"))
                    assert (await ws.closed()).code == 4002
                assert gateway._backends is not None
                stats = gateway._backends.lean("api").core.statistics(trio.current_time())
                assert [h.requests for h in stats.hosts] == [2, 1]  # round robin, all three
                assert [h.failures for h in stats.hosts] == [0, 0]
                stop.set()


async def test_a_handshake_that_never_ends_times_out_as_a_connect_and_is_retried(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    pki = Pki(tmp_path)
    hung_up = trio.Event()

    async def silent(stream: trio.SocketStream) -> None:
        """Accepts, and never says a word of TLS; notes when the client gives up."""
        while await stream.receive_some():
            pass  # the client's hello, unanswered
        hung_up.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, silent, 0, host="127.0.0.1")
        )
        silent_url = f"https://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with tls_hosts((echo, pki.server_context())) as [(good, good_url)]:
            svc = service([silent_url, good_url], ca_bundle=str(pki.ca_file), connect_timeout=1.0)
            async with client(svc) as c:
                assert (await get(c))["index"] == 0  # answered by the second host
                stats = {h.url: h for h in c.core.statistics(trio.current_time()).hosts}
                assert stats[silent_url].failures == 1
                assert stats[silent_url].requests == 1
                assert len(good.seen) == 1
            await hung_up.wait()  # the half-made connection was closed
        nursery.cancel_scope.cancel()
