"""The driver of the resilience core for a service client's calls: a call's tries until one
is its answer.

Each try goes to the host the core picks, through that host's own pool (``Host.tag`` holds
it, as a :class:`~._client_hosts.HostLink`), by the try's deadline; its outcome -- an
answer's status, or a :class:`Failure` for what the pool raised -- goes back to
:meth:`Call.finish`, whose verdict answers, retries after a pause (inside the call's
deadline) or drops it. With hedging, the tries of a call run in a nursery: a hedge starts
when :meth:`Call.hedge_at` comes, the first try whose outcome is the call's answer cancels
the others (their connections are closed, never reused: the pool's cancellation rule).
Each try's end is an event on the call's span when tracing is on.

Separate from the client (:mod:`._client`), which renders the request, begins and ends the
call and reads its answer: this is the loop between, and the task boundary of the hedges.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import trio

from .. import _tracing
from ._answers import failure_of
from ._call_core import Attempt, Call, Verdict
from ._client_hosts import ClientHosts
from ._failures import ConnectFailed, TransportFailure
from ._h1 import Answer
from ._outlier_core import Failure, Outcome
from ._pool import ResponseTooLarge

__all__ = ["CallNote", "Tries", "TryEnd"]


@dataclass(slots=True)
class TryEnd:
    """How one try ended, as the call may use it: an answer, the status of one too big, or
    the pool's failure."""

    outcome: Outcome
    answer: Answer | None = None
    failure: TransportFailure | None = None
    host: str | None = None  # the host it went to (its Host), for the logs


@dataclass(slots=True)
class CallNote:
    """Where a call went, for the logs: the host of its answering try (its ``Host``; None
    before any try) and how many times it was retried. Filled by :meth:`ServiceClient.call`."""

    host: str | None = None
    retries: int = 0


class Tries(ClientHosts):
    """The tries of a :class:`ClientHosts`' calls (see the module)."""

    async def _drive(
        self,
        call: Call,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None],
        note: CallNote,
    ) -> TryEnd:
        """The core's loop for one call: tries until one is the call's answer (``note``
        counts the retries)."""
        attempt = call.attempt(trio.current_time())
        while True:
            if attempt is None:  # every host drained meanwhile
                return TryEnd(
                    Outcome.failed(Failure.CONNECT),
                    failure=ConnectFailed(f"service {self.service.name!r} has no host to call"),
                )
            if call.hedge_at() is None:
                done = await self._try(attempt, request)
                verdict = call.finish(attempt, trio.current_time(), done.outcome)
                if _tracing.ACTIVE.on:
                    _traced_try(attempt, done.outcome, verdict)
            else:
                verdict, done = await self._hedged(call, attempt, request)
            if verdict.action == "answer":
                if _tracing.ACTIVE.on and done.outcome.status is not None:
                    _tracing.ACTIVE.annotate("http.response.status_code", done.outcome.status)
                return done
            # "retry" (a "drop" leaves no try out here: only a try still out drops one)
            assert verdict.action == "retry", verdict
            note.retries += 1
            with trio.move_on_at(call.deadline):
                await trio.sleep(verdict.delay)
            attempt = call.attempt(trio.current_time())

    async def _hedged(
        self,
        call: Call,
        first: Attempt,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None],
    ) -> tuple[Verdict, TryEnd]:
        """``first`` and the hedges beside it, until one try's verdict is not a drop."""
        decided: list[tuple[Verdict, TryEnd]] = []

        async def run(attempt: Attempt, scope: trio.CancelScope) -> None:
            try:
                done = await self._try(attempt, request)
            except BaseException:
                if not attempt.done:  # cancelled: another try answered, or the call ended
                    verdict = call.finish(attempt, trio.current_time(), Outcome.cancel())
                    if _tracing.ACTIVE.on:
                        _traced_try(attempt, Outcome.cancel(), verdict)
                raise
            verdict = call.finish(attempt, trio.current_time(), done.outcome)
            if _tracing.ACTIVE.on:
                _traced_try(attempt, done.outcome, verdict)
            if verdict.action != "drop":
                decided.append((verdict, done))
                scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, first, nursery.cancel_scope)
                while (at := call.hedge_at()) is not None:
                    await trio.sleep_until(at)
                    hedge = call.hedge(trio.current_time())
                    if hedge is not None:
                        nursery.start_soon(run, hedge, nursery.cancel_scope)
                # No more hedges: the tries out decide.
        except BaseExceptionGroup as group:
            # The boundary: a cancellation goes on as trio raised it (the scope that
            # cancelled finds it in the group); one error alone goes on as itself, so the
            # caller sees the same errors with a hedge as without.
            _, others = group.split(trio.Cancelled)
            if others is not None:
                leaves = list(_leaves(others))
                if len(leaves) == 1 and isinstance(leaves[0], Exception):
                    raise leaves[0] from None
            raise
        assert decided, "a call's last try out always decides"
        return decided[0]

    async def _try(
        self,
        attempt: Attempt,
        request: tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None],
    ) -> TryEnd:
        """One try, on its host's pool, by its deadline."""
        method, target, headers, body = request
        if self._closed:
            closed = ConnectFailed(f"the client of service {self.service.name!r} is closed")
            return TryEnd(Outcome.failed(Failure.CONNECT), failure=closed)
        link = self._link(attempt.host)
        host = link.netloc.decode("latin-1")
        wire = [(b"Host", link.netloc), *headers[1:]]  # the first is the Host header
        try:
            answer = await link.pool.request(
                method,
                target,
                wire,
                body,
                deadline=attempt.deadline,
                max_bytes=self.service.max_response_bytes,
            )
        except ResponseTooLarge as exc:
            return TryEnd(Outcome.answer(exc.status), host=host)
        except TransportFailure as exc:
            return TryEnd(Outcome.failed(failure_of(exc)), failure=exc, host=host)
        return TryEnd(Outcome.answer(answer.status), answer=answer, host=host)


def _traced_try(attempt: Attempt, outcome: Outcome, verdict: Verdict) -> None:
    """A try's end as an event on the call's span (the current one; a hedge's task has a
    copy of its context): its kind (first, retry, hedge), host, outcome and what the call
    does next."""
    attributes: dict[str, _tracing.Attribute] = {
        "pipework.try": attempt.kind,
        "server.address": attempt.host.url,
        "pipework.verdict": verdict.action,
        "pipework.reason": verdict.reason,
    }
    if outcome.status is not None:
        attributes["http.response.status_code"] = outcome.status
    elif outcome.failure is not None:
        attributes["error.type"] = outcome.failure.value
    else:
        attributes["pipework.cancelled"] = True
    if verdict.action == "retry":
        attributes["pipework.retry_delay"] = verdict.delay
    _tracing.ACTIVE.event("try", attributes)


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
