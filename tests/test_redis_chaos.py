"""The chaos harness's short profiles (:mod:`tests._chaos`): mixed jobs on two ``pipework
serve`` processes sharing one Redis, while the harness kills Redis's client connections,
pauses Redis, restarts it and kills a gateway with SIGKILL. Every accepted job ends, and
each client was told the truth: 200 means done, "nothing was done" means its job never
ran, a ``Location`` leads to a final job. Without persistence, a restart of Redis loses
what it held and nothing else (docs/scaling.md, "Chaos"). The long profile is
``python -m tests._chaos --long``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._chaos import SHORT, STRIKES, Profile, check, harness, play

pytestmark = [
    # Two gateway processes started (and one started again after each SIGKILL), Redis
    # restarted: a new interpreter importing pipework takes seconds on a busy machine.
    pytest.mark.hang_guard(real_seconds=420),
    # A request whose gateway is killed while httpx sends its body leaves httpx's body
    # iterator to the garbage collector (collected before the harness returns): the
    # harness's client, not pipework.
    pytest.mark.filterwarnings(
        "ignore:Async generator 'httpx._content.ByteStream.__aiter__' was garbage collected"
        ":ResourceWarning"
    ),
]


async def test_every_answer_is_honest_through_kills_pauses_and_restarts(tmp_path: Path) -> None:
    async with harness(SHORT, tmp_path) as run:
        await play(run)
        findings = await check(run)
    assert not findings.broken, f"{findings}\n(the gateways' logs: {tmp_path})"
    assert set(run.struck) == set(STRIKES)
    assert findings.counts["sync done"]
    assert findings.counts["async follow"]
    assert findings.counts["signal follow"]


async def test_without_persistence_a_restart_loses_what_redis_held_and_nothing_else(
    tmp_path: Path,
) -> None:
    profile = Profile(jobs=48, clients=12, strikes=4, persist=False)
    async with harness(profile, tmp_path) as run:
        await play(run)
        findings = await check(run)
    assert not findings.broken, f"{findings}\n(the gateways' logs: {tmp_path})"
    assert run.restarts_done == 1
