"""What a pipe's :class:`~pipework.Context` calls: progress, output chunks, callback URLs.

A job's own pipe reports on the record its step works on (written back by the step, or at
once for progress, which readers see immediately). A pipe inside a parallel branch
reports on the top-level job its caller follows: progress and chunks go to that job,
written under its lock on a shared store.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from ..pipes._pipe import Context
from ._ends import Ends
from ._flight import Flight, Hooks
from ._job import Job, Progress
from ._status import TERMINAL
from ._store import JobStore
from ._suspend import Suspensions

__all__ = ["PipeOps"]


class PipeOps:
    """The engine's side of every :class:`~pipework.Context` (``JobOps``)."""

    def __init__(
        self,
        store: JobStore,
        flight: Flight,
        hooks: Hooks,
        ends: Ends,
        suspensions: Suspensions,
    ) -> None:
        self._store = store
        self._flight = flight
        self._hooks = hooks
        self._ends = ends
        self._suspensions = suspensions

    async def report_progress(
        self, ctx: Context, done: float, total: float | None, message: str | None
    ) -> None:
        job = self._flight.running.get(ctx.job_id)
        if job is not None and job.parent is None:  # the job's own pipe, in this step
            job.progress = Progress(done, total, message)
            job.updated_at = time.time()
            await self._store.update(job)
            self._hooks.changed(job)
            return

        # A pipe inside a parallel branch reports on the job its caller follows.
        def report(root: Job) -> bool:
            root.progress = Progress(done, total, message, branch=ctx.path)
            root.updated_at = time.time()
            return True

        root = await self._suspensions.change_parent(await self._root_of(ctx.job_id), report)
        if root is not None:
            self._hooks.changed(root)

    async def _root_of(self, job_id: str) -> Job:
        """The top-level job a branch (at any depth) belongs to."""
        running = self._flight.running
        job = running.get(job_id) or await self._store.get(job_id)
        while job.parent is not None:
            # A parent in a step (its stage runs there) is the step's record, not the store's.
            job = running.get(job.parent) or await self._store.get(job.parent)
        return job

    def callback_url(self, ctx: Context, signal: str, ttl: float) -> str:
        factory = self._hooks.callback_factory
        if factory is None:
            raise RuntimeError(
                "callback URLs need an HTTP container serving this engine; in process, "
                "call engine.signal(job_id, name, payload) instead"
            )
        return factory(ctx.job_id, signal, ttl)

    async def emit(self, ctx: Context, chunk: Any) -> None:
        job = self._flight.running.get(ctx.job_id)
        if job is None or job.parent is not None:
            job = await self._root_of(ctx.job_id)
            own = False
        else:
            own = True
        streams = self._ends.streams
        stream = streams.get(job.id)
        if stream is not None:
            try:
                await stream.send(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # The reader left (a stream route's client hung up): nobody reads the job's
                # chunks any more, so it is cancelled, as a hang-up cancels it; the cancel
                # lands here when it is this step's (a branch's lands with its stage's).
                streams.pop(job.id, None)
                if job.status not in TERMINAL:
                    await self._ends.cancel(job)
                await trio.lowlevel.checkpoint_if_cancelled()
            return
        emit_elsewhere = self._hooks.emit_elsewhere
        if emit_elsewhere is not None and await emit_elsewhere(job.id, chunk):
            return
        if own:  # the step writes its own job back
            _append_output(job, chunk)
        else:  # a branch's parent is written here

            def append(root: Job) -> bool:
                _append_output(root, chunk)
                return True

            await self._suspensions.change_parent(job, append)


def _append_output(job: Job, chunk: Any) -> None:
    # A record has no output list until its first chunk (most jobs never emit).
    if isinstance(job.output, list):
        job.output.append(chunk)
    else:
        job.output = [chunk]
