"""``[store]``: memory by default, Redis when asked, every mistake named by its key path;
a gateway served with ``backend = "redis"`` keeps its jobs there."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import pytest
import trio

import pipework as pw
from pipework import ConfigError, Gateway, config_from_dict
from pipework.container import BoundAddress
from pipework.redis import RedisEventQueue, RedisJobStore
from pipework.redis._wire import public_url, sentinel_target
from pipework.registry import _config_redis

from ._redis import RedisServer
from .test_gateway import backend, gateway_file

ROUTES = {
    "pipes": {"p": {"python": "tests.test_config_corpus:enrich"}},
    "routes": {"r": {"path": "/r", "chain": ["p"]}},
}


def test_the_memory_store_is_the_default() -> None:
    config = config_from_dict(ROUTES)
    assert config.store.backend == "memory"
    store, queue = config.store.build(queue_capacity=5)
    assert isinstance(store, pw.MemoryJobStore)
    assert queue is None  # the engine's own in-memory queue


def test_the_redis_store_and_queue_are_built_from_the_file() -> None:
    config = config_from_dict(
        {
            **ROUTES,
            "store": {
                "backend": "redis",
                "url": "redis://redis.internal:6379/2",
                "prefix": "shop",
                "retain_seconds": 60,
                "claim_idle": 5,
                "resend_seconds": 12,
            },
        }
    )
    store, queue = config.store.build(queue_capacity=7)
    assert isinstance(store, RedisJobStore)
    assert store.resend_seconds == 12
    assert (store.url, store.prefix, store.retain_seconds) == (
        "redis://redis.internal:6379/2",
        "shop",
        60,
    )
    assert isinstance(queue, RedisEventQueue)
    assert (queue.stream, queue.capacity, queue.claim_idle) == ("shop:events", 7, 5)


@pytest.mark.parametrize("section", ["store", "boards"])
def test_without_hiredis_redis_is_served_and_the_slower_reader_warned_about(
    section: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The redis extra brings only hiredis's C reader of replies: without it pipework reads
    them in Python, and says so."""
    monkeypatch.setattr(_config_redis, "c_reader_installed", lambda: False)
    switch = "backend" if section == "store" else "backplane"
    config = config_from_dict(
        {**ROUTES, section: {switch: "redis", "url": "redis://redis.internal:6379/2"}}
    )
    (warning,) = [str(w) for w in config.warnings if f"{section}.{switch}" in str(w)]
    assert "hiredis is not installed" in warning
    assert "pip install 'pipework[redis]'" in warning
    monkeypatch.undo()
    config = config_from_dict(
        {**ROUTES, section: {switch: "redis", "url": "redis://redis.internal:6379/2"}}
    )
    assert not [w for w in config.warnings if "hiredis" in str(w)]


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_how_long_and_how_many_dropped_ids_are_remembered_is_the_files(backend: str) -> None:
    """Both stores remember a week of dropped ids, 100,000 at most, unless the file says."""
    section: dict[str, object] = {"backend": backend, "url": "redis://x:1/0"}
    if backend == "memory":
        del section["url"]
    store, _ = config_from_dict({**ROUTES, "store": section}).store.build(queue_capacity=1)
    assert isinstance(store, pw.MemoryJobStore | RedisJobStore)
    assert (store.remember_gone_count, store.remember_gone_seconds) == (100_000, 7 * 86400)
    section |= {"remember_gone_count": 500, "remember_gone_seconds": 0}
    store, _ = config_from_dict({**ROUTES, "store": section}).store.build(queue_capacity=1)
    assert isinstance(store, pw.MemoryJobStore | RedisJobStore)
    assert (store.remember_gone_count, store.remember_gone_seconds) == (500, 0)


@pytest.mark.parametrize("section", ["store", "boards"])
def test_sentinels_and_the_primarys_name_make_a_sentinel_url(section: str) -> None:
    """The file names Sentinels and the primary's name; the store (or the backplane) is
    given a redis+sentinel:// URL, which every connection resolves through them."""
    switch = "backend" if section == "store" else "backplane"
    names = {"sentinels": ["10.0.0.1:26379", "[::1]:26380"], "sentinel_master": "shop main"}
    config = config_from_dict({**ROUTES, section: {switch: "redis", **names}})
    settings = config.store if section == "store" else config.backplane
    expected = "redis+sentinel://10.0.0.1:26379,[::1]:26380/shop%20main"
    assert settings.url_value() == expected
    target = sentinel_target(expected)
    assert (target.sentinels, target.master) == ([("10.0.0.1", 26379), ("::1", 26380)], "shop main")


def test_a_sentinel_url_may_carry_a_password_and_a_database() -> None:
    target = sentinel_target("redis+sentinel://:s%40cret@s1:26379,s2:26379/main/3")
    assert (target.userinfo, target.db, target.master) == (":s%40cret@", "3", "main")
    assert public_url("redis+sentinel://:s%40cret@s1:1/m") == "redis+sentinel://***@s1:1/m"


def test_the_url_may_come_from_the_environment() -> None:
    config = config_from_dict({**ROUTES, "store": {"backend": "redis", "url_env": "SHOP_REDIS"}})
    store, _ = config.store.build(queue_capacity=1, environ={"SHOP_REDIS": "redis://x:1/0"})
    assert isinstance(store, RedisJobStore)
    assert store.url == "redis://x:1/0"
    with pytest.raises(
        ConfigError, match=r"store\.url_env: names .*'SHOP_REDIS', which is not set"
    ):
        config.store.build(queue_capacity=1, environ={})
    # Checked with the file, when an environment is given: an error before anything starts.
    with pytest.raises(
        ConfigError, match=r"store\.url_env: names .*'SHOP_REDIS', which is not set"
    ):
        config_from_dict(
            {**ROUTES, "store": {"backend": "redis", "url_env": "SHOP_REDIS"}}, environ={}
        )


@pytest.mark.parametrize(
    ("store", "path", "message"),
    [
        ({"backend": "redsi"}, "store.backend", "did you mean 'redis'?"),
        ({"backend": "redis"}, "store.url", 'backend = "redis" needs url'),
        ({"backend": "redis", "url": "http://x"}, "store.url", "starting with redis://"),
        (
            {"backend": "redis", "url": "redis://x", "url_env": "X"},
            "store.url",
            "set url or url_env, not both",
        ),
        ({"backend": "redis", "url": "redis://x", "prefix": "a:b"}, "store.prefix", "':'"),
        ({"retain_count": 0}, "store.retain_count", ""),
        ({"remember_gone_count": -1}, "store.remember_gone_count", "at least 0, got -1"),
        ({"remember_gone_count": 2.5}, "store.remember_gone_count", "an integer"),
        ({"remember_gone_seconds": -1}, "store.remember_gone_seconds", "0 or more, got -1"),
        ({"remember_gone_seconds": "1d"}, "store.remember_gone_seconds", "a number"),
        ({"resend_seconds": -1}, "store.resend_seconds", "0 or more, got -1"),
        ({"urls": "redis://x"}, "store.urls", "did you mean 'url'?"),
        (
            {"backend": "redis", "sentinels": ["s1:26379"]},
            "store.sentinel_master",
            "sentinels need sentinel_master",
        ),
        (
            {"backend": "redis", "sentinel_master": "main"},
            "store.sentinels",
            "sentinel_master needs sentinels",
        ),
        (
            {"backend": "redis", "sentinels": "s1:26379", "sentinel_master": "m"},
            "store.sentinels",
            'expected an array of "HOST:PORT"',
        ),
        (
            {"backend": "redis", "sentinels": ["s1:26379", "s2"], "sentinel_master": "m"},
            "store.sentinels[1]",
            "expected HOST:PORT for each Sentinel, got 's2'",
        ),
        (
            {"backend": "redis", "sentinels": ["s1:26379", 7], "sentinel_master": "m"},
            "store.sentinels[1]",
            'expected a Sentinel\'s "HOST:PORT", got 7',
        ),
        (
            {"backend": "redis", "url": "redis://x", "sentinels": ["s:1"], "sentinel_master": "m"},
            "store.sentinels",
            "set url (or url_env) or sentinels, not both",
        ),
        (
            {"backend": "redis", "url": "redis+sentinel://s1:26379"},
            "store.url",
            "the path must name the primary",
        ),
        (
            {"backend": "redis", "url": "redis+sentinel://s1:26379,s2/main"},
            "store.url",
            "expected HOST:PORT for each Sentinel, got 's2'",
        ),
    ],
)
def test_mistakes_are_named_by_their_key_path(
    store: dict[str, object], path: str, message: str
) -> None:
    with pytest.raises(ConfigError) as failed:
        config_from_dict({**ROUTES, "store": store})
    problems = [p for p in failed.value.errors if p.path == path]
    assert problems, failed.value.errors
    assert message in problems[0].message


async def test_a_gateway_on_the_redis_store_keeps_its_jobs_there(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    with trio.fail_after(20):
        async with backend() as users:
            path = tmp_path / "gateway.toml"
            text = gateway_file(users.url)
            text += f'\n[store]\nbackend = "redis"\nurl = "{redis_server.url}"\nprefix = "gw"\n'
            path.write_text(text)
            gateway = Gateway(str(path))
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                address: BoundAddress = await nursery.start(
                    functools.partial(gateway.run, port=0, stop=stop)
                )
                async with httpx.AsyncClient(base_url=address.url) as client:
                    answer = await client.get("/users/7")
                    assert answer.status_code == 200, answer.text
                    assert answer.json()["id"] == "7"
                assert gateway.engine is not None
                store = gateway.engine.store
                assert isinstance(store, RedisJobStore)
                done = await store.list(pw.Status.DONE)
                assert [job.chain for job in done] == ["user"]
                stop.set()
