"""The Redis job store's calls sent again: a script or command whose round trip failed for
the store (its connection lost, no answer in time, a server loading) goes again on a new
connection, at once, then while its time lasts (:mod:`._resend` says when), and the jobs
whose last write may or may not have been made are remembered, their next write sent
marked (see :mod:`._store`, **Sent again**).

Separate from the store's reads and writes, which each decide what may be sent again and
until when: this is how, over the batches of :mod:`._batches`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import trio

from .._errors import StoreUnavailable
from ..dispatcher._job import Job
from ._batches import Batches, _Call
from ._resend import Resend
from ._store_scripts import _SHAS
from ._wire import Arg, Command

__all__ = ["Resending"]

#: How many jobs whose last write may or may not have been made are remembered (their next
#: write is sent as one sent again).
_UNSURE_KEPT: Final = 4096


class Resending(Batches):
    """The store's calls sent again (see the module). The store sets ``resend_seconds`` and
    ``_unsure`` (an empty dict) in its ``__init__``."""

    resend_seconds: float
    _unsure: dict[str, None]

    async def _script(
        self,
        name: str,
        keys: list[str],
        args: list[Arg],
        *,
        until: float | None = None,
        reads: bool = False,
    ) -> Any:
        """One of the store's scripts that may run twice (a read, or a write of the same
        outcome again): sent again on a new connection if its round trip failed, at once,
        and until ``until`` (None: only at once). ``reads``: it changes nothing a client
        asked for (its failure says nothing was done)."""
        command: Command = ["EVALSHA", _SHAS[name], len(keys), *keys, *args]
        try:
            return await self._run(command, name)
        except StoreUnavailable as exc:
            now = trio.current_time()
            until = now if until is None else until
            return await self._resend(command, name, until, exc, reads=reads)

    async def _resend(
        self,
        command: Command,
        script: str | None,
        until: float,
        lost: StoreUnavailable,
        read: Callable[[Any], None] | None = None,
        *,
        reads: bool = False,
    ) -> Any:
        """Send ``command`` again after its round trip failed with ``lost``: at once (on a
        new connection), then with growing pauses while ``until`` has not passed
        (:class:`Resend`); the last failure is raised if none goes through. ``command``
        must be one that may run twice: a read, or a write marked as sent again (its script
        then tells a write already made, see _AGAIN). ``read``: as ``_Call.read``.
        ``reads``: ``command`` changes nothing a client asked for: its failure says
        nothing was done (``StoreUnavailable.maybe_done``)."""
        resend = Resend(until)
        maybe_done = lost.maybe_done
        while (pause := resend.pause(trio.current_time())) is not None:
            if pause > 0:
                await trio.sleep(pause)
            call = _Call([command], script, many=False)
            call.read = read
            try:
                return await self._call(call)
            except StoreUnavailable as exc:
                lost = exc
                maybe_done = maybe_done or exc.maybe_done
        lost.maybe_done = maybe_done and not reads  # (perhaps, if any of them may have been)
        raise lost

    def _resend_until(self, job: Job) -> float:
        """Until when a write of ``job``'s is sent again: its deadline, and
        ``resend_seconds`` from now at most."""
        return min(job.deadline, trio.current_time() + self.resend_seconds)

    def _unsure_of(self, job_id: str) -> None:
        """The job's last write got no answer: its next one is sent as one sent again."""
        self._unsure[job_id] = None
        if len(self._unsure) > _UNSURE_KEPT:
            del self._unsure[next(iter(self._unsure))]
