"""Shared test configuration."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

import pipework as pw
from pipework.container import _server
from pipework.container._server import HTTP1_SERVERS
from pipework.dispatcher import _engine

from ._copying_store import CopyingJobStore
from ._redis import redis_server, store_class

__all__ = ["redis_server"]  # a fixture, shared with every test module

# Every test fails, instead of hanging the run, if it runs too long (see the module).
pytest_plugins = ["tests._hang_guard"]

# No per-example deadline: a loaded 2-core machine must not make property tests flaky.
settings.register_profile(
    "pipework",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("pipework")

# A property test over Redis (each_store's "redis"): an example there is tens of round trips
# to a server that shares the machine, where the memory store's costs microseconds. The
# engine's properties get their 200 examples on the in-process stores; on Redis these
# examples check that the store keeps them too, in a bounded time on a busy machine.
settings.register_profile("pipework-redis", settings.get_profile("pipework"), max_examples=25)


@pytest.fixture(params=["memory", "copying", "redis"])
def each_store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> type[Any]:
    """Run the test on every job store: the memory store; one that hands out copies decoded
    from msgpack on every read, as a shared store does; and the Redis store, on a server of
    the session's own (each test under a key prefix of its own). Engines built without a
    store get this one; the fixture's value is the store class, for tests that build their
    own (``each_store(retain_count=3)``)."""
    store: type[Any]
    if request.param == "memory":
        store = pw.MemoryJobStore
    elif request.param == "copying":
        store = CopyingJobStore
    else:
        store = store_class(request.getfixturevalue("redis_server"))
    monkeypatch.setattr(_engine, "MemoryJobStore", store)
    return store


@pytest.fixture
async def engine(each_store: type[Any]) -> AsyncIterator[pw.Engine]:
    """A running engine on each store (each_store): the test declares its pipes and chains
    on it (an engine takes registrations while it runs); it stops when the test ends."""
    async with pw.Engine() as engine:
        yield engine


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "http1_servers(*names): the HTTP/1.1 servers a test using the http1_server fixture "
        "runs against (default: every one); a test of hypercorn's internals names hypercorn",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "http1_server" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("http1_servers")
        servers = marker.args if marker is not None else HTTP1_SERVERS
        metafunc.parametrize("http1_server", servers, indirect=True)


@pytest.fixture
def http1_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Serve cleartext HTTP/1.1 with each server ``serve`` has (``serve(http1=...)``'s
    default for the test): pipework's own and hypercorn. A test file takes it with
    ``pytestmark = pytest.mark.usefixtures("http1_server")``."""
    server: str = request.param
    monkeypatch.setattr(_server, "DEFAULT_HTTP1", server)
    return server
