"""The cyclic garbage collector while a container serves.

A server holding thousands of connections holds about a million tracked objects. With the
interpreter's default thresholds (700 allocations per young collection) a broadcast to
5,000 SSE followers runs some 160 young collections, promotes what is in flight at each,
and so triggers one full collection of the whole heap: measured, about 70% of the server's
CPU during the broadcast, for pipework and for a bare quart-trio app alike
(docs/performance.md, "Push boards"). A young threshold of 50,000 makes that two young
collections and no full one; the garbage a young collection waits for is at most that
many objects (a few MB). Reference counting frees everything without cycles at once,
whatever the thresholds.

:func:`tuned_collector` sets the young threshold while the container serves and restores
the interpreter's when the last server in the process stops.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["SERVING_GC_THRESHOLD", "tuned_collector"]

#: The young generation's threshold while serving (the interpreter's default is 700).
SERVING_GC_THRESHOLD: Final = 50_000

_serving = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def tuned_collector(young: int | None) -> Iterator[None]:
    """Raise the young threshold to ``young`` (None or lower than the current one: leave
    it) for the block; the thresholds found are restored when the last block ends."""
    global _serving, _saved
    if young is None:
        yield
        return
    if _serving == 0:
        _saved = gc.get_threshold()
    _serving += 1
    current = gc.get_threshold()
    if young > current[0]:
        gc.set_threshold(young, *current[1:])
    try:
        yield
    finally:
        _serving -= 1
        if _serving == 0 and _saved is not None:
            gc.set_threshold(*_saved)
            _saved = None
