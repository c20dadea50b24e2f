"""What a job's steps say while they run, carried to the process that holds its request.

With several processes on one Redis, a job's step may run anywhere, while the request that
waits for it (a ``stream=True`` response, an SSE follower of ``/jobs/{id}/events``) is held
by one process. Its end already reaches every process (the store publishes finished ids);
this module carries the rest, over **one pub/sub connection per process**, demultiplexed by
job id:

- **Changes (status, progress) of a watched job.** A process that holds a follower calls
  :meth:`RedisRelay.watch`: it subscribes to the job's channel ``{p}:relay:{id}``, then sets
  ``{p}:watch:{id}`` (a lease it refreshes). The store's update script publishes the new
  version on that channel when, and only when, the key exists: a job nobody follows costs
  one ``EXISTS`` inside a script that runs anyway. The watching process reads the record
  and tells its observers (once per version: its own writes are not told twice). After
  subscribing it reads the record once, so a change made before the key was set is not
  missed either; changes in between come as one read of the newest version.
- **Streamed chunks** go on a Redis Stream per job, ``{p}:chunks:{id}``, not on pub/sub:
  chunks must arrive in order and none may be lost, and a reader slower than the pipe must
  not lose what it has not read yet. The accepting process marks the job
  (``{p}:streamed:{id}``) before its first event is written; a step anywhere appends each
  chunk with a script that appends only for a marked job (otherwise the chunk goes to the
  record's ``output``, as before) and publishes a wake-up on the job's channel. The reader
  reads from its last entry on, and once the job has ended reads what is left and stops.
  Every chunk of such a job goes this way, also from a step in the reading process itself,
  so chunks of steps on different processes keep their order.
- **Cancels** are published on ``{p}:cancel``: every process hears them, and the one
  running a step of the job cancels that step's scope, as a local cancel does.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Final, Protocol

import msgpack
import trio

from ..dispatcher._job import Job
from ..dispatcher._status import TERMINAL
from ._client import Client, Subscription
from ._scripts import load
from ._wire import UNREACHABLE, ReplyError, redis_outage

__all__ = ["RedisRelay", "RelayTarget"]

_log = logging.getLogger("pipework.dispatcher")

#: Negative answers kept about jobs whose chunks stay in their record.
_PLAIN_MEMORY: Final = 10_000

_EMIT: Final = load("relay_emit")
_READ: Final = load("relay_read")

#: What a command of the relay's that could not be made raises.
_FAILED: Final = (*UNREACHABLE, ReplyError)


class RelayTarget(Protocol):
    """What the relay acts on in its process (the engine)."""

    def interrupt(self, job_id: str) -> None:
        """A cancel came: cancel the step running the job here, if one is."""

    async def read(self, job_id: str) -> Job:
        """The job's record."""
        ...

    def changed(self, job: Job) -> None:
        """A watched job changed elsewhere: tell this process's observers."""


class _Reader:
    __slots__ = ("ended", "notice", "recheck")

    def __init__(self) -> None:
        self.notice = trio.Event()
        self.ended = False
        self.recheck = False  # notices may have been lost: look at the record


class RedisRelay:
    """The relay of one process, for the jobs under ``prefix``. ``lease`` bounds how long a
    mark of a process that died outlives it. The engine runs :meth:`run`."""

    def __init__(self, url: str, *, prefix: str, lease: float = 60.0) -> None:
        self.url = url
        self.prefix = prefix
        self.lease = lease
        self._client: Client | None = None
        # The process's one subscription: the broadcast channels and the channel of every
        # job followed here. Ends are not listened for here: the engine hears them already
        # (the store's subscription) and tells :meth:`ended`, so each end is decoded once
        # per process.
        self._subscription = Subscription(
            url,
            [f"{prefix}:cancel"],
            what="the relay's subscription",
            # A loaded machine may take more than a second to confirm.
            confirm_timeout=10.0,
        )
        self._channels: dict[str, int] = {}  # job id -> users of its channel here
        self._watched: dict[str, int] = {}  # job id -> newest version told here
        self._readers: dict[str, _Reader] = {}
        self._dirty: dict[str, None] = {}  # watched jobs to read again, in order
        self._have_dirty = trio.Event()
        self._to_watch: list[str] = []
        self._to_release: list[str] = []  # streams let go: their keys and channel
        self._have_watch = trio.Event()
        self._cancels: list[str] = []
        self._have_cancels = trio.Event()
        self._plain: OrderedDict[str, None] = OrderedDict()
        self._target: RelayTarget | None = None
        self.running = False

    def _key(self, kind: str, job_id: str) -> str:
        return f"{self.prefix}:{kind}:{job_id}"

    # -- running -------------------------------------------------------------------------

    async def __aenter__(self) -> RedisRelay:
        # Opened before the engine's nursery and closed after it (the event queue does
        # both): the connection must outlive the tasks that use it. Its commands (marks,
        # leases, reads, cancel notices) may run twice, so a batch that finds its idle
        # connection dropped (Redis restarted) goes again at once rather than failing; a
        # chunk whose append Redis ran just before the connection broke may so come twice.
        self._client = Client(self.url, resend_stale=True)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def run(
        self, target: RelayTarget, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen and relay until cancelled."""
        self._target = target
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._listen)
                self.running = True
                nursery.start_soon(self._watch_loop)
                nursery.start_soon(self._read_loop)
                nursery.start_soon(self._cancel_loop)
                nursery.start_soon(self._lease_loop)
                task_status.started()
        finally:
            self.running = False

    async def _listen(self, *, task_status: trio.TaskStatus[None]) -> None:
        """The subscription, made again after Redis came back (then every followed job is
        read again)."""
        made = 0

        def live() -> None:
            nonlocal made
            made += 1
            if made > 1:
                self._resubscribed()

        await self._subscription.run(self._on_message, live=live, task_status=task_status)

    def _on_message(self, channel_name: bytes, message: bytes) -> None:
        channel = channel_name.decode(errors="replace")
        data = message.decode(errors="replace")
        kind, _, job_id = channel[len(self.prefix) + 1 :].partition(":")
        assert self._target is not None
        try:
            self._dispatch(kind, job_id, data)
        except Exception:  # one odd message must not end the subscription
            _log.exception("pipework: the relay could not handle %r on %s", data, channel)

    def _dispatch(self, kind: str, job_id: str, data: str) -> None:
        assert self._target is not None
        if kind == "cancel":
            self._target.interrupt(data)
        elif data == "c":  # a chunk was appended
            reader = self._readers.get(job_id)
            if reader is not None:
                reader.notice.set()
        else:  # a watched job's record changed: its new version
            told = self._watched.get(job_id)
            if told is not None and int(data) > told:
                self._mark_dirty(job_id)

    def _resubscribed(self) -> None:
        """The subscription was made again: what was published meanwhile is lost, so every
        followed job is read again, and every reader looks whether its job has ended."""
        for job_id in self._watched:
            self._mark_dirty(job_id)
        for reader in self._readers.values():
            reader.recheck = True
            reader.notice.set()

    def ended(self, job_id: str) -> None:
        """The job has ended (here or in another process)."""
        reader = self._readers.get(job_id)
        if reader is not None:
            reader.ended = True
            reader.notice.set()
        if job_id in self._watched:
            self._mark_dirty(job_id)  # its final record, then it is let go

    def _mark_dirty(self, job_id: str) -> None:
        self._dirty[job_id] = None
        self._have_dirty.set()

    # -- watching changes ----------------------------------------------------------------

    def watch(self, job_id: str) -> None:
        """Tell this process's observers of the job's changes made anywhere, until it
        ends."""
        if job_id in self._watched or not self.running:
            return
        self._watched[job_id] = -1
        self._to_watch.append(job_id)
        self._have_watch.set()

    def seen(self, job: Job) -> None:
        """This process told its observers of ``job`` at its version: not again."""
        told = self._watched.get(job.id)
        if told is not None and job.version > told:
            self._watched[job.id] = job.version

    async def _watch_loop(self) -> None:
        while True:
            await self._have_watch.wait()
            self._have_watch = trio.Event()
            released, self._to_release = self._to_release, []
            for job_id in released:
                with contextlib.suppress(*_FAILED):
                    keys = [self._key("streamed", job_id), self._key("chunks", job_id)]
                    await self._redis().call("DEL", *keys)
                await self._unsubscribe(job_id)
            batch, self._to_watch = self._to_watch, []
            for job_id in batch:
                try:
                    await self._subscribe(job_id)
                    await self._redis().call(
                        "SET", self._key("watch", job_id), b"1", "PX", int(self.lease * 1000)
                    )
                except _FAILED as exc:
                    _log.log(
                        self._level(exc, "relay watches"),
                        "pipework: watching job %s failed: %s",
                        job_id,
                        exc,
                    )
                    self._watched.pop(job_id, None)
                    continue
                self._mark_dirty(job_id)  # what changed before the mark was set

    async def _read_loop(self) -> None:
        assert self._target is not None
        while True:
            await self._have_dirty.wait()
            self._have_dirty = trio.Event()
            while self._dirty:
                job_id = next(iter(self._dirty))
                del self._dirty[job_id]
                if job_id not in self._watched:
                    continue
                try:
                    job = await self._target.read(job_id)
                except Exception as exc:  # gone, or the store away: nothing more to tell
                    _log.info("pipework: reading watched job %s: %s", job_id, exc)
                    await self._unwatch(job_id)
                    continue
                if job.version > self._watched.get(job_id, job.version):
                    self._target.changed(job)
                    self.seen(job)
                if job.status in TERMINAL:  # it has ended: told for the last time
                    await self._unwatch(job_id)

    async def _unwatch(self, job_id: str) -> None:
        if self._watched.pop(job_id, None) is None:
            return
        with contextlib.suppress(*_FAILED):
            await self._redis().call("DEL", self._key("watch", job_id))
        await self._unsubscribe(job_id)

    async def _subscribe(self, job_id: str) -> None:
        """Hear the job's channel (once Redis has confirmed it, or, while Redis is away, as
        soon as the subscription is made again)."""
        users = self._channels.get(job_id, 0)
        self._channels[job_id] = users + 1
        if users == 0:
            await self._subscription.subscribe(self._key("relay", job_id))

    async def _unsubscribe(self, job_id: str) -> None:
        users = self._channels.pop(job_id, 0) - 1
        if users > 0:
            self._channels[job_id] = users
        else:
            await self._subscription.unsubscribe(self._key("relay", job_id))

    async def _lease_loop(self) -> None:
        """Keep this process's marks alive while it lives."""
        while True:
            await trio.sleep(self.lease / 3)
            keys = [self._key("watch", job_id) for job_id in self._watched]
            for job_id in self._readers:  # a slow reader's backlog stays too
                keys += [self._key("streamed", job_id), self._key("chunks", job_id)]
            if not keys:
                continue
            lease = int(self.lease * 1000)
            try:
                await self._redis().pipeline([["PEXPIRE", key, lease] for key in keys])
            except _FAILED as exc:
                _log.log(
                    self._level(exc, "relay refreshes"),
                    "pipework: refreshing relay marks failed: %s",
                    exc,
                )

    # -- streamed chunks -----------------------------------------------------------------

    async def open_stream(self, job_id: str) -> None:
        """Mark the job streamed, before its first event is written: its chunks will come
        through :meth:`chunks` here, wherever its steps run."""
        self._readers[job_id] = _Reader()
        await self._subscribe(job_id)
        lease = int(self.lease * 1000)
        await self._redis().call("SET", self._key("streamed", job_id), b"1", "PX", lease)

    def close_stream(self, job_id: str) -> None:
        """Let the job's stream go (read to its end, left early, or never read): its keys
        and its channel are let go by the relay's task."""
        if self._readers.pop(job_id, None) is not None:
            self._to_release.append(job_id)
            self._have_watch.set()

    async def chunks(self, job_id: str, *, batch: int = 64) -> AsyncIterator[Any]:
        """The job's chunks in order, until it has ended and every one was read."""
        reader = self._readers[job_id]
        last = b"0-0"
        try:
            while True:
                reader.notice = trio.Event()
                ended = reader.ended  # read before the entries: none can come after an end
                entries = await self._redis().script(
                    _READ, [self._key("chunks", job_id)], [last, batch]
                )
                for i in range(0, len(entries), 2):
                    last = entries[i]
                    yield msgpack.unpackb(entries[i + 1], raw=False)
                if entries:
                    continue
                if ended:
                    return
                if reader.recheck and self._target is not None:
                    reader.recheck = False
                    job = await self._target.read(job_id)
                    if job.status in TERMINAL:
                        reader.ended = True
                        continue
                await reader.notice.wait()
        finally:
            self.close_stream(job_id)

    async def emit(self, job_id: str, chunk: Any) -> bool:
        """Append a chunk to a streamed job's stream; False for a job that is not streamed
        (its chunks stay in its record)."""
        if job_id in self._plain or not self.running:
            return False
        data = msgpack.packb(chunk, use_bin_type=True)
        keys = [self._key("streamed", job_id), self._key("chunks", job_id)]
        keys.append(self._key("relay", job_id))
        appended = await self._redis().script(_EMIT, keys, [data, int(self.lease * 1000)])
        if not appended:
            self._plain[job_id] = None
            if len(self._plain) > _PLAIN_MEMORY:
                self._plain.popitem(last=False)
        return bool(appended)

    # -- cancels -------------------------------------------------------------------------

    def cancel(self, job_id: str) -> None:
        """Tell every process to cancel the step of the job it may be running."""
        if self.running:
            self._cancels.append(job_id)
            self._have_cancels.set()

    async def _cancel_loop(self) -> None:
        while True:
            await self._have_cancels.wait()
            self._have_cancels = trio.Event()
            batch, self._cancels = self._cancels, []
            channel = f"{self.prefix}:cancel"
            try:
                await self._redis().pipeline([["PUBLISH", channel, job_id] for job_id in batch])
            except _FAILED as exc:
                # Best effort: the record says cancelled already, and the step ends at its
                # next write.
                _log.log(
                    self._level(exc, "cancel notices"),
                    "pipework: publishing %d cancels failed: %s",
                    len(batch),
                    exc,
                )

    # -- plumbing ------------------------------------------------------------------------

    def _level(self, exc: BaseException, what: str) -> int:
        """WARNING for a failure, DEBUG while Redis's outage (its own line) explains it."""
        if isinstance(exc, ReplyError):
            return logging.WARNING
        return logging.DEBUG if redis_outage(self.url).failed(exc, what) else logging.WARNING

    def _redis(self) -> Client:
        if self._client is None:
            raise RuntimeError("the relay is not running")
        return self._client
