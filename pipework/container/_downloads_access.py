"""Who may have a job's file: the jobs a request names by ticket (:func:`claims`), the
caller's identity with ``[server] jobs_auth``, the owner checks of a job and of its file,
and the signed links that stand for them in a URL.

The base of :class:`~._downloads.DownloadsApi` (its listing and its downloads are made on
it), in a module of its own so the download centre reads in one sitting.
"""

from __future__ import annotations

import hmac
import math
import re
from typing import Any, Final
from urllib.parse import urlencode

from quart import request

from .._errors import JobNotFound
from .._http._auth import RouteAuth, put_identity
from .._http._problems import Problem
from ..dispatcher._engine import Engine
from ..dispatcher._job import JobView, hash_token
from ._callbacks import CallbackSigner
from ._result_files import FileResults, ResultFile, owned_file

__all__ = ["LINK_TTL", "MAX_TICKETS", "VISIBLE_ASCII", "FileAccess", "claims"]

#: How long a signed download link works, in seconds: long enough to click, short enough
#: that a link copied out of the page (or a proxy's log) soon opens nothing.
LINK_TTL: Final = 300
#: The most jobs one listing, one stream or one zip may name.
MAX_TICKETS: Final = 200
#: What a ticket and a job id are made of.
VISIBLE_ASCII: Final = re.compile(r"[\x21-\x7e]+\Z")
_EXPIRES: Final = re.compile(r"[0-9]{1,12}\Z")
_SIGNATURE: Final = re.compile(r"[A-Za-z0-9_-]{1,128}\Z")


def claims(headers: Any) -> list[tuple[str, str]]:
    """The jobs a request names by ticket: ``(job id, token)`` pairs from
    ``X-Job-Tickets`` (an authenticated identity names its own besides: see
    :meth:`FileAccess.caller`)."""
    tickets = [t.strip() for t in headers.get("X-Job-Tickets", "").split(",")]
    tickets = [t for t in tickets if t]
    if len(tickets) > MAX_TICKETS:
        raise _bad_tickets(f"it names {len(tickets)} jobs; at most {MAX_TICKETS}")
    pairs: list[tuple[str, str]] = []
    for number, ticket in enumerate(tickets, 1):
        job_id, colon, token = ticket.partition(":")
        if not VISIBLE_ASCII.match(ticket) or not colon or not job_id or not token:
            raise _bad_tickets(
                f"ticket {number} is not ID:TOKEN in visible ASCII (the job's X-Job-Id "
                "and X-Job-Token)"
            )
        pairs.append((job_id, token))
    return list(dict.fromkeys(pairs))


def _bad_tickets(why: str) -> Problem:
    return Problem(
        400, "Bad job tickets", f"X-Job-Tickets cannot be read: {why}", slug="bad-job-tickets"
    )


def _refused(detail: str) -> Problem:
    return Problem(403, "Download refused", detail, slug="download-refused")


class FileAccess:
    """The download centre's handlers' base: what is known of a job and its file, whose
    they are, and the signed links (see the module)."""

    def __init__(
        self,
        engine: Engine,
        signer: CallbackSigner,
        *,
        expose_errors: bool,
        max_body: int,
        body_time_limit: float,
        link_ttl: int = LINK_TTL,
        auth: RouteAuth | None = None,
    ) -> None:
        self.engine = engine
        #: Who may call ``GET /jobs``, ``POST /jobs/downloads`` and ``GET /jobs/events``
        #: (``[server] jobs_auth``): they then list and serve the identity's jobs, and
        #: answer 401 without its credential. None: tickets alone.
        self.auth = auth
        self.signer = signer
        self.expose_errors = expose_errors
        self.max_body = max_body
        self.body_time_limit = body_time_limit
        self.link_ttl = link_ttl
        self.providers: list[FileResults] = []

    # -- what is known of a job ----------------------------------------------------------

    async def file_of(self, job_id: str) -> ResultFile | None:
        found = await self._lookup(job_id)
        return None if found is None else found[1]

    async def _lookup(self, job_id: str) -> tuple[FileResults, ResultFile] | None:
        """The job's file and the route that made it, if one did."""
        for provider in self.providers:
            file = await provider.result_file(job_id)
            if file is not None:
                return provider, file
        return None

    async def _owned(self, job_id: str, token: str) -> tuple[JobView | None, ResultFile | None]:
        """The job (if the store knows it) and its file (if a route made one), each only
        if ``token`` is its owner's."""
        view: JobView | None
        try:
            view = await self.engine.authorize(job_id, token)
        except JobNotFound:  # unknown, not the caller's, or dropped: the file may say more
            view = None
        file = await self.file_of(job_id)
        if file is not None and (
            file.owner is None or not hmac.compare_digest(file.owner, hash_token(token))
        ):
            file = None
        return view, file

    async def caller(self) -> str | None:
        """The owner string of the request's identity (``Identity.owner``) when the
        endpoints have an authentication: a 401 (or 403) :class:`Problem` without a good
        credential. None when they have none."""
        auth = self.auth
        if auth is None:
            return None
        headers = {name.lower(): value for name, value in request.headers.items()}
        identity = await auth.authenticate(headers)
        scope: Any = request.scope  # the ASGI scope, a dict (typed as a TypedDict)
        put_identity(scope, identity)
        return identity.owner

    async def owned_views(self, owner: str) -> list[JobView]:
        """The newest :data:`MAX_TICKETS` jobs of ``owner`` the job store knows (what
        ``GET /jobs/events`` follows for an identity)."""
        return (await self.engine.owned(owner, limit=MAX_TICKETS))[0]

    async def _owned_by(self, job_id: str, owner: str) -> tuple[JobView | None, ResultFile | None]:
        """The job (if the store knows it) and its file (if a route made one), each only
        if ``owner`` owns it: the job by its record's owner, the file by its record's
        identity, or, with none recorded, by being the file of a job ``owner`` owns."""
        view: JobView | None
        try:
            view = await self.engine.authorize_owner(job_id, owner)
        except JobNotFound:
            view = None
        return view, owned_file(await self.file_of(job_id), owner, view is not None)

    # -- signed links --------------------------------------------------------------------

    def _link(self, target: str, joiner: str) -> tuple[str, int]:
        expires = math.ceil(self.signer.now() + self.link_ttl)
        signature = self.signer.signature("GET", target, expires)
        return f"{target}{joiner}{urlencode({'exp': expires, 'sig': signature})}", expires

    def _verify(self, target: str) -> None:
        exp, sig = request.args.get("exp"), request.args.get("sig")
        if exp is None or sig is None or not _EXPIRES.match(exp) or not _SIGNATURE.match(sig):
            raise _refused(
                "the download link lacks its exp and sig parameters, or one is malformed; "
                "take a new link from the download centre (or send the job's token)"
            )
        expected = self.signer.signature("GET", target, int(exp))
        if not hmac.compare_digest(expected.encode(), sig.encode("ascii")):
            raise _refused("the download link's signature does not match what it names")
        if int(exp) <= self.signer.now():
            raise _refused(
                "the download link has expired; the download centre gives a new one "
                f"(links last {self.link_ttl}s)"
            )
