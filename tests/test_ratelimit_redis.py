"""The Redis store of the rate limits decides as the memory store does: the same GCRA, in
one Lua script, one round trip per request whatever the number of limits it meets."""

from __future__ import annotations

import secrets

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pipework._http._ratelimit import Limit, LimitSpec, LimitStoreUnavailable
from pipework._http._ratelimit_core import MICROS, Rate, decide_all
from pipework.redis._client import Client
from pipework.redis._ratelimit import RedisLimitStore

from ._redis import RedisServer

rates = st.builds(
    Rate, rate=st.integers(1, 20), period=st.sampled_from([1.0, 60.0]), burst=st.integers(1, 6)
)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(rates, min_size=1, max_size=3),
    st.lists(st.tuples(st.integers(0, 2 * MICROS), st.integers(0, 3)), min_size=1, max_size=30),
)
def test_the_script_decides_as_the_core(
    redis_server: RedisServer, limit_rates: list[Rate], steps: list[tuple[int, int]]
) -> None:
    """Any limits, any arrivals (a gap, then which of a few keys): the same verdicts and
    the same TATs from Redis as from the core."""
    limits = [Limit(LimitSpec(f"l{i}", rate), None) for i, rate in enumerate(limit_rates)]

    async def main() -> None:
        store = RedisLimitStore(redis_server.url, prefix=secrets.token_hex(6))
        tats: dict[tuple[int, int], int] = {}
        now = 10**15  # a Redis-clock-sized time: exact in a Lua number all the same
        try:
            for gap, which in steps:
                now += gap
                store.now = now
                keys = [f"k{which}"] * len(limits)
                allowed, at, after = await store.take(limits, keys)
                mine = [tats.get((i, which)) for i in range(len(limits))]
                expected, expected_after = decide_all(limit_rates, mine, now)
                assert (allowed, at, after) == (expected, now, expected_after)
                if expected:
                    for i, tat in enumerate(expected_after):
                        tats[(i, which)] = tat
        finally:
            await store.aclose()

    trio.run(main)


async def test_keys_expire_once_full_again(redis_server: RedisServer) -> None:
    store = RedisLimitStore(redis_server.url, prefix=secrets.token_hex(6))
    limit = Limit(LimitSpec("slow", Rate(1, 60.0, 1)), None)
    store.now = 10**15
    try:
        allowed, _, _ = await store.take([limit], ["client:1"])
        assert allowed
        probe = Client(redis_server.url)
        try:
            ttl = await probe.call("PTTL", store.key(limit, "client:1"))
            assert 0 < ttl <= 60_000  # until the bucket is full again, and no longer
        finally:
            await probe.aclose()
    finally:
        await store.aclose()


async def test_an_unreachable_store_is_unavailable() -> None:
    store = RedisLimitStore("redis://127.0.0.1:1/0", timeout=5)
    limit = Limit(LimitSpec("x", Rate(1, 1.0, 1)), None)
    try:
        with pytest.raises(LimitStoreUnavailable, match=r"127\.0\.0\.1:1"):
            await store.take([limit], ["client:1"])
    finally:
        await store.aclose()
