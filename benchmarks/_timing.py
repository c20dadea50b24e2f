"""Small timing helpers shared by the scenarios."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def median_of(repeats: int, measure: Callable[..., float], *args: Any) -> float:
    """The median of ``repeats`` calls of ``measure(*args)`` (each one a fresh run)."""
    return statistics.median(measure(*args) for _ in range(repeats))
