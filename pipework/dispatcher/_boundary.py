"""Sorting what escapes a task boundary the engine owns (a step, a graph callback).

trio and the libraries on it raise exception groups, so a boundary cannot catch
``trio.Cancelled`` or ``Exception`` alone: it splits what escaped into the part that belongs
to whoever stops the engine (a cancellation from outside, KeyboardInterrupt, SystemExit),
which travels on, and the errors, which end there.
"""

from __future__ import annotations

import trio

__all__ = ["split_outside"]

_OUTSIDE = (trio.Cancelled, KeyboardInterrupt, SystemExit)


def split_outside(escaped: BaseException) -> tuple[BaseException | None, BaseException | None]:
    """``(outside, errors)``: either may be None; groups are split, never collapsed away."""
    if isinstance(escaped, _OUTSIDE):
        return escaped, None
    if isinstance(escaped, BaseExceptionGroup):
        return escaped.split(_OUTSIDE)
    return None, escaped
