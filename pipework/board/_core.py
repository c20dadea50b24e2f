"""The push board's decisions, as a pure state machine: no I/O, no clock, no trio.

A board holds resources (an id, a JSON-able state, a version). Writes change a resource at
once (a read sees them) and queue a *change* for its followers; the trio driver
(``_driver.py``) flushes the queued batch when :meth:`BoardCore.deadline` comes -- the batch
window after its first change, or at once when the batch holds ``max_batch`` events -- and
wakes the followers :meth:`BoardCore.flush` names, which then :meth:`BoardCore.take` their
events and send them.

The rules, each tested in ``tests/test_board_core.py``:

* **Coalescing.** Within one batch a resource's updates collapse to its latest version (a
  board with ``keep_all`` keeps every change instead); a delete supersedes every pending
  update of its resource, in both modes.
* **Versions** are an epoch (one per board incarnation, so a position from an earlier
  process is recognised as foreign) plus an offset counted across the whole board, so one
  number is a follower's position on every resource it follows, and offsets grow per
  resource too.
* **No silent gaps.** Each resource keeps the last ``history`` events it published. A
  follower joining at a position (``Last-Event-ID``, ``?since=``) gets every event after it
  from that history, or -- when the history no longer reaches back that far, or the
  position belongs to another epoch -- one explicit ``resync`` event with the current state.
  It gets nothing at or before that position, an event of the batch still pending (its own
  write, answered with its version before the batch flushed) neither.
* **Bounded followers.** A follower's queue holds at most one event per resource on a
  coalescing board; on a ``keep_all`` board, once it holds ``max_queue`` events it collapses
  to one ``resync`` per resource carrying that resource's latest state. Either way a slow
  follower costs memory in proportion to what it follows, not to how much happens.
* **Limits.** ``max_followers`` in all and ``max_per_resource`` on one resource; past them
  :meth:`BoardCore.join` raises :class:`BoardFull` and changes nothing.
* **Delete** closes: a follower that takes a resource's delete stops following it, and is
  :attr:`~Taken.closed` once it follows nothing.

After any sequence of writes, joins, leaves and flushes, a follower that takes its events
and applies them in order (update and resync set the state, delete removes it) holds every
resource it follows at its latest published state (the hypothesis state machine in the
tests checks exactly that).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final

__all__ = [
    "BoardCore",
    "BoardFull",
    "BoardSettings",
    "BoardStatistics",
    "Event",
    "Kind",
    "ResourceExists",
    "ResourceNotFound",
    "Taken",
    "Version",
]

_NEVER: Final = -1


class Kind(Enum):
    """What an event tells a follower."""

    UPDATE = "update"  #: the resource's new state (also its first, on create)
    DELETE = "delete"  #: the resource is gone; its followers are closed
    RESYNC = "resync"  #: the current state, replacing whatever the follower missed


@dataclass(frozen=True, slots=True, order=True)
class Version:
    """``epoch-offset``: the wire form is what SSE sends as ``id:``."""

    epoch: int
    offset: int

    def __str__(self) -> str:
        return f"{self.epoch}-{self.offset}"

    @classmethod
    def parse(cls, text: str | None) -> Version | None:
        """The version written as ``epoch-offset``; None for anything else."""
        if not text:
            return None
        epoch, sep, offset = text.strip().partition("-")
        if not sep or not epoch.isdigit() or not offset.isdigit():
            return None
        return cls(int(epoch), int(offset))


@dataclass(frozen=True, slots=True)
class Event:
    """One change as followers see it. ``data`` is None for a delete.

    One event object goes to every follower of its resource; ``encoded`` holds its wire
    forms, filled by the transport that first sends it, so every follower gets the same
    bytes and the event is encoded once, not once per follower."""

    resource: str
    kind: Kind
    version: Version
    data: Any = None
    encoded: dict[str, bytes] = field(default_factory=dict, compare=False, repr=False)

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.resource,
            "event": self.kind.value,
            "version": str(self.version),
            "data": self.data,
        }


@dataclass(frozen=True, slots=True)
class Taken:
    """What :meth:`BoardCore.take` hands a follower: its events in version order, and
    whether it is done (every resource it followed was deleted)."""

    events: tuple[Event, ...]
    closed: bool


class BoardFull(Exception):
    """A join past a follower limit; ``reason`` is ``board`` or ``resource``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ResourceNotFound(KeyError):
    """No such resource (never created, or deleted)."""


class ResourceExists(KeyError):
    """A create with an id already in use."""


@dataclass(frozen=True, slots=True)
class BoardSettings:
    """How one board batches and bounds (``[boards.NAME]`` in the gateway file).

    ``window``: seconds a batch collects changes after its first; ``max_batch``: events in
    a batch that flush it at once; ``keep_all``: deliver every change, not only the latest
    per batch; ``history``: published events kept per resource for reconnects;
    ``max_queue``: events a slow follower may have waiting (``keep_all`` boards);
    ``max_followers`` / ``max_per_resource``: follower limits; ``max_resources``: resources
    one board holds at most.
    """

    window: float = 0.05
    max_batch: int = 1000
    keep_all: bool = False
    history: int = 64
    max_queue: int = 256
    max_followers: int = 10_000
    max_per_resource: int = 10_000
    max_resources: int = 100_000

    def __post_init__(self) -> None:
        if not self.window >= 0:
            raise ValueError(f"window must not be negative, got {self.window!r}")
        for name in (
            "max_batch",
            "history",
            "max_queue",
            "max_followers",
            "max_per_resource",
            "max_resources",
        ):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class BoardStatistics:
    """Counters since the board started, and the followers now."""

    followers: int
    resources: int
    changes: int  #: writes (create, update, delete)
    published: int  #: events flushed to followers, after coalescing
    coalesced: int  #: changes that a later one in the same batch superseded
    delivered: int  #: events handed to followers
    resyncs: int  #: resync events handed out (a position too old, or a slow queue)
    dropped: int  #: followers dropped because a send to them failed


@dataclass(slots=True, eq=False)
class _Resource:
    id: str
    data: Any
    version: Version
    #: Published events, oldest first; ``evicted`` is the offset of the newest one dropped.
    history: deque[Event]
    evicted: int = _NEVER
    followers: set[int] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class _Follower:
    resources: set[str]
    #: Waiting events by resource, in the order resources were touched.
    queue: dict[str, list[Event]] = field(default_factory=dict)
    size: int = 0
    #: The offset it joined at (this epoch's): it knows every event up to there, those
    #: still in the pending batch too, and is handed none of them.
    after: int = _NEVER


class BoardCore:
    """One board's resources, pending batch, histories and followers."""

    def __init__(self, settings: BoardSettings | None = None, *, epoch: int = 1) -> None:
        self.settings = settings or BoardSettings()
        self.epoch = epoch
        self._offset = 0
        self._resources: dict[str, _Resource] = {}
        #: Deleted resources whose delete is still pending: their followers need it.
        self._deleted: dict[str, _Resource] = {}
        self._pending: dict[str, list[Event]] = {}
        self._pending_count = 0
        self._batch_started: float | None = None
        self._followers: dict[int, _Follower] = {}
        self._ids = itertools.count(1)
        # counters
        self._changes = self._published = self._coalesced = 0
        self._delivered = self._resyncs = self._dropped = 0

    # -- reads ---------------------------------------------------------------------------

    @property
    def position(self) -> Version:
        """The newest version written on this board (the position of a follower that has
        seen everything)."""
        return Version(self.epoch, self._offset)

    def read(self, resource: str) -> tuple[Version, Any]:
        """The resource's current version and state (writes show at once)."""
        found = self._resources.get(resource)
        if found is None:
            raise ResourceNotFound(resource)
        return found.version, found.data

    def __contains__(self, resource: object) -> bool:
        return resource in self._resources

    def resources(self) -> Iterator[str]:
        return iter(self._resources)

    def snapshot(self) -> dict[str, tuple[int, Any]]:
        """Every resource's offset and state: what a shared log restarts from."""
        return {r.id: (r.version.offset, r.data) for r in self._resources.values()}

    def followers_of(self, resource: str) -> int:
        found = self._resources.get(resource)
        return 0 if found is None else len(found.followers)

    def statistics(self) -> BoardStatistics:
        return BoardStatistics(
            followers=len(self._followers),
            resources=len(self._resources),
            changes=self._changes,
            published=self._published,
            coalesced=self._coalesced,
            delivered=self._delivered,
            resyncs=self._resyncs,
            dropped=self._dropped,
        )

    # -- writes --------------------------------------------------------------------------

    def create(
        self, resource: str, data: Any, now: float, version: Version | None = None
    ) -> Version:
        """``version``: the one a shared backplane assigned (this board's epoch, past its
        position); without it the board counts its own."""
        if resource in self._resources or resource in self._deleted:
            raise ResourceExists(resource)
        if len(self._resources) >= self.settings.max_resources:
            raise BoardFull(
                f"the board holds {len(self._resources)} resources, its limit", "resources"
            )
        version = self._next_version(version)
        self._resources[resource] = _Resource(
            resource, data, version, deque(maxlen=self.settings.history)
        )
        self._queue_change(Event(resource, Kind.UPDATE, version, data), now)
        return version

    def update(
        self, resource: str, data: Any, now: float, version: Version | None = None
    ) -> Version:
        found = self._resources.get(resource)
        if found is None:
            raise ResourceNotFound(resource)
        version = self._next_version(version)
        found.data, found.version = data, version
        self._queue_change(Event(resource, Kind.UPDATE, version, data), now)
        return version

    def delete(self, resource: str, now: float, version: Version | None = None) -> Version:
        """Remove the resource now; its followers get the delete with the next batch."""
        found = self._resources.get(resource)
        if found is None:
            raise ResourceNotFound(resource)
        version = self._next_version(version)
        found.version, found.data = version, None
        del self._resources[resource]
        # Whoever follows it still needs the delete: keep the record until the flush.
        self._deleted[resource] = found
        self._queue_change(Event(resource, Kind.DELETE, version), now)
        return version

    def _next_version(self, given: Version | None = None) -> Version:
        if given is None:
            self._offset += 1
        elif given.epoch != self.epoch or given.offset <= self._offset:
            # Applied out of order, a position would skip a change: refuse, change nothing.
            raise ValueError(f"version {given} does not follow {self.position}")
        else:
            self._offset = given.offset
        self._changes += 1
        return Version(self.epoch, self._offset)

    def reconcile(
        self, epoch: int, offset: int, state: Mapping[str, tuple[int, Any]], now: float
    ) -> None:
        """Make this board equal ``state`` (resource -> (offset, data)), the shared state at
        ``Version(epoch, offset)``: what a replica does when it missed changes (or the
        shared log started over under a new epoch). Flush first: the pending batch must not
        mix with what this queues.

        Every resource that differs (every resource, when the epoch changed) gets one event
        at ``Version(epoch, offset)``: an update with the shared state, or a delete. What a
        history held before that position cannot say what this board missed, so a follower
        joining behind it gets a ``resync``, never a gap."""
        if self._pending:
            raise RuntimeError("flush the pending batch before reconciling")
        new_epoch = epoch != self.epoch
        self.epoch, self._offset = epoch, offset
        version = Version(epoch, offset)
        touched: list[_Resource] = []
        for resource_id in [r for r in self._resources if r not in state]:
            found = self._resources.pop(resource_id)
            found.version, found.data = version, None
            self._deleted[resource_id] = found
            self._changes += 1
            self._queue_change(Event(resource_id, Kind.DELETE, version), now)
            touched.append(found)
        for resource_id, (at, data) in state.items():
            known = self._resources.get(resource_id)
            if known is not None and not new_epoch and known.version.offset == at:
                continue
            if known is None:
                known = self._resources[resource_id] = _Resource(
                    resource_id, data, version, deque(maxlen=self.settings.history)
                )
            found = known
            found.data, found.version = data, version
            self._changes += 1
            self._queue_change(Event(resource_id, Kind.UPDATE, version, data), now)
            touched.append(found)
        for found in touched if not new_epoch else self._all_records():
            if new_epoch:  # another epoch's offsets say nothing about this one's
                found.history.clear()
            found.evicted = max(found.evicted if not new_epoch else _NEVER, offset - 1)

    def _all_records(self) -> list[_Resource]:
        return [*self._resources.values(), *self._deleted.values()]

    def _queue_change(self, event: Event, now: float) -> None:
        pending = self._pending.get(event.resource)
        if self._batch_started is None:
            self._batch_started = now
        if pending is None:
            self._pending[event.resource] = [event]
            self._pending_count += 1
        elif event.kind is Kind.DELETE or not self.settings.keep_all:
            self._coalesced += len(pending)
            self._pending_count += 1 - len(pending)
            pending[:] = [event]
        else:
            pending.append(event)
            self._pending_count += 1

    # -- batches -------------------------------------------------------------------------

    def deadline(self) -> float | None:
        """When the pending batch is due (None: nothing pending). A full batch is due at
        once: its deadline is when it started."""
        started = self._batch_started
        if started is None:
            return None
        if self._pending_count >= self.settings.max_batch:
            return started
        return started + self.settings.window

    def flush(self) -> list[int]:
        """Publish the pending batch: append to histories, queue for followers. Returns the
        followers that now have events to take."""
        pending, self._pending = self._pending, {}
        self._pending_count, self._batch_started = 0, None
        woken: dict[int, None] = {}
        keep_all = self.settings.keep_all
        for resource_id, events in pending.items():
            resource = self._resources.get(resource_id) or self._deleted.pop(resource_id)
            for event in events:
                self._published += 1
                if len(resource.history) == resource.history.maxlen:
                    resource.evicted = resource.history[0].version.offset
                resource.history.append(event)
                for follower_id in resource.followers:
                    follower = self._followers[follower_id]
                    if event.version.offset <= follower.after:
                        continue  # it joined at a position past this event: it has it
                    self._push(follower, event, keep_all)
                    woken[follower_id] = None
            if events[-1].kind is Kind.DELETE:
                for follower_id in resource.followers:
                    self._followers[follower_id].resources.discard(resource_id)
                resource.followers.clear()
        return list(woken)

    def _push(self, follower: _Follower, event: Event, keep_all: bool) -> None:
        queued = follower.queue.pop(event.resource, None)
        if queued is None:
            follower.queue[event.resource] = [event]
            follower.size += 1
        elif keep_all and event.kind is not Kind.DELETE:
            queued.append(event)
            follower.queue[event.resource] = queued  # moved last: most recently touched
            follower.size += 1
        else:  # the newest event supersedes what this follower has not taken yet
            follower.size += 1 - len(queued)
            follower.queue[event.resource] = [event]
        # Whatever grew the queue (another resource's first event too), it stays bounded.
        if keep_all and follower.size > self.settings.max_queue:
            self._collapse(follower)

    def _collapse(self, follower: _Follower) -> None:
        """A slow follower on a keep_all board: one resync per resource, at its latest."""
        for resource_id, events in follower.queue.items():
            last = events[-1]
            if last.kind is not Kind.DELETE and len(events) > 1:
                events[:] = [Event(resource_id, Kind.RESYNC, last.version, last.data)]
        follower.size = len(follower.queue)

    # -- followers -----------------------------------------------------------------------

    def join(self, resources: Iterable[str], since: Version | None = None) -> int:
        """Start following ``resources`` (each must exist); returns the follower's id.

        Without ``since`` the follower first gets each resource's last published state (if
        it has been published yet). With ``since`` it gets every published event after it,
        or a ``resync`` where the history does not reach back that far. Raises BoardFull past
        a limit, ResourceNotFound for an unknown resource; either way nothing changes."""
        wanted = list(dict.fromkeys(resources))
        found = []
        for resource_id in wanted:
            resource = self._resources.get(resource_id)
            if resource is None:
                raise ResourceNotFound(resource_id)
            found.append(resource)
        if len(self._followers) >= self.settings.max_followers:
            raise BoardFull(f"the board has {len(self._followers)} followers, its limit", "board")
        for resource in found:
            if len(resource.followers) >= self.settings.max_per_resource:
                raise BoardFull(
                    f"resource {resource.id!r} has {len(resource.followers)} followers, its limit",
                    "resource",
                )
        follower_id = next(self._ids)
        follower = self._followers[follower_id] = _Follower(set(wanted))
        foreign = since is not None and (since.epoch != self.epoch or since.offset > self._offset)
        if since is not None and not foreign:
            follower.after = since.offset
        for resource in found:
            resource.followers.add(follower_id)
            if not resource.history:
                continue  # not published yet: its first event is in the pending batch
            last = resource.history[-1]
            if since is None:
                follower.queue[resource.id] = [last]
            elif foreign or resource.evicted > since.offset:
                follower.queue[resource.id] = [
                    Event(resource.id, Kind.RESYNC, last.version, last.data)
                ]
            else:
                missed = [e for e in resource.history if e.version.offset > since.offset]
                if not missed:
                    continue
                follower.queue[resource.id] = missed
            follower.size += len(follower.queue[resource.id])
        if follower.size > self.settings.max_queue:
            self._collapse(follower)
        return follower_id

    def ended(self, follower_id: int) -> bool:
        """Whether the follower follows nothing any more (its resources were deleted, or
        :meth:`end_followers` ended it): its next :meth:`take` is closed."""
        return not self._followers[follower_id].resources

    def end_followers(self) -> list[int]:
        """End every follower now: each one's next :meth:`take` hands it what was waiting
        and is closed. A reconnect at its last position resumes with nothing missed (what
        was still in the pending batch is in the history by then). Returns the followers
        to wake."""
        for follower in self._followers.values():
            follower.resources.clear()
        for resource in (*self._resources.values(), *self._deleted.values()):
            resource.followers.clear()
        return list(self._followers)

    def reconfigure(self, settings: BoardSettings) -> None:
        """New settings for this board: batching, queues and limits apply from the next
        change or join (followers beyond a lowered limit stay); each resource's history
        takes the new length at once, a shortened one counting what it drops as evicted,
        so a follower behind it gets a ``resync``, never a gap."""
        self.settings = settings
        for resource in (*self._resources.values(), *self._deleted.values()):
            history = resource.history
            if history.maxlen == settings.history:
                continue
            while len(history) > settings.history:
                resource.evicted = history.popleft().version.offset
            resource.history = deque(history, maxlen=settings.history)

    def pending_for(self, follower_id: int) -> bool:
        """Whether the follower has events waiting (a long-poll answers at once if so)."""
        return self._followers[follower_id].size > 0

    def take(self, follower_id: int) -> Taken:
        """Hand the follower everything waiting for it, oldest version first."""
        follower = self._followers[follower_id]
        queue, follower.queue, follower.size = follower.queue, {}, 0
        if len(queue) == 1:  # one resource (the usual follower): its events are in order
            events = next(iter(queue.values()))
        else:
            events = sorted(itertools.chain.from_iterable(queue.values()), key=_offset)
        self._delivered += len(events)
        self._resyncs += sum(1 for e in events if e.kind is Kind.RESYNC)
        return Taken(tuple(events), not follower.resources)

    def leave(self, follower_id: int, *, dropped: bool = False) -> None:
        """Stop following (``dropped``: because a send to it failed). Idempotent."""
        follower = self._followers.pop(follower_id, None)
        if follower is None:
            return
        if dropped:
            self._dropped += 1
        for resource_id in follower.resources:
            resource = self._resources.get(resource_id) or self._deleted.get(resource_id)
            if resource is not None:
                resource.followers.discard(follower_id)


def _offset(event: Event) -> int:
    return event.version.offset
