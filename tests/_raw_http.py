"""Reading a server's raw answers strictly, for the tests that talk to it with raw bytes.

:func:`split_answers` cuts what a server sent on one connection into HTTP/1.1 answers and
says whether the bytes end cleanly. An answer with neither length nor chunks (to an
HTTP/1.0 request) runs to the end of the connection: its body is whatever follows. It
knows only what a client can know: an answer to a ``HEAD`` request looks like one to a
``GET`` here, so the tests that use it send none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["Answer", "Malformed", "split_answers"]

_STATUS_LINE: Final = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9]) ([\t !-~\x80-\xff]*)\r\n")
_HEADER_LINE: Final = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*([^\r\n]*?)[ \t]*\r\n")
_CHUNK_SIZE: Final = re.compile(rb"([0-9A-Fa-f]{1,8})(?:;[^\r\n]*)?\r\n")


class Malformed(AssertionError):
    """What the server sent is not HTTP/1.1."""


@dataclass
class Answer:
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)

    def json(self) -> Any:
        return json.loads(self.body)


def split_answers(data: bytes) -> tuple[list[Answer], bytes]:
    """The whole answers at the start of ``data`` and the bytes after them (an answer cut
    short, or a websocket's frames after a ``101``). Raises :class:`Malformed` where the
    bytes cannot be the start of an answer."""
    answers: list[Answer] = []
    at = 0
    while at < len(data):
        parsed = _answer(data, at)
        if parsed is None:
            break
        answer, at = parsed
        answers.append(answer)
        if answer.status == 101:
            break
    return answers, data[at:]


def _answer(data: bytes, at: int) -> tuple[Answer, int] | None:
    end_of_head = data.find(b"\r\n\r\n", at)
    if end_of_head == -1:
        _check_prefix(data[at:])
        return None
    status_line = _STATUS_LINE.match(data, at)
    if status_line is None:
        raise Malformed(f"not a status line: {data[at : at + 80]!r}")
    status = int(status_line.group(1))
    headers: list[tuple[bytes, bytes]] = []
    position = status_line.end()
    while position < end_of_head + 2:
        line = _HEADER_LINE.match(data, position)
        if line is None:
            raise Malformed(f"not a header line: {data[position : position + 80]!r}")
        headers.append((line.group(1).lower(), line.group(2)))
        position = line.end()
    position = end_of_head + 4
    answer = Answer(status, status_line.group(2), headers, b"")
    if status < 200 and status != 101:
        return answer, position  # an interim answer (100 Continue): the real one follows
    if status in (101, 204, 304):
        return answer, position
    encoding = answer.header(b"transfer-encoding")
    length = answer.header(b"content-length")
    if encoding is not None:
        if length is not None:
            raise Malformed("an answer with both Transfer-Encoding and Content-Length")
        if encoding.lower() != b"chunked":
            raise Malformed(f"an answer with Transfer-Encoding {encoding!r}")
        return _chunked(data, position, answer)
    if length is None:
        # Delimited by the end of the connection (an HTTP/1.0 stream): the rest is its body.
        if (answer.header(b"connection") or b"").lower() != b"close":
            raise Malformed(f"an answer with no length that keeps its connection: {headers!r}")
        answer.body = data[position:]
        return answer, len(data)
    if not length.isdigit():
        raise Malformed(f"an answer with no valid length: {headers!r}")
    end = position + int(length)
    if end > len(data):
        return None
    answer.body = data[position:end]
    return answer, end


def _chunked(data: bytes, position: int, answer: Answer) -> tuple[Answer, int] | None:
    body = bytearray()
    while True:
        line_end = data.find(b"\r\n", position)
        if line_end == -1:
            return None
        size = _CHUNK_SIZE.match(data, position)
        if size is None or size.end() != line_end + 2:
            raise Malformed(f"not a chunk size line: {data[position : position + 40]!r}")
        count = int(size.group(1), 16)
        start = size.end()
        if count == 0:
            # no trailers from this server: the last chunk is followed by the final CRLF
            if len(data) < start + 2:
                return None
            if data[start : start + 2] != b"\r\n":
                raise Malformed(f"bytes after the last chunk: {data[start : start + 40]!r}")
            answer.body = bytes(body)
            return answer, start + 2
        if len(data) < start + count + 2:
            return None
        if data[start + count : start + count + 2] != b"\r\n":
            raise Malformed("a chunk longer than its size line says")
        body += data[start : start + count]
        position = start + count + 2


def _check_prefix(rest: bytes) -> None:
    """An answer cut short must still start like one."""
    expected = b"HTTP/1."
    if not (rest[: len(expected)] == expected[: len(rest)]):
        raise Malformed(f"not the start of an answer: {rest[:80]!r}")
