"""When a store call whose round trip failed (the connection lost, no answer in time, a
server loading its data) is sent again: the arithmetic alone, no I/O (the store does the
sending, :meth:`~._store_resend.Resending._resend`).

A call is sent again at once, whatever the time (a killed connection is made again at once
and the call then goes through); after that, with pauses doubling from ``first`` up to
``most`` seconds, while the time given (``until``: the job's deadline for a step's write,
bounded by the store's ``resend_seconds``; ``resend_seconds`` for a parked request's read
and the per-job lock) has not passed; none of them later than ``until``. Only calls that
may be sent twice are sent again: a read, or a write whose script tells its own earlier
write apart (``lua/store_update.lua``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["FIRST_PAUSE", "MOST_PAUSE", "Resend"]

#: The pause before the second attempt to send again, doubling up to MOST_PAUSE.
FIRST_PAUSE: Final = 0.05
MOST_PAUSE: Final = 1.0


@dataclass(slots=True)
class Resend:
    """The times to send a failed call again, until ``until`` (an absolute time on the
    caller's clock). Ask :meth:`pause` each time the call has failed."""

    until: float
    first: float = FIRST_PAUSE
    most: float = MOST_PAUSE
    #: How many times the call was sent again so far.
    sent: int = 0

    def pause(self, now: float) -> float | None:
        """Seconds to wait before sending the call again, or None: give up (its time is
        over). The first time, 0: sent again at once, even if ``until`` has passed."""
        if self.sent == 0:
            self.sent = 1
            return 0.0
        if now >= self.until:
            return None
        wait = min(self.most, self.first * 2.0 ** (self.sent - 1))
        self.sent += 1
        return min(wait, self.until - now)
