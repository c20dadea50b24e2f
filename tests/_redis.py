"""A Redis server of the tests' own: started on a free port in a temporary directory, with
no persistence (or with AOF, ``persist=True``), and stopped when the session ends.

Debian's ``redis-server`` must be on PATH (scripts/ensure-tools installs it). Without it a
test that needs Redis fails, saying what to install; it is never skipped.
"""

from __future__ import annotations

import math
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from pipework.redis import RedisJobStore

__all__ = [
    "RedisServer",
    "TestRedisJobStore",
    "held",
    "redis_server",
    "start_redis",
    "store_class",
    "wait_idle",
]


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]
    directory: Path
    #: AOF persistence (``appendonly yes``, ``appendfsync everysec``): a restart keeps the data.
    persist: bool = False
    #: More arguments for redis-server (``--replicaof HOST PORT``, say).
    extra: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.send_signal(signal.SIGCONT)  # a paused server hears SIGTERM after it
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        """Stop the server (SIGTERM: with AOF it writes what it holds first) and start it
        again on the same port: what it held is lost, unless it persists."""
        self.stop()
        self.process = _launch(self.port, self.directory, self.persist, self.extra)
        _wait_ready(self.port, self.process, self.directory)

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing until :meth:`resume`."""
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _launch(
    port: int, directory: Path, persist: bool = False, extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
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
        "--appendonly", "yes" if persist else "no",
        "--appendfsync", "everysec",
        "--daemonize", "no",
        "--logfile", str(directory / "redis.log"),
        *extra,
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


def start_redis(
    directory: Path, *, persist: bool = False, extra: tuple[str, ...] = ()
) -> RedisServer:
    """A server in ``directory`` (made if need be) on a free port."""
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    process = _launch(port, directory, persist, extra)
    _wait_ready(port, process, directory)
    return RedisServer(port, process, directory, persist, extra)


def start_sentinel(directory: Path, master: str, primary: RedisServer) -> RedisServer:
    """A Sentinel (``redis-server FILE --sentinel``) on a free port, monitoring ``primary``
    as ``master`` with a quorum of one, quick to call it down and to fail over."""
    directory.mkdir(parents=True, exist_ok=True)
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run scripts/ensure-tools", pytrace=False)
    port = _free_port()
    conf = directory / "sentinel.conf"  # Sentinel rewrites it: a file of its own
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {directory}\nlogfile {directory / 'redis.log'}\n"
        f"sentinel monitor {master} 127.0.0.1 {primary.port} 1\n"
        f"sentinel down-after-milliseconds {master} 1000\n"
        f"sentinel failover-timeout {master} 10000\n"
    )
    args = [binary, str(conf), "--sentinel"]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    """The Redis store for the engine's suite: :class:`~pipework.redis.RedisJobStore` itself,
    following ends as in production, with the test's clock held while it waits on Redis.

    The engine's suite runs on trio's ``MockClock`` with autojump: when no task can run, the
    clock leaps to the next deadline. A task waiting on a socket cannot run, so without help
    every round trip to Redis would let virtual time leap (to a pipe's timeout, the store's
    own ``io_timeout``, the hang guard's bound) while Redis answers in microseconds: times
    would no longer be exact, and a wait for a subscription's first connection would leap a
    day. So while a round trip is on its way (the store's ``_wait``, through which each one
    goes) and while :meth:`follow_finished` makes its subscription, the clock is held
    (:func:`held`): its autojump waits ``io_timeout`` seconds of real time instead of none,
    and the run loop sleeps in the kernel until Redis answers. Virtual time stands still
    meanwhile, as it does for the memory store; a Redis that never answers lets the clock go
    after ``io_timeout`` real seconds, and the store's own bound then fails the round trip.

    What is not the production path: nothing but the hold. An end published by another
    engine on the same store reaches this one's subscription outside any round trip, so the
    clock may move while it is on its way; the suite's single-engine tests do not wait for
    such ends (tests of several processes use the real store on the real clock)."""

    __test__ = False  # not a test class, whatever its name

    async def _wait(self, request: Callable[[], Awaitable[Any]]) -> Any:
        with held(self.io_timeout):
            return await request()

    async def follow_finished(
        self,
        finished: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        with held(self.io_timeout) as hold:
            told = _Started(hold, task_status)
            await super().follow_finished(finished, task_status=told)


class _Hold:
    """One holder of the run's clock (see :func:`held`); ``release`` lets go, once."""

    def __init__(self, bound: float) -> None:
        state = _held.get()
        if state is None:
            clock = trio.lowlevel.current_clock()
            mock = clock if isinstance(clock, trio.testing.MockClock) else None
            state = _Held(mock)
            _held.set(state)
        state.holders += 1
        if state.clock is not None:
            state.clock.autojump_threshold = max(bound, state.threshold)
        self._state: _Held | None = state

    def release(self) -> None:
        state, self._state = self._state, None
        if state is None:
            return
        state.holders -= 1
        if state.holders == 0:
            _held.set(None)
            if state.clock is not None:
                state.clock.autojump_threshold = state.threshold
            state.released.set()


class _Held:
    """The run's clock while it is held: by how many, its autojump threshold before them
    (if it autojumps), and an event set when the last lets go."""

    def __init__(self, clock: trio.testing.MockClock | None) -> None:
        self.clock = clock
        self.threshold = math.inf if clock is None else clock.autojump_threshold
        self.holders = 0
        self.released = trio.Event()


_held: trio.lowlevel.RunVar[_Held | None] = trio.lowlevel.RunVar("held", default=None)


@contextmanager
def held(bound: float) -> Iterator[_Hold]:
    """Hold the run's clock while the block waits on Redis: if it autojumps, it leaps only
    after ``bound`` seconds of real time with no task able to run; and :func:`wait_idle`
    waits for the block to end. Holds nest (two round trips on their way at once): the last
    one out restores the clock."""
    hold = _Hold(bound)
    try:
        yield hold
    finally:
        hold.release()


async def wait_idle() -> None:
    """:func:`trio.testing.wait_all_tasks_blocked` for the engine's suite: every task is
    blocked and none waits for Redis's answer (a round trip on its way ends without the
    clock moving, as a call to the memory store does; see :class:`TestRedisJobStore`)."""
    while True:
        await trio.testing.wait_all_tasks_blocked()
        state = _held.get()
        if state is None:
            return
        await state.released.wait()


class _Started:
    """The task status :meth:`TestRedisJobStore.follow_finished` passes on: the hold ends
    once the subscription is made (from then on the subscription waits for messages, which
    is idleness, not a round trip)."""

    def __init__(self, hold: _Hold, status: trio.TaskStatus[None]) -> None:
        self._hold = hold
        self._status = status

    def started(self, value: None = None) -> None:
        self._hold.release()
        self._status.started(value)


def store_class(server: RedisServer) -> type[RedisJobStore]:
    """A store class whose instances share ``server`` under a prefix of their own: what the
    engine builds when given no store (``MemoryJobStore()``), or a test with options."""
    prefix = f"t{secrets.token_hex(6)}"

    class Store(TestRedisJobStore):
        def __init__(self, **options: Any) -> None:
            super().__init__(server.url, prefix=prefix, **options)

    return Store
