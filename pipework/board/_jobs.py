"""Jobs on a board: every change of a job's status or progress, published as its document.

The engine calls :meth:`JobBoard.observe` (through :meth:`Engine.observe`) whenever a job
changes; the job's document (what ``GET /jobs/{id}`` answers) becomes the state of resource
``{job id}`` on the board named :data:`JOB_BOARD`, which ``GET /jobs/{id}/events``, the
multi-job stream behind the jobs page and their metrics use. Only the hash of each job's
owner token is kept, beside the board (never in what followers receive), so a follower
proves it holds the token before it follows.

Finished jobs stay on the board so a late follower gets the final state at once; past
``max_finished`` the oldest finished ones are dropped from it (``GET /jobs/{id}`` still
answers from the job store for as long as the store keeps them).

Only a job still active on the board can change, so the board listens to the engine only
while it holds one (:meth:`JobBoard.attach`): a request whose job nobody follows costs the
engine no job view per change.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from .._http._jobs import job_document
from ..dispatcher._engine_observers import JobObserver
from ..dispatcher._job import JobView
from ..dispatcher._status import TERMINAL
from ._core import BoardSettings, ResourceExists
from ._driver import Boards, BoardSpec

__all__ = ["JOB_BOARD", "JobBoard"]

#: The board jobs are published on; no board in a gateway file may take its name.
JOB_BOARD: Final = "jobs"


class JobBoard:
    """Publishes the engine's job changes on ``boards`` (adding the job board to it)."""

    def __init__(
        self,
        boards: Boards,
        *,
        settings: BoardSettings | None = None,
        max_finished: int = 10_000,
        expose_errors: bool = False,
        keepalive: float = 15.0,
    ) -> None:
        self.boards = boards
        boards.add(
            BoardSpec(
                JOB_BOARD,
                settings or BoardSettings(window=0.05, history=16),
                keepalive=keepalive,
                local=True,
            )
        )
        self.core = boards.cores[JOB_BOARD]
        self.owners: dict[str, str | None] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self.max_finished = max_finished
        self.expose_errors = expose_errors
        self.keepalive = keepalive
        # The jobs on the board that have not ended: what the engine's changes can reach.
        self._active: set[str] = set()
        self._subscribe: Callable[[JobObserver], Callable[[], None]] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def attach(self, subscribe: Callable[[JobObserver], Callable[[], None]]) -> Callable[[], None]:
        """Hear of job changes through ``subscribe`` (:meth:`Engine.observe`) whenever the
        board holds an active job, and only then; returns the function that detaches."""
        self._subscribe = subscribe
        self._listen()

        def detach() -> None:
            self._subscribe = None
            self._listen()

        return detach

    def _listen(self) -> None:
        subscribe = self._subscribe
        if subscribe is not None and self._active:
            if self._unsubscribe is None:
                self._unsubscribe = subscribe(self.observe)
        elif self._unsubscribe is not None:
            unsubscribe, self._unsubscribe = self._unsubscribe, None
            unsubscribe()

    def _ended(self, job_id: str) -> None:
        if job_id in self._active:
            self._active.discard(job_id)
            if not self._active:
                self._listen()

    def observe(self, view: JobView, token_hash: str | None) -> None:
        """The engine observer: publish the job's new document if anyone put the job on the
        board (a follower does, through :meth:`publish`). A job nobody follows costs no
        document: it is on every request's path."""
        if view.id in self.core:
            self._apply(view, token_hash)
        elif view.status in TERMINAL:
            self._ended(view.id)  # taken off the board while it ran

    def _apply(self, view: JobView, token_hash: str | None) -> None:
        document = job_document(view, expose=self.expose_errors)
        if view.id in self.core:
            self.boards.update(JOB_BOARD, view.id, document)
        elif view.id in self._finished:
            return  # dropped from the board already; the store answers for it
        else:
            self.boards.create(JOB_BOARD, view.id, document)
            self.owners[view.id] = token_hash
        if view.status not in TERMINAL:
            if view.id not in self._active:
                self._active.add(view.id)
                self._listen()
            return
        self._ended(view.id)
        self._finished[view.id] = None
        while len(self._finished) > self.max_finished:
            old, _ = self._finished.popitem(last=False)
            self.owners.pop(old, None)
            if old in self.core:
                self.boards.delete(JOB_BOARD, old)

    def publish(self, view: JobView, token_hash: str | None) -> None:
        """Put a job on the board that is not there yet (one accepted before the board
        existed, or dropped from it): a follower then follows it like any other."""
        if view.id not in self.core:
            self._finished.pop(view.id, None)
            with contextlib.suppress(ResourceExists):  # its drop is being flushed: no matter
                self._apply(view, token_hash)
