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

It may also freeze the heap (``gc.freeze()``, which costs nothing: no collection first, so
what start-up left as garbage in cycles stays, once): the modules, the app and its routes,
some 80,000 objects that live as long as the process, are then never scanned again. A full
collection otherwise scans them every time, and each pauses every request in flight
(docs/resilience.md, "Measured"). Frozen objects are never collected either, so a reload,
after which the first plan is garbage, freezes again (:func:`refreeze`): one full
collection then, none of the old plan kept. The last server to stop unfreezes the heap.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["SERVING_GC_THRESHOLD", "refreeze", "tuned_collector"]

#: The young generation's threshold while serving (the interpreter's default is 700).
SERVING_GC_THRESHOLD: Final = 50_000

_serving = 0
_saved: tuple[int, int, int] | None = None
_freezing = 0


@contextmanager
def tuned_collector(young: int | None, *, freeze: bool = False) -> Iterator[None]:
    """Raise the young threshold to ``young`` (None or lower than the current one: leave
    it) for the block; the thresholds found are restored when the last block ends. With
    ``freeze``, the heap is frozen for the block (unfrozen when the last such block ends)."""
    with _frozen(freeze), _threshold(young):
        yield


@contextmanager
def _frozen(freeze: bool) -> Iterator[None]:
    global _freezing
    if not freeze:
        yield
        return
    if _freezing == 0:
        gc.freeze()
    _freezing += 1
    try:
        yield
    finally:
        _freezing -= 1
        if _freezing == 0:
            gc.unfreeze()


def refreeze() -> None:
    """Freeze the heap again if a server froze it: after a reload, whose old plan is now
    garbage that frozen would never be collected (one full collection)."""
    if _freezing:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


@contextmanager
def _threshold(young: int | None) -> Iterator[None]:
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
