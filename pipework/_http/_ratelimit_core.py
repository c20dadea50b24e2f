"""Rate limits decided without I/O: the generic cell rate algorithm (GCRA) and a bounded
table of its state.

A limit lets ``burst`` requests through at once and refills at ``rate`` requests per
``period`` seconds. GCRA keeps one number per key, its *theoretical arrival time* (TAT):
the time at which the key's bucket would be full again. A request at ``now`` passes when
``max(tat, now) - now <= tolerance`` (room for one more), and then moves the TAT on by one
``interval``. It is a token bucket stated as one timestamp: no refill task, no counter to
decay, and the same rule runs in Python here and in Redis (``pipework/redis/lua``).

Times are whole microseconds (integers): the same arithmetic on both sides, exact in a
Lua number (a double holds every integer below 2**53, some 285 years of microseconds),
and no drift from adding a float interval a million times.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MICROS", "Decision", "LimitTable", "Rate", "decide_all", "describe", "to_micros"]

#: Microseconds in a second.
MICROS = 1_000_000


def to_micros(seconds: float) -> int:
    return round(seconds * MICROS)


@dataclass(frozen=True, slots=True)
class Rate:
    """``burst`` requests at once, then ``rate`` every ``period`` seconds."""

    rate: int
    period: float
    burst: int

    def __post_init__(self) -> None:
        if self.rate < 1 or self.burst < 1 or not self.period > 0:
            raise ValueError("a rate limit needs rate >= 1, burst >= 1 and period > 0")

    @property
    def interval(self) -> int:
        """Microseconds between two requests at the sustained rate (at least one)."""
        return max(1, round(self.period * MICROS / self.rate))

    @property
    def tolerance(self) -> int:
        """How far ahead of ``now`` the TAT may be for a request to pass."""
        return self.interval * (self.burst - 1)

    @property
    def window(self) -> int:
        """Whole seconds a drained bucket takes to fill again (``RateLimit-Policy``'s
        ``w``: ``burst`` requests per that window, at most)."""
        return max(1, math.ceil(self.interval * self.burst / MICROS))


@dataclass(frozen=True, slots=True)
class Decision:
    """One limit's verdict on one request, as the ``RateLimit`` fields tell it:
    ``remaining`` requests that would pass now, seconds until the bucket is full again
    (``reset``), and, refused, seconds until one would pass (``retry_after``)."""

    allowed: bool
    remaining: int
    reset: float
    retry_after: float = 0.0


def describe(rate: Rate, tat: int, now: int, *, allowed: bool) -> Decision:
    """The decision for a key whose TAT is ``tat`` after the request (moved on if it
    passed, as it was if not)."""
    ahead = max(0, tat - now)
    # Room left: each interval below tolerance + interval is one more request.
    remaining = max(0, (rate.tolerance + rate.interval - ahead) // rate.interval)
    retry_after = 0.0 if allowed else max(0, ahead - rate.tolerance) / MICROS
    return Decision(allowed, remaining, ahead / MICROS, retry_after)


def decide_all(
    rates: Sequence[Rate], tats: Sequence[int | None], now: int
) -> tuple[bool, list[int]]:
    """Whether a request passes every limit (their stored TATs, None for a key not seen
    or forgotten) and each limit's TAT after it: moved on for all of them when it passes,
    left as they were (at least ``now``) for all of them when one refuses -- a request
    refused by one limit takes nothing from the others."""
    current = [now if tat is None or tat < now else tat for tat in tats]
    allowed = all(tat - now <= rate.tolerance for rate, tat in zip(rates, current, strict=True))
    if allowed:
        current = [tat + rate.interval for rate, tat in zip(rates, current, strict=True)]
    return allowed, current


class LimitTable:
    """One limit's TATs by key in one process, at most ``max_keys`` of them.

    The least recently used key goes first when a new one would pass the bound: a flood
    of distinct keys (client addresses) costs at most ``max_keys`` entries. A key whose
    TAT has passed holds a full bucket, the same as a key never seen, so dropping it loses
    nothing; dropping a key still draining gives it a full bucket again, which only a
    flood of more than ``max_keys`` distinct keys within one refill can cause."""

    __slots__ = ("_tats", "evicted", "max_keys")

    def __init__(self, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError("a limit table keeps at least one key")
        self.max_keys = max_keys
        self._tats: OrderedDict[str, int] = OrderedDict()
        #: Keys dropped to keep the bound (still draining or not).
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._tats)

    def get(self, key: str) -> int | None:
        return self._tats.get(key)

    def put(self, key: str, tat: int, now: int) -> None:
        tats = self._tats
        if key in tats:
            tats.move_to_end(key)
        elif len(tats) >= self.max_keys:
            # The oldest first: those are the likeliest to be full again already.
            while len(tats) >= self.max_keys:
                _, old = tats.popitem(last=False)
                if old > now:
                    self.evicted += 1
        tats[key] = tat
