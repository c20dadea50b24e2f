"""The PDF workers' wire protocol: length-prefixed msgpack frames over a pipe.

A frame is a 4-byte big-endian length, then that many bytes of one msgpack map with a
``type`` key. The service writes to the worker's stdin and reads its stdout:

- worker -> service, once at start: ``{"type": "ready", "pid": int, "browser": str}``, or
  ``{"type": "failed", "error": str, "message": str}`` and exit;
- service -> worker: ``{"type": "render", "id": int, "html": str, "timeout": float}``;
- worker -> service: ``{"type": "pdf", "id": int, "pdf": bytes, "pages": int}`` (pages:
  how many pages the worker's browser has made so far, 1 while it reuses its first) or
  ``{"type": "error", "id": int, "error": str, "message": str}``;
- service -> worker: ``{"type": "close"}`` (or end of input): close the browser and exit 0.

:class:`FrameDecoder` is sans-IO: it takes bytes as they arrive, in any pieces, and gives
back whole messages, so both sides (trio streams here, blocking pipes in the worker) and
the tests share it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, Final

import msgpack

__all__ = ["MAX_FRAME", "FrameDecoder", "ProtocolError", "encode"]

_LENGTH: Final = struct.Struct(">I")
#: The largest frame either side accepts: a report's PDF is far smaller.
MAX_FRAME: Final = 256 * 1024 * 1024


class ProtocolError(Exception):
    """A frame that breaks the protocol: too large, not msgpack, or not a typed map."""


def encode(message: Mapping[str, Any]) -> bytes:
    """One frame: the length, then the message as msgpack."""
    body: bytes = msgpack.packb(dict(message), use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"a {message.get('type')!r} frame of {len(body)} bytes is too large")
    return _LENGTH.pack(len(body)) + body


class FrameDecoder:
    """Feed bytes as they arrive; ``next_message()`` gives each whole message once."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buffer = bytearray()
        self._max_frame = max_frame

    def feed(self, data: bytes | bytearray) -> None:
        self._buffer += data

    @property
    def pending(self) -> int:
        """Bytes received that are not yet a whole message."""
        return len(self._buffer)

    def next_message(self) -> dict[str, Any] | None:
        """The next whole message, or None until more bytes arrive."""
        if len(self._buffer) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._buffer)
        if length > self._max_frame:
            raise ProtocolError(f"a frame of {length} bytes is over the limit of {self._max_frame}")
        end = _LENGTH.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[_LENGTH.size : end])
        del self._buffer[:end]
        try:
            message = msgpack.unpackb(body, raw=False)
        except Exception as error:
            raise ProtocolError(f"a frame that is not msgpack ({error})") from error
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise ProtocolError(f"a frame that is not a map with a 'type': {message!r:.80}")
        return message
