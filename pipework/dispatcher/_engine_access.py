"""Reading a job back for a caller: its view, and the checks that it is the caller's (its
owner token, or its owner), which answer as for an unknown id when it is not, and an owner's
jobs a page at a time.

A part of :class:`~._engine.Engine` (a base it is made of), in a module of its own so the
engine reads in one sitting.
"""

from __future__ import annotations

import hmac

from .._errors import JobNotFound
from ._job import JobView, hash_token
from ._store import JobGone, JobStore, OwnerIndex

__all__ = ["JobAccess"]


class JobAccess:
    """The engine's reads of a job for a caller: :meth:`status`, :meth:`authorize`,
    :meth:`authorize_owner`, :meth:`owned`."""

    # Made by Engine.__init__.
    store: JobStore
    _owner_index: OwnerIndex | None

    async def status(self, job_id: str) -> JobView:
        return (await self.store.get(job_id)).view()

    async def authorize(self, job_id: str, token: str | None) -> JobView:
        """The job's view if ``token`` is its owner token; otherwise JobNotFound, exactly as
        for an unknown id, so a wrong token reveals nothing."""
        given = "" if token is None else hash_token(token)
        try:
            job = await self.store.get(job_id)
        except JobGone as gone:  # "gone" is news only for the owner
            if gone.token_hash is not None and hmac.compare_digest(gone.token_hash, given):
                raise
            raise JobNotFound(f"no job with id {job_id!r}") from None
        expected = job.token_hash
        if expected is None or not hmac.compare_digest(expected, given):
            raise JobNotFound(f"no job with id {job_id!r}")
        return job.view()

    async def authorize_owner(self, job_id: str, owner: str) -> JobView:
        """The job's view if ``owner`` owns it (``submit(owner=...)``); otherwise
        JobNotFound, as for an unknown id (a job dropped is not found either: its
        tombstone keeps no owner)."""
        try:
            job = await self.store.get(job_id)
        except JobGone:
            raise JobNotFound(f"no job with id {job_id!r}") from None
        # As bytes: an owner is any text (a JWT's sub), and compare_digest takes str only
        # in ASCII.
        if job.owner is None or not hmac.compare_digest(
            job.owner.encode("utf-8", "surrogatepass"), owner.encode("utf-8", "surrogatepass")
        ):
            raise JobNotFound(f"no job with id {job_id!r}")
        return job.view()

    async def owned(
        self, owner: str, *, limit: int, before: float | None = None
    ) -> tuple[list[JobView], float | None]:
        """``owner``'s jobs, newest first, a page at a time (see ``OwnerIndex.owned``):
        nothing on a store that keeps no owner index."""
        index = self._owner_index
        if index is None:
            return [], None
        jobs, more = await index.owned(owner, limit=limit, before=before)
        return [job.view() for job in jobs if job.owner == owner], more
