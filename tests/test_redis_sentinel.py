"""Redis Sentinel: a gateway whose ``[store]`` names Sentinels and the primary's name (not a
server) follows the primary through a failover. A primary, a replica and one Sentinel on
free ports (``redis-server FILE --sentinel``); ``SENTINEL FAILOVER`` promotes the replica,
and the same gateway serves jobs on the new primary, without a restart."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pipework import Gateway
from pipework.container import BoundAddress
from pipework.redis._wire import Connection, ConnectionLost

from ._redis import RedisServer, start_redis, start_sentinel
from .test_gateway import backend, gateway_file

MASTER = "pipework-main"
# Three servers started, a failover (Sentinel's own steps take seconds).
pytestmark = pytest.mark.hang_guard(real_seconds=150)


async def _call(server: RedisServer, *args: str) -> Any:
    connection = await Connection.open(server.url)
    try:
        (reply,) = await connection.call([list(args)])
        return reply
    finally:
        await connection.aclose()


async def _primary_port(sentinel: RedisServer) -> int:
    host_port = await _call(sentinel, "SENTINEL", "get-master-addr-by-name", MASTER)
    return int(host_port[1])


async def _until(condition: Any) -> None:
    """Poll ``condition`` (Sentinel has no way to tell us; its own steps are timed)."""
    while True:
        if await condition():
            return
        await trio.sleep(0.1)


async def test_the_store_follows_the_primary_sentinel_promotes(tmp_path: Path) -> None:
    primary = start_redis(tmp_path / "primary")
    replica = start_redis(
        tmp_path / "replica", extra=("--replicaof", "127.0.0.1", str(primary.port))
    )
    sentinel = start_sentinel(tmp_path / "sentinel", MASTER, primary)
    try:

        async def replica_known() -> bool:
            replicas = await _call(sentinel, "SENTINEL", "replicas", MASTER)
            for fields in replicas:
                info = dict(zip(fields[::2], fields[1::2], strict=True))
                if info[b"port"] == str(replica.port).encode() and info[b"flags"] == b"slave":
                    return info.get(b"master-link-status") == b"ok"
            return False

        with trio.fail_after(60):
            await _until(replica_known)
        async with backend() as users:
            path = tmp_path / "gateway.toml"
            path.write_text(
                gateway_file(users.url)
                + f'\n[store]\nbackend = "redis"\nsentinels = ["127.0.0.1:{sentinel.port}"]\n'
                f'sentinel_master = "{MASTER}"\nprefix = "sentinel"\n'
            )
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                async with httpx.AsyncClient(base_url=address.url, timeout=30) as client:
                    before = await client.get("/users/1")
                    assert before.status_code == 200, before.text
                    job = before.headers["x-job-id"]
                    assert await _call(primary, "EXISTS", f"sentinel:job:{job}") == 1

                    assert await _call(sentinel, "SENTINEL", "FAILOVER", MASTER) == b"OK"

                    async def promoted() -> bool:
                        """The replica promoted, and the old primary made its replica (it
                        drops its clients then: until that, it takes writes that will be
                        lost, as Redis's replication is asynchronous; docs/scaling.md)."""
                        if await _primary_port(sentinel) != replica.port:
                            return False
                        roles = [(await _call(s, "ROLE"))[0] for s in (replica, primary)]
                        return roles == [b"master", b"slave"]

                    with trio.fail_after(60):
                        await _until(promoted)
                    # Served on the new primary, by the same gateway: jobs after the
                    # failover (the first may meet a connection the old primary dropped,
                    # or one that reads READONLY, and is answered after a reconnect).
                    with trio.fail_after(60):
                        for n in range(2, 12):
                            after = await client.get(f"/users/{n}")
                            assert after.status_code == 200, after.text
                            assert after.json()["id"] == str(n)
                    job = after.headers["x-job-id"]
                    assert await _call(replica, "EXISTS", f"sentinel:job:{job}") == 1
                stop.set()
    finally:
        for server in (sentinel, replica, primary):
            server.stop()


async def test_no_sentinel_knowing_the_primary_is_a_clear_connection_error(
    tmp_path: Path,
) -> None:
    primary = start_redis(tmp_path / "primary")
    sentinel = start_sentinel(tmp_path / "sentinel", MASTER, primary)
    try:
        url = f"redis+sentinel://127.0.0.1:{sentinel.port},127.0.0.1:1/unknown"
        with pytest.raises(ConnectionLost) as refused:
            await Connection.open(url)
        message = str(refused.value)
        assert "no Sentinel named the primary 'unknown'" in message
        assert f"127.0.0.1:{sentinel.port}: does not know it" in message
        assert "127.0.0.1:1: " in message  # refused: the next one was asked
        connection = await Connection.open(
            f"redis+sentinel://127.0.0.1:1,127.0.0.1:{sentinel.port}/{MASTER}"
        )
        try:
            assert await connection.call([["ROLE"]]) == [[b"master", 0, []]]
        finally:
            await connection.aclose()
    finally:
        sentinel.stop()
        primary.stop()
