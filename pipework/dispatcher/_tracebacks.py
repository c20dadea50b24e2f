"""How long a failed job's exception keeps its traceback: for the latest failures only.

A finished job is retained with its exception (``Engine.wait`` raises it as it was, the
stage path in its notes), and a traceback keeps every frame it came through, each frame its
locals: about ten tracebacks and ten frames per failure, more each time the exception is
raised again (every ``wait`` adds its own frames). Retained for minutes at hundreds of
failures a second, that is most of what the garbage collector scans, and each full
collection pauses every request in flight (docs/resilience.md, "Measured"). So only the
latest :data:`FRESH_TRACEBACKS` failures keep their frames; an older one keeps its type,
message, notes, causes and group members, and says in a note that its frames were let go.
Nothing an operator reads is lost: a failure's traceback is logged when the pipe ends.
"""

from __future__ import annotations

from typing import Final

__all__ = ["FRESH_TRACEBACKS", "FreshTracebacks", "drop_tracebacks"]

#: How many of the latest failures keep their tracebacks.
FRESH_TRACEBACKS: Final = 100

_NOTE: Final = (
    f"(the frames of this traceback were let go: a retained job keeps those of the latest "
    f"{FRESH_TRACEBACKS} failures only; the pipe's log line when it failed has them)"
)


def drop_tracebacks(exc: BaseException) -> None:
    """Let go of the traceback of ``exc``, of its causes and contexts, and of its group's
    members, saying so in a note on ``exc``."""
    had = False
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            e.__traceback__ = None
            had = True
        for linked in (e.__cause__, e.__context__):
            if linked is not None:
                todo.append(linked)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
    if had:
        exc.add_note(_NOTE)


class FreshTracebacks:
    """The latest failures, whose tracebacks are kept; the one pushed out loses its own.
    An exception added again (a branch's, then its parent's) moves to the newest end."""

    __slots__ = ("_latest", "size")

    def __init__(self, size: int = FRESH_TRACEBACKS) -> None:
        self.size = size
        # By id: an exception need not be hashable. Held here, so no id is reused meanwhile.
        self._latest: dict[int, BaseException] = {}

    def add(self, exc: BaseException) -> None:
        latest = self._latest
        latest.pop(id(exc), None)
        latest[id(exc)] = exc
        if len(latest) > self.size:
            drop_tracebacks(latest.pop(next(iter(latest))))
