"""A plain dict whose entries leave after a fixed time or beyond a count, oldest first.

Every entry is kept for the same time, so insertion order is expiry order: the oldest is
always first, and dropping the expired ones looks at the head only, in batches, when an entry
is added. Reads are a dict lookup and never read the clock (``cachetools.TTLCache`` expires
on every read, which costs more than the lookup); an entry may therefore outlive its time
until the next write, which is harmless where the job pool, not this table, decides whether
a job still exists.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["Retained"]

V = TypeVar("V")


class Retained(Generic[V]):
    __slots__ = ("_entries", "maxsize", "ttl")

    def __init__(self, maxsize: int, ttl: float) -> None:
        self.maxsize = maxsize
        self.ttl = ttl
        self._entries: dict[str, tuple[float, V]] = {}  # key -> (expires at, value)

    def get(self, key: str) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def put(self, key: str, value: V, now: float) -> None:
        """Keep ``value`` until ``now + ttl`` (or until ``maxsize`` newer entries push it out)."""
        entries = self._entries
        entries.pop(key, None)  # a key put again moves to the end, with its new time
        entries[key] = (now + self.ttl, value)
        while entries:
            oldest = next(iter(entries))
            if entries[oldest][0] > now and len(entries) <= self.maxsize:
                return
            del entries[oldest]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries
