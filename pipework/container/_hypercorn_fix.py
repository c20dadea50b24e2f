"""Keep hypercorn's trio worker from abandoning connection bookkeeping half-done.

The bug (hypercorn 0.18.0 with quart-trio 0.12 on trio 0.35; the family of hypercorn
issue #106, "Hypercorn skip socket shutdown when cancelled with trio"):

When a response ends, hypercorn does the connection's bookkeeping from inside the ASGI
app's own ``send`` call, in the app's task::

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

- When the response ends the connection (``Connection: close`` from either side, the
  response after ``keep_alive_max_requests``, any response during a graceful shutdown),
  ``aclose()`` is skipped: the client has its whole response but never sees EOF.
- When the connection is kept alive, the idle timer is never restarted, so
  ``keep_alive_timeout`` never closes the idle connection, and neither does a graceful
  shutdown, which works through that timer.

Either way the socket stays open until the client hangs up, and a graceful shutdown
waits for the whole grace period. (When a connection task ends, trio's
``serve_listeners`` closes its stream, so sockets are held open, not leaked.)

The fix runs ``TCPServer._close``, ``TrioSingleTask.restart`` and ``TrioSingleTask.stop``
in shielded cancel scopes. None of them can block for long: ``send_eof`` on a
``SocketStream`` is one ``shutdown()`` call (TLS streams have none; hypercorn catches the
``AttributeError``), hypercorn's ``SSLListener`` is ``https_compatible``, so ``aclose``
only closes the transport, and the idle timer's lock is held only by these two methods,
whose ``nursery.start`` returns at once. Each scope still has a deadline in case a future
version makes them wait on the peer; trio closes a transport even when ``aclose`` is
cancelled. Outer cancellation is delivered at the next checkpoint after them.

``apply()`` checks the internals it relies on and raises ``RuntimeError`` if they
changed, rather than patching something it no longer understands.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, Final

import trio
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

__all__ = ["TESTED_HYPERCORN_VERSION", "apply", "is_applied"]

#: The hypercorn release whose internals this patch was written against; pyproject.toml pins
#: hypercorn to its minor series (``>=0.18,<0.19``).
TESTED_HYPERCORN_VERSION: Final = "0.18.0"
_PIN: Final = "hypercorn>=0.18,<0.19"

# Each shielded call takes microseconds; the bound only matters if one ever starts
# waiting on the peer, and then a stuck peer must not pin the connection task.
_SHIELD_TIMEOUT: Final = 5.0

_MARKER: Final = "_pipework_shielded"

_AsyncMethod = Callable[..., Coroutine[Any, Any, None]]

# (class, method, its parameters, names its body must use)
_TARGETS: Final[tuple[tuple[type, str, tuple[str, ...], frozenset[str]], ...]] = (
    (TCPServer, "_close", ("self",), frozenset({"send_eof", "aclose"})),
    (TrioSingleTask, "restart", ("self", "task_group", "action"), frozenset({"start"})),
    (TrioSingleTask, "stop", ("self",), frozenset({"cancel"})),
)

# The paths that must go through the patched methods (class, method, names it must use);
# if one stopped doing so, the shields would no longer cover it.
_CALLERS: Final[tuple[tuple[type, str, frozenset[str]], ...]] = (
    (TCPServer, "__init__", frozenset({"TrioSingleTask", "idle_task"})),
    (TCPServer, "run", frozenset({"_close"})),
    (TCPServer, "protocol_send", frozenset({"_close", "idle_task", "restart", "stop"})),
)


def is_applied() -> bool:
    """Whether every method this module shields is the shielded version."""
    return all(_is_shielded(getattr(cls, name, None)) for cls, name, _, _ in _TARGETS)


def apply() -> None:
    """Shield hypercorn's connection bookkeeping against cancellation. Idempotent.

    Raises ``RuntimeError`` if hypercorn's trio worker no longer looks like the one this
    patch was written for; nothing is patched then.
    """
    originals = _check_internals()
    for (cls, name, _, _), original in zip(_TARGETS, originals, strict=True):
        if not _is_shielded(original):
            setattr(cls, name, _shielded(original))


def _shielded(method: _AsyncMethod) -> _AsyncMethod:
    @functools.wraps(method)
    async def shielded(*args: Any, **kwargs: Any) -> None:
        with trio.move_on_after(_SHIELD_TIMEOUT, shield=True):
            await method(*args, **kwargs)

    setattr(shielded, _MARKER, True)
    return shielded


def _is_shielded(method: object) -> bool:
    return getattr(method, _MARKER, False) is True


def _check_internals() -> list[_AsyncMethod]:
    """Return the current target methods after checking what the patch relies on."""
    methods: list[_AsyncMethod] = []
    for cls, name, parameters, uses in _TARGETS:
        where = f"{cls.__name__}.{name}"
        method = getattr(cls, name, None)
        if method is None:
            raise _incompatible(f"{where} is missing")
        original = inspect.unwrap(method)
        if not inspect.iscoroutinefunction(original):
            raise _incompatible(f"{where} is not an async method")
        signature = inspect.signature(original)
        if tuple(signature.parameters) != parameters:
            raise _incompatible(f"{where}{signature} does not take {parameters}")
        if not uses <= set(original.__code__.co_names):
            raise _incompatible(f"{where} no longer uses {', '.join(sorted(uses))}")
        methods.append(method)
    for cls, name, uses in _CALLERS:
        code = getattr(getattr(cls, name, None), "__code__", None)
        if code is None or not uses <= set(code.co_names):
            raise _incompatible(f"{cls.__name__}.{name} no longer uses {', '.join(sorted(uses))}")
    return methods


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
            f"hypercorn {installed}, re-check the bug described in "
            "pipework/container/_hypercorn_fix.py against it, update the fix, "
            "TESTED_HYPERCORN_VERSION and the pin in pyproject.toml together"
        )
    return RuntimeError(
        f"pipework cannot apply its connection fix to hypercorn {installed}: {problem}. "
        f"The fix was written for hypercorn {TESTED_HYPERCORN_VERSION}; {todo}."
    )
