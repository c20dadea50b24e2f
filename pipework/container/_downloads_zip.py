"""The download centre's zips: several jobs' files as one zip, streamed as it is read,
in memory one chunk at a time however large the files are.

Separate from the download centre's handlers (:mod:`._downloads`): the zip's format is
zipfile's, written to a sink that is emptied at every chunk, and reads no request.
"""

from __future__ import annotations

import time
import zipfile
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime
from typing import Any, Final

__all__ = ["CHUNK", "zip_chunks"]

#: Bytes read (and, in a zip, held) at a time.
CHUNK: Final = 256 * 1024


class _Sink:
    """What zipfile writes to: held until taken, one chunk and a header or two at most."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes, /) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.parts.clear()

    def take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        return data


def _zip_name(name: str, taken: set[str]) -> str:
    """``name``, or ``name (2)`` and so on: two jobs' files may share a name."""
    stem, dot, suffix = name.rpartition(".")
    if not dot:
        stem, suffix = name, ""
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{stem} ({n}).{suffix}" if dot else f"{stem} ({n})"
    taken.add(candidate)
    return candidate


async def zip_chunks(
    entries: Iterable[tuple[str, Any, int, float | None]],
) -> AsyncIterator[bytes]:
    """One zip of ``(name, trio file open for reading, size, time)`` entries, as chunks:
    each file is read :data:`CHUNK` bytes at a time and its bytes given on at once (stored,
    not compressed: no CPU on the event loop; a data descriptor after each file, since its
    CRC is known only at its end; ZIP64 for a file of 2 GiB or more)."""
    sink = _Sink()
    taken: set[str] = set()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, file, size, when in entries:
            stamp = datetime.fromtimestamp(when or time.time(), UTC)
            info = zipfile.ZipInfo(_zip_name(name, taken), stamp.timetuple()[:6])
            info.compress_type = zipfile.ZIP_STORED
            with archive.open(info, "w", force_zip64=size >= 2**31) as entry:
                while chunk := await file.read(CHUNK):
                    entry.write(chunk)
                    yield sink.take()
            yield sink.take()
    yield sink.take()  # the central directory
