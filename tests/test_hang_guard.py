"""The suite's hang guard (tests/_hang_guard.py) turns hanging tests into failures.

Each case runs pytest on a small generated test file in a subprocess, with the guard's
bounds lowered so that the whole module takes a few seconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

HANGING = """
import pytest
import trio
import trio.testing


async def test_deadlock_under_autojump(autojump_clock: trio.testing.MockClock) -> None:
    await trio.Event().wait()


async def test_hang_on_the_real_clock() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)


async def test_hang_on_a_clock_that_never_moves(mock_clock: trio.testing.MockClock) -> None:
    await trio.sleep_forever()


async def test_long_virtual_wait_passes(autojump_clock: trio.testing.MockClock) -> None:
    await trio.sleep(30)


@pytest.mark.hang_guard(trio_seconds=1000)
async def test_marker_raises_the_bound(autojump_clock: trio.testing.MockClock) -> None:
    await trio.sleep(100)


async def test_cleanup_runs_when_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    try:
        await trio.sleep_forever()
    finally:
        print("cleanup ran")


async def test_other_failures_are_untouched() -> None:
    assert 1 + 1 == 3
"""


@pytest.fixture
def guarded(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini(
        """
        [pytest]
        trio_mode = true
        filterwarnings = error
        hang_guard_trio_seconds = 60
        hang_guard_real_seconds = 1
        hang_guard_exit_seconds = 2
        """
    )
    return pytester


def _run(pytester: pytest.Pytester) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "tests._hang_guard", "-rA", timeout=60)


def test_hanging_trio_tests_fail_with_where_they_waited(guarded: pytest.Pytester) -> None:
    guarded.makepyfile(test_hanging=HANGING)
    result = _run(guarded)
    result.assert_outcomes(passed=2, failed=5)
    result.stdout.fnmatch_lines(
        [
            "*_ test_deadlock_under_autojump _*",
            "*Failed: hang guard: the test ran for more than 60s on its trio clock; "
            "it was cancelled while waiting at:",
            "*test_hanging.py*, in test_deadlock_under_autojump",
            "*await trio.Event().wait()",
            "*_ test_hang_on_the_real_clock _*",
            "*Failed: hang guard: the test ran for more than 1s of real time*",
            "*test_hanging.py*, in test_hang_on_the_real_clock",
            "*async with trio.open_nursery() as nursery:",
            "*_ test_hang_on_a_clock_that_never_moves _*",
            "*Failed: hang guard: the test ran for more than 1s of real time*",
            "*await trio.sleep_forever()",
            "*_ test_cleanup_runs_when_cancelled _*",
            "*Failed: hang guard: the test ran for more than 60s on its trio clock*",
            "cleanup ran",
            "*_ test_other_failures_are_untouched _*",
            "*AssertionError: assert (1 + 1) == 3",
            "PASSED *::test_long_virtual_wait_passes",
            "PASSED *::test_marker_raises_the_bound",
        ]
    )
    result.stdout.no_fnmatch_line("*::test_other_failures_are_untouched - hang guard*")


def test_a_test_that_never_yields_ends_the_run_with_every_stack(
    guarded: pytest.Pytester,
) -> None:
    guarded.makepyfile(
        test_busy="""
        async def test_busy_loop() -> None:
            while True:
                pass
        """
    )
    result = _run(guarded)
    assert result.ret != 0
    result.stderr.fnmatch_lines(["Timeout (0:00:02)!", "*test_busy.py*line [23] in test_busy_loop"])


def test_a_shielded_wait_ends_the_run_naming_the_test_and_where_it_waited(
    guarded: pytest.Pytester,
) -> None:
    """A wait inside a shielded scope outlives the real-time bound's cancellation: the
    process bound ends it, and says first which test it was and where the real-time bound
    found it waiting (a trio task's frames are on no thread's stack)."""
    guarded.makepyfile(
        test_shielded="""
        import trio

        async def spin_forever() -> None:
            while True:
                await trio.lowlevel.checkpoint()

        async def test_shielded_spin() -> None:
            with trio.CancelScope(shield=True):
                await spin_forever()
        """
    )
    result = _run(guarded)
    assert result.ret != 0
    result.stderr.fnmatch_lines(
        [
            "hang guard: test_shielded.py::test_shielded_spin has run for about 2s of real "
            "time; the test ran for more than 1s of real time, but it did not end when "
            "cancelled (a shielded wait?); it was waiting at:",
            "*test_shielded.py*, in test_shielded_spin",
            "*await spin_forever()",
            "*test_shielded.py*, in spin_forever",
            "the process ends now, with every thread's stack:",
            "Timeout (0:00:02)!",
        ]
    )


def test_a_marker_that_raises_the_real_bound_raises_the_process_bound(
    guarded: pytest.Pytester,
) -> None:
    guarded.makepyfile(
        test_long="""
        import time
        import pytest

        @pytest.mark.hang_guard(real_seconds=1)
        def test_sync_and_longer_than_the_exit_bound() -> None:
            time.sleep(3)  # a sync test: only the process bound watches it
        """
    )
    result = _run(guarded)
    result.assert_outcomes(passed=1)
