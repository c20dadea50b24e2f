"""The weighted worker pool: the trio driver around :class:`AdmissionCore`.

The core decides; this module parks the tasks the core makes wait and wakes the ones it
grants or rejects. A grant is made by the releaser, synchronously, so a freed slot is handed
to its next owner and no newcomer can take it first.

Blocking pipes are counted like any other: the engine holds the slot around
``trio.to_thread.run_sync``, so a thread busy with a step is a slot in use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import cast

import trio
from trio.lowlevel import (
    Abort,
    RaiseCancelT,
    Task,
    cancel_shielded_checkpoint,
    checkpoint_if_cancelled,
    current_task,
    enable_ki_protection,
    reschedule,
    wait_task_rescheduled,
)

from ._weighted_config import PoolConfig, Weights
from ._weighted_core import AdmissionCore
from ._weighted_ledger import Ticket, TicketState
from ._weighted_statistics import PoolStatistics

__all__ = ["WeightedPool"]


class WeightedPool:
    """``max_workers`` slots shared by keys with per-key ``reserve`` and ``limit``.

    ::

        pool = WeightedPool(max_workers=64, keys={"users": Weights(reserve=8),
                                                  "search": Weights(limit=16)})
        async with pool.slot("users", deadline=job_deadline):
            started = trio.current_time()
            ...                                   # one or more steps of key "users"
            pool.record("users", ok=True, latency=trio.current_time() - started)

    Entering ``slot`` waits for a slot or raises :class:`~pipework.Rejected`; cancelling the
    wait withdraws it. See docs/weighted-pool.md for the admission rules.
    """

    def __init__(
        self,
        max_workers: int = 64,
        *,
        keys: Mapping[str, Weights] | None = None,
        default: Weights | None = None,
        wait_timeout: float | None = 10.0,
        max_passed_over: int = 8,
        max_keys: int = 10_000,
    ) -> None:
        config = PoolConfig(
            max_workers=max_workers,
            keys=keys or {},
            default=default or Weights(),
            wait_timeout=wait_timeout,
            max_passed_over=max_passed_over,
            max_keys=max_keys,
        )
        self._core = AdmissionCore(config)

    @classmethod
    def from_config(cls, config: PoolConfig) -> WeightedPool:
        pool = cls.__new__(cls)
        pool._core = AdmissionCore(config)
        return pool

    @property
    def config(self) -> PoolConfig:
        return self._core.config

    @property
    def config_generation(self) -> int:
        return self._core.config_generation

    def slot(
        self, key: str, *, deadline: float = math.inf, continuing: bool = False
    ) -> AbstractAsyncContextManager[None]:
        """Hold one slot under ``key`` for the body of ``async with``.

        ``deadline`` is an absolute ``trio.current_time()``; the wait ends at the earlier of it
        and the key's wait timeout, with ``Rejected(reason="deadline" | "wait_timeout")``.
        ``continuing`` marks a step of an accepted job: it waits up to ``deadline`` and is
        never refused for a full queue, a pause or the wait timeout.
        """
        return _Slot(self, key, deadline, continuing)

    def check_admission(self, key: str, *, deadline: float = math.inf) -> None:
        """Raise :class:`~pipework.Rejected` if a new step under ``key`` would be refused
        now; return if it would be granted or queued (nothing is held either way)."""
        self._core.check_admission(key, trio.current_time(), deadline=deadline)

    @enable_ki_protection
    def reconfigure(self, config: PoolConfig) -> int:
        """Swap ``config`` in at once and wake the waiters it settles; returns the new
        ``config_generation``. ``config`` was validated when it was built, so a bad one never
        gets here; ``pool.config.with_weights(key, Weights(...))`` changes one key."""
        self._wake(self._core.reconfigure(config, trio.current_time()))
        return self._core.config_generation

    @enable_ki_protection
    def record(self, key: str, *, ok: bool, latency: float) -> None:
        """Report one step's outcome for ``key``'s adaptive limit (a no-op without one).

        ``ok=False`` for errors and timeouts that point at the key's backend; ``latency`` in
        seconds. Call it while still holding the slot, once per step; skip cancelled steps.
        """
        if not self._core.adaptive(key):
            if not latency >= 0:
                raise ValueError(f"latency must be 0 or more seconds, got {latency}")
            return  # nothing to feed: no clock read, no call into the core
        self._wake(self._core.record(key, trio.current_time(), ok=ok, latency=latency))

    def limited(self, key: str) -> bool:
        """Whether ``key`` has a limit (static, adaptive, or a pause): work under it that
        could share another step's slot takes a slot of its own instead, to be counted."""
        return self._core.limited(key)

    def grant_nowait(self, key: str) -> object | None:
        """The uncontended path of :meth:`slot`, with no schedule point and no ticket: hold a
        slot under ``key`` if one is free for it now (no earlier waiter, within its limit and
        the shared pool) and return a handle for :meth:`release_nowait`; else None, with
        nothing held, queued or refused (then enter :meth:`slot`)."""
        return self._core.grant_nowait(key)

    @enable_ki_protection
    def release_nowait(self, handle: object, granted_at: float, now: float) -> None:
        """Give back a slot :meth:`grant_nowait` granted at ``granted_at`` (both times are
        ``trio.current_time()`` readings); the waiters it frees are woken."""
        woken = self._core.release_nowait(handle, granted_at, now)
        if woken:
            self._wake(woken)

    @enable_ki_protection
    def withdraw_nowait(self, handle: object) -> None:
        """Give back a slot :meth:`grant_nowait` granted that was never used: no hold time
        is counted for it; the waiters it frees are woken."""
        woken = self._core.withdraw_nowait(handle, trio.current_time())
        if woken:
            self._wake(woken)

    def statistics(self) -> PoolStatistics:
        return self._core.statistics(trio.current_time())

    # The private helpers run under the KI protection of their callers (``_Slot`` and
    # ``_wait``): a KeyboardInterrupt between two bookkeeping steps would leak a slot.

    def _acquire(self, key: str, deadline: float, continuing: bool) -> Ticket:
        ticket = self._core.acquire(
            key, trio.current_time(), deadline=deadline, continuing=continuing
        )
        ticket.tag = current_task()  # set before any grant can need it
        return ticket

    def _release(self, ticket: Ticket) -> None:
        woken = self._core.release(ticket, trio.current_time())
        if woken:
            self._wake(woken)

    def _cancel(self, ticket: Ticket) -> None:
        self._wake(self._core.cancel(ticket, trio.current_time()))

    @staticmethod
    def _wake(tickets: Iterable[Ticket]) -> None:
        for ticket in tickets:
            reschedule(cast(Task, ticket.tag))

    @enable_ki_protection
    async def _wait(self, ticket: Ticket) -> None:
        scope: trio.CancelScope | None = None

        def abort(_: RaiseCancelT) -> Abort:
            # Runs synchronously when the wait is cancelled, before any other task, so the
            # ticket leaves the queue while nothing can grant it.
            now = trio.current_time()
            if scope is not None and scope.cancel_called and now >= ticket.expires_at:
                self._core.expire(ticket, now)  # stores the rejection on the ticket
            else:
                self._cancel(ticket)
            return Abort.SUCCEEDED

        if ticket.expires_at == math.inf:  # a cancel scope costs about as much as the wait
            await wait_task_rescheduled(abort)
        else:
            with trio.CancelScope(deadline=ticket.expires_at) as scope:
                await wait_task_rescheduled(abort)
        if ticket.state is TicketState.REJECTED:
            assert ticket.rejection is not None
            raise ticket.rejection
        try:
            # A grant that landed while an outer scope was being cancelled: give it back
            # now rather than start a step that is about to be cancelled.
            await checkpoint_if_cancelled()
        except BaseException:
            self._cancel(ticket)
            raise


class _Slot:
    """One use of ``WeightedPool.slot``: a plain class rather than ``@asynccontextmanager``,
    because the uncontended path is the hot one."""

    __slots__ = ("_continuing", "_deadline", "_key", "_pool", "_ticket")

    def __init__(self, pool: WeightedPool, key: str, deadline: float, continuing: bool) -> None:
        self._pool = pool
        self._key = key
        self._deadline = deadline
        self._continuing = continuing
        self._ticket: Ticket | None = None

    @enable_ki_protection
    async def __aenter__(self) -> None:
        if self._ticket is not None:
            raise RuntimeError("a slot context can be entered only once; call pool.slot() again")
        await checkpoint_if_cancelled()
        try:
            ticket = self._pool._acquire(self._key, self._deadline, self._continuing)
        except BaseException:
            await cancel_shielded_checkpoint()  # a refusal is still a schedule point
            raise
        self._ticket = ticket
        if ticket.state is TicketState.GRANTED:
            await cancel_shielded_checkpoint()
        else:
            await self._pool._wait(ticket)

    @enable_ki_protection
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._ticket is not None
        self._pool._release(self._ticket)
