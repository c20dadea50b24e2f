"""``ResourcePool``: N long-lived resources (browsers, worker processes, connections) made at
start-up and lent to one borrower at a time.

The rules, in one place:

- start-up makes all ``size`` resources, one after the other, each within ``launch_timeout``;
  if one fails, those already made are closed and start-up fails with
  :class:`ResourceStartupError` (the factory's error as its ``__cause__``);
- ``borrow()`` lends an idle resource at once, or queues the borrower (first come, first
  served) until one comes back; past ``borrow_timeout`` it raises :class:`BorrowTimeout`,
  and the caller's own cancel scopes bound the wait too;
- a resource comes back to the pool when the ``async with`` body ends normally; when the body
  raises (or the resource was reported broken) it is closed and a replacement is made in the
  background, in the pool's own nursery;
- a replacement that fails is logged as a WARNING and retried with exponential backoff; until
  it succeeds the pool holds fewer resources (``capacity < size``), and borrowers wait for
  the others;
- shutdown fails every waiter with :class:`ResourcePoolClosed`, stops the replacements,
  closes the idle resources, and closes each borrowed one as its borrower gives it back.

The pool runs in its owner's nursery: ``async with pool:`` or ``await nursery.start(pool.run)``
(and cancelling that nursery shuts it down). No task outlives it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, Protocol, TypeVar, runtime_checkable

import trio

from .._errors import (
    BorrowTimeout,
    PoolConfigError,
    ResourcePoolClosed,
    ResourceStartupError,
)
from .._metrics import Metrics

__all__ = ["ResourcePool", "ResourcePoolStatistics"]

R = TypeVar("R")

logger = logging.getLogger("pipework.resources")


@dataclass(frozen=True, slots=True)
class ResourcePoolStatistics:
    """A snapshot of one :class:`ResourcePool`.

    ``size``: resources the pool is configured to hold; ``capacity``: resources it holds now
    (``idle + borrowed``; below ``size`` while replacements are due); ``waiting``: borrowers
    queued; ``replacements``: replacements made; ``failures``: replacement attempts that
    failed; ``discarded``: resources closed because they failed while borrowed.
    """

    name: str
    size: int
    capacity: int
    idle: int
    borrowed: int
    waiting: int
    replacements: int
    failures: int
    discarded: int


class _Waiter(Generic[R]):
    __slots__ = ("closed", "event", "resource")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.resource: R | None = None
        self.closed = False


@runtime_checkable
class _AsyncClosable(Protocol):
    """A resource that says how it is closed (a browser, a client, a trio stream)."""

    async def aclose(self) -> None: ...


async def _default_close(resource: object) -> None:
    if isinstance(resource, _AsyncClosable):
        await resource.aclose()


class ResourcePool(Generic[R]):
    """``size`` resources made by ``factory`` at start-up, lent one borrower at a time.

    ``factory()`` makes one resource (within ``launch_timeout`` seconds); ``close(resource)``
    closes one (default: its ``aclose()`` if it has one), within ``close_timeout`` (default
    ``launch_timeout``). A borrower waits at most ``borrow_timeout`` seconds. A failed
    replacement is retried after ``retry_backoff`` seconds, doubling up to
    ``retry_backoff_max``. ``metrics``: export the pool's families with ``pool=name``.
    ``concurrent_start``: make the ``size`` resources at start-up all at once rather than
    one after the other (for resources whose launch mostly waits, such as a process).

    Example::

        async def launch() -> Browser:
            return await Browser.launch()

        pool = pw.ResourcePool(launch, 4, borrow_timeout=30, launch_timeout=30, name="pdf")
        async with pool:                       # all 4 made here, closed on the way out
            async with pool.borrow() as browser:
                pdf = await browser.render(html)   # raising here replaces the browser
    """

    def __init__(
        self,
        factory: Callable[[], Awaitable[R]],
        size: int,
        *,
        borrow_timeout: float,
        launch_timeout: float,
        close: Callable[[R], Awaitable[object]] | None = None,
        close_timeout: float | None = None,
        name: str = "default",
        retry_backoff: float = 1.0,
        retry_backoff_max: float = 60.0,
        metrics: Metrics | None = None,
        concurrent_start: bool = False,
    ) -> None:
        if not isinstance(size, int) or size < 1:
            raise PoolConfigError(f"resource pool {name!r}: size must be 1 or more, not {size!r}")
        for label, value in (
            ("borrow_timeout", borrow_timeout),
            ("launch_timeout", launch_timeout),
            ("close_timeout", launch_timeout if close_timeout is None else close_timeout),
            ("retry_backoff", retry_backoff),
        ):
            if not value > 0:
                raise PoolConfigError(
                    f"resource pool {name!r}: {label} must be more than 0 seconds, not {value!r}"
                )
        if retry_backoff_max < retry_backoff:
            raise PoolConfigError(
                f"resource pool {name!r}: retry_backoff_max ({retry_backoff_max!r}) must be at "
                f"least retry_backoff ({retry_backoff!r})"
            )
        self.name = name
        self.size = size
        self.borrow_timeout = borrow_timeout
        self.launch_timeout = launch_timeout
        self.close_timeout = launch_timeout if close_timeout is None else close_timeout
        self.retry_backoff = retry_backoff
        self.retry_backoff_max = retry_backoff_max
        self.concurrent_start = concurrent_start
        self._factory = factory
        self._close: Callable[[R], Awaitable[object]] = close or _default_close
        self._metrics = metrics
        self._idle: deque[R] = deque()
        self._borrowed: dict[int, R] = {}  # by id(): resources need not be hashable
        self._broken: set[int] = set()
        self._waiters: deque[_Waiter[R]] = deque()
        self._state = "new"  # new -> starting -> open -> closed
        self._nursery: trio.Nursery | None = None
        self._running: AsyncExitStack | None = None
        self._owner: trio.Nursery | None = None
        self._replacements = 0
        self._failures = 0
        self._discarded = 0

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Make every resource, report started, then serve until cancelled; shut down then.

        For ``await nursery.start(pool.run)``: start-up failures are raised from ``start``."""
        if self._state != "new":
            raise ResourcePoolClosed(
                f"resource pool {self.name!r} has already run; make a new pool", pool=self.name
            )
        self._state = "starting"
        try:
            await self._make_all()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._state = "open"
                if self._metrics is not None:
                    self._metrics.watch_resource_pool(self.name, self)
                logger.info(
                    "resource pool %r started: size=%d launch_timeout=%s borrow_timeout=%s",
                    self.name,
                    self.size,
                    self.launch_timeout,
                    self.borrow_timeout,
                )
                task_status.started()
                try:
                    await trio.sleep_forever()
                finally:
                    # Borrowers giving resources back from here on close them.
                    self._state = "closing"
        finally:
            await self._shut_down()

    async def __aenter__(self) -> ResourcePool[R]:
        failure: Exception | None = None
        async with AsyncExitStack() as stack:
            nursery = await stack.enter_async_context(trio.open_nursery())
            try:
                await nursery.start(self.run)
            except Exception as error:  # raised as it is, not in the nursery's group
                failure = error
            else:
                self._running = stack.pop_all()
        if failure is not None:
            raise failure
        self._owner = nursery
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        running, owner = self._running, self._owner
        self._running = self._owner = None
        if running is None or owner is None:
            raise RuntimeError(f"resource pool {self.name!r} is not running")
        owner.cancel_scope.cancel()
        # Only the pool's own task runs in this nursery: the block's exception goes on as it is.
        await running.__aexit__(None, None, None)

    async def _make_all(self) -> None:
        made: list[R] = []
        try:
            if self.concurrent_start:
                await self._make_all_at_once(made)
            else:
                for index in range(self.size):
                    try:
                        made.append(await self._make())
                    except Exception as error:
                        raise self._startup_error(index, error, len(made)) from error
        except BaseException:
            with trio.CancelScope(shield=True):
                for resource in made:
                    await self._close_quietly(resource)
            raise
        self._idle.extend(made)

    async def _make_all_at_once(self, made: list[R]) -> None:
        """Every launch at once, each to its end (made, failed or past ``launch_timeout``):
        then the lowest-numbered failure is the one reported, whatever the timing."""
        failed: dict[int, Exception] = {}

        async def make(index: int) -> None:
            try:
                made.append(await self._make())
            except Exception as error:
                failed[index] = error

        async with trio.open_nursery() as nursery:
            for index in range(self.size):
                nursery.start_soon(make, index)
        if failed:
            index = min(failed)
            raise self._startup_error(index, failed[index], len(made)) from failed[index]

    def _startup_error(self, index: int, error: Exception, made: int) -> ResourceStartupError:
        return ResourceStartupError(
            f"resource pool {self.name!r}: making resource {index + 1} of {self.size} failed "
            f"({_describe(error)}); the {made} made were closed",
            pool=self.name,
        )

    async def _make(self) -> R:
        """One resource from the factory, within ``launch_timeout`` (``TooSlowError`` past)."""
        with trio.fail_after(self.launch_timeout):
            return await self._factory()

    async def _shut_down(self) -> None:
        self._state = "closed"
        self._nursery = None
        if self._metrics is not None:
            self._metrics.unwatch_resource_pool(self.name, self)
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.closed = True
            waiter.event.set()
        with trio.CancelScope(shield=True):
            while self._idle:
                await self._close_quietly(self._idle.popleft())

    # -- borrowing -----------------------------------------------------------------------

    @asynccontextmanager
    async def borrow(self) -> AsyncIterator[R]:
        """Lend one resource for the ``async with`` block.

        Raises :class:`BorrowTimeout` past ``borrow_timeout`` and :class:`ResourcePoolClosed`
        when the pool is not running. When the block raises, the resource is closed and
        replaced in the background; otherwise it goes back to the pool."""
        resource = await self._acquire()
        key = id(resource)
        try:
            yield resource
        except BaseException:
            self._broken.add(key)
            raise
        finally:
            del self._borrowed[key]
            broken = key in self._broken
            self._broken.discard(key)
            nursery = self._nursery
            if self._state != "open" or nursery is None:
                with trio.CancelScope(shield=True):
                    await self._close_quietly(resource)
            elif broken:
                self._discarded += 1
                logger.warning(
                    "resource pool %r: a borrowed resource failed; closing it and making a "
                    "replacement",
                    self.name,
                )
                nursery.start_soon(self._replace, resource)
            else:
                self._give(resource)

    def report_broken(self, resource: R) -> None:
        """Mark a borrowed resource as broken: when its ``borrow()`` block ends, it is closed
        and replaced even though the block did not raise."""
        key = id(resource)
        if self._borrowed.get(key) is not resource:
            raise ValueError(f"resource pool {self.name!r} has not lent {resource!r}")
        self._broken.add(key)

    async def _acquire(self) -> R:
        if self._state != "open":
            raise ResourcePoolClosed(
                f"resource pool {self.name!r} is not running (state: {self._state}); borrow "
                "inside `async with pool:` or after `await nursery.start(pool.run)`",
                pool=self.name,
            )
        start = trio.current_time()
        if self._idle and not self._waiters:
            await trio.lowlevel.checkpoint()
            if self._idle and self._state == "open":  # still there after the checkpoint
                self._observe_wait(start)
                return self._lend(self._idle.popleft())
        waiter: _Waiter[R] = _Waiter()
        self._waiters.append(waiter)
        try:
            with trio.move_on_after(self.borrow_timeout):
                await waiter.event.wait()
        except BaseException:
            # Cancelled from outside: a resource handed over meanwhile goes to the next.
            if waiter.resource is not None:
                del self._borrowed[id(waiter.resource)]
                self._give(waiter.resource)
            elif not waiter.event.is_set():
                self._waiters.remove(waiter)
            raise
        self._observe_wait(start)
        if waiter.resource is not None:
            return waiter.resource
        if waiter.closed:
            raise ResourcePoolClosed(
                f"resource pool {self.name!r} shut down while this borrower waited",
                pool=self.name,
            )
        self._waiters.remove(waiter)
        logger.warning(
            "resource pool %r: no resource came free within borrow_timeout=%s (size=%d, "
            "capacity=%d)",
            self.name,
            self.borrow_timeout,
            self.size,
            self._capacity(),
        )
        raise BorrowTimeout(
            f"resource pool {self.name!r}: no resource came free within "
            f"{self.borrow_timeout} s (size {self.size}, {self._capacity()} held now); raise "
            "the size or the borrow_timeout",
            pool=self.name,
            timeout=self.borrow_timeout,
        )

    def _observe_wait(self, start: float) -> None:
        if self._metrics is not None:
            self._metrics.observe(
                self._metrics.resource_pool_wait, (self.name,), trio.current_time() - start
            )

    def _lend(self, resource: R) -> R:
        self._borrowed[id(resource)] = resource
        return resource

    def _give(self, resource: R) -> None:
        """A resource ready to lend: to the first waiter (lent from now), or to the idle
        ones."""
        if self._waiters:
            waiter = self._waiters.popleft()
            waiter.resource = self._lend(resource)
            waiter.event.set()
        else:
            self._idle.append(resource)

    async def _replace(self, old: R) -> None:
        with trio.CancelScope(shield=True):
            await self._close_quietly(old)
        delay = self.retry_backoff
        while True:
            try:
                resource = await self._make()
            except Exception as error:
                self._failures += 1
                logger.warning(
                    "resource pool %r: making a replacement failed (%s); capacity %d of %d, "
                    "retrying in %s s",
                    self.name,
                    _describe(error),
                    self._capacity(),
                    self.size,
                    delay,
                )
                await trio.sleep(delay)
                delay = min(delay * 2, self.retry_backoff_max)
                continue
            self._replacements += 1
            logger.info(
                "resource pool %r: replacement made; capacity %d of %d",
                self.name,
                self._capacity() + 1,
                self.size,
            )
            self._give(resource)
            return

    async def _close_quietly(self, resource: R) -> None:
        """Close one resource within ``close_timeout``; a failure is logged, not raised."""
        try:
            with trio.fail_after(self.close_timeout):
                await self._close(resource)
        except Exception as error:
            logger.warning(
                "resource pool %r: closing a resource failed (%s)", self.name, _describe(error)
            )

    # -- introspection -------------------------------------------------------------------

    def _capacity(self) -> int:
        return len(self._idle) + len(self._borrowed)

    def statistics(self) -> ResourcePoolStatistics:
        return ResourcePoolStatistics(
            name=self.name,
            size=self.size,
            capacity=self._capacity(),
            idle=len(self._idle),
            borrowed=len(self._borrowed),
            waiting=len(self._waiters),
            replacements=self._replacements,
            failures=self._failures,
            discarded=self._discarded,
        )

    def __repr__(self) -> str:
        s = self.statistics()
        return (
            f"<ResourcePool {self.name!r} {self._state} size={s.size} capacity={s.capacity} "
            f"idle={s.idle} borrowed={s.borrowed} waiting={s.waiting}>"
        )


def _describe(error: BaseException) -> str:
    if isinstance(error, trio.TooSlowError):
        return "timed out"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
