"""What a route whose jobs leave a file tells the download centre: a job's file
(:class:`ResultFile`), the protocol a route implements to say it (:class:`FileResults`,
:class:`OwnedFiles`), and whether an identity may have a file (:func:`owned_file`).

Separate from the download centre's handlers (:mod:`._downloads`): these are the public
types a route implements (``pipework.FileResults``, ``pipework.ResultFile``), and need
none of the handlers' HTTP.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

__all__ = ["FileResults", "FileState", "OwnedFiles", "ResultFile", "owned_file"]

FileState = Literal["running", "done", "failed", "expired"]


@dataclass(frozen=True, slots=True)
class ResultFile:
    """A job's file, as the download centre lists and serves it.

    ``owner`` is the hash of the job's owner token (what the job store keeps:
    SHA-256, hex); ``identity``, the owner string of the authenticated caller who started
    the job (``JobRecord.owner``, ``AUTH:SUBJECT``), when one did; ``state`` is the file's
    own (``expired`` once it was deleted); ``path`` is where it is while it can be
    downloaded. Times are Unix seconds."""

    job_id: str
    name: str
    owner: str | None
    state: FileState
    path: Path | None = None
    chain: str = ""
    media_type: str = "application/octet-stream"
    rows: int | None = None
    size: int | None = None
    created: float | None = None
    finished: float | None = None
    keep_until: float | None = None
    error: str | None = None
    downloaded: float | None = None
    identity: str | None = None

    @property
    def ready(self) -> bool:
        return self.state == "done" and self.path is not None


class FileResults(Protocol):
    """What a route whose jobs leave files tells the download centre."""

    async def result_file(self, job_id: str) -> ResultFile | None:
        """The job's file, if this route made one for it (running, done, failed or
        expired); None for a job it knows nothing of."""
        ...

    async def mark_downloaded(self, job_id: str, when: float) -> None:
        """Its file was downloaded whole at ``when`` (Unix seconds): keep the mark."""
        ...


@runtime_checkable
class OwnedFiles(Protocol):
    """A :class:`FileResults` whose records also list an identity's files: the download
    centre then lists them for that identity even when the job store no longer knows
    their jobs (the memory store after a restart)."""

    async def files_of(self, identity: str, *, limit: int) -> list[ResultFile]:
        """At most ``limit`` of the files whose ``identity`` is this one, newest first."""
        ...


def owned_file(file: ResultFile | None, owner: str, job_owned: bool) -> ResultFile | None:
    """``file`` if ``owner`` may have it: its record names that identity, or names none and
    its job is ``owner``'s (``job_owned``)."""
    if file is None:
        return None
    if file.identity is None:
        return file if job_owned else None
    # As bytes: an identity is any text, and compare_digest takes str only in ASCII.
    return file if hmac.compare_digest(_utf8(file.identity), _utf8(owner)) else None


def _utf8(text: str) -> bytes:
    # surrogatepass: any text encodes (as hash_token's).
    return text.encode("utf-8", "surrogatepass")
