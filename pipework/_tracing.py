"""Tracing: the spans pipework makes, behind one small interface, off unless configured.

OpenTelemetry is an optional extra (``pipework[otel]``). Nothing here imports it: the
process's :data:`ACTIVE` tracing is :data:`NO_TRACING` (every method a no-op, ``on``
False) until start-up :func:`install`\\ s another -- the SDK's, built by
:func:`pipework._tracing_otel.build` from the gateway file's ``[tracing]`` section
(docs/tracing.md). It is chosen once; the hot paths ask only ``ACTIVE.on`` and do
nothing more while it is False, so tracing off (or not installed) costs one attribute
read per step, pipe and backend call, and no ASGI layer at all.

What is traced, and where (docs/tracing.md has the tree):

- a **server** span per request: an ASGI layer in front of everything
  (:meth:`Tracing.wrap_asgi`), a child of the request's ``traceparent``; the route, the
  job's id (``pipework.route``, ``pipework.job_id``) are set on it as they are known;
- a span per **step** (``pipework/dispatcher/_step.py``), a child of the span the job's
  ``traceparent`` names: the job carries its request's server span as that field (in
  memory, and in a shared store's record), so a step run by the engine's tasks -- or by
  another process -- is still a child of the request's span; the slot wait is an event;
- a span per **pipe** (``pipework/dispatcher/_pipe_run.py``), the step's child;
- a **client** span per backend call (``pipework/backends/_http.py``), the pipe's child,
  whose ``traceparent`` the backend receives; each try (first, retry, hedge) is an event.

The current span is trio's: OpenTelemetry keeps it in a context variable, and trio gives
every task a copy of its parent's context, so a span made current in a task is the parent
of spans its children start.

:func:`current_trace_id` is the request's trace id (32 hex digits) where a log line wants
it: read in the request's task (the access log's), it names the server span's trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal, Protocol, TypeAlias

__all__ = [
    "ACTIVE",
    "NO_TRACING",
    "Attribute",
    "Kind",
    "Span",
    "Tracing",
    "current_trace_id",
    "install",
]

Attribute: TypeAlias = str | bool | int | float
Kind: TypeAlias = Literal["server", "client", "internal"]


class Span(Protocol):
    """A span started by :meth:`Tracing.start`: current in its task until :meth:`end`."""

    def set(self, key: str, value: Attribute) -> None:
        """Set an attribute."""

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        """Add an event, timed now."""

    def headers(self) -> tuple[str | None, str | None]:
        """This span's W3C ``traceparent`` and ``tracestate`` (None when it has none):
        what a call made under it sends, so the callee's span is its child."""

    def end(self, error: BaseException | None = None) -> None:
        """End the span (an error marks it failed and is recorded) and make the span that
        was current before it current again. Call it in the task that started it."""


class Tracing(Protocol):
    """What pipework asks of a tracer (see the module docstring)."""

    #: Whether spans are made: every call site asks this first and does nothing when False.
    on: bool

    def start(
        self,
        name: str,
        kind: Kind,
        attributes: Mapping[str, Attribute],
        *,
        traceparent: str | None = None,
        tracestate: str | None = None,
        new_trace: bool = False,
    ) -> Span:
        """Start a span and make it current in this task: a child of the span named by
        ``traceparent`` (with ``tracestate``) when given, else of the current one (else,
        with ``new_trace``, the first span of a new trace)."""

    def annotate(self, key: str, value: Attribute) -> None:
        """Set an attribute on the current span (none: nothing)."""

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        """Add an event to the current span (none: nothing)."""

    def rename(self, name: str) -> None:
        """Rename the current span (a server span, once its route is known)."""

    def headers(self) -> tuple[str | None, str | None]:
        """The current span's ``traceparent`` and ``tracestate`` (Nones without one)."""

    def trace_id(self) -> str | None:
        """The current span's trace id, 32 hex digits (None without one)."""

    def wrap_asgi(self, app: Any) -> Any:
        """``app`` behind the layer that makes a server span per request."""

    def shutdown(self) -> None:
        """Export what is left and stop (at the end of serving)."""


class _NoSpan:
    __slots__ = ()

    def set(self, key: str, value: Attribute) -> None:
        pass

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        pass

    def headers(self) -> tuple[str | None, str | None]:
        return None, None

    def end(self, error: BaseException | None = None) -> None:
        pass


_NO_SPAN: Final = _NoSpan()


class NoTracing:
    """Tracing off: no span, no layer, nothing imported."""

    __slots__ = ()
    on = False

    def start(
        self,
        name: str,
        kind: Kind,
        attributes: Mapping[str, Attribute],
        *,
        traceparent: str | None = None,
        tracestate: str | None = None,
        new_trace: bool = False,
    ) -> Span:
        return _NO_SPAN

    def annotate(self, key: str, value: Attribute) -> None:
        pass

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        pass

    def rename(self, name: str) -> None:
        pass

    def headers(self) -> tuple[str | None, str | None]:
        return None, None

    def trace_id(self) -> str | None:
        return None

    def wrap_asgi(self, app: Any) -> Any:
        return app

    def shutdown(self) -> None:
        pass


NO_TRACING: Final[Tracing] = NoTracing()

#: The process's tracing (see :func:`install`); read ``ACTIVE.on`` before anything else.
ACTIVE: Tracing = NO_TRACING


def install(tracing: Tracing) -> Tracing:
    """Make ``tracing`` the process's (at start-up, before the container is built: its
    ASGI layer is put in then); returns the one it replaces."""
    global ACTIVE
    previous, ACTIVE = ACTIVE, tracing
    return previous


def current_trace_id() -> str | None:
    """The current span's trace id (32 lower-case hex digits), None with tracing off or
    outside any span. In a request's task (its handlers, the access log): its trace's."""
    return ACTIVE.trace_id()
