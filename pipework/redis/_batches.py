"""The Redis job store's round trips (:class:`~._store.RedisJobStore` is a
:class:`Batches`): its calls, and those of the event queue sharing it, go in batches on its
one connection (:mod:`._wire`), one write and one pipeline each.

- **Who sends.** The first call made with no batch gathering becomes the batch's *lead*: it
  lets the tasks that are ready run (up to _PASSES passes of the run loop), so their calls
  join, then sends the batch and reads its replies. A call that fills the batch (_EARLY
  calls, or half of the calls waiting for answers if more) sends it at once instead, the
  lead then waiting as any call.
- **Batches on their way.** The next batch may be gathered and sent while one is on its
  way (_FLIGHTS at most): sends keep the order of the batches, and so do the reads of
  their replies, on the one connection. A batch cut short (a timeout, a broken socket)
  closes the connection, failing those behind it too; the next batch opens another.
- **Calls nobody waits for** (``update_soon``) join a batch being gathered or the next one;
  they are told their answer in the task that read it, and if none is left to send them,
  the last lead does.
- **Reads riding along.** The event queue's ``XREADGROUP`` rides at the end of a batch
  (:class:`_Rider`), and a call may read events too (a claim, ``_Call.read``): both are told
  their replies in the batch's order, so events are delivered in the order Redis read them.
- **Scripts Redis does not know** (a new or restarted server) are loaded, and the calls
  that needed them sent again, as a batch of their own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol

import trio

from .._errors import StoreUnavailable
from ._wire import UNREACHABLE, Command, Connection, ReplyError, public_url, redis_outage

__all__ = ["Batches"]

_log = logging.getLogger("pipework.dispatcher")


#: How many passes of trio's run loop a batch waits before it goes: the tasks a round
#: trip's replies wake make their calls in the first, and those they wake in turn (a
#: delivered event's step, which marks its job running) in the next ones; each call that
#: joins this batch is one less round trip.
_PASSES: Final = 3

#: A batch that already holds this many calls, or half of the calls waiting for answers
#: if that is more, goes at once, without waiting those passes (or the rest of them): the
#: call that fills it sends it, and the tasks of the same pass run on while Redis runs it,
#: their calls making the next batch (the next one may go before this one lands, see
#: _FLIGHTS). A whole pass's calls in one batch would leave Redis idle while this process
#: runs them, and this process idle while Redis runs theirs.
_EARLY: Final = 8


class _Call:
    """Commands waiting for their round trip (one, or a caller's pipeline: ``many``);
    ``lead``: it sends the next batch; ``then``: a call nobody waits for (``update_soon``),
    told of its answer instead; ``read``: a call that reads events (a claim), told its
    reply as the batch's replies are taken, in order."""

    __slots__ = (
        "answered",
        "commands",
        "error",
        "lead",
        "many",
        "read",
        "result",
        "script",
        "task",
        "then",
    )

    def __init__(self, commands: Sequence[Command], script: str | None, many: bool) -> None:
        self.commands = commands
        self.script = script  # the script whose EVALSHA the one command is
        self.many = many
        self.task: trio.lowlevel.Task | None = None  # parked until its answer or its turn
        self.result: Any = None
        self.error: BaseException | None = None
        self.answered = False
        self.lead = False
        self.then: Callable[[_Call], None] | None = None
        self.read: Callable[[Any], None] | None = None


#: How many batches may be on their way at once on the connection: while Redis runs one,
#: this process gathers and sends the next, rather than the two taking turns idle. Two
#: were faster than one and than three (docs/scaling.md).
_FLIGHTS: Final = 2


class _Flight:
    """A batch on its way: ``previous`` is the batch sent before it (its replies come
    first), let go of once they are read; the tasks waiting for this one to be sent or
    read; the read riding in it and that read's reply."""

    __slots__ = (
        "batch",
        "previous",
        "read",
        "read_waiter",
        "ride",
        "rider",
        "send_waiter",
        "sent",
    )

    def __init__(self, batch: list[_Call], previous: _Flight | None) -> None:
        self.batch = batch
        #: The event queue's read riding in the batch, and its reply once read.
        self.rider: _Rider | None = None
        self.ride: Any = None
        self.previous = previous
        self.sent = False
        self.read = False
        self.send_waiter: trio.lowlevel.Task | None = None
        self.read_waiter: trio.lowlevel.Task | None = None


class _Rider(Protocol):
    """A command sent at the end of each of the store's round trips, if it has one then,
    and told its reply (the event queue reads new events so: those it has just written
    come back in the same round trip)."""

    def board(self) -> Command | None: ...

    def alight(self, reply: Any) -> None: ...


def _no_abort(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED


def _copy(exc: Exception) -> Exception:
    """The batch's error, an object of its own for each caller that raises it."""
    if isinstance(exc, StoreUnavailable):
        copy = StoreUnavailable(str(exc), maybe_done=exc.maybe_done, dependency=exc.dependency)
        copy.__cause__ = exc.__cause__
        return copy
    return exc


class Batches:
    """The batching of a store's calls (see the module). The store sets ``url``,
    ``io_timeout``, ``_scripts`` (its scripts' sources by name, for NOSCRIPT), ``rider``,
    and its connection state, and calls :meth:`_init_batches` in its ``__init__``."""

    url: str
    io_timeout: float
    _scripts: Mapping[str, str]
    _connection: Connection | None
    _entered: int
    #: What rides along in every round trip (the event queue's reads, see _Rider).
    rider: _Rider | None

    def _init_batches(self) -> None:
        self._calls: list[_Call] = []  # waiting for the next round trip
        self._lead = False  # a call is gathering the next batch, to send it
        self._gatherer: _Call | None = None  # that call, while it waits for more
        self._outstanding = 0  # calls made and not answered yet
        self._early = _EARLY
        self._flights: list[_Flight] = []  # batches sent, their replies not all read yet
        self._orphaned = False  # calls nobody waits for are left to the last sender

    def _unavailable(self, exc: BaseException, *, maybe_done: bool = True) -> StoreUnavailable:
        """``maybe_done``: the commands may have reached Redis (False: none was sent)."""
        outage = redis_outage(self.url)
        outage.failed(exc, "job store calls")
        return StoreUnavailable(
            f"the job store at {public_url(self.url)} cannot be reached ({exc}); retry later",
            maybe_done=maybe_done,
            dependency=outage.name,
        )

    async def _run(self, command: Command, script: str | None = None) -> Any:
        """Run one command (``script``: the name of one of the store's scripts, whose
        ``EVALSHA`` it is). Calls made while a round trip is on its way are sent together in
        the next one (one pipeline): under load a round trip's cost is shared by every call
        it carries."""
        return await self._call(_Call([command], script, many=False))

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """Send the commands in this store's next round trip, in order, and return their
        replies (an error reply as a :class:`ReplyError` in its place): the event queue's
        writes share the store's round trips this way."""
        result: list[Any] = await self._call(_Call(commands, None, many=True))
        return result

    async def _call(self, call: _Call) -> Any:
        calls = self._calls
        calls.append(call)
        self._outstanding += 1
        early = self._early = max(_EARLY, self._outstanding // 2)
        if self._lead and self._gatherer is not None and len(calls) >= early:
            if len(self._flights) < _FLIGHTS:
                # The lead waits for more calls, and there are enough: this call sends them
                # now, while the other tasks of this pass go on; the lead waits as any call.
                self._gatherer.lead = False
                self._gatherer = call
                call.lead = True
        elif not self._lead and len(self._flights) < _FLIGHTS:
            self._lead = call.lead = True
            self._gatherer = call
        if not call.lead:
            # Its answer, or its turn to send the next batch: a wait that cancellation
            # does not end (as if shielded), bounded by the round trips before its own.
            call.task = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(_no_abort)
        if call.lead:
            with trio.move_on_after(self.io_timeout, shield=True) as scope:
                await self._gather()
                if call.lead:
                    await self._fly()
                    # Calls nobody waits for (update_soon) and none to send them: this task
                    # sends them too, before it goes on.
                    while self._orphaned:
                        self._orphaned = False
                        self._lead = True
                        await self._gather()
                        await self._fly()
            if scope.cancelled_caught:
                self._timed_out(call)
        if not call.answered and call.error is None:
            # A later call took its lead and sent its batch: it waits for its answer.
            call.task = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(_no_abort)
        if call.error is not None:
            raise call.error
        return call.result

    def _timed_out(self, call: _Call) -> None:
        """The lead's time ran out: its call, if it had not gone, and calls nobody waits for
        that it was to send, fail as unanswered."""
        if call.lead and not call.answered and call.error is None and call in self._calls:
            self._calls.remove(call)
            self._outstanding -= 1
            self._lead = False
            self._gatherer = None
            self._hand_on()
            call.error = self._no_answer(maybe_done=False)
        if self._orphaned:
            self._orphaned = False
            self._lead = False
            orphans, self._calls = self._calls, []
            self._outstanding -= len(orphans)
            for orphan in orphans:
                orphan.error = self._no_answer(maybe_done=False)
                self._tell(orphan)

    async def _gather(self) -> None:
        """Every task that is ready runs first, so the calls it makes join this batch (a
        round trip costs mostly the wake-ups it causes, here and in Redis): up to _PASSES
        passes of the run loop, none once the batch holds _EARLY calls."""
        gatherer = self._gatherer
        for _ in range(_PASSES):
            if len(self._calls) >= self._early:
                return
            await trio.lowlevel.checkpoint()
            if self._gatherer is not gatherer:
                return  # a later call sent the batch

    def _no_answer(self, *, maybe_done: bool = True) -> StoreUnavailable:
        """``maybe_done``: the call was sent (False: its time ran out before it went)."""
        return StoreUnavailable(
            f"the job store at {public_url(self.url)} did not answer within {self.io_timeout:g}s",
            maybe_done=maybe_done,
            dependency=redis_outage(self.url).name,
        )

    async def _fly(self) -> None:
        """Send the calls gathered as one batch, then, in turn, read its replies and
        answer its callers. The next batch may go while this one is on its way."""
        batch, self._calls = self._calls, []
        self._lead = False
        self._gatherer = None
        flight = _Flight(batch, self._flights[-1] if self._flights else None)
        self._flights.append(flight)
        try:
            try:
                replies = await self._wait(functools.partial(self._round_trip, flight))
            except UNREACHABLE as exc:
                # Done perhaps, if it was sent; not if no connection could be made.
                raise self._unavailable(exc, maybe_done=flight.sent) from exc
            self._take(batch, replies)
        except Exception as exc:
            for call in batch:
                if not call.answered:  # (those answered before a retry keep their answer)
                    call.error = _copy(exc)
        finally:
            self._landed(flight)
            self._alight(flight)
            self._outstanding -= len(batch)
            for call in batch:
                if not call.answered and call.error is None:  # the round trip's time ran out
                    call.error = self._no_answer()
                if call.task is not None:
                    trio.lowlevel.reschedule(call.task)
                    call.task = None
                elif call.then is not None:
                    self._tell(call)
            self._hand_on()

    def _take(self, batch: list[_Call], replies: list[Any], skip: Sequence[int] = ()) -> None:
        """Give each call of the batch its replies, in order (but those at ``skip``, sent
        again); a call that reads events is told its reply now (``_Call.read``)."""
        at = 0
        for call in batch:
            if call.answered:
                at += len(call.commands)
                continue
            if call.many:
                call.result = replies[at : at + len(call.commands)]
                at += len(call.commands)
            else:
                if at in skip:
                    at += 1
                    continue
                reply = replies[at]
                at += 1
                if isinstance(reply, ReplyError):
                    call.error = self._refused(reply)
                else:
                    call.result = reply
                    if call.read is not None:
                        call.read(reply)
            call.answered = True

    @staticmethod
    def _alight(flight: _Flight) -> None:
        """The read riding in the batch is told its reply (None if none came), once."""
        rider, flight.rider = flight.rider, None
        if rider is not None:
            rider.alight(flight.ride)

    @staticmethod
    def _tell(call: _Call) -> None:
        """A call nobody waits for is told its answer (it must not raise: it is told in
        the task that sent the batch, whose own call has its answer too)."""
        assert call.then is not None
        try:
            call.then(call)
        except Exception:
            _log.exception("pipework: handling the answer of a job store write failed")

    async def _round_trip(self, flight: _Flight) -> list[Any]:
        """One batch on the store's connection (opened if there is none; outside ``async
        with``, a connection for this batch only): sent after the batches before it, its
        replies read after theirs."""
        batch = flight.batch
        commands = [command for call in batch for command in call.commands]
        if flight.previous is not None and not flight.previous.sent:
            await self._turn(flight.previous, "send_waiter")
        connection = self._connection
        if connection is None or connection.closed:
            connection = await Connection.open(self.url)
            if self._entered:
                self._connection = connection
        rider = self.rider
        extra = None if rider is None else rider.board()
        if extra is not None:
            flight.rider = rider
        try:
            try:
                await connection.send(commands if extra is None else [*commands, extra])
            finally:
                flight.sent = True
                self._wake(flight, "send_waiter")
            if flight.previous is not None and not flight.previous.read:
                await self._turn(flight.previous, "read_waiter")
            flight.previous = None  # (each batch held the one before: a chain of all of them)
            replies = await connection.read(len(commands) + (extra is not None))
            self._landed(flight)
            if extra is not None:
                flight.ride = replies.pop()  # told once the batch's replies are taken
        finally:
            if connection is not self._connection:
                await connection.aclose()
        # Scripts Redis does not know yet (a new or restarted server) are loaded, and the
        # calls that needed them sent again, as a batch of their own.
        scripts = [call.script for call in batch for _ in call.commands]
        missing = [
            i
            for i, reply in enumerate(replies)
            if isinstance(reply, ReplyError) and reply.code == "NOSCRIPT" and scripts[i]
        ]
        if missing:
            # The read riding in this batch ran before the calls sent again: its entries
            # are delivered first, as are those of the calls that did not need a script.
            self._take(batch, replies, missing)
            self._alight(flight)
            names = sorted({name for i in missing if (name := scripts[i])})
            loads: list[Command] = [["SCRIPT", "LOAD", self._scripts[n]] for n in names]
            again = await self._call(_Call(loads + [commands[i] for i in missing], None, True))
            for i, reply in zip(missing, again[len(loads) :], strict=True):
                replies[i] = reply
        return replies

    async def _turn(self, previous: _Flight, slot: str) -> None:
        """Wait until the batch before has been sent (``send_waiter``) or read."""
        setattr(previous, slot, trio.lowlevel.current_task())
        await trio.lowlevel.wait_task_rescheduled(_no_abort)

    @staticmethod
    def _wake(flight: _Flight, slot: str) -> None:
        task = getattr(flight, slot)
        if task is not None:
            setattr(flight, slot, None)
            trio.lowlevel.reschedule(task)

    def _landed(self, flight: _Flight) -> None:
        """The batch's replies are read (or will never be): the next batch reads."""
        if flight.read:
            return
        flight.read = flight.sent = True
        flight.previous = None
        self._flights.remove(flight)
        self._wake(flight, "send_waiter")
        self._wake(flight, "read_waiter")

    def _refused(self, reply: ReplyError) -> Exception:
        """A command's error reply, for its caller: a server that is loading its data or
        cannot write is unavailable for now; anything else is a bug, raised as it is."""
        if reply.code in ("LOADING", "MASTERDOWN", "READONLY", "BUSY", "OOM", "MISCONF"):
            where = public_url(self.url)
            return StoreUnavailable(
                f"the job store at {where} refused the command ({reply}); retry later",
                maybe_done=False,
            )
        return reply

    def _hand_on(self) -> None:
        """A batch has landed: if calls wait with no lead to send them, the first that
        waits sends the next one (if only calls nobody waits for are left, the task that
        sent this batch sends them: _orphaned)."""
        if self._lead or not self._calls:
            return
        for following in self._calls:
            if following.task is not None:
                following.lead = self._lead = True
                self._gatherer = following
                trio.lowlevel.reschedule(following.task)
                following.task = None
                return
        self._orphaned = True

    async def _wait(self, request: Callable[[], Awaitable[Any]]) -> Any:
        """Every round trip goes through here (tests under a mock clock wrap it)."""
        return await request()
