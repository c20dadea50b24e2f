"""Admission for the weighted worker pool, as a pure state machine: no I/O, no clock, no trio.

Every method takes the current time and returns what it decided, so the trio driver
(``_weighted.py``) only parks and wakes tasks, and the rules are tested step by step.

How slots are counted: a key *holds* slots; the first ``reserve`` it holds count as reserved,
any beyond as shared. The split is computed from the count, not tagged on each grant, so a key
always gives back a shared slot before a reserved one and a reserved slot is never held by
another key.

After every step (``tests/test_weighted_core.py`` checks it after each one):

* total in use <= ``max_workers``, shared use <= the shared pool, no key above its effective
  limit -- unless a reconfiguration or an adaptive cut lowered a bound below what was already
  admitted; admitted work is never revoked, so the overshoot is *debt* and only shrinks;
* no waiting head could take a free slot (grants are greedy). Hence no queue jumping: a
  newcomer is admitted at once only when its key has nobody waiting.

The books these rules read and change (keys, tickets, counts, the config applied, the
statistics) are kept in ``_weighted_ledger.py``; the configuration values are in
``_weighted_config.py``, the statistics values in ``_weighted_statistics.py``.
"""

from __future__ import annotations

import math

from .._errors import Rejected
from ._weighted_config import PoolConfig
from ._weighted_ledger import UNLIMITED, KeyState, Ledger, Ticket, TicketState, effective_limit_of

__all__ = ["PAUSED_RETRY_AFTER", "AdmissionCore"]

#: Retry-After for a paused key: an operator has to act, so a client should not spin.
PAUSED_RETRY_AFTER = 30.0
#: Retry-After when there are no hold times to predict from yet.
_FALLBACK_RETRY_AFTER = 1.0
_HOLD_ALPHA = 0.2  # hold-time EWMA: about the last ten holds
_FAST_ALPHA = 0.3  # adaptive: recent latency
_SLOW_ALPHA = 0.02  # adaptive: baseline latency, about the last fifty successes
_WARMUP = 10  # successes before latency can count as congestion


class AdmissionCore(Ledger):
    """The admission decisions of a weighted pool; see the module docstring."""

    # -- requests ---------------------------------------------------------------------------

    def acquire(
        self, key: str, now: float, *, deadline: float = math.inf, continuing: bool = False
    ) -> Ticket:
        """A granted ticket, or a waiting one; raises :class:`Rejected` if it cannot wait.

        ``continuing`` marks a step of work already accepted (a hand-off, a resume, a
        branch): it is never refused for a full queue, a pause or a predicted wait, and waits
        up to ``deadline`` whatever the wait timeout, since refusing it would drop accepted
        work; the bounds are for new work."""
        k = self._keys.get(key) or self._add_key(key)
        self._seq += 1
        ticket = Ticket(k, self._seq, now)
        # Nobody waits for this key, so no earlier waiter could take this slot (they would
        # have been granted already): taking it is not queue jumping.
        if not k.queue and self._fits(k):
            self._grant(k, ticket, now)
            return ticket
        if continuing:
            self._enqueue_continuing(k, ticket, now, deadline)
        else:
            self._enqueue(k, ticket, now, deadline)
        return ticket

    def grant_nowait(self, key: str) -> object | None:
        """Hold a slot under ``key`` if ``acquire`` would grant one at once, with no ticket;
        else None (nothing held, queued or refused: the caller then calls ``acquire``).
        Returns the handle :meth:`release_nowait` takes back."""
        k = self._keys.get(key) or self._add_key(key)
        if k.queue or not self._fits(k):
            return None
        self._take(k)
        return k

    def release_nowait(self, handle: object, granted_at: float, now: float) -> list[Ticket]:
        """Give back a slot :meth:`grant_nowait` granted at ``granted_at``; returns the
        waiters granted in its place."""
        assert isinstance(handle, KeyState)
        self._hold_sample(handle, now - granted_at)
        return self._give_back(handle, now)

    def withdraw_nowait(self, handle: object, now: float) -> list[Ticket]:
        """Give back a slot :meth:`grant_nowait` granted that was never used (a new job's
        slot held while its record was written, see Dispatcher.hold_first): not a hold-time
        sample. Returns the waiters granted in its place."""
        assert isinstance(handle, KeyState)
        return self._give_back(handle, now)

    def check_admission(self, key: str, now: float, *, deadline: float = math.inf) -> None:
        """Raise the :class:`Rejected` a new step under ``key`` would get now (paused, queue
        full, or a predicted wait past ``deadline``); return if it would be granted or queued.

        For work that is promised before it runs (an async job's 202): its admission is
        decided here, and its steps then ask with ``continuing=True``. Nothing is held."""
        k = self._keys.get(key) or self._add_key(key)
        if not k.queue and self._fits(k):
            return
        if k.weights.limit == 0:
            raise self._paused(k)
        position = len(k.queue) + 1
        if position > k.weights.max_waiting:
            raise self._reject(
                k,
                "queue_full",
                f"key {k.name!r} already has {len(k.queue)} waiting steps (its max_waiting); "
                "try again later, or raise its limit or max_waiting",
            )
        predicted = self._predict_wait(k, position)
        if predicted is not None and deadline - now < predicted:
            raise self._reject(
                k,
                "deadline",
                f"the job would have {deadline - now:.3g} s but a worker slot for key "
                f"{k.name!r} is predicted in about {predicted:.3g} s; try again later, or "
                "give the job more time or the key more workers",
                retry_after=predicted,
            )

    def release(self, ticket: Ticket, now: float) -> list[Ticket]:
        """Give a granted slot back; returns the waiters granted in its place."""
        if ticket.state is not TicketState.GRANTED:
            raise RuntimeError(f"cannot release {ticket!r}: it does not hold a slot")
        k = ticket._key
        self._hold_sample(k, now - ticket.granted_at)
        return self._free(k, ticket, now)

    @staticmethod
    def _hold_sample(k: KeyState, hold: float) -> None:
        k.hold_avg = hold if k.hold_avg is None else k.hold_avg + _HOLD_ALPHA * (hold - k.hold_avg)

    def cancel(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The requester went away: withdraw a waiter, or give back a grant it never used."""
        if ticket.state is TicketState.WAITING:
            # A non-eligible head leaving makes nobody eligible (its successor shares its key,
            # hence its eligibility), so there is nothing to dispatch.
            self._unqueue(ticket)
            ticket.state = TicketState.WITHDRAWN
            return []
        if ticket.state is TicketState.GRANTED:
            # Not a hold-time sample: the slot was never used.
            return self._free(ticket._key, ticket, now)
        return []

    def expire(self, ticket: Ticket, now: float) -> Rejected:
        """The waiter reached ``ticket.expires_at``: reject it with its expiry reason."""
        if ticket.state is not TicketState.WAITING:
            raise RuntimeError(f"cannot expire {ticket!r}: it is not waiting")
        self._unqueue(ticket)
        k = ticket._key
        waited = now - ticket.enqueued_at
        if ticket.expiry_reason == "deadline":
            message = f"no worker slot for key {k.name!r} before the job's deadline"
        else:
            message = f"no worker slot for key {k.name!r} within its wait timeout ({waited:.3g} s)"
        exc = self._reject(k, ticket.expiry_reason, self._state_note(k, message))
        ticket.state = TicketState.REJECTED
        ticket.rejection = exc
        return exc

    # -- outcomes and configuration ----------------------------------------------------------

    def record(self, key: str, now: float, *, ok: bool, latency: float) -> list[Ticket]:
        """Feed one outcome to the key's adaptive limit; returns the waiters it admits."""
        if not latency >= 0:
            raise ValueError(f"latency must be 0 or more seconds, got {latency}")
        k = self._keys.get(key)
        if k is None or k.aimd is None:
            return []
        a = k.aimd
        congested = not ok
        if ok:
            if a.fast is None:
                a.fast = a.slow = latency
            else:
                a.fast += _FAST_ALPHA * (latency - a.fast)
                a.slow += _SLOW_ALPHA * (latency - a.slow)
            a.samples += 1
            tol = a.spec.latency_tolerance
            congested = tol is not None and a.samples >= _WARMUP and a.fast > tol * a.slow
        if congested:
            # At most one cut per typical latency, as TCP cuts once per round trip: the
            # failures of one overload episode halve the limit once, not once each.
            if now - a.last_cut >= (a.fast if a.fast is not None else latency):
                a.limit = max(float(a.low), a.limit * a.spec.backoff)
                a.last_cut = now
        elif k.held * 2 >= a.limit:
            # Grow only while the limit is in use: idle time says nothing about capacity.
            a.limit = min(float(a.high), a.limit + a.spec.increase / a.limit)
        before = k.effective
        k.effective = effective_limit_of(k)
        if k.effective > before and k.queue:
            return self._dispatch(now)
        return []

    def limited(self, key: str) -> bool:
        """Whether ``key`` has a limit (static or adaptive; a pause is a limit of 0): only
        then must every piece of its work hold a slot of its own to be counted."""
        k = self._keys.get(key) or self._add_key(key)
        return k.weights.limit is not None or k.aimd is not None

    def adaptive(self, key: str) -> bool:
        """Whether ``key`` has an adaptive limit (only then does :meth:`record` do anything)."""
        k = self._keys.get(key)
        return k is not None and k.aimd is not None

    def reconfigure(self, config: PoolConfig, now: float) -> list[Ticket]:
        """Swap ``config`` in; returns the waiters it settles (granted, or rejected if their
        key is now paused and they are new work: a step of accepted work waits the pause
        out, up to its deadline). Admitted work is never revoked."""
        self._apply(config)
        settled: list[Ticket] = []
        for k in list(self._queued):
            if k.weights.limit == 0:
                for ticket in [t for t in k.queue if not t.continuing]:
                    self._unqueue(ticket)
                    ticket.state = TicketState.REJECTED
                    ticket.rejection = self._paused(k)
                    settled.append(ticket)
        settled += self._dispatch(now)
        return settled

    # -- internals ---------------------------------------------------------------------------

    def _free(self, k: KeyState, ticket: Ticket, now: float) -> list[Ticket]:
        ticket.state = TicketState.RELEASED
        return self._give_back(k, now)

    def _give_back(self, k: KeyState, now: float) -> list[Ticket]:
        k.held -= 1
        self._in_use -= 1
        if k.held >= k.reserve:
            self._shared_in_use -= 1
        return self._dispatch(now) if self._waiting else []

    def _enqueue(self, k: KeyState, ticket: Ticket, now: float, deadline: float) -> None:
        if k.weights.limit == 0:
            raise self._paused(k)
        position = len(k.queue) + 1
        if position > k.weights.max_waiting:
            raise self._reject(
                k,
                "queue_full",
                f"key {k.name!r} already has {len(k.queue)} waiting steps (its max_waiting); "
                "try again later, or raise its limit or max_waiting",
            )
        if deadline <= now:
            raise self._reject(
                k,
                "deadline",
                f"the job's deadline passed before key {k.name!r} could have a worker slot",
            )
        predicted = self._predict_wait(k, position)
        if predicted is not None and deadline - now < predicted:
            raise self._reject(
                k,
                "deadline",
                f"the job has {deadline - now:.3g} s left but a worker slot for key {k.name!r} "
                f"is predicted in about {predicted:.3g} s; give the job more time or the key "
                "more workers",
                retry_after=predicted,
            )
        if k.wait_timeout is not None:
            ticket.expires_at = now + k.wait_timeout
        if deadline <= ticket.expires_at:
            ticket.expires_at = deadline
            ticket.expiry_reason = "deadline"
        if not k.queue:
            self._queued[k] = None
        k.queue.append(ticket)
        self._waiting += 1

    def _enqueue_continuing(self, k: KeyState, ticket: Ticket, now: float, deadline: float) -> None:
        ticket.continuing = True
        if deadline <= now:
            raise self._reject(
                k,
                "deadline",
                f"the job's deadline passed before key {k.name!r} could have a worker slot",
            )
        ticket.expires_at = deadline
        ticket.expiry_reason = "deadline"
        if not k.queue:
            self._queued[k] = None
        k.queue.append(ticket)
        self._waiting += 1

    def _unqueue(self, ticket: Ticket) -> None:
        k = ticket._key
        if k.queue[0] is ticket:
            k.queue.popleft()
        else:
            k.queue.remove(ticket)  # O(queue length), bounded by max_waiting
        if not k.queue:
            del self._queued[k]
        self._waiting -= 1

    def _dispatch(self, now: float) -> list[Ticket]:
        granted: list[Ticket] = []
        # Reserved capacity first: only its owner may use it, so serving it passes nobody over.
        if self._shared_pool < self._max_workers:
            for k in list(self._queued):
                while (
                    k.queue
                    and k.held < k.reserve
                    and k.held < k.effective
                    and self._in_use < self._max_workers
                ):
                    granted.append(self._grant_head(k, now))
        # Shared capacity: max-min fair -- least shared use first, then longest waiting -- but
        # a head passed over max_passed_over times goes first, in the order it got there.
        bound = self._config.max_passed_over
        while self._in_use < self._max_workers and self._shared_in_use < self._shared_pool:
            if len(self._queued) == 1:  # the common case: one key waits, nobody to rank
                k = next(iter(self._queued))
                if k.held >= k.effective:
                    break
                granted.append(self._grant_head(k, now))
                continue
            chosen: KeyState | None = None
            best: tuple[int, int, int] = (2, 0, 0)
            eligible: list[Ticket] = []
            for k in self._queued:
                if k.held >= k.effective:
                    continue  # at its limit: skipped, so it never blocks another key
                head = k.queue[0]
                eligible.append(head)
                rank = (
                    (0, head._starved, 0)
                    if head._starved >= 0
                    else (1, k.held - k.reserve, head.seq)
                )
                if rank < best:
                    best, chosen = rank, k
            if chosen is None:
                break
            ticket = self._grant_head(chosen, now)
            for head in eligible:
                if head is not ticket:
                    head.passed_over += 1
                    if head.passed_over >= bound and head._starved < 0:
                        head._starved = self._starve_seq
                        self._starve_seq += 1
            granted.append(ticket)
        return granted

    def _grant_head(self, k: KeyState, now: float) -> Ticket:
        ticket = k.queue.popleft()
        if not k.queue:
            del self._queued[k]
        self._waiting -= 1
        self._grant(k, ticket, now)
        return ticket

    def _predict_wait(self, k: KeyState, position: int) -> float | None:
        # Optimistic on purpose (as if the key had every slot it may use): an early
        # rejection has to be likely right, and the wait stays bounded by the deadline anyway.
        if k.hold_avg is None:
            return None
        lanes = min(k.effective, k.reserve + self._shared_pool, self._max_workers)
        return position * k.hold_avg / max(lanes, 1)

    def _reject(
        self, k: KeyState, reason: str, message: str, retry_after: float | None = None
    ) -> Rejected:
        k.rejected[reason] += 1
        if retry_after is None:
            retry_after = self._predict_wait(k, max(len(k.queue), 1))
        if retry_after is None:
            retry_after = _FALLBACK_RETRY_AFTER
        return Rejected(message, key=k.name, reason=reason, retry_after=retry_after)

    def _paused(self, k: KeyState) -> Rejected:
        return self._reject(
            k,
            "paused",
            f"key {k.name!r} is paused (limit = 0); set its limit above 0 to resume it",
            retry_after=PAUSED_RETRY_AFTER,
        )

    def _state_note(self, k: KeyState, message: str) -> str:
        limit = "no limit" if k.effective == UNLIMITED else f"limit {k.effective}"
        return (
            f"{message}: it holds {k.held} ({limit}, reserve {k.reserve}), {len(k.queue)} "
            f"still wait, pool {self._in_use}/{self._max_workers} in use; raise the key's "
            "limit or wait_timeout, or add workers"
        )
