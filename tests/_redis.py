"""A Redis server of the tests' own: started on a free port in a temporary directory, with
no persistence, and stopped when the session ends.

Debian's ``redis-server`` must be on PATH (scripts/ensure-tools installs it). Without it a
test that needs Redis fails, saying what to install; it is never skipped.
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from pipework.redis._store import RedisJobStore, StoreUnavailable

__all__ = ["RedisServer", "TestRedisJobStore", "redis_server", "start_redis", "store_class"]


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]
    directory: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        """Stop the server and start it again on the same port (what it held is lost)."""
        self.stop()
        self.process = _launch(self.port, self.directory)
        _wait_ready(self.port, self.process, self.directory)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _launch(port: int, directory: Path) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail(
            "redis-server is not installed: run scripts/ensure-tools "
            "(or apt-get install redis-server)",
            pytrace=False,
        )
    args = [
        binary,
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(directory),
        "--save", "",
        "--appendonly", "no",
        "--daemonize", "no",
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(port: int, process: subprocess.Popen[bytes], directory: Path) -> None:
    give_up = time.monotonic() + 15
    while time.monotonic() < give_up:
        if process.poll() is not None:
            log = directory / "redis.log"
            said = log.read_text() if log.exists() else ""
            pytest.fail(f"redis-server exited with {process.returncode}: {said}", pytrace=False)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.02)  # a sync fixture waiting for a process to listen
    process.kill()
    pytest.fail(f"redis-server did not answer on port {port} within 15s", pytrace=False)


def start_redis(directory: Path) -> RedisServer:
    port = _free_port()
    process = _launch(port, directory)
    _wait_ready(port, process, directory)
    return RedisServer(port, process, directory)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One Redis for the session; tests keep apart by key prefix."""
    with tempfile.TemporaryDirectory(prefix="pipework-redis-") as directory:
        server = start_redis(Path(directory))
        try:
            yield server
        finally:
            server.stop()


class TestRedisJobStore(RedisJobStore):
    """The Redis store for the engine's suite, which runs on trio's MockClock: while a
    round trip waits on the socket, a task spins through checkpoints, so an autojumping
    clock does not take the wait for idleness and leap to the next deadline.

    The clock stands still meanwhile, so the store's own bound (``io_timeout`` on the trio
    clock) cannot end a round trip that never ends, nor can anything inside it that waits
    on the clock (the client's retry back-off): the spin is bounded in real time instead,
    and a round trip past ``io_timeout`` real seconds fails with the store's error. The
    round trip is shielded, so without this bound the test would spin until the hang
    guard's process bound killed the run."""

    __test__ = False  # not a test class, whatever its name

    #: The suite runs one engine per store, whose own ends wake its waiters; the pub/sub
    #: subscription that hears other processes' ends keeps client-side timeouts that an
    #: autojumping clock would fire at once. Tests with two engines use the real store.
    follow_finished = None  # type: ignore[assignment]  # the capability is absent here

    async def _wait(self, request: Callable[[], Awaitable[Any]]) -> Any:
        result: list[Any] = []
        give_up = time.monotonic() + self.io_timeout

        async def wait() -> None:
            result.append(await request())
            nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            while time.monotonic() < give_up:
                await trio.lowlevel.checkpoint()
            nursery.cancel_scope.cancel()
        if not result:
            raise StoreUnavailable(
                f"the job store at {self.url} did not answer within {self.io_timeout:g}s "
                "of real time (the test's trio clock stands still while it waits)"
            )
        return result[0]


def store_class(server: RedisServer) -> type[RedisJobStore]:
    """A store class whose instances share ``server`` under a prefix of their own: what the
    engine builds when given no store (``MemoryJobStore()``), or a test with options."""
    prefix = f"t{secrets.token_hex(6)}"

    class Store(TestRedisJobStore):
        def __init__(self, **options: Any) -> None:
            super().__init__(server.url, prefix=prefix, **options)

    return Store
