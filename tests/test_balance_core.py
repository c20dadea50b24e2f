"""The balancers and the peak-EWMA latency of ``_balance_core``, without trio: examples,
then properties (weights honoured exactly by round robin, statistically by random and p2c;
the same seed, the same choices)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipework import HostSpec
from pipework.backends._balance_core import (
    DECAY_TIME,
    P2C,
    Host,
    RandomBalancer,
    RoundRobin,
    make_balancer,
)


def hosts(*weights: int) -> list[Host]:
    return [Host(HostSpec(f"http://h{i}.internal", w)) for i, w in enumerate(weights)]


weight_lists = st.lists(st.integers(1, 20), min_size=1, max_size=7)


# -- the latency estimate -----------------------------------------------------------------


def test_a_slower_sample_counts_in_full_at_once() -> None:
    (h,) = hosts(1)
    assert h.latency(0.0) is None
    h.observe(0.0, 0.1)
    h.observe(0.001, 0.5)
    assert h.latency(0.001) == 0.5


def test_a_faster_sample_is_blended_by_the_time_since_the_last() -> None:
    (h,) = hosts(1)
    h.observe(0.0, 1.0)
    h.observe(DECAY_TIME, 0.0)  # one decay time later: e^-1 of the old estimate is left
    assert h.latency(DECAY_TIME) == pytest.approx(math.exp(-1.0))
    h.observe(DECAY_TIME, 0.0)  # at once again: no time passed, so it weighs nothing
    assert h.latency(DECAY_TIME) == pytest.approx(math.exp(-1.0))


def test_the_estimate_decays_between_samples() -> None:
    (h,) = hosts(1)
    h.observe(5.0, 0.2)
    assert h.latency(5.0) == pytest.approx(0.2)
    assert h.latency(5.0 + 2 * DECAY_TIME) == pytest.approx(0.2 * math.exp(-2.0))


def test_cost_counts_outstanding_calls_per_unit_of_weight() -> None:
    light, heavy = hosts(1, 2)
    for h in (light, heavy):
        h.observe(0.0, 0.1)
        h.outstanding = 2
    assert light.cost(0.0, 1.0) == pytest.approx(0.1 * 3)
    assert heavy.cost(0.0, 1.0) == pytest.approx(0.1 * 2)
    (fresh,) = hosts(1)
    assert fresh.cost(0.0, 0.4) == pytest.approx(0.4)  # no sample: the fallback


# -- round robin --------------------------------------------------------------------------


def test_round_robin_is_nginx_smooth_sequence() -> None:
    a, b, c = hosts(5, 1, 1)
    rr = RoundRobin()
    picked = [rr.choose([a, b, c], 0.0) for _ in range(7)]
    assert picked == [a, a, b, a, c, a, a]


@given(weight_lists)
def test_round_robin_gives_each_host_its_weight_in_every_run_of_the_total(
    weights: list[int],
) -> None:
    pool = hosts(*weights)
    rr = RoundRobin()
    total = sum(weights)
    picks = [rr.choose(pool, 0.0) for _ in range(3 * total)]
    for start in range(2 * total + 1):
        counts = Counter(picks[start : start + total])
        assert [counts[h] for h in pool] == weights


# -- random and p2c -----------------------------------------------------------------------


def shares_within(picks: list[Host], pool: list[Host], sigmas: float = 6.0) -> None:
    n = len(picks)
    counts = Counter(picks)
    total = sum(h.weight for h in pool)
    for h in pool:
        p = h.weight / total
        bound = sigmas * math.sqrt(p * (1 - p) / n) + 1 / n
        assert abs(counts[h] / n - p) <= bound, (h, counts[h] / n, p)


@settings(max_examples=40)
@given(weight_lists, st.integers(0, 2**32))
def test_random_shares_follow_the_weights(weights: list[int], seed: int) -> None:
    pool = hosts(*weights)
    balancer = RandomBalancer(random.Random(seed))
    shares_within([balancer.choose(pool, 0.0) for _ in range(3000)], pool)


@settings(max_examples=40)
@given(weight_lists, st.integers(0, 2**32))
def test_p2c_shares_follow_the_weights_among_equal_hosts(weights: list[int], seed: int) -> None:
    pool = hosts(*weights)
    for h in pool:
        h.observe(0.0, 0.05)
    balancer = P2C(random.Random(seed))
    shares_within([balancer.choose(pool, 0.0) for _ in range(3000)], pool)


def test_p2c_prefers_the_less_loaded_and_the_faster() -> None:
    busy, idle = hosts(1, 1)
    busy.outstanding = 3
    balancer = P2C(random.Random(1))
    assert {balancer.choose([busy, idle], 0.0) for _ in range(50)} == {idle}
    slow, fast = hosts(1, 1)
    slow.observe(0.0, 0.5)
    fast.observe(0.0, 0.05)
    assert {balancer.choose([slow, fast], 0.0) for _ in range(50)} == {fast}


def test_p2c_under_load_spreads_outstanding_calls_by_weight() -> None:
    # Calls that never end: p2c keeps outstanding/weight level, so load follows weight.
    pool = hosts(1, 3)
    for h in pool:
        h.observe(0.0, 0.05)
    balancer = P2C(random.Random(7))
    for _ in range(400):
        balancer.choose(pool, 0.0).outstanding += 1
    light, heavy = pool
    assert heavy.outstanding == pytest.approx(3 * light.outstanding, rel=0.05)


@settings(max_examples=25)
@given(weight_lists, st.integers(0, 2**32), st.sampled_from(["p2c", "round_robin", "random"]))
def test_the_same_seed_makes_the_same_choices(weights: list[int], seed: int, kind: str) -> None:
    def run() -> list[int]:
        pool = hosts(*weights)
        balancer = make_balancer(kind, random.Random(seed))  # type: ignore[arg-type]  # kind drawn as str
        out = []
        for i in range(200):
            chosen = balancer.choose(pool, i * 0.01)
            chosen.outstanding += 1
            chosen.observe(i * 0.01, 0.01 * (1 + pool.index(chosen)))
            if i % 3 == 0:
                chosen.outstanding -= 1
            out.append(pool.index(chosen))
        return out

    assert run() == run()
