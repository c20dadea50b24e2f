"""A service as proxy routes see it: its name, its time limits and how to stream an
exchange to it or open a websocket.

The proxy needs a client that streams
(:meth:`~pipework.backends._client.ServiceClient.stream`) and opens websockets
(:meth:`~pipework.backends._client.ServiceClient.websocket`), each through the service's
resilience core; the registry, which builds the backends, hands it these. The proxy
itself knows no HTTP client library.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

import trio

from .._errors import PipeworkError
from ..backends._stream import Handshake, StreamTimeouts, UpstreamAnswer

__all__ = ["Streams", "Upstream", "Websocket"]


class Websocket(Protocol):
    """One proxied websocket as its service's call (the lean client's ``WebsocketCall``)."""

    async def connect(self) -> trio.SocketStream | trio.SSLStream[trio.SocketStream]: ...

    def host(self, given: bytes) -> bytes: ...

    def handshake_done(self, handshake: Handshake) -> None: ...


class Streams(Protocol):
    """What streams one exchange to a service, and opens a websocket's call (the lean
    client does); and what says, first, whether the service refuses calls now."""

    def refusal(self) -> PipeworkError | None:
        """The error a call to the service gets now without being tried (its breaker
        open, every host drained: counted as such), or None when it would be taken."""
        ...

    def websocket(self, connect_timeout: float) -> AbstractAsyncContextManager[Websocket]: ...

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
    """Service ``name``: its ``Host`` (``netloc``, its first host's: the client gives each
    host its own), its ``timeout`` and ``connect_timeout`` (seconds; the route's own win),
    the header carrying the request id (None: not sent), and its ``client``, which picks
    the host of each exchange and websocket."""

    name: str
    client: Streams
    netloc: bytes
    timeout: float
    connect_timeout: float | None = None
    request_id_header: str | None = "X-Request-ID"
