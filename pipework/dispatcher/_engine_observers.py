"""Who hears of a job's changes: the observers :meth:`Engine.observe` subscribes (the job
board), told of every change of a top-level job's status or progress, and :meth:`Engine.watch`
for the changes other processes make.

A part of :class:`~._engine.Engine` (a base it is made of), in a module of its own so the
engine reads in one sitting; the job intake (``_engine_intake.py``) tells the observers of
each job it accepts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ._dispatcher import INTERNAL_PLAN
from ._job import Job, JobView

__all__ = ["JobObserver", "JobObservers"]

_log = logging.getLogger("pipework.engine")

#: ``observer(view, token_hash)``: see :meth:`Engine.observe`.
JobObserver = Callable[[JobView, str | None], None]


class JobObservers:
    """The engine's observers: :meth:`observe`, :meth:`watch`, and telling them of a change."""

    # Made by Engine.__init__.
    _observers: list[JobObserver]
    #: A shared queue's relay (Redis), or None: see Engine.__init__.
    _relay: Any

    def observe(self, observer: JobObserver) -> Callable[[], None]:
        """Call ``observer(view, token_hash)`` whenever a job's status or progress changes
        (accepted, running, handed off, suspended, resumed, progress, finished), from the
        engine's own tasks: it must not block. ``token_hash`` is the hash of the job's owner
        token (None without one). Branches of parallel stages and the probe job are not
        reported. An observer that raises is logged and kept. Returns the unsubscriber."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    def _changed(self, job: Job) -> None:
        if not self._observers or job.parent is not None or job.plan == INTERNAL_PLAN:
            return
        if self._relay is not None:
            self._relay.seen(job)
        view = job.view()
        for observer in list(self._observers):
            try:
                observer(view, job.token_hash)
            except Exception:
                _log.exception("pipework: a job observer failed on job %s", job.id)

    def watch(self, job_id: str) -> None:
        """Tell this engine's observers of the job's changes (status, progress) made by
        other processes too, until it ends: for a follower held here of a job that may run
        elsewhere. Nothing to do when every step runs in this process (the memory queue)."""
        if self._relay is not None:
            self._relay.watch(job_id)
