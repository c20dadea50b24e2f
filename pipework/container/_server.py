"""Serve an ASGI app (a ``QuartTrio`` app) the trio way: cleartext HTTP/1.1 with
pipework's own server (:mod:`._h1_server`, which hands websockets and HTTP/2 to hypercorn),
everything else (HTTPS, HTTP/2 by ALPN) with hypercorn's trio worker; ``http1="hypercorn"``
gives every connection to hypercorn.

``serve`` runs in the caller's nursery and reports where it listens through
``task_status``::

    async with trio.open_nursery() as nursery:
        address = await nursery.start(partial(serve, app, shutdown_trigger=stop))
        ...                     # address.port is the real port, even for port=0
        stop.set()              # graceful: stop accepting, let requests finish

Setting ``shutdown_trigger`` is the graceful path: the server closes the listening socket
at once (so the port is free again), closes idle keep-alive connections, lets requests in
flight finish for up to ``graceful_timeout`` seconds, then cancels their handlers and
drops their connections without a response (a handler that wants to answer 503 must do
so before that deadline), runs the app's shutdown (Quart's ``after_serving``), and
``serve`` returns. Cancelling the task that runs ``serve`` is the hard path: everything
stops at once and the app's shutdown does not run.

The app must handle the ASGI ``lifespan`` scope (Quart does): one that simply returns
from it makes either server fail at startup with ``ClosedResourceError`` (both run the
lifespan with hypercorn's own ``Lifespan``).

``serve`` applies :mod:`._hypercorn_fix` and :mod:`._hypercorn_ws`, without which one
client's bytes could end the whole server, requests HTTP/1.1 refuses would be served,
connections would stay open after ``Connection: close`` and keep-alive timeouts, and a
websocket protocol error would end without its close frame.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from typing import Final, Literal, NamedTuple
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.typing import ASGIFramework

from . import _h1_server, _hypercorn_fix, _hypercorn_ws

__all__ = ["HTTP1_SERVERS", "BoundAddress", "serve"]

#: Who serves cleartext HTTP/1.1: pipework's own server (:mod:`._h1_server`, handing
#: websockets and h2c to hypercorn) or hypercorn for everything.
HTTP1_SERVERS: Final = ("lean", "hypercorn")
Http1Server = Literal["lean", "hypercorn"]

#: The default of ``serve(http1=...)`` (and of ``[server] http1_server``).
DEFAULT_HTTP1: Http1Server = "lean"

# Config attributes serve() owns, with what to do instead of setting them.
_RESERVED_OPTIONS: Final[Mapping[str, str]] = {
    "bind": "pass host and port",
    "insecure_bind": "serve() listens on one address; pass host and port",
    "quic_bind": "serve() listens on one address; pass host and port",
    "graceful_timeout": "pass graceful_timeout",
    "keep_alive_timeout": "pass keep_alive_timeout",
    "keep_alive_max_requests": "pass keep_alive_max_requests",
    "workers": "serve() runs in this process; start more processes outside it",
    "debug": "hypercorn ignores it outside its command line",
}


class BoundAddress(NamedTuple):
    """Where a server listens: the address it really bound, with the real port."""

    host: str
    port: int
    scheme: str = "http"

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:8080`` (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


async def serve(
    app: ASGIFramework,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    fd: int | None = None,
    shutdown_trigger: trio.Event | None = None,
    graceful_timeout: float = 3.0,
    keep_alive_timeout: float = 5.0,
    keep_alive_max_requests: int = 1000,
    hypercorn_options: Mapping[str, object] | None = None,
    ssl_context: ssl.SSLContext | None = None,
    http1: Http1Server | None = None,
    task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` until ``shutdown_trigger`` is set, then shut down.

    ``port=0`` picks a free port; ``task_status.started()`` reports the
    :class:`BoundAddress` once the socket is listening and the app's startup has run.
    ``fd``: serve on this already bound TCP socket (a file descriptor inherited from a
    supervising process) instead of binding ``host:port``; it is closed at the end.

    When ``shutdown_trigger`` is set, the server stops accepting, lets requests in flight
    finish for up to ``graceful_timeout`` seconds, cancels the rest, and returns. Without a
    trigger it serves until cancelled.

    ``hypercorn_options`` sets any other :class:`hypercorn.config.Config` attribute (for
    example ``h11_max_incomplete_size``, ``read_timeout``, ``accesslog``, ``certfile``).
    Hypercorn's error log goes to the ``hypercorn.error`` logger through the
    application's own logging configuration unless ``errorlog`` is given here.

    ``ssl_context``: serve HTTPS with this context (and HTTP/2 to clients that ask for it
    by ALPN), kept for the server's life: what it serves can change through it (the
    gateway's :class:`~._tls.CertificateSwitch`), where hypercorn's own ``certfile`` and
    ``keyfile`` are read once. TLS connections are always hypercorn's.

    ``http1``: who serves cleartext HTTP/1.1 (default :data:`DEFAULT_HTTP1`): ``"lean"``,
    pipework's own server (:mod:`._h1_server`; it reads the same hypercorn options and
    hands websockets, h2c and HTTP/2 prior knowledge to hypercorn), or ``"hypercorn"``.
    """
    if http1 is None:
        http1 = DEFAULT_HTTP1
    if http1 not in HTTP1_SERVERS:
        raise ValueError(f"http1 must be one of {', '.join(HTTP1_SERVERS)}, not {http1!r}")
    _hypercorn_fix.apply()
    _hypercorn_ws.apply()
    config = _build_config(
        host=host,
        port=port,
        fd=fd,
        graceful_timeout=graceful_timeout,
        keep_alive_timeout=keep_alive_timeout,
        keep_alive_max_requests=keep_alive_max_requests,
        options=hypercorn_options or {},
    )
    trigger = shutdown_trigger.wait if shutdown_trigger is not None else None
    if ssl_context is None and http1 == "lean":
        await _h1_server.serve_h1(
            app, config, shutdown_trigger=trigger, task_status=_ReportLeanAddress(task_status)
        )
        return
    if ssl_context is not None:
        _serve_tls(config, ssl_context)
    await hypercorn_serve(
        app,
        config,
        shutdown_trigger=trigger,
        task_status=_ReportBoundAddress(task_status),
    )


def _build_config(
    *,
    host: str,
    port: int,
    fd: int | None = None,
    graceful_timeout: float,
    keep_alive_timeout: float,
    keep_alive_max_requests: int,
    options: Mapping[str, object],
) -> Config:
    for name in options:
        if name in _RESERVED_OPTIONS:
            raise ValueError(
                f"hypercorn option {name!r} cannot be set through hypercorn_options: "
                f"{_RESERVED_OPTIONS[name]}"
            )
        if name.startswith("_") or not hasattr(Config, name):
            raise ValueError(
                f"unknown hypercorn option {name!r}; see hypercorn.config.Config for the names"
            )
    config = Config()
    # Without an explicit logger hypercorn replaces the handlers of its loggers with its
    # own stderr handler; a library must leave logging set-up to the application.
    config.errorlog = logging.getLogger("hypercorn.error")
    for name, value in options.items():
        setattr(config, name, value)
    # Brackets keep an IPv6 host apart from the port for hypercorn's "host:port" parser.
    if fd is not None:
        config.bind = [f"fd://{fd}"]
    else:
        config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.graceful_timeout = graceful_timeout
    config.keep_alive_timeout = keep_alive_timeout
    config.keep_alive_max_requests = keep_alive_max_requests
    return config


def _serve_tls(config: Config, context: ssl.SSLContext) -> None:
    """Make hypercorn serve TLS with ``context``: it does when ``certfile`` and ``keyfile``
    are set (``ssl_enabled``), and takes its context from ``create_ssl_context`` once, at
    start-up; the files are then never read by hypercorn."""
    if config.certfile is not None or config.keyfile is not None:
        raise ValueError("give ssl_context or the certfile and keyfile options, not both")
    config.certfile = config.keyfile = "<ssl_context>"
    # An instance attribute over the method: hypercorn calls config.create_ssl_context().
    config.create_ssl_context = lambda: context  # type: ignore[method-assign]  # see above


class _ReportBoundAddress(trio.TaskStatus[list[str]]):
    """Turn hypercorn's started value (its bind URLs) into our :class:`BoundAddress`."""

    def __init__(self, task_status: trio.TaskStatus[BoundAddress]) -> None:
        self._task_status = task_status

    def started(self, value: list[str] | None = None) -> None:
        # serve() binds exactly one address, so hypercorn reports exactly one URL.
        if value is None or len(value) != 1:
            raise RuntimeError(f"expected hypercorn to report one bound address, got {value!r}")
        self._task_status.started(_parse_bind_url(value[0]))


class _ReportLeanAddress(trio.TaskStatus[tuple[str, int]]):
    """Turn the lean server's started value (host, port) into our :class:`BoundAddress`."""

    def __init__(self, task_status: trio.TaskStatus[BoundAddress]) -> None:
        self._task_status = task_status

    def started(self, value: tuple[str, int] | None = None) -> None:
        if value is None:
            raise RuntimeError("expected the server to report its bound address")
        self._task_status.started(BoundAddress(value[0], value[1]))


def _parse_bind_url(url: str) -> BoundAddress:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise RuntimeError(f"cannot read a host and port from hypercorn's bind URL {url!r}")
    return BoundAddress(parts.hostname, parts.port, parts.scheme)
