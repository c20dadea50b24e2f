"""Fixes to hypercorn's trio worker and HTTP/1.1 protocol, applied when pipework serves.

Each fix below explains its bug; ``apply()`` checks the internals they rely on and raises
``RuntimeError`` if they changed, rather than patching something it no longer understands.

**1. A connection's close races its own sends, and the error ends the server** (hypercorn
issue #203, "H11 Got data when expected EOF"). ``TCPServer.protocol_send`` writes under
``send_lock``, but ``TCPServer._close`` calls ``send_eof`` without it, and trio's
``SocketStream`` refuses two senders at once with ``trio.BusyResourceError``. A client that
sends bytes after a ``Connection: close`` request's body makes h11 raise "Got data when
expecting EOF" in the reading task, whose 400 answer is then sent while the application's
task, its own answer done, closes the connection::

    reading task   _handle_events ─ _send_error_response ─ send_all   (holds send_lock)
    app's task     _maybe_recycle ─ TCPServer._close ─ send_eof        (no lock: Busy...)

Whichever loses raises ``BusyResourceError``, which nothing in hypercorn catches: it leaves
``TCPServer.run`` into the nursery of every connection and ends the process. The fix:
``_close`` takes ``send_lock`` (its EOF goes after the bytes queued before it); fix 5
removes this story's trigger too.

**2. A connection's task is a boundary** (``TCPServer.run``): whatever escapes it besides
a cancellation from outside is logged once with its traceback and closes that connection
only. hypercorn lets it end the server; one client's bytes must never end the others'
requests. Cancellation, ``KeyboardInterrupt`` and ``SystemExit`` pass through.

**3. Connection bookkeeping cancelled half-way** (hypercorn 0.18.0 with quart-trio 0.12 on
trio 0.35; the family of hypercorn issue #106, "Hypercorn skip socket shutdown when
cancelled with trio"). When a response ends, hypercorn does the connection's bookkeeping
from inside the ASGI app's own ``send`` call, in the app's task::

    quart-trio handle_request ─ send(last body chunk)
      └ HTTPStream._send_closed ─ H11Protocol._maybe_recycle
          ├ _close_stream ─ queues {"type": "http.disconnect"} for the app
          ├ (connection ends)  TCPServer._close
          │     ├ await stream.send_eof()     <- Cancelled here
          │     └ await stream.aclose()       <- never reached
          └ (keep-alive)       TrioSingleTask.restart(_idle_timeout)
                └ await lock / nursery.start  <- Cancelled here: no idle timer

quart-trio runs the handler beside a ``handle_messages`` task in one nursery; that task
receives the queued ``http.disconnect`` and cancels the nursery, and the cancel lands on
the next checkpoint of the bookkeeping. (HTTP/2 restarts the idle timer the same way.)
When the response ends the connection, ``aclose()`` is skipped: the client has its whole
response but never sees EOF. When it is kept alive, the idle timer is never restarted, so
``keep_alive_timeout`` never closes the idle connection, nor does a graceful shutdown,
which works through that timer. The fix runs ``TCPServer._close``,
``TrioSingleTask.restart`` and ``TrioSingleTask.stop`` in shielded cancel scopes. None of
them blocks for long: ``send_eof`` on a ``SocketStream`` is one ``shutdown()`` call (TLS
streams have none; hypercorn catches the ``AttributeError``), hypercorn's ``SSLListener``
is ``https_compatible``, so ``aclose`` only closes the transport, and the idle timer's lock
is held only by these two methods, whose ``nursery.start`` returns at once. Each scope
still has a deadline: a send stuck on a peer that does not read holds ``send_lock``, and
``_close`` then closes the stream without its EOF.

**4 and 5**, in hypercorn's HTTP/1.1 protocol, are in :mod:`._hypercorn_h11`: requests
RFC 9112 refuses are refused, hypercorn's own answers are problems with reason phrases,
and nothing is read after a request that closes its connection (so the bytes of fix 1's
story are dropped unread, and the application's answer is the only one).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final

import trio
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

from ..dispatcher._boundary import split_outside
from . import _hypercorn_h11

__all__ = ["TESTED_HYPERCORN_VERSION", "apply", "is_applied"]

#: The hypercorn release whose internals this patch was written against; pyproject.toml pins
#: hypercorn to its minor series (``>=0.18,<0.19``).
TESTED_HYPERCORN_VERSION: Final = "0.18.0"
_PIN: Final = "hypercorn>=0.18,<0.19"

# Each shielded call takes microseconds; the bound only matters if one ever starts
# waiting on the peer, and then a stuck peer must not pin the connection task.
_SHIELD_TIMEOUT: Final = 5.0

_MARKER: Final = "_pipework_patched"

_log = logging.getLogger("pipework.container")

_AsyncMethod = Callable[..., Coroutine[Any, Any, None]]


# -- the fixes -------------------------------------------------------------------------


def _shielded(method: _AsyncMethod) -> _AsyncMethod:
    async def shielded(*args: Any, **kwargs: Any) -> None:
        with trio.move_on_after(_SHIELD_TIMEOUT, shield=True):
            await method(*args, **kwargs)

    return shielded


def _close_after_sends(close: _AsyncMethod) -> _AsyncMethod:
    async def close_after_sends(self: TCPServer) -> None:
        with trio.move_on_after(_SHIELD_TIMEOUT, shield=True):
            if self.send_lock.statistics().owner is trio.lowlevel.current_task():
                await close(self)  # closing from inside a send (trio's Lock is not re-entrant)
            else:
                async with self.send_lock:
                    await close(self)
            return
        # A send held the lock past the bound (a peer that does not read): closing the
        # stream wakes it with ClosedResourceError, which hypercorn handles.
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    return close_after_sends


def _connection_boundary(run: _AsyncMethod) -> _AsyncMethod:
    async def connection_boundary(self: TCPServer) -> None:
        peer = _peer(self.stream)  # while the peer is there to ask
        try:
            await run(self)
        except BaseException as escaped:
            outside, errors = split_outside(escaped)
            if errors is not None:
                _log.error(
                    "a connection from %s failed in the server; closed that connection only",
                    peer,
                    exc_info=errors,
                )
                with trio.CancelScope(shield=True):
                    await self.stream.aclose()
            if outside is not None:
                raise outside from None
            # the errors end here, with the connection

    return connection_boundary


def _peer(stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]) -> str:
    transport = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    try:
        host, port, *_ = transport.socket.getpeername()
    except (OSError, ValueError):  # gone already, or not an IP socket
        return "an unknown peer"
    return f"{host}:{port}"


# -- what is patched, and what it relies on --------------------------------------------


@dataclass(frozen=True)
class _Patch:
    cls: type
    name: str
    parameters: tuple[str, ...]
    uses: frozenset[str]  # names the original's body must use
    replace: Callable[[Any], Any]
    is_async: bool = True


_H11_INIT: Final = (
    "self",
    "app",
    "config",
    "context",
    "task_group",
    "connection_state",
    "ssl",
    "client",
    "server",
    "send",
)

_PATCHES: Final[tuple[_Patch, ...]] = (
    _Patch(
        H11Protocol,
        "__init__",
        _H11_INIT,
        frozenset({"Connection", "SERVER", "h11_max_incomplete_size"}),
        _hypercorn_h11.reading_connection,
        is_async=False,
    ),
    _Patch(TCPServer, "run", ("self",), frozenset({"_read_data", "_close"}), _connection_boundary),
    _Patch(TCPServer, "_close", ("self",), frozenset({"send_eof", "aclose"}), _close_after_sends),
    _Patch(
        TrioSingleTask, "restart", ("self", "task_group", "action"), frozenset({"start"}), _shielded
    ),
    _Patch(TrioSingleTask, "stop", ("self",), frozenset({"cancel"}), _shielded),
    _Patch(
        H11Protocol,
        "_create_stream",
        ("self", "request"),
        frozenset({"HTTPStream", "WSStream", "method", "http_version"}),
        _hypercorn_h11.refuse_bad_framing,
    ),
    _Patch(
        H11Protocol,
        "_send_error_response",
        ("self", "status_code"),
        frozenset({"_send_h11_event", "EndOfMessage"}),
        _hypercorn_h11.h11_problem_answer,
    ),
    _Patch(
        H11Protocol,
        "_send_h11_event",
        ("self", "event"),
        frozenset({"send", "RawData"}),
        _hypercorn_h11.with_reason,
    ),
    _Patch(
        HTTPStream,
        "_send_error_response",
        ("self", "status_code"),
        frozenset({"Response", "EndBody", "CLOSED", "access", "start_time"}),
        _hypercorn_h11.http_stream_problem_answer,
    ),
    _Patch(
        WSStream,
        "_send_error_response",
        ("self", "status_code"),
        frozenset({"Response", "EndBody", "access", "start_time"}),
        _hypercorn_h11.ws_stream_problem_answer,
    ),
)

# The paths that must go through the patched methods (class, method, names it must use);
# if one stopped doing so, a fix would no longer cover it.
_CALLERS: Final[tuple[tuple[type, str, frozenset[str]], ...]] = (
    (TCPServer, "__init__", frozenset({"TrioSingleTask", "idle_task", "send_lock"})),
    (
        TCPServer,
        "protocol_send",
        frozenset({"_close", "idle_task", "restart", "stop", "send_lock"}),
    ),
    (H11Protocol, "_handle_events", frozenset({"_send_error_response", "_create_stream"})),
    (H11Protocol, "stream_send", frozenset({"_send_h11_event"})),
    (HTTPStream, "app_send", frozenset({"_send_error_response"})),
    (WSStream, "handle", frozenset({"_send_error_response"})),
)


def is_applied() -> bool:
    """Whether every method this module patches is the patched version."""
    return all(_is_patched(getattr(p.cls, p.name, None)) for p in _PATCHES)


def apply() -> None:
    """Apply every fix above. Idempotent.

    Raises ``RuntimeError`` if hypercorn no longer looks like the one these fixes were
    written for; nothing is patched then.
    """
    originals = _check_internals()
    for patch, original in zip(_PATCHES, originals, strict=True):
        if not _is_patched(original):
            replacement = functools.wraps(original)(patch.replace(original))
            setattr(replacement, _MARKER, True)
            setattr(patch.cls, patch.name, replacement)


def _is_patched(method: object) -> bool:
    return getattr(method, _MARKER, False) is True


def _check_internals() -> list[_AsyncMethod]:
    """Return the current target methods after checking what the fixes rely on."""
    methods: list[_AsyncMethod] = []
    for patch in _PATCHES:
        where = f"{patch.cls.__name__}.{patch.name}"
        method = getattr(patch.cls, patch.name, None)
        if method is None:
            raise _incompatible(f"{where} is missing")
        original = inspect.unwrap(method)
        if inspect.iscoroutinefunction(original) is not patch.is_async:
            kind = "an async" if patch.is_async else "a plain"
            raise _incompatible(f"{where} is not {kind} method")
        signature = inspect.signature(original)
        if tuple(signature.parameters) != patch.parameters:
            raise _incompatible(f"{where}{signature} does not take {patch.parameters}")
        if not patch.uses <= _names(original.__code__):
            raise _incompatible(f"{where} no longer uses {', '.join(sorted(patch.uses))}")
        methods.append(method)
    for cls, name, uses in _CALLERS:
        # Unwrapped: another fix may wrap a caller (_hypercorn_ws wraps WSStream.handle).
        method = getattr(cls, name, None)
        code = None if method is None else getattr(inspect.unwrap(method), "__code__", None)
        if code is None or not uses <= _names(code):
            raise _incompatible(f"{cls.__name__}.{name} no longer uses {', '.join(sorted(uses))}")
    return methods


def _names(code: Any) -> set[str]:
    """The global and attribute names a function's body uses, nested blocks included."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if inspect.iscode(constant):
            names |= _names(constant)
    return names


def _installed_version() -> str:
    try:
        return importlib.metadata.version("hypercorn")
    except importlib.metadata.PackageNotFoundError:  # imported, yet not installed: vendored
        return "unknown"


def _incompatible(problem: str) -> RuntimeError:
    installed = _installed_version()
    if installed == TESTED_HYPERCORN_VERSION:
        todo = (
            "the installed hypercorn has the tested version but was changed: reinstall it "
            f"(pip install --force-reinstall 'hypercorn=={TESTED_HYPERCORN_VERSION}')"
        )
    else:
        todo = (
            f"install the series pipework declares (pip install '{_PIN}'), or, to move to "
            f"hypercorn {installed}, re-check the bugs described in "
            "pipework/container/_hypercorn_fix.py against it, update the fixes, "
            "TESTED_HYPERCORN_VERSION and the pin in pyproject.toml together"
        )
    return RuntimeError(
        f"pipework cannot apply its connection fix to hypercorn {installed}: {problem}. "
        f"The fix was written for hypercorn {TESTED_HYPERCORN_VERSION}; {todo}."
    )
