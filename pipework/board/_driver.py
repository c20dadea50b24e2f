"""The push board's trio driver: one flush task for every board, and followers that wait.

:class:`Boards` owns the :class:`~._core.BoardCore` of each board and drives them:
writes go in through the board's backplane (synchronously on a board in one process, so an
engine observer can publish from the dispatcher's tasks), one task flushes each board when
its batch is due and wakes the followers the core names, and a :class:`Follower` waits for
its events with :meth:`Follower.wait`. All decisions are the core's; this module only parks
and wakes tasks.

Every write goes through a :class:`Backplane`, which decides its version and applies it
(:meth:`Boards.apply`) on every process that serves the board. :class:`LocalBackplane` (the
default) is one process: it applies at once and the board counts its own versions. A shared
one (``pipework.redis``'s ``RedisBackplane``) is the one authority on versions: a write's version is
assigned where every process reads the changes in the same order, and ``await
boards.write(...)`` returns it once the change is applied here too (a read after a write on
the same process sees it). The HTTP side only ever calls :class:`Boards`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import trio

from ._core import (
    BoardCore,
    BoardSettings,
    BoardStatistics,
    Taken,
    Version,
)

__all__ = [
    "Backplane",
    "BoardSpec",
    "BoardUnavailable",
    "Boards",
    "Change",
    "Follower",
    "LocalBackplane",
    "new_epoch",
]


def new_epoch() -> int:
    """A board incarnation's epoch: random, so positions from an earlier process (or
    another one) are told apart from this one's."""
    return secrets.randbelow(2**40) + 1


@dataclass(frozen=True, slots=True)
class BoardSpec:
    """A board as configured: its batching and limits, and who may use it.

    ``write_token``: the bearer token that may create, update and delete (None: nobody may,
    over HTTP); ``read_token``: the token that may read and follow; ``public_read``: anyone
    may read and follow. ``keepalive``: seconds between SSE keep-alive comments;
    ``long_poll``: the longest a long-poll waits.
    """

    name: str
    settings: BoardSettings = field(default_factory=BoardSettings)
    write_token: str | None = None
    read_token: str | None = None
    public_read: bool = False
    keepalive: float = 15.0
    long_poll: float = 30.0
    #: In this process alone, whatever the backplane (the job board: a job's changes are
    #: observed where it runs).
    local: bool = False

    def __post_init__(self) -> None:
        if not self.keepalive > 0 or not self.long_poll > 0:
            raise ValueError("keepalive and long_poll must be positive")


@dataclass(frozen=True, slots=True)
class Change:
    """A write as it travels between processes: ``op`` is create, update or delete."""

    board: str
    op: str
    resource: str
    data: Any = None


class BoardUnavailable(Exception):
    """A write could not reach the shared backplane (Redis away, or not answering in
    time): nothing was written; retry later (HTTP 503)."""


class Backplane(Protocol):
    """Carries every write to every process's boards, and decides its version.

    ``connect`` hands it the boards once; ``run`` receives the writes other processes make
    (until cancelled; it reports started at once, not only once connected); ``publish``
    returns a write's version once the change is applied in this process, raising what the
    core raises (:class:`ResourceExists`, :class:`ResourceNotFound`, :class:`BoardFull`)
    or :class:`BoardUnavailable`. ``shared``: whether other processes hear the writes (then
    writes need ``await``: the version comes from elsewhere)."""

    shared: bool

    def connect(self, boards: Boards) -> None: ...

    async def publish(self, change: Change) -> Version: ...

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None: ...


class LocalBackplane:
    """One process: a change is applied here, at once, and the board counts the version."""

    shared = False

    def __init__(self) -> None:
        self._boards: Boards | None = None

    def connect(self, boards: Boards) -> None:
        self._boards = boards

    def publish_now(self, change: Change) -> Version:
        assert self._boards is not None, "the backplane is not connected to its boards"
        return self._boards.apply(change)

    async def publish(self, change: Change) -> Version:
        return self.publish_now(change)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()


class Boards:
    """Every board of a container (and the job board), and their one flush task.

    ``async with boards:`` or ``await nursery.start(boards.run)`` runs the flush task;
    writes and follows work only while it runs (a write outside it is flushed once it
    starts)."""

    def __init__(
        self,
        specs: Iterable[BoardSpec] = (),
        *,
        clock: Callable[[], float] = trio.current_time,
        backplane: Backplane | None = None,
    ) -> None:
        self.specs: dict[str, BoardSpec] = {}
        self.cores: dict[str, BoardCore] = {}
        self._clock = clock
        self._kick = trio.Event()
        # Keyed by the core, not the board's name: a board removed by a reload and added
        # again is a new core whose follower ids start over.
        self._followers: dict[BoardCore, dict[int, Follower]] = {}
        #: When each board with followers next sends keep-alives to its idle streams.
        self._beats: dict[BoardCore, float] = {}
        for spec in specs:
            self.add(spec)
        #: Where the boards' writes go; boards declared ``local`` (the job board) always
        #: stay in this process.
        self.backplane: Backplane = backplane or LocalBackplane()
        self.backplane.connect(self)
        self._local = LocalBackplane()
        self._local.connect(self)

    def add(self, spec: BoardSpec) -> None:
        if spec.name in self.specs:
            raise ValueError(f"board {spec.name!r} is declared twice")
        self.specs[spec.name] = spec
        self.cores[spec.name] = BoardCore(spec.settings, epoch=new_epoch())

    def reconfigure(self, specs: Iterable[BoardSpec]) -> dict[str, list[str]]:
        """Serve exactly ``specs`` from now on (a reload), synchronously, in one step.

        A board whose spec is unchanged is untouched. A new one is added. A changed one
        keeps its resources and followers and takes the new settings
        (:meth:`BoardCore.reconfigure`) -- unless who may read or write it changed: then
        its followers' streams end (a reconnect is checked under the new rules and resumes
        at its last position). A removed board deletes its resources, so each follower
        gets a final ``delete`` and its stream ends; new requests find no board. Returns
        the names ``added``, ``changed`` and ``removed``."""
        wanted: dict[str, BoardSpec] = {}
        for spec in specs:
            if spec.name in wanted:
                raise ValueError(f"board {spec.name!r} is declared twice")
            wanted[spec.name] = spec
        summary: dict[str, list[str]] = {"added": [], "changed": [], "removed": []}
        for name in [n for n in self.specs if n not in wanted]:
            self._remove(name)
            summary["removed"].append(name)
        for name, spec in wanted.items():
            old = self.specs.get(name)
            if old is None:
                self.add(spec)
                summary["added"].append(name)
            elif old != spec:
                core = self.cores[name]
                self.specs[name] = spec
                core.reconfigure(spec.settings)
                if _access(old) != _access(spec):
                    self._wake(core, core.end_followers())
                self._kick.set()  # the batch's deadline may have moved
                summary["changed"].append(name)
        return summary

    def _remove(self, name: str) -> None:
        del self.specs[name]
        core = self.cores.pop(name)
        now = self._clock()
        for resource in list(core.resources()):
            core.delete(resource, now)
        # Flushed now: the flush task no longer sees this core. Its followers hold it
        # until they have taken their deletes and left.
        self._wake(core, core.flush())

    def _wake(self, core: BoardCore, follower_ids: Iterable[int]) -> None:
        followers = self._followers.get(core)
        if followers is None:
            return
        for follower_id in follower_ids:
            follower = followers.get(follower_id)
            if follower is not None:
                follower._wake()

    def statistics(self) -> Mapping[str, BoardStatistics]:
        return {name: core.statistics() for name, core in self.cores.items()}

    # -- writes --------------------------------------------------------------------------

    def plane(self, board: str) -> Backplane:
        """The backplane that carries ``board``'s writes."""
        spec = self.specs.get(board)
        if spec is None:
            raise KeyError(board)
        return self._local if spec.local else self.backplane

    async def write(self, change: Change) -> Version:
        """Write through the board's backplane; the version, once applied here."""
        return await self.plane(change.board).publish(change)

    def post(self, change: Change) -> Version:
        """Write at once, without awaiting: only on a board in this process alone (the
        engine's observer publishes so, from the dispatcher's tasks)."""
        plane = self.plane(change.board)
        if not isinstance(plane, LocalBackplane):
            raise TypeError(
                f"board {change.board!r} is shared between processes: its writes take "
                "`await boards.write(...)`"
            )
        return plane.publish_now(change)

    def apply(self, change: Change, version: Version | None = None) -> Version:
        """Apply a change to this process's board: what a backplane calls, with the
        version it assigned (None: the board counts its own)."""
        core = self.cores[change.board]
        now = self._clock()
        if change.op == "create":
            version = core.create(change.resource, change.data, now, version)
        elif change.op == "update":
            version = core.update(change.resource, change.data, now, version)
        elif change.op == "delete":
            version = core.delete(change.resource, now, version)
        else:
            raise ValueError(f"unknown change {change.op!r}")
        self._kick.set()
        return version

    def reconcile(
        self, board: str, epoch: int, offset: int, state: Mapping[str, tuple[int, Any]]
    ) -> None:
        """Make ``board`` equal the shared ``state`` at ``Version(epoch, offset)`` (see
        :meth:`BoardCore.reconcile`); what was pending is flushed first."""
        core = self.cores[board]
        self._wake(core, core.flush())
        core.reconcile(epoch, offset, state, self._clock())
        self._kick.set()

    def create(self, board: str, resource: str, data: Any) -> Version:
        return self.post(Change(board, "create", resource, data))

    def update(self, board: str, resource: str, data: Any) -> Version:
        return self.post(Change(board, "update", resource, data))

    def delete(self, board: str, resource: str) -> Version:
        return self.post(Change(board, "delete", resource))

    def read(self, board: str, resource: str) -> tuple[Version, Any]:
        return self.cores[board].read(resource)

    # -- following -----------------------------------------------------------------------

    def follow(
        self, board: str, resources: Iterable[str], since: Version | None = None
    ) -> Follower:
        """Follow ``resources`` from ``since``: raises BoardFull or ResourceNotFound at
        once; ``with`` the result to leave when done."""
        core = self.cores[board]
        follower_id = core.join(resources, since)
        follower = Follower(self, board, core, follower_id)
        followers = self._followers.setdefault(core, {})
        if not followers:
            self._beats[core] = self._clock() + self.specs[board].keepalive
            self._kick.set()
        followers[follower_id] = follower
        return follower

    def _leave(self, core: BoardCore, follower_id: int, dropped: bool) -> None:
        followers = self._followers.get(core)
        if followers is not None:
            followers.pop(follower_id, None)
            if not followers:
                del self._followers[core]
                self._beats.pop(core, None)
        core.leave(follower_id, dropped=dropped)

    # -- the flush task ------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush each board's batches when they are due, and beat its idle streams every
        ``keepalive`` seconds, until cancelled; the backplane receives beside it."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.backplane.run)
            task_status.started()
            await self._flush_loop()

    async def _flush_loop(self) -> None:
        while True:
            self._kick = trio.Event()
            deadline = min(self._flush_due(), self._beat_due())
            if deadline == math.inf:
                await self._kick.wait()
            else:
                with trio.move_on_at(deadline):
                    await self._kick.wait()

    def _flush_due(self) -> float:
        """Flush every due batch; the earliest deadline still ahead (inf: none)."""
        now = self._clock()
        earliest = math.inf
        for core in self.cores.values():
            due = core.deadline()
            if due is None:
                continue
            if due <= now:
                self._wake(core, core.flush())
            else:
                earliest = min(earliest, due)
        return earliest

    def _beat_due(self) -> float:
        """Beat every board whose keep-alive is due: each stream that sent nothing since
        the last beat is woken to send one (one pass per board, instead of a timer per
        stream re-armed at every event). The earliest beat still ahead (inf: none)."""
        now = self._clock()
        earliest = math.inf
        for core, due in list(self._beats.items()):
            if due <= now:
                name = next((n for n, c in self.cores.items() if c is core), None)
                if name is None:  # removed by a reload: its streams are ending
                    continue
                for follower in self._followers.get(core, {}).values():
                    follower._beat()
                due = self._beats[core] = now + self.specs[name].keepalive
            earliest = min(earliest, due)
        return earliest


def _access(spec: BoardSpec) -> tuple[str | None, str | None, bool]:
    return spec.write_token, spec.read_token, spec.public_read


class Follower:
    """One connection following resources of one board. Leave it with ``with`` (or
    :meth:`close`); :meth:`drop` when a send to it failed.

    Its task parks itself (:func:`trio.lowlevel.wait_task_rescheduled`) and the board
    reschedules it: a broadcast to thousands wakes each for the price of one reschedule,
    with no event object made per follower per wake."""

    def __init__(self, boards: Boards, board: str, core: BoardCore, follower_id: int) -> None:
        self._boards = boards
        self.board = board
        # The core itself, not its name: a reload that removes the board leaves this
        # follower able to take its final events.
        self._core = core
        self.id = follower_id
        self._closed = False
        self._parked: trio.lowlevel.Task | None = None
        self._beats = False  # parked in next(): a keep-alive beat wakes it too
        self._beaten = False  # a beat woke it
        self._active = True  # it took events since the last beat

    @property
    def ready(self) -> bool:
        """Events are waiting (a long-poll answers at once), or the follower was ended."""
        return self._core.pending_for(self.id) or self._core.ended(self.id)

    @property
    def position(self) -> Version:
        """The newest version written on the follower's board."""
        return self._core.position

    def take(self) -> Taken:
        """Whatever is waiting now (maybe nothing)."""
        if not self.ready:
            return Taken((), False)
        self._active = True
        return self._core.take(self.id)

    async def wait(self) -> Taken:
        """Wait until events come, and take them."""
        while not self.ready:
            await self._park(beats=False)
        return self.take()

    async def next(self) -> Taken | None:
        """Wait until events come and take them, or return None when the board's
        keep-alive beat finds this stream idle (nothing taken since the last beat)."""
        while not self.ready:
            self._beaten = False
            await self._park(beats=True)
            if self._beaten and not self.ready:
                return None
        return self.take()

    async def _park(self, *, beats: bool) -> None:
        self._parked = trio.lowlevel.current_task()
        self._beats = beats
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self._parked = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake(self) -> None:
        task, self._parked = self._parked, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def _beat(self) -> None:
        if self._active:
            self._active = False
        elif self._beats and self._parked is not None:
            self._beaten = True
            self._wake()

    def close(self, *, dropped: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._boards._leave(self._core, self.id, dropped)

    def drop(self) -> None:
        """Leave because a send failed (counted as a drop)."""
        self.close(dropped=True)

    def __enter__(self) -> Follower:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
