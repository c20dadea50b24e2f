"""A service as proxy routes see it: where it listens and how to stream an exchange to it.

The proxy needs a service's address, its time limits and a client that streams
(:meth:`~pipework.backends._client.ServiceClient.stream`); the registry, which builds the
backends, hands it these. The proxy itself knows no HTTP client library.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from ..backends._stream import StreamTimeouts, UpstreamAnswer

__all__ = ["Streams", "Upstream"]


class Streams(Protocol):
    """What streams one exchange to a service (the lean client does)."""

    def stream(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: AsyncIterator[bytes] | None,
        *,
        length: int | None,
        timeouts: StreamTimeouts,
        deadline: float = math.inf,
    ) -> AbstractAsyncContextManager[UpstreamAnswer]: ...


@dataclass(frozen=True, slots=True)
class Upstream:
    """Service ``name`` at ``host:port`` (``netloc``: its ``Host``), its ``timeout`` and
    ``connect_timeout`` (seconds; the route's own win), the header carrying the request
    id (None: not sent), and its streaming ``client``."""

    name: str
    client: Streams
    host: str
    port: int
    netloc: bytes
    timeout: float
    connect_timeout: float | None = None
    request_id_header: str | None = "X-Request-ID"
