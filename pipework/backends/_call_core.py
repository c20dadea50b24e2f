"""One call through a service's resilience core: its tries (:class:`Attempt`), what to do
after each (:class:`Verdict`: answer, retry after a pause, or drop), its hedges, and a call
refused before it starts (:class:`Refusal`). Sans-IO, as the rest of the core; the service
side -- hosts, breaker, budget -- is :class:`~._hosts_core.ServiceCore`, whose module
docstring shows the driver's loop.

**The rules of one call**, in the order :meth:`Call.finish` applies them to a try's
outcome: a success or a failure no retry can fix (see ``_budget_core.classify``) is the
call's answer; a retryable failure while another try is still out is dropped (that try
may still answer); a retryable failure of a call that may not be sent again is the answer
(``not_idempotent``), as is one of a half-open breaker's probe (``probe``: one try only),
one past ``attempts`` tries in all, hedges included (``attempts``), one while the breaker
is not closed (``breaker``), one whose retry could not be over before the deadline
(``deadline``: the time left after the backoff is below the service's median latency),
and one the retry budget has no room for (``budget``). Otherwise the call retries, after
a full-jitter pause, on a host it has not tried yet if there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeAlias

from ._balance_core import Host
from ._breaker_core import BreakerState, Permit
from ._budget_core import backoff, classify
from ._outlier_core import Outcome

if TYPE_CHECKING:
    from ._hosts_core import ServiceCore

__all__ = ["Attempt", "AttemptKind", "Call", "Refusal", "Verdict"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """The call may not go out: ``reason`` is ``circuit_open`` (the breaker is open),
    ``circuit_probing`` (half open, its probes are out) or ``no_host`` (every host is
    drained); try again after ``retry_after`` seconds."""

    reason: Literal["circuit_open", "circuit_probing", "no_host"]
    retry_after: float
    message: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do after a try ended. ``action``: ``answer`` (this outcome is the call's),
    ``retry`` (after ``delay`` seconds, :meth:`Call.attempt` again) or ``drop`` (not the
    call's outcome: it was cancelled, came after the answer, or another try is still out).
    ``reason`` says why, for logs and tests: ``success``, ``final``, ``retry``,
    ``attempts``, ``budget``, ``deadline``, ``not_idempotent``, ``probe``, ``breaker``,
    ``in_flight``, ``cancelled``, ``late``."""

    action: Literal["answer", "retry", "drop"]
    reason: str
    delay: float = 0.0


AttemptKind: TypeAlias = Literal["first", "retry", "hedge"]


class Attempt:
    """One try of a call: to ``host``, begun at ``started``, to end by ``deadline`` (the
    call's deadline, or sooner with a per-try timeout). ``kind``: first, retry or hedge."""

    __slots__ = ("call", "deadline", "done", "host", "kind", "started")

    def __init__(
        self, call: Call, host: Host, started: float, deadline: float, kind: AttemptKind
    ) -> None:
        self.call = call
        self.host = host
        self.started = started
        self.deadline = deadline
        self.kind = kind
        self.done = False

    def __repr__(self) -> str:
        return f"<Attempt {self.kind} to {self.host.url} at {self.started:g}>"


class Call:
    """One call through a :class:`ServiceCore`: its attempts, retries and hedges."""

    __slots__ = (
        "_core",
        "_ended",
        "_held",
        "_retry_granted",
        "answered",
        "attempts",
        "deadline",
        "hedging",
        "may_resend",
        "permit",
    )

    def __init__(
        self, core: ServiceCore, permit: Permit, deadline: float, may_resend: bool, hedging: bool
    ) -> None:
        self._core = core
        self.permit = permit
        self.deadline = deadline
        self.may_resend = may_resend
        self.hedging = hedging and not permit.probe and may_resend
        self.attempts: list[Attempt] = []
        self.answered = False
        self._retry_granted = False
        self._ended = False
        self._held: Host | None = None

    @property
    def probe(self) -> bool:
        """A half-open breaker's probe: one try, no retry, no hedge."""
        return self.permit.probe

    @property
    def in_flight(self) -> list[Attempt]:
        return [a for a in self.attempts if not a.done]

    def attempt(self, now: float) -> Attempt | None:
        """The first try, or the retry the last :class:`Verdict` granted; None when no host
        can take it (every one drained)."""
        if self._ended:
            raise RuntimeError("this call has ended")
        if self.attempts and not self._retry_granted:
            raise RuntimeError("no retry was granted: call.finish() decides retries")
        kind: AttemptKind = "retry" if self._retry_granted else "first"
        self._retry_granted = False
        core = self._core
        host = core.pick(now, self._tried())
        if host is None:
            if kind == "retry":
                core.budget.release()
            return None
        return self._launch(host, now, kind)

    def hedge_at(self) -> float | None:
        """When a hedge would go out (trio time), or None if this call will not hedge (not
        configured or not opted in, not resendable, a probe, hedges used up, answered, no
        try out, no p95 known yet, or past the deadline)."""
        spec = self._core.resilience.hedge
        if spec is None or not self.hedging or self.answered or self._ended:
            return None
        hedges = sum(1 for a in self.attempts if a.kind == "hedge")
        out = self.in_flight
        if hedges >= spec.max_extra or not out:
            return None
        delay = self._core.latencies.quantile(0.95) if spec.delay == "p95" else spec.delay
        if delay is None:
            return None
        at = max(a.started for a in out) + delay
        return at if at < self.deadline else None

    def hedge(self, now: float) -> Attempt | None:
        """Another try beside the one out, to a host not tried yet, if :meth:`hedge_at` has
        come; else None. When it has come but no untried host is available or the retry
        budget has no room, the call hedges no more (:meth:`hedge_at` is None from then on,
        so a driver waiting for it never spins)."""
        at = self.hedge_at()
        if at is None or now < at:
            return None
        core = self._core
        host = core.pick(now, self._tried(), repeat=False)
        if host is None or not core.budget.acquire(now, hedge=True):
            self.hedging = False
            return None
        return self._launch(host, now, "hedge")

    def finish(
        self, attempt: Attempt, now: float, outcome: Outcome, *, hold: bool = False
    ) -> Verdict:
        """``attempt`` ended with ``outcome``: count it, and say what the call does next.

        ``hold``: the outcome is the answer's head, whose body the caller goes on reading
        (a proxied stream). The try is over -- its outcome and latency count now -- but an
        answer that is the call's keeps its host's count of calls outstanding until
        :meth:`end`, so the balancer sees a long stream as load."""
        if attempt.call is not self or attempt.done:
            raise RuntimeError(f"{attempt!r} is not an attempt of this call still out")
        attempt.done = True
        core = self._core
        core.record(attempt, now, outcome)
        if outcome.cancelled:
            return Verdict("drop", "cancelled")
        if self.answered:
            return Verdict("drop", "late")
        verdict = self._decide(attempt, now, outcome)
        if verdict.action == "answer":
            self.answered = True
            if hold and outcome.status is not None:
                self._held = attempt.host
                attempt.host.outstanding += 1
        return verdict

    def sent(self) -> None:
        """Part of the request went out and cannot be sent again (a streamed body was read
        from): from now on only a failed connection -- nothing sent -- is retried."""
        self.may_resend = False
        self.hedging = False

    def end(self, now: float) -> None:
        """The call is over: attempts still out count as cancelled, a retry granted but not
        begun gives its budget back, an unused probe permit goes back to the breaker."""
        if self._ended:
            return
        core = self._core
        for attempt in self.in_flight:
            self.finish(attempt, now, Outcome.cancel())
        if self._retry_granted:
            core.budget.release()
            self._retry_granted = False
        if not self.attempts:
            core.breaker.record(self.permit, now, error=None)
        if self._held is not None:
            self._held.outstanding -= 1
            self._held = None
        core.budget.end()
        self._ended = True

    # -- internals ---------------------------------------------------------------------------

    def _tried(self) -> set[Host]:
        return {a.host for a in self.attempts}

    def _launch(self, host: Host, now: float, kind: AttemptKind) -> Attempt:
        per_try = self._core.resilience.retry.per_try_timeout
        deadline = self.deadline if per_try is None else min(self.deadline, now + per_try)
        attempt = Attempt(self, host, now, deadline, kind)
        self.attempts.append(attempt)
        host.outstanding += 1
        host.requests += 1
        return attempt

    def _decide(self, attempt: Attempt, now: float, outcome: Outcome) -> Verdict:
        core = self._core
        spec = core.resilience.retry
        kind = classify(outcome, spec, may_resend=self.may_resend)
        if kind == "final":
            return Verdict("answer", "final" if outcome.is_error else "success")
        if self.in_flight:
            return Verdict("drop", "in_flight")  # a hedge is still out: its answer may do
        if kind == "not_idempotent":
            return Verdict("answer", "not_idempotent")
        if self.probe:
            return Verdict("answer", "probe")
        if len(self.attempts) >= spec.attempts:
            return Verdict("answer", "attempts")
        if core.breaker.state is not BreakerState.CLOSED:
            return Verdict("answer", "breaker")
        retries = sum(1 for a in self.attempts if a.kind == "retry")
        delay = backoff(spec, retries, core.rng)
        left = self.deadline - (now + delay)
        typical = core.latencies.quantile(0.5)
        if left <= 0 or (typical is not None and left < typical):
            return Verdict("answer", "deadline")
        if not core.budget.acquire(now):
            return Verdict("answer", "budget")
        self._retry_granted = True
        return Verdict("retry", "retry", delay)
