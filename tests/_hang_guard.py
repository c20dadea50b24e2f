"""A hang guard around every test: a hung test fails instead of hanging the run.

Three bounds, each for a kind of hang the others cannot see:

- **trio clock.** A trio test on a ``MockClock`` (``autojump_clock``) fails once its virtual
  time passes ``hang_guard_trio_seconds``. A task of the run sleeps until then, so a
  deadlock under autojump (every task blocked, nothing else pending) jumps straight there
  and fails at once in real time.
- **real time.** Every trio test also fails after ``hang_guard_real_seconds`` of real time,
  whatever its clock: a watchdog thread wakes the run (``run_sync_soon``), which catches a
  test on the real clock and one whose virtual clock never advances (``mock_clock``).
  Either bound cancels the test body, lets its cleanup run, and fails the test with where
  the test was waiting.
- **process.** Code that never reaches a checkpoint (a busy loop, a blocking call, a sync
  test) cannot be cancelled, nor can a wait inside a shielded cancel scope: after
  ``hang_guard_exit_seconds`` of real time on any test (or the test's own real-time bound
  plus a minute, if its marker raises it past that), ``faulthandler`` prints every thread's
  stack and ends the process, so CI fails instead of waiting for its own timeout. Just
  before, the guard names the test, and where it was waiting if the real-time bound had
  already fired: a trio task's frames are on no thread's stack.

The guard wraps the test function itself, in the test's own task: the test's exceptions
and outcomes (skip, xfail) pass through unchanged. Async fixtures' setup and teardown are
covered by the process bound only. A test that needs more may say so with
``@pytest.mark.hang_guard(trio_seconds=..., real_seconds=...)``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import inspect
import os
import threading
import traceback
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TextIO

import pytest
import trio
import trio.testing

# A deadlock under autojump jumps to this bound at once, whatever its size: it can be
# generous, so that tests may sleep through retention periods and the like.
TRIO_SECONDS = 86_400.0
REAL_SECONDS = 60.0
EXIT_SECONDS = 120.0

_TRIO = os.path.dirname(trio.__file__) + os.sep


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "hang_guard_trio_seconds",
        "fail a trio test on a MockClock after this much virtual time",
        default=str(TRIO_SECONDS),
    )
    parser.addini(
        "hang_guard_real_seconds",
        "fail a trio test after this much real time",
        default=str(REAL_SECONDS),
    )
    parser.addini(
        "hang_guard_exit_seconds",
        "dump every stack and end the process when a test runs this long in real time",
        default=str(EXIT_SECONDS),
    )


# Where the process bound writes its stacks: the real stderr, kept from before pytest
# captures it (a capture file would be lost when the process ends).
_stderr: pytest.StashKey[TextIO] = pytest.StashKey()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_stderr] = os.fdopen(os.dup(2), "w")
    config.addinivalue_line(
        "markers",
        "hang_guard(trio_seconds=None, real_seconds=None): raise this test's hang guard bounds",
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash[_stderr].close()


# The watch of the trio test running now, for the process bound's last words.
_watch: pytest.StashKey[_Watch] = pytest.StashKey()

#: How long the process bound waits beyond a real-time bound raised by a marker.
_EXIT_MARGIN = 60.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    seconds = float(item.config.getini("hang_guard_exit_seconds"))
    marker = item.get_closest_marker("hang_guard")
    if marker is not None and "real_seconds" in marker.kwargs:
        seconds = max(seconds, float(marker.kwargs["real_seconds"]) + _EXIT_MARGIN)
    stderr = item.config.stash[_stderr]
    # Said just before faulthandler ends the process (a thread of Python's own, so it may
    # not get its turn if something holds the GIL; the stacks come regardless).
    last_words = threading.Timer(max(seconds - 1.0, seconds * 0.9), _say_which, (item, seconds))
    last_words.daemon = True
    last_words.start()
    faulthandler.dump_traceback_later(seconds, exit=True, file=stderr)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()
        last_words.cancel()
        if _watch in item.stash:
            del item.stash[_watch]


def _say_which(item: pytest.Item, seconds: float) -> None:
    stderr = item.config.stash[_stderr]
    said = f"\nhang guard: {item.nodeid} has run for about {seconds:g}s of real time"
    watch = item.stash.get(_watch, None)
    if watch is not None and watch.reason is not None:
        said += (
            f"; {watch.reason}, but it did not end when cancelled (a shielded wait?); "
            f"it was waiting at:\n{watch.where}"
        )
    stderr.write(said + "\nthe process ends now, with every thread's stack:\n")
    stderr.flush()


# tryfirst: wrap the test before pytest-trio wraps it in trio.run.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    if isinstance(item, pytest.Function) and item.get_closest_marker("trio") is not None:
        trio_seconds = float(item.config.getini("hang_guard_trio_seconds"))
        real_seconds = float(item.config.getini("hang_guard_real_seconds"))
        marker = item.get_closest_marker("hang_guard")
        if marker is not None:
            trio_seconds = marker.kwargs.get("trio_seconds", trio_seconds)
            real_seconds = marker.kwargs.get("real_seconds", real_seconds)
        hypothesis = getattr(item.obj, "hypothesis", None)
        if hypothesis is not None:
            hypothesis.inner_test = _guarded(
                hypothesis.inner_test, trio_seconds, real_seconds, item
            )
        else:
            item.obj = _guarded(item.obj, trio_seconds, real_seconds, item)
    return (yield)


def _guarded(
    test: Callable[..., Any], trio_seconds: float, real_seconds: float, item: pytest.Item
) -> Callable[..., Any]:
    if not inspect.iscoroutinefunction(test) or getattr(test, "_hang_guarded", False):
        return test  # already wrapped (by us, or by pytest-trio on an earlier run)

    @functools.wraps(test)
    async def guarded(**kwargs: Any) -> None:
        await _run_guarded(functools.partial(test, **kwargs), trio_seconds, real_seconds, item)

    guarded._hang_guarded = True  # type: ignore[attr-defined]  # a marker on a function object
    return guarded


class _Watch:
    """What ran out, and where the test was waiting at that moment."""

    def __init__(self, scope: trio.CancelScope) -> None:
        self._scope = scope
        self._task = trio.lowlevel.current_task()
        self.reason: str | None = None
        self.where = ""

    def expire(self, reason: str) -> None:
        if self.reason is not None or self._scope.cancel_called:
            return
        self.reason = reason
        frames = list(self._task.iter_await_frames())
        # Show the test's own frames: drop pytest-trio's and this module's, above them,
        # and trio's innards below.
        for index, (frame, _) in enumerate(frames):
            if frame.f_code is _run_guarded.__code__:
                frames = frames[index + 1 :]
                break
        frames = [(f, n) for f, n in frames if not f.f_code.co_filename.startswith(_TRIO)]
        self.where = "".join(traceback.format_list(traceback.StackSummary.extract(frames)))
        self._scope.cancel()


async def _run_guarded(
    body: Callable[[], Awaitable[None]],
    trio_seconds: float,
    real_seconds: float,
    item: pytest.Item,
) -> None:
    clock = trio.lowlevel.current_clock()
    token = trio.lowlevel.current_trio_token()
    with trio.CancelScope() as scope:
        watch = item.stash[_watch] = _Watch(scope)
        timers = trio.CancelScope()
        if isinstance(clock, trio.testing.MockClock):
            trio.lowlevel.spawn_system_task(_trio_clock_bound, watch, timers, trio_seconds)

        def wake() -> None:
            with contextlib.suppress(trio.RunFinishedError):  # the test has just ended
                token.run_sync_soon(
                    watch.expire, f"the test ran for more than {real_seconds:g}s of real time"
                )

        thread = threading.Timer(real_seconds, wake)
        thread.daemon = True
        thread.start()
        try:
            await body()
        except BaseException as exc:
            if watch.reason is not None and not _only_cancelled(exc):
                # The cancellation turned into another error on the way out: report the hang.
                pytest.fail(_message(watch), pytrace=False)
            raise
        finally:
            thread.cancel()
            timers.cancel()
    if scope.cancelled_caught and watch.reason is not None:
        pytest.fail(_message(watch), pytrace=False)


async def _trio_clock_bound(watch: _Watch, timers: trio.CancelScope, seconds: float) -> None:
    with timers:
        await trio.sleep(seconds)
        watch.expire(f"the test ran for more than {seconds:g}s on its trio clock")


def _only_cancelled(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


def _message(watch: _Watch) -> str:
    return (
        f"hang guard: {watch.reason}; it was cancelled while waiting at:\n{watch.where}"
        "(raise the bounds with @pytest.mark.hang_guard(trio_seconds=..., real_seconds=...) "
        "if the test is meant to run this long)"
    )
