"""A pipe is one named step: an ``async def`` (or a declared blocking function) taking a
:class:`Context`. The context is the pipe's whole view of its job."""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, NoReturn, Protocol

import msgpack
import trio

from .._errors import RegistrationError, StateError
from ._state import check_value

__all__ = [
    "DEGRADED_KEY",
    "REQUEST_KEY",
    "Context",
    "JobOps",
    "Pipe",
    "PipeFunction",
    "RequestUse",
    "Suspend",
    "as_pipe",
    "is_seconds",
]

PipeFunction = Callable[["Context"], Awaitable[None]] | Callable[["Context"], None]


class Suspend(BaseException):
    """Raised by :meth:`Context.suspend` to end the pipe and park the job.

    A BaseException so that a pipe's ``except Exception`` cannot swallow it."""

    def __init__(self, signal: str, timeout: float | None, into: str) -> None:
        super().__init__(signal)
        self.signal = signal
        self.timeout = timeout
        self.into = into


class _Describes(Protocol):
    """What names a pipe's place (a chain): formatted only when asked for."""

    def describe(self, path: tuple[int, ...], pipe: Pipe | None = None) -> str: ...


class JobOps(Protocol):
    async def report_progress(
        self, ctx: Context, done: float, total: float | None, message: str | None
    ) -> None: ...

    async def emit(self, ctx: Context, chunk: Any) -> None: ...

    def callback_url(self, ctx: Context, signal: str, ttl: float) -> str: ...


#: The state key under which a route records what its chain's pipes read of its request
#: (:class:`RequestUse`): ``{"headers": [[name, value], ...], "body": raw value}``.
REQUEST_KEY: Final = "request"

#: The state key where a job records the pipes it degraded (skipped, or answered by their
#: fallback): ``{pipe name: reason}`` (see docs/degradation.md).
DEGRADED_KEY: Final = "degraded"


@dataclass(frozen=True, slots=True)
class RequestUse:
    """What a pipe reads of the request that started its job beyond the state its body,
    query and path make: the request ``headers`` it may pass on (lower-case names, ``"*"``
    for every end-to-end one: see :mod:`pipework._headers`) and whether it sends the
    request's ``body`` as it came. A route records them in the job's state, under
    ``"request"``, only when its chain's pipes use them."""

    headers: frozenset[str] = frozenset()
    body: bool = False

    def __or__(self, other: RequestUse) -> RequestUse:
        return RequestUse(self.headers | other.headers, self.body or other.body)


@dataclass(frozen=True, eq=False, slots=True)
class Pipe:
    """A named pipe. ``key`` is its admission key (None: the chain's), ``timeout`` bounds
    one run (always within the job's deadline), ``blocking`` runs it in a worker thread;
    ``request_use`` says what it reads of the request that started its job.

    A pipe marked ``optional``, or given a ``fallback``, is one its job can do without: it
    is **degraded** (skipped, or answered by its fallback) rather than waited for or failing
    the job, when its key has no slot free at once, its key refuses calls, the time left is
    shorter than it usually takes, or it fails (see docs/degradation.md). ``fallback`` is
    either state to set (a mapping of top-level keys to values, copied each time) or a pipe
    to run in its place, at once, taking no slot.
    """

    fn: PipeFunction
    name: str
    key: str | None = None
    timeout: float | None = None
    blocking: bool = False
    request_use: RequestUse | None = None
    optional: bool = False
    fallback: Mapping[str, Any] | Pipe | None = None
    #: ``optional`` or with a fallback: set from them, read on every run.
    degradable: bool = field(default=False, init=False, repr=False)
    #: A fallback mapping packed once: each degraded run unpacks a copy of its own.
    _fallback_state: bytes | None = field(default=None, init=False, repr=False)

    kind = "pipe"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RegistrationError(f"a pipe's name must be a non-empty string, got {self.name!r}")
        if self.timeout is not None and not is_seconds(self.timeout):
            raise RegistrationError(
                f"pipe {self.name!r}: timeout must be a positive number of seconds or None, "
                f"got {self.timeout!r}"
            )
        if self.key is not None and not (isinstance(self.key, str) and self.key):
            raise RegistrationError(
                f"pipe {self.name!r}: key (its admission key) must be a non-empty string or "
                f"None, got {self.key!r}"
            )
        if not isinstance(self.blocking, bool):
            raise RegistrationError(
                f"pipe {self.name!r}: blocking must be True or False, got {self.blocking!r}"
            )
        if not callable(self.fn):
            raise RegistrationError(f"pipe {self.name!r}: {self.fn!r} is not a function")
        is_async = inspect.iscoroutinefunction(self.fn)
        if self.blocking and is_async:
            raise RegistrationError(
                f"pipe {self.name!r} is an async function declared blocking; "
                "drop blocking=True (async pipes run on the event loop)"
            )
        if not self.blocking and not is_async:
            raise RegistrationError(
                f"pipe {self.name!r} is not an async function; write it as `async def`, "
                "or declare it with blocking=True to run it in a worker thread"
            )
        if not isinstance(self.optional, bool):
            raise RegistrationError(
                f"pipe {self.name!r}: optional must be True or False, got {self.optional!r}"
            )
        if self.fallback is not None:
            object.__setattr__(self, "_fallback_state", self._check_fallback(self.fallback))
        object.__setattr__(self, "degradable", self.optional or self.fallback is not None)

    def _check_fallback(self, fallback: object) -> bytes | None:
        """The fallback mapping packed (None for a fallback pipe), or RegistrationError."""
        return check_fallback(f"pipe {self.name!r}: fallback", fallback)

    def fallback_state(self) -> dict[str, Any]:
        """A fresh copy of the state a fallback mapping sets (empty for none)."""
        packed = self._fallback_state
        if packed is None:
            return {}
        state: dict[str, Any] = msgpack.unpackb(packed, strict_map_key=False)
        return state

    async def run(self, ctx: Context) -> None:
        if self.blocking:
            # Not abandoned on cancel: the slot stays held until the thread really ends, so
            # the pool's accounting never undercounts work still running.
            await trio.to_thread.run_sync(self.fn, ctx)
        else:
            await self.fn(ctx)  # type: ignore[misc]  # async by the check in __post_init__


def is_seconds(value: object) -> bool:
    """Whether ``value`` is a positive number of seconds (a bool is not a number here)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def as_pipe(item: Pipe | PipeFunction) -> Pipe:
    """A Pipe as is; a bare function becomes a pipe named after it."""
    if isinstance(item, Pipe):
        return item
    if callable(item):
        return Pipe(item, getattr(item, "__name__", repr(item)))
    raise RegistrationError(f"expected a pipe, a stage or an async function, got {item!r}")


class Context:
    """What a pipe sees of its job.

    ``state`` is the job's state (a branch sees its own snapshot); write only values msgpack
    can store. ``deadline`` is the absolute trio time this run must end by (the tightest of
    the pipe, stage and job limits); pass ``remaining`` on to backend calls.
    """

    __slots__ = (
        "_ops",
        "_position",
        "_where",
        "baggage",
        "chain",
        "correlation_id",
        "deadline",
        "job_id",
        "key",
        "pipe",
        "state",
        "traceparent",
        "tracestate",
    )

    def __init__(
        self,
        state: dict[str, Any],
        job_id: str,
        correlation_id: str,
        chain: str,
        pipe: Pipe,
        where: _Describes,
        position: tuple[int, ...],
        key: str,
        deadline: float,
        ops: JobOps,
        traceparent: str | None = None,
        tracestate: str | None = None,
        baggage: str | None = None,
    ) -> None:
        self.state = state
        #: The W3C trace context of the request that started the job, if it sent one
        #: (``tracestate`` only with a ``traceparent``; ``baggage`` on its own).
        self.traceparent = traceparent
        self.tracestate = tracestate
        self.baggage = baggage
        self.job_id = job_id
        self.correlation_id = correlation_id
        self.chain = chain
        self.pipe = pipe
        self.key = key
        self.deadline = deadline
        self._where = where
        self._position = position
        self._ops = ops

    @property
    def path(self) -> str:
        """Where this pipe runs: ``chain 'order' > all_of[1] > pipe 'quote'``."""
        return self._where.describe(self._position, self.pipe)

    @property
    def remaining(self) -> float:
        """Seconds left before ``deadline`` (``inf`` without one, never negative)."""
        if self.deadline == math.inf:
            return math.inf
        return max(0.0, self.deadline - trio.current_time())

    async def progress(
        self, done: float, total: float | None = None, message: str | None = None
    ) -> None:
        """Record progress on the job; it is visible to status readers at once."""
        await self._ops.report_progress(self, done, total, message)

    async def emit(self, chunk: Any) -> None:
        """Send an output chunk (streamed to a consumer, else kept with the job's output).
        Waits while a streaming consumer is behind: backpressure, not buffering."""
        check_value(chunk, root="chunk")
        await self._ops.emit(self, chunk)

    def callback_url(self, signal: str, *, ttl: float = 3600.0) -> str:
        """A signed URL that delivers ``signal`` to this job when a backend POSTs to it,
        valid for ``ttl`` seconds. Hand it to the backend, then :meth:`suspend`. Needs an
        HTTP container serving the engine."""
        return self._ops.callback_url(self, signal, ttl)

    async def suspend(
        self,
        signal: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - how long the job waits, not this call
        into: str | None = None,
    ) -> NoReturn:
        """End this pipe and park the job until ``signal`` arrives (or ``timeout`` passes).

        The job's slot is released and its cursor saved *after* this pipe, so when the
        signal comes the chain continues with the next step and this pipe does not run
        again. The signal's payload is written to ``state[into]`` (default: the signal
        name) for the pipes that follow. If the signal already arrived while the job was
        running, the job continues at once.
        """
        if not signal or not isinstance(signal, str):
            raise ValueError("a signal name must be a non-empty string")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"suspend timeout must be positive, got {timeout}")
        await trio.lowlevel.checkpoint()
        raise Suspend(signal, timeout, into or signal)


def check_fallback(where: str, fallback: object) -> bytes | None:
    """A fallback (of a pipe, or of a branch: ``where`` says which) checked: the mapping
    packed (None for a fallback pipe), or RegistrationError."""
    if isinstance(fallback, Pipe):
        if fallback.degradable:
            raise RegistrationError(
                f"{where} {fallback.name!r} is optional or has a fallback itself; a "
                "fallback answers at once, so give it neither"
            )
        return None
    if not isinstance(fallback, Mapping):
        raise RegistrationError(
            f"{where} must be a mapping of state keys to values (the state it sets) or "
            f"a pipe (run in its place), got {fallback!r}"
        )
    for key in fallback:
        if not isinstance(key, str):
            raise RegistrationError(f"{where}: state keys must be strings, got {key!r}")
        if key == DEGRADED_KEY:
            raise RegistrationError(
                f"{where} sets {DEGRADED_KEY!r}, where the engine records what it "
                "degraded; use another key"
            )
    try:
        check_value(dict(fallback), root="fallback")
    except StateError as exc:
        raise RegistrationError(f"{where}: {exc}") from None
    packed: bytes = msgpack.packb(dict(fallback))
    return packed
