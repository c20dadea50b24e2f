"""The gateway served over TLS from its file's ``[server] tls_*`` keys, through real sockets
with certificates made here (trustme): HTTPS and HTTP/2 by ALPN, mutual TLS required and
optional, a certificate swapped by SIGHUP while a client holds a connection (it keeps
working; a new one sees the new certificate), and a reload with a bad key refused."""

from __future__ import annotations

import functools
import os
import signal
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import h11
import httpx
import pytest
import trio
import trustme
from quart import request
from quart_trio import QuartTrio

from pipework import ConfigError, Gateway
from pipework.container import BoundAddress
from pipework.container._server import serve

from .test_gateway import TOKEN, Lines

# Each test runs on each HTTP/1.1 server serve() has (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("http1_server")

HANG_GUARD = 30.0


class Certs:
    """A CA, and the server's certificate files in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.ca = trustme.CA()
        self.cert = directory / "server.pem"
        self.key = directory / "server.key"
        self.ca_file = directory / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.issued = self.issue("first")

    def issue(self, name: str) -> trustme.LeafCert:
        """A new server certificate (named ``name``) written over the files."""
        leaf = self.ca.issue_cert("127.0.0.1", "localhost", common_name=name)
        leaf.cert_chain_pems[0].write_to_path(str(self.cert))
        leaf.private_key_pem.write_to_path(str(self.key))
        self.issued = leaf
        return leaf

    def client_context(self, client: trustme.LeafCert | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        if client is not None:
            client.configure_cert(context)
        return context


def der(leaf: trustme.LeafCert) -> bytes:
    return ssl.PEM_cert_to_DER_cert(leaf.cert_chain_pems[0].bytes().decode())


def tls_file(certs: Certs, backend: str, extra: str = "") -> str:
    return f"""
[server]
admin_token = "{TOKEN}"
tls_cert = "{certs.cert}"
tls_key = "{certs.key}"
{extra}

[services.slow]
base_url = "{backend}"
timeout = 20

[pipes.hold]
service = "slow"
path = "/hold/{{n}}"
into = "held"

[routes.hold]
method = "GET"
path = "/hold/{{n}}"
chain = ["hold"]
result = "held"
"""


class Gate:
    """A backend whose ``/hold/N`` answers once :attr:`release` is set."""

    def __init__(self) -> None:
        self.arrived = trio.Event()
        self.release = trio.Event()

    def app(self) -> QuartTrio:
        app = QuartTrio("gate")

        @app.route("/hold/<n>")
        async def hold(n: str) -> dict[str, str]:
            if n == "wait":
                self.arrived.set()
                await self.release.wait()
            return {"n": n, "host": request.headers.get("Host", "")}

        return app


@asynccontextmanager
async def gate_backend() -> AsyncIterator[tuple[Gate, str]]:
    gate = Gate()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(serve, gate.app(), port=0, shutdown_trigger=stop)
        )
        try:
            yield gate, address.url
        finally:
            gate.release.set()
            stop.set()


@asynccontextmanager
async def served(path: Path) -> AsyncIterator[tuple[Gateway, BoundAddress]]:
    gateway = Gateway(str(path))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(gateway.run, port=0, stop=stop)
        )
        try:
            yield gateway, address
        finally:
            stop.set()


class Held:
    """One TLS connection, held by the test: HTTP/1.1 requests on it, one at a time."""

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> Held:
        stream = await trio.open_ssl_over_tcp_stream(
            "127.0.0.1", port, ssl_context=context, https_compatible=True
        )
        await stream.do_handshake()
        return cls(stream)

    def peer_certificate(self) -> bytes | None:
        der: bytes | None = self.stream.getpeercert(binary_form=True)
        return der

    async def send(self, target: str) -> None:
        h = self.h11
        if h.our_state is h11.DONE:
            h.start_next_cycle()
        data = h.send(h11.Request(method="GET", target=target, headers=[("Host", "gw")]))
        await self.stream.send_all(data + (h.send(h11.EndOfMessage()) or b""))

    async def answer(self) -> tuple[int, bytes]:
        status, body = 0, b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(bytes(await self.stream.receive_some()))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, body


async def test_https_and_http2_by_alpn(tmp_path: Path) -> None:
    certs = Certs(tmp_path)
    with trio.fail_after(HANG_GUARD):
        async with gate_backend() as (_, url):
            path = tmp_path / "gateway.toml"
            path.write_text(tls_file(certs, url))
            async with served(path) as (_, address):
                assert address.url.startswith("https://")
                verify = certs.client_context()
                async with httpx.AsyncClient(base_url=address.url, verify=verify) as client:
                    answer = await client.get("/hold/1")
                    assert answer.json() == {"n": "1", "host": url.split("//")[1]}
                    assert answer.http_version == "HTTP/1.1"
                async with httpx.AsyncClient(
                    base_url=address.url, verify=verify, http2=True
                ) as client:
                    answer = await client.get("/hold/2")
                    assert answer.json()["n"] == "2"
                    assert answer.http_version == "HTTP/2"
                # Plain HTTP on the TLS port is not served.
                async with httpx.AsyncClient(base_url=address.url.replace("https", "http")) as c:
                    with pytest.raises(httpx.TransportError):
                        await c.get("/hold/3")


@pytest.mark.parametrize("client_auth", ["required", "optional"])
async def test_mutual_tls(tmp_path: Path, client_auth: str) -> None:
    certs = Certs(tmp_path)
    client_ca = trustme.CA()
    (tmp_path / "clients.pem").write_bytes(client_ca.cert_pem.bytes())
    extra = f'tls_client_ca = "{tmp_path / "clients.pem"}"\ntls_client_auth = "{client_auth}"'
    with trio.fail_after(HANG_GUARD):
        async with gate_backend() as (_, url):
            path = tmp_path / "gateway.toml"
            path.write_text(tls_file(certs, url, extra))
            async with served(path) as (_, address):
                known = client_ca.issue_cert("client@example.com")
                stranger = trustme.CA().issue_cert("client@example.com")
                with_cert = certs.client_context(known)
                async with httpx.AsyncClient(base_url=address.url, verify=with_cert) as client:
                    assert (await client.get("/hold/1")).status_code == 200
                # A certificate from another CA is refused, required or optional.
                async with httpx.AsyncClient(
                    base_url=address.url, verify=certs.client_context(stranger)
                ) as client:
                    with pytest.raises(httpx.TransportError):
                        await client.get("/hold/2")
                async with httpx.AsyncClient(
                    base_url=address.url, verify=certs.client_context()
                ) as client:
                    if client_auth == "required":
                        with pytest.raises(httpx.TransportError):
                            await client.get("/hold/3")
                    else:
                        assert (await client.get("/hold/3")).status_code == 200


async def test_sighup_swaps_the_certificate_and_the_held_connection_keeps_working(
    tmp_path: Path,
) -> None:
    certs = Certs(tmp_path)
    first = certs.issued
    with trio.fail_after(HANG_GUARD):
        async with gate_backend() as (gate, url):
            path = tmp_path / "gateway.toml"
            path.write_text(tls_file(certs, url))
            command = [sys.executable, "-m", "pipework", "serve", str(path), "--port", "0"]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(
                    functools.partial(
                        trio.run_process, command, stderr=subprocess.PIPE, check=False, env=env
                    )
                )
                assert process.stderr is not None
                log = Lines(process.stderr)
                line = await log.wait_for("pipework serving on https://")
                port = int(line.rsplit(":", 1)[1])
                context = certs.client_context()
                held = await Held.open(port, context)
                assert held.peer_certificate() == der(first)
                # A request in flight on the held connection across the swap.
                await held.send("/hold/wait")
                await gate.arrived.wait()
                second = certs.issue("second")
                process.send_signal(signal.SIGHUP)
                await log.wait_for("SIGHUP: reloaded (plan 2)")
                nursery.start_soon(log.drain)
                fresh = await Held.open(port, context)
                assert fresh.peer_certificate() == der(second)
                await fresh.send("/hold/new")
                assert (await fresh.answer())[0] == 200
                gate.release.set()
                assert (await held.answer())[0] == 200
                await held.send("/hold/again")  # and the next request on it
                status, body = await held.answer()
                assert status == 200
                assert b'"again"' in body
                assert held.peer_certificate() == der(first)
                await held.stream.aclose()
                await fresh.stream.aclose()
                process.send_signal(signal.SIGTERM)


async def test_a_reload_with_a_key_that_is_not_the_certificates_changes_nothing(
    tmp_path: Path,
) -> None:
    certs = Certs(tmp_path)
    first = certs.issued
    with trio.fail_after(HANG_GUARD):
        async with gate_backend() as (_, url):
            path = tmp_path / "gateway.toml"
            path.write_text(tls_file(certs, url))
            async with served(path) as (gateway, address):
                other = certs.ca.issue_cert("127.0.0.1")
                other.private_key_pem.write_to_path(str(certs.key))  # the wrong key
                with pytest.raises(ConfigError) as refused:
                    await gateway.reload()
                assert "server.tls_key" in str(refused.value)
                assert "is not the key of the certificate" in str(refused.value)
                held = await Held.open(address.port, certs.client_context())
                assert held.peer_certificate() == der(first)
                await held.stream.aclose()
                # The pair written whole is taken by the next reload (the admin API's too).
                second = certs.issue("second")
                auth = {"Authorization": f"Bearer {TOKEN}"}
                async with httpx.AsyncClient(
                    base_url=address.url, verify=certs.client_context()
                ) as client:
                    assert (await client.post("/admin/reload", headers=auth)).status_code == 200
                held = await Held.open(address.port, certs.client_context())
                assert held.peer_certificate() == der(second)
                await held.stream.aclose()


def test_check_loads_the_servers_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipework.__main__ import main

    certs = Certs(tmp_path)
    other = tmp_path / "other.key"
    certs.ca.issue_cert("127.0.0.1").private_key_pem.write_to_path(str(other))
    path = tmp_path / "gateway.toml"

    def check(server: str) -> tuple[int, str]:
        path.write_text(f"[server]\n{server}\n")
        code = main(["check", str(path)])
        out = capsys.readouterr()
        return code, out.out + out.err

    pair = f'tls_cert = "{certs.cert}"\ntls_key = "{certs.key}"'
    assert check(pair)[0] == 0
    assert check(f'{pair}\ntls_client_ca = "{certs.ca_file}"\ntls_client_auth = "optional"')[0] == 0
    code, said = check(f'tls_cert = "{certs.cert}"\ntls_key = "{other}"')
    assert code == 1
    assert "server.tls_key: the key in" in said
    assert "is not the key of the certificate in" in said
    code, said = check(f'tls_cert = "{tmp_path / "gone.pem"}"\ntls_key = "{certs.key}"')
    assert code == 1
    assert "server.tls_cert: cannot read" in said
    code, said = check(f'tls_cert = "{certs.key}"\ntls_key = "{certs.key}"')
    assert code == 1
    assert "server.tls_cert:" in said
    assert "holds no PEM certificate" in said
    code, said = check(f'tls_cert = "{certs.cert}"')
    assert code == 1
    assert "server.tls_cert: tls_cert needs tls_key" in said
    code, said = check(f'tls_client_ca = "{certs.ca_file}"')
    assert code == 1
    assert "server.tls_client_ca: tls_client_ca needs tls_cert and tls_key" in said
    code, said = check(f'{pair}\ntls_client_ca = "{tmp_path / "gone.pem"}"')
    assert code == 1
    assert "server.tls_client_ca: cannot read" in said
    code, said = check(f'{pair}\ntls_client_auth = "sometimes"')
    assert code == 1
    assert "server.tls_client_auth" in said
    code, said = check(f'{pair}\ntls_client_auth = "optional"')
    assert code == 0
    assert "tls_client_auth does nothing without tls_client_ca" in said
