"""A gateway served from a config file, against real backend servers on free ports:
reload through the admin API (a bad file changes nothing) and on SIGHUP."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
from quart import request
from quart_trio import QuartTrio

from pipework import Gateway
from pipework.container import BoundAddress, serve

# A bound for a hang, not for speed: a `pipework serve` process starts a fresh interpreter,
# which on two cores shared with a second test run takes many seconds.
HANG_GUARD = 100.0
TOKEN = "gateway-admin-token"


def backend_app() -> QuartTrio:
    app = QuartTrio("backend")

    @app.route("/users/<user_id>")
    async def user(user_id: str) -> dict[str, str]:
        return {"id": user_id, "name": f"user-{user_id}", "via": request.headers.get("X-Via", "")}

    @app.route("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    return app


def gateway_file(backend: str, *, extra_route: bool = False, limit: int = 4) -> str:
    text = f"""
[server]
admin_token = "{TOKEN}"

[services.users]
base_url = "{backend}"
timeout = 2
limit = {limit}

[pipes.get_user]
service = "users"
path = "/users/{{user_id}}"
headers = {{ X-Via = "pipework" }}
into = "user"

[routes.user]
method = "GET"
path = "/users/{{user_id}}"
chain = ["get_user"]
result = "user"
"""
    if extra_route:
        text += """
[pipes.hello]
service = "users"
path = "/hello"
into = "hello"

[routes.hello]
method = "GET"
path = "/hello"
chain = ["hello"]
result = "hello"
"""
    return text


@asynccontextmanager
async def backend() -> AsyncIterator[BoundAddress]:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        address: BoundAddress = await nursery.start(
            functools.partial(serve, backend_app(), port=0, shutdown_trigger=stop)
        )
        try:
            yield address
        finally:
            stop.set()


async def test_admin_reload_swaps_the_plan_and_a_bad_file_changes_nothing(
    tmp_path: Path,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with backend() as users:
            path = tmp_path / "gateway.toml"
            path.write_text(gateway_file(users.url))
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                auth = {"Authorization": f"Bearer {TOKEN}"}
                async with httpx.AsyncClient(base_url=address.url) as client:
                    first = await client.get("/users/7")
                    assert first.status_code == 200
                    assert first.json() == {"id": "7", "name": "user-7", "via": "pipework"}
                    assert (await client.get("/hello")).status_code == 404

                    path.write_text("[routes.broken]\nchain = ['nope']\n")
                    bad = await client.post("/admin/reload", headers=auth)
                    assert bad.status_code == 400
                    assert bad.json()["type"] == "urn:pipework:problem:config-invalid"
                    assert bad.json()["title"] == "Invalid configuration"
                    assert "unknown pipe 'nope'" in bad.json()["detail"]
                    assert (await client.get("/users/8")).json()["id"] == "8"  # still serving

                    path.write_text(gateway_file(users.url, extra_route=True, limit=2))
                    good = await client.post("/admin/reload", headers=auth)
                    assert good.status_code == 200, good.text
                    assert good.json()["plan_generation"] == 2
                    assert (await client.get("/hello")).json() == {"hello": "world"}
                    pool = (await client.get("/admin/pool", headers=auth)).json()
                    assert pool["keys"]["users"]["limit"] == 2
                    metrics = (await client.get("/metrics")).text
                    assert 'pipework_backend_calls_total{outcome="ok",service="users"} 3.0' in (
                        metrics
                    )
                stop.set()


async def test_sighup_reloads_the_file(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with backend() as users:
            path = tmp_path / "gateway.toml"
            path.write_text(gateway_file(users.url))
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
                line = await log.wait_for("pipework serving on ")
                url = line.split("pipework serving on ", 1)[1].strip()
                async with httpx.AsyncClient(base_url=url) as client:
                    assert (await client.get("/hello")).status_code == 404
                    path.write_text(gateway_file(users.url, extra_route=True))
                    process.send_signal(signal.SIGHUP)
                    await log.wait_for("SIGHUP: reloaded (plan 2)")
                    assert (await client.get("/hello")).json() == {"hello": "world"}
                process.send_signal(signal.SIGTERM)
                nursery.start_soon(log.drain)  # until it exits: logs must not fill the pipe
            assert process.returncode == 0


async def test_readyz_survives_an_admin_reload_and_stays_out_of_the_metrics(
    tmp_path: Path,
) -> None:
    with trio.fail_after(HANG_GUARD):
        async with backend() as users:
            path = tmp_path / "gateway.toml"
            path.write_text(gateway_file(users.url))
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                auth = {"Authorization": f"Bearer {TOKEN}"}
                async with httpx.AsyncClient(base_url=address.url) as client:
                    before = await client.get("/readyz")
                    assert before.status_code == 200, before.text
                    path.write_text(gateway_file(users.url, extra_route=True))
                    reloaded = await client.post("/admin/reload", headers=auth)
                    assert reloaded.status_code == 200, reloaded.text
                    for _ in range(3):
                        after = await client.get("/readyz")
                        assert after.status_code == 200, after.text
                        assert after.json() == {"status": "ready"}
                    metrics = (await client.get("/metrics")).text
                stop.set()
    assert "canary" not in metrics
    routes = {
        line.split('route="', 1)[1].split('"', 1)[0]
        for line in metrics.splitlines()
        if 'route="' in line
    }
    assert routes <= {"user", "hello"}


async def test_readyz_survives_sighup(tmp_path: Path) -> None:
    with trio.fail_after(HANG_GUARD):
        async with backend() as users:
            path = tmp_path / "gateway.toml"
            path.write_text(gateway_file(users.url))
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
                line = await log.wait_for("pipework serving on ")
                url = line.split("pipework serving on ", 1)[1].strip()
                async with httpx.AsyncClient(base_url=url) as client:
                    assert (await client.get("/readyz")).status_code == 200
                    path.write_text(gateway_file(users.url, extra_route=True))
                    process.send_signal(signal.SIGHUP)
                    await log.wait_for("SIGHUP: reloaded (plan 2)")
                    ready = await client.get("/readyz")
                    assert ready.status_code == 200, ready.text
                process.send_signal(signal.SIGTERM)
                nursery.start_soon(log.drain)  # until it exits: logs must not fill the pipe
            assert process.returncode == 0


class Lines:
    """The server's stderr, line by line."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def wait_for(self, marker: str) -> str:
        """The next line containing ``marker`` (bounded by the caller's hang guard)."""
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                text = line.decode(errors="replace")
                if marker in text:
                    return text
            chunk = await self._stream.receive_some()
            assert chunk, f"the server exited before {marker!r}"
            self._buffer += chunk

    async def drain(self) -> None:
        while await self._stream.receive_some():
            pass  # read and dropped: only the pipe must not fill


def test_cli_check_routes_and_graph(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipework.__main__ import main

    path = tmp_path / "gateway.toml"
    path.write_text(gateway_file("http://127.0.0.1:9", extra_route=True))
    assert main(["check", str(path)]) == 0
    assert main(["routes", str(path)]) == 0
    out = capsys.readouterr().out
    assert "/users/{user_id}" in out
    assert "get_user" in out
    assert main(["graph", str(path), "--out", str(tmp_path / "diagrams")]) == 0
    drawn = sorted(p.name for p in (tmp_path / "diagrams").iterdir())
    assert len(drawn) == 2
    assert "mermaid" in (tmp_path / "diagrams" / drawn[0]).read_text()
    (tmp_path / "bad.toml").write_text("[routes.x]\nchain = ['nope']\n")
    assert main(["check", str(tmp_path / "bad.toml")]) == 1
    assert "unknown pipe 'nope'" in capsys.readouterr().err


def test_the_readme_tour_is_a_valid_gateway_file(tmp_path: Path) -> None:
    import re

    from pipework import load_config

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    tour = re.search(r"```toml\n(.*?)```", readme, re.S)
    assert tour is not None
    path = tmp_path / "gateway.toml"
    path.write_text(tour.group(1))
    config = load_config(path)
    assert set(config.routes) == {"order"}
    assert config.warnings == ()


async def test_live_weights_survive_a_reload_until_the_file_changes_them(
    tmp_path: Path,
) -> None:
    """The rule: a weight set live stands until the file's value for that key and field
    changes, or until DELETE clears it."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with trio.fail_after(HANG_GUARD):
        async with backend() as users:
            path = tmp_path / "gateway.toml"
            path.write_text(gateway_file(users.url, limit=4))
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                async with httpx.AsyncClient(base_url=address.url, headers=auth) as client:

                    async def users_key() -> tuple[int | None, dict[str, object]]:
                        document = (await client.get("/admin/pool")).json()
                        row = document["keys"]["users"]
                        assert document["overrides"].get("users", {}) == row["live"]
                        return row["limit"], row["live"]

                    put = await client.put("/admin/pool/keys/users", json={"limit": 2})
                    assert put.status_code == 200, put.text
                    assert await users_key() == (2, {"limit": 2})

                    # The file unchanged (another route added): the live value stands.
                    path.write_text(gateway_file(users.url, limit=4, extra_route=True))
                    same = await client.post("/admin/reload")
                    assert same.status_code == 200, same.text
                    assert same.json()["overrides"] == {"users": {"limit": 2}}
                    assert same.json()["overrides_dropped"] == []
                    assert await users_key() == (2, {"limit": 2})

                    # The file changes that field: the file wins, and the answer says so.
                    path.write_text(gateway_file(users.url, limit=6, extra_route=True))
                    changed = await client.post("/admin/reload")
                    assert changed.status_code == 200, changed.text
                    assert changed.json()["overrides"] == {}
                    (sentence,) = changed.json()["overrides_dropped"]
                    assert sentence.startswith("users.limit: the file changed it from 4 to 6")
                    assert await users_key() == (6, {})

                    # DELETE puts the file's value back.
                    await client.put("/admin/pool/keys/users", json={"limit": 1})
                    assert await users_key() == (1, {"limit": 1})
                    cleared = await client.delete("/admin/pool/keys/users")
                    assert cleared.status_code == 200, cleared.text
                    assert cleared.json()["cleared"] == {"limit": 1}
                    assert await users_key() == (6, {})

                    unknown_key = await client.put("/admin/pool/keys/user", json={"limit": 1})
                    unknown_field = await client.put("/admin/pool/keys/users", json={"limt": 1})
                    after = (await client.get("/admin/pool")).json()
                stop.set()
    assert unknown_key.status_code == 404
    assert unknown_key.json()["type"] == "urn:pipework:problem:admin-unknown-key"
    assert "did you mean 'users'?" in unknown_key.json()["detail"]
    assert "user" not in after["keys"]  # the PUT created nothing
    assert unknown_field.status_code == 400
    assert "'limt': did you mean 'limit'?" in unknown_field.json()["detail"]
