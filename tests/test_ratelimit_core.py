"""The rate limits' core (GCRA) and its memory store, at virtual time: exact counts.

Properties, over any rate, burst and arrival times:
- in any span of time, a key lets through at most ``burst`` plus one per interval elapsed;
- a key that waits as told (``Retry-After``'s exact value) passes;
- requests spaced one interval apart all pass, for ever (the sustained rate is the rate);
- a request refused by one limit takes nothing from the others it meets;
- a table keeps at most ``max_keys`` keys, whatever the flood.
"""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from pipework._http._ratelimit import Limit, LimitSpec, MemoryLimitStore, RateLimits
from pipework._http._ratelimit_core import (
    MICROS,
    LimitTable,
    Rate,
    decide_all,
    describe,
    to_micros,
)

rates = st.builds(
    Rate,
    rate=st.integers(1, 50),
    period=st.sampled_from([0.5, 1.0, 2.0, 60.0]),
    burst=st.integers(1, 10),
)
# Arrival gaps in microseconds, many of them zero (concurrent requests).
gaps = st.lists(st.one_of(st.just(0), st.integers(0, 3 * MICROS)), min_size=1, max_size=80)


def run(rate: Rate, arrivals: list[int]) -> list[bool]:
    tat: int | None = None
    passed = []
    for now in arrivals:
        allowed, (after,) = decide_all([rate], [tat], now)
        if allowed:
            tat = after
        passed.append(allowed)
    return passed


def times(steps: list[int]) -> list[int]:
    now, out = 0, []
    for step in steps:
        now += step
        out.append(now)
    return out


@settings(max_examples=300)
@given(rates, gaps)
def test_no_span_lets_through_more_than_burst_plus_one_per_interval(
    rate: Rate, steps: list[int]
) -> None:
    arrivals = times(steps)
    passed = [t for t, ok in zip(arrivals, run(rate, arrivals), strict=True) if ok]
    for i, start in enumerate(passed):
        for j in range(i, len(passed)):
            span = passed[j] - start
            assert j - i + 1 <= rate.burst + span // rate.interval


@settings(max_examples=300)
@given(rates, gaps)
def test_waiting_as_told_passes(rate: Rate, steps: list[int]) -> None:
    tat: int | None = None
    for now in times(steps):
        allowed, (after,) = decide_all([rate], [tat], now)
        if allowed:
            tat = after
            continue
        told = describe(rate, after, now, allowed=False).retry_after
        assert told > 0
        later = now + to_micros(told)
        again, _ = decide_all([rate], [tat], later)
        assert again
        # ...and not a microsecond earlier: the wait is exact.
        sooner, _ = decide_all([rate], [tat], later - 1)
        assert not sooner


@given(rates, st.integers(1, 500))
def test_the_sustained_rate_passes_for_ever(rate: Rate, n: int) -> None:
    assert all(run(rate, [i * rate.interval for i in range(n)]))


@given(rates)
def test_a_burst_passes_at_once_and_not_one_more(rate: Rate) -> None:
    assert run(rate, [0] * (rate.burst + 3)) == [True] * rate.burst + [False] * 3


@given(rates, st.integers(1, 10))
def test_remaining_counts_what_passes_now(rate: Rate, used: int) -> None:
    used = min(used, rate.burst)
    tat: int | None = None
    after = 0
    for _ in range(used):
        _, (after,) = decide_all([rate], [tat], 0)
        tat = after
    left = describe(rate, after, 0, allowed=True).remaining
    assert left == rate.burst - used
    assert run_from(rate, tat, [0] * (left + 1)) == [True] * left + [False]


def run_from(rate: Rate, tat: int | None, arrivals: list[int]) -> list[bool]:
    passed = []
    for now in arrivals:
        allowed, (after,) = decide_all([rate], [tat], now)
        if allowed:
            tat = after
        passed.append(allowed)
    return passed


def test_a_refusal_by_one_limit_takes_nothing_from_another() -> None:
    loose, tight = Rate(100, 1.0, 100), Rate(1, 60.0, 1)
    tats: list[int | None] = [None, None]
    allowed, after = decide_all([loose, tight], tats, 0)
    assert allowed
    allowed, again = decide_all([loose, tight], after, 0)
    assert not allowed
    assert again == after  # the loose limit's TAT did not move


@given(st.integers(1, 20), st.lists(st.integers(0, 1000), max_size=300))
def test_a_table_keeps_at_most_max_keys(max_keys: int, keys: list[int]) -> None:
    table = LimitTable(max_keys)
    for now, key in enumerate(keys):
        table.put(str(key), now + 5, now)
        assert len(table) <= max_keys
        assert table.get(str(key)) == now + 5  # the newest is always kept


def test_the_least_recently_used_key_goes_first() -> None:
    table = LimitTable(2)
    table.put("a", 10, 0)
    table.put("b", 10, 0)
    table.put("a", 11, 0)  # a is now the most recent
    table.put("c", 10, 0)
    assert table.get("b") is None
    assert table.get("a") == 11
    assert table.get("c") == 10
    assert table.evicted == 1  # b was still draining


# -- the memory store, on trio's virtual clock ---------------------------------------------


def scope(client: str = "10.0.0.1", **headers: str) -> dict[str, object]:
    return {
        "client": (client, 1234),
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }


async def test_concurrent_requests_at_virtual_time_exact_counts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """50 tasks each sending one request every 10 ms for 10 virtual seconds, from one
    address: a limit of 20/s with a burst of 5 lets exactly 5 + 20*10 through."""
    limits = RateLimits.build(
        [LimitSpec("api", Rate(20, 1.0, 5))], {"r": ["api"]}, store=MemoryLimitStore()
    )
    applied = limits.applying("r")
    passed = refused = 0

    async def client() -> None:
        nonlocal passed, refused
        for _ in range(1000):
            if await limits.check(applied, scope()) is None:
                passed += 1
            else:
                refused += 1
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        for _ in range(50):
            nursery.start_soon(client)
    # The burst at 0.00, then one every 50 ms from 0.05 to 9.95 (requests come every 10 ms
    # until 9.99): 199 more.
    assert passed == 5 + 199
    assert passed + refused == 50 * 1000


async def test_keys_are_separate_and_headers_key_them(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limits = RateLimits.build(
        [LimitSpec("per-key", Rate(1, 60.0, 2), key="header:X-Api-Key")], {"r": ["per-key"]}
    )
    applied = limits.applying("r")
    outcomes = [await limits.check(applied, scope(X_Api_Key=k)) is None for k in "aaabbb"]
    assert outcomes == [True, True, False, True, True, False]
    # Without the header: keyed by the client's address (missing = "client").
    assert [await limits.check(applied, scope()) is None for _ in range(3)] == [
        True,
        True,
        False,
    ]


async def test_a_refusal_is_a_429_with_the_draft_fields(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limits = RateLimits.build([LimitSpec("api", Rate(2, 1.0, 2))], {"r": ["api"]})
    applied = limits.applying("r")
    assert await limits.check(applied, scope()) is None
    await trio.sleep(0.1)
    assert await limits.check(applied, scope()) is None
    problem = await limits.check(applied, scope())
    assert problem is not None
    assert problem.status == 429
    assert problem.headers["Retry-After"] == "1"  # 0.4 s, rounded up
    assert problem.headers["RateLimit-Policy"] == '"api";q=2;w=1'
    assert problem.headers["RateLimit"] == '"api";r=0;t=1'
    assert problem.slug == "rate-limited"


def test_a_limit_keeps_its_table_across_an_unchanged_rebuild() -> None:
    old = RateLimits.build([LimitSpec("a", Rate(1, 1.0, 1)), LimitSpec("b", Rate(1, 1.0, 1))], {})
    new = RateLimits.build(
        [LimitSpec("a", Rate(5, 1.0, 1)), LimitSpec("b", Rate(1, 1.0, 1), key="identity")], {}
    )
    assert new.adopt(old) == ["a"]
    assert new.limits["a"].table is old.limits["a"].table
    assert isinstance(new.limits["b"], Limit)
    assert new.limits["b"].table is not old.limits["b"].table
