"""A retained failure keeps its traceback only while it is among the latest: older ones let
their frames go (what the garbage collector would scan), and keep everything else."""

from __future__ import annotations

import traceback
from typing import NoReturn, TypeVar

import pytest

import pipework as pw
from pipework.dispatcher._tracebacks import FRESH_TRACEBACKS, FreshTracebacks, drop_tracebacks

E = TypeVar("E", bound=BaseException)


def _throw(exc: BaseException) -> NoReturn:
    raise exc


def _raised(exc: E) -> E:
    with pytest.raises(type(exc)):
        _throw(exc)
    return exc


def _grouped() -> NoReturn:
    """Raise a group with a cause, a context and a member, each with its traceback."""
    member = _raised(KeyError("member"))
    try:
        _throw(OSError("context"))
    except OSError:
        raise ExceptionGroup("group", [member, ValueError("bare")]) from _raised(
            TimeoutError("cause")
        )


def _chained() -> BaseException:
    try:
        _grouped()
    except ExceptionGroup as group:
        return group


def test_drop_reaches_causes_contexts_and_members() -> None:
    group = _chained()
    assert isinstance(group, ExceptionGroup)
    member = group.exceptions[0]
    assert group.__cause__ is not None
    assert group.__context__ is not None
    assert all(
        e.__traceback__ is not None for e in (group, member, group.__cause__, group.__context__)
    )
    drop_tracebacks(group)
    for e in (group, member, group.__cause__, group.__context__):
        assert e.__traceback__ is None
    # What it was stays: type, message, members, causes; and a note says what was let go.
    assert str(group.exceptions[0]) == "'member'"
    assert isinstance(group.__cause__, TimeoutError)
    assert "let go" in group.__notes__[-1]
    assert "let go" in "".join(traceback.format_exception(group))


def test_drop_without_traceback_adds_no_note() -> None:
    exc = ValueError("never raised")
    drop_tracebacks(exc)
    assert not hasattr(exc, "__notes__")


def test_only_the_oldest_beyond_the_window_loses_its_frames() -> None:
    fresh = FreshTracebacks(size=2)
    first, second, third = (_raised(ValueError(str(n))) for n in range(3))
    fresh.add(first)
    fresh.add(second)
    assert first.__traceback__ is not None
    fresh.add(first)  # added again (a branch's, then its parent's): the newest now
    fresh.add(third)
    assert second.__traceback__ is None
    assert first.__traceback__ is not None
    assert third.__traceback__ is not None


async def test_an_old_failure_still_raises_as_itself() -> None:
    engine = pw.Engine()

    @engine.pipe
    async def fails(ctx: pw.Context) -> None:
        raise LookupError(f"missing {ctx.state['n']}")

    engine.chain("c", fails)
    async with engine:
        ids = []
        for n in range(FRESH_TRACEBACKS + 1):  # one after another: the first is the oldest
            ids.append(await engine.submit("c", {"n": n}))
            with pytest.raises(LookupError):
                await engine.wait(ids[-1])
        with pytest.raises(LookupError, match="missing 0") as oldest:
            await engine.wait(ids[0])
        with pytest.raises(LookupError, match=f"missing {FRESH_TRACEBACKS}") as newest:
            await engine.wait(ids[-1])
    # The oldest lost the pipe's frames (only wait's own are there) and says so; the
    # newest keeps them, and both keep the stage path's note.
    assert "fails" not in {f.name for f in traceback.extract_tb(oldest.value.__traceback__)}
    assert any("let go" in n for n in oldest.value.__notes__)
    assert "fails" in {f.name for f in traceback.extract_tb(newest.value.__traceback__)}
    assert not any("let go" in n for n in newest.value.__notes__)
    assert any("pipe 'fails'" in n for n in oldest.value.__notes__)
