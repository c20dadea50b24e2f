"""Two uses of :class:`~._wire.Connection` beyond the job store's batches: a connection that
concurrent callers share (the relay's commands, the backplane's writes), and a pub/sub
subscription that outlives the connection it is on (the store's ends, the relay's notices).

**Client.** A call made while none is on its way sends at once; calls made while a batch is
on its way wait, and the first of them sends every call made meanwhile as the next batch
(one write, one pipeline), the others waiting for their answers. The sending caller's round
trip is shielded and bounded by ``timeout``, so the connection is never left with replies
half read; a waiting caller that is cancelled leaves at once (its call dropped if it was not
sent, its answer told to nobody if it was). A batch cut short fails every call in it with
:class:`~._wire.ConnectionLost` and closes the connection; the next batch opens another.
Nothing is sent twice: a write whose answer was lost may have happened.

**Subscription.** One connection in Redis's subscribed state: :meth:`Subscription.run` reads
the messages as they come, and when the connection drops it connects again (after
``retry`` seconds) and subscribes again to every channel it holds. What was published
meanwhile is lost: each time the subscription is made, ``live`` is called, and each time a
live one ends, ``dropped``, so the owner can look again at whatever it may have missed.
:meth:`Subscription.subscribe` returns once Redis has confirmed the subscription (or the
connection dropped meanwhile: it is made again with the rest), so what is published after
it returns is heard.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio

from ._scripts import Script
from ._wire import (
    UNREACHABLE,
    Arg,
    Command,
    Connection,
    ConnectionLost,
    ReplyError,
    public_url,
    redis_outage,
)

__all__ = ["Client", "Subscription"]

_log = logging.getLogger("pipework.redis")


class _Call:
    """Commands waiting for their round trip; ``task`` is parked until its answer or its
    turn to send (None once nobody waits: cancelled, or it sends)."""

    __slots__ = ("commands", "error", "lead", "replies", "task")

    def __init__(self, commands: Sequence[Command]) -> None:
        self.commands = commands
        self.replies: list[Any] | None = None
        self.error: BaseException | None = None
        self.lead = False
        self.task: trio.lowlevel.Task | None = None


class Client:
    """One connection to Redis at ``url`` for concurrent callers (see the module); each
    round trip is bounded by ``timeout`` seconds. :meth:`aclose` closes it.

    ``resend_stale``: a batch whose connection, opened for an earlier one, turns out to be
    lost is sent once more on a new one. Redis drops idle connections when it restarts (or
    is told to), and the first batch after that finds out; but a batch Redis ran and then
    lost the connection of runs twice, so only a user whose commands may run twice sets it.
    """

    def __init__(self, url: str, *, timeout: float = 10.0, resend_stale: bool = False) -> None:
        self.url = url
        self.timeout = timeout
        self.resend_stale = resend_stale
        self._connection: Connection | None = None
        self._waiting: list[_Call] = []  # made while a batch was on its way
        self._busy = False  # a batch is on its way, or a caller is about to send one
        self._closed = False

    async def aclose(self) -> None:
        self._closed = True
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.aclose()

    async def call(self, *args: Arg) -> Any:
        """One command's reply; an error reply is raised (:class:`~._wire.ReplyError`)."""
        (reply,) = await self.pipeline([args])
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    async def script(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run ``script`` by its SHA1, with its text if Redis does not know it yet."""
        try:
            return await self.call("EVALSHA", script.sha, len(keys), *keys, *args)
        except ReplyError as exc:
            if exc.code != "NOSCRIPT":
                raise
        return await self.call("EVAL", script.source, len(keys), *keys, *args)

    async def pipeline(self, commands: Sequence[Command]) -> list[Any]:
        """The commands' replies, in order, sent together (an error reply in its place)."""
        if self._closed:
            raise ConnectionLost(f"the connection to Redis at {public_url(self.url)} is closed")
        call = _Call(commands)
        if self._busy:
            self._waiting.append(call)
            call.task = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(functools.partial(self._abort, call))
            if not call.lead:
                return self._answer(call)
        self._busy = True
        try:
            batch, self._waiting = [call, *self._waiting], []
            await self._send(batch)
        finally:
            self._hand_on()
        return self._answer(call)

    def _abort(self, call: _Call, _: Any) -> trio.lowlevel.Abort:
        """A waiting caller is cancelled: its call goes no more (or its answer to nobody)."""
        call.task = None
        if call in self._waiting:
            self._waiting.remove(call)
        return trio.lowlevel.Abort.SUCCEEDED

    def _hand_on(self) -> None:
        """The batch is answered: the first call waiting, if any, sends the next one."""
        self._busy = False
        while self._waiting:
            call = self._waiting.pop(0)
            if call.task is not None:
                self._busy = call.lead = True
                self._wake(call)
                return

    @staticmethod
    def _wake(call: _Call) -> None:
        task, call.task = call.task, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def _send(self, batch: list[_Call]) -> None:
        """One round trip for the batch, shielded: its callers may leave, the connection
        is not left with their replies unread. Every caller of the batch is answered,
        whatever happens."""
        commands = [command for call in batch for command in call.commands]
        error: BaseException | None = None
        replies: list[Any] = []
        try:
            with trio.move_on_after(self.timeout, shield=True) as scope:
                for resend in (self.resend_stale, False):
                    connection = self._connection
                    stale = connection is not None and not connection.closed
                    try:
                        if connection is None or connection.closed:
                            connection = self._connection = await Connection.open(self.url)
                        replies = await connection.call(commands)
                    except UNREACHABLE as exc:
                        error = exc
                        if resend and stale:
                            continue  # (see resend_stale)
                    else:
                        error = None
                    break
            if scope.cancelled_caught:  # the connection closed itself, its replies unread
                error = TimeoutError(f"no answer within {self.timeout:g}s")
        except BaseException as exc:  # (a refused AUTH, say): told to every caller
            error = exc
            raise
        finally:
            at = 0
            for call in batch:
                if error is None:
                    call.replies = replies[at : at + len(call.commands)]
                    at += len(call.commands)
                else:
                    call.error = self._failed(error)
                self._wake(call)  # (the caller that sent it waits for nobody)

    def _failed(self, error: BaseException) -> Exception:
        """The batch's error, an object of its own for each of its callers."""
        failure: Exception
        if isinstance(error, ReplyError):
            failure = ReplyError(str(error))
        else:
            failure = ConnectionLost(f"Redis at {public_url(self.url)} cannot be reached ({error})")
        failure.__cause__ = error
        return failure

    @staticmethod
    def _answer(call: _Call) -> list[Any]:
        if call.error is not None:
            raise call.error
        assert call.replies is not None
        return call.replies


def _nothing() -> None:
    pass


class Subscription:
    """A pub/sub subscription to Redis at ``url`` (see the module), to ``channels`` and those
    :meth:`subscribe` adds. ``what`` names it in the log; ``retry``: seconds between
    attempts to connect again; ``confirm_timeout``: how long :meth:`subscribe` waits for
    Redis to confirm before it takes the connection for broken (and makes it again)."""

    def __init__(
        self,
        url: str,
        channels: Iterable[str] = (),
        *,
        what: str,
        retry: float = 1.0,
        confirm_timeout: float = 10.0,
    ) -> None:
        self.url = url
        self.what = what
        self.retry = retry
        self.confirm_timeout = confirm_timeout
        self._channels: dict[bytes, None] = dict.fromkeys(c.encode() for c in channels)
        self._connection: Connection | None = None  # subscribed (or subscribing) on it
        self._sending = trio.Lock()  # one write at a time on it
        self._confirming: set[bytes] = set()  # the channels of the subscription being made
        self._confirms: dict[bytes, list[trio.Event]] = {}  # subscribe()'s waits
        self._live = False  # subscribed to every channel on this connection

    async def run(
        self,
        message: Callable[[bytes, bytes], None],
        *,
        live: Callable[[], None] = _nothing,
        dropped: Callable[[], None] = _nothing,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``message(channel, data)`` for each message, until cancelled; reports
        started once the first subscription is made (a first connection that fails raises
        its error). ``live``: the subscription is made (again); ``dropped``: a live one
        ended (Redis away, or this task cancelled)."""
        started = False
        while True:
            try:
                await self._subscribed(message, live, task_status, started)
            except (*UNREACHABLE, ReplyError) as exc:
                if not self._live and not started:
                    raise
                out = not isinstance(exc, ReplyError) and redis_outage(self.url).failed(
                    exc, self.what
                )
                _log.log(
                    logging.DEBUG if out else logging.WARNING,  # the outage's own line says it
                    "pipework: %s at %s ended (%s); subscribing again in %gs",
                    self.what,
                    public_url(self.url),
                    exc,
                    self.retry,
                )
            finally:
                started = started or self._live
                was_live, self._live = self._live, False
                connection, self._connection = self._connection, None
                self._confirming.clear()
                for waits in self._confirms.values():  # made again with the rest
                    for wait in waits:
                        wait.set()
                self._confirms.clear()
                if connection is not None:
                    with trio.CancelScope(shield=True):
                        await connection.aclose()
                if was_live:
                    dropped()
            await trio.sleep(self.retry)

    async def _subscribed(
        self,
        message: Callable[[bytes, bytes], None],
        live: Callable[[], None],
        task_status: trio.TaskStatus[None],
        started: bool,
    ) -> None:
        """One connection's life: subscribe to every channel, then read until it breaks."""
        connection = await Connection.open(self.url)
        self._connection = connection  # from now on subscribe() sends on it too
        channels = list(self._channels)
        self._confirming = set(channels)
        if channels:
            async with self._sending:
                await connection.send([["SUBSCRIBE", *channels]])
        while self._confirming:  # (messages on the channels confirmed come meanwhile)
            self._take(await connection.read(1), message)
        self._live = True
        live()
        if not started:
            task_status.started()
        while True:
            self._take(await connection.read(1), message)

    def _take(self, replies: list[Any], message: Callable[[bytes, bytes], None]) -> None:
        (reply,) = replies
        if isinstance(reply, ReplyError):
            raise reply  # a subscription refused (an ACL, say): made again later
        kind = reply[0]
        if kind == b"message":
            message(reply[1], reply[2])
        elif kind == b"subscribe":
            self._confirmed(reply[1])
        # (an unsubscribe's confirmation: nothing to do)

    def _confirmed(self, channel: bytes) -> None:
        self._confirming.discard(channel)
        for wait in self._confirms.pop(channel, ()):
            wait.set()

    async def subscribe(self, channel: str) -> None:
        """Hear ``channel`` too, from when Redis confirms it on: returns then (or at once,
        while the connection is away: it subscribes when it is back)."""
        name = channel.encode()
        if name in self._channels:
            return
        self._channels[name] = None
        connection = self._connection
        if connection is None:
            return
        confirmed = trio.Event()
        self._confirms.setdefault(name, []).append(confirmed)
        try:
            async with self._sending:
                await connection.send([["SUBSCRIBE", name]])
        except UNREACHABLE:
            return  # the reader sees it too: subscribed again with the rest
        with trio.move_on_after(self.confirm_timeout):
            await confirmed.wait()
            return
        # No confirmation in time: the connection is taken for broken, and made again.
        _log.warning(
            "pipework: %s at %s did not confirm %r within %gs; reconnecting",
            self.what,
            public_url(self.url),
            channel,
            self.confirm_timeout,
        )
        if self._connection is connection:
            await connection.aclose()

    async def unsubscribe(self, channel: str) -> None:
        """Stop hearing ``channel`` (a message sent just before may still come)."""
        name = channel.encode()
        if self._channels.pop(name, False) is None and self._connection is not None:
            try:
                async with self._sending:
                    await self._connection.send([["UNSUBSCRIBE", name]])
            except UNREACHABLE:
                pass  # not subscribed again when it is back
