"""The push board's Redis backplane: every process serving the same boards on one Redis
(and key prefix) hears every write, with the same versions, in the same order.

Per board, under ``{prefix}:board:{name}:``:

- ``meta``, a hash: the board's shared ``epoch`` and ``offset`` (its last version);
- ``state``, a hash: each resource's ``[offset, state]`` (JSON), what a process starting
  late, or one that fell behind, loads;
- ``log``, a Stream: every change (epoch, offset, op, resource, state), trimmed to about
  ``log_length`` entries.

**A write** is one Lua script, atomic against every other process's: it checks the change
against the shared state (create of an id in use, update or delete of a missing one, the
board's ``max_resources``), counts the board's offset up, stores the state and appends the
change to the log. Redis is thus the one authority on versions. The writer then waits until
its own reader has applied the change (in log order, after every earlier one), so a read on
the same process after the write sees it, and answers with the version.

**Each process reads** every board's log from where it stands (one blocking ``XREAD`` for
all boards) and applies each change at its version. A Stream rather than pub/sub: a reader
that lost its connection for a moment goes on from its last entry instead of missing what
was said meanwhile, and the offsets show a gap (a log trimmed past it, Redis restarted),
after which the process reloads the board's state and reconciles to it
(:meth:`Boards.reconcile`): every resource that differs gets one event, and a follower
behind that point gets a ``resync``, never a gap. Because every process applies the same
changes at the same versions, a follower's ``Last-Event-ID`` is a position on every
process: a reconnect to another one gets exactly what it missed, within that process's
history.

**Redis away**: a write fails at once with :class:`BoardUnavailable` (HTTP 503); reads and
followers go on from each process's copy, and the reader retries. If Redis comes back
without its data (no persistence), the first process to reconnect writes its own copy of
each board back under a new epoch (so positions from before are recognised as foreign), and
every process reconciles to it: followers stay connected and get one event per resource. A
write acknowledged just before Redis lost it may be missing from that copy; a Redis with
persistence loses nothing (docs/design.md, "Push boards").
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Final

import trio

# The board's types: the one place this module says where the board lives.
from ..board import (
    BoardFull,
    Boards,
    BoardUnavailable,
    Change,
    ResourceExists,
    ResourceNotFound,
    Version,
    new_epoch,
)
from ._client import Client
from ._scripts import Script, load
from ._wire import (
    UNREACHABLE,
    Arg,
    Connection,
    ConnectionLost,
    ReplyError,
    public_url,
    redis_outage,
)

__all__ = ["RedisBackplane"]

_log = logging.getLogger("pipework.boards")

_WRITE: Final = load("board_write")
_LOAD: Final = load("board_load")
_SEED: Final = load("board_seed")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisBackplane:
    """The boards' writes shared through Redis at ``url`` under ``prefix`` (see the
    module). ``io_timeout``: how long a write waits for Redis, and then for its own
    reader, before it fails (:class:`BoardUnavailable`); ``block``: how long one read
    waits for changes; ``log_length``: about how many changes each board's log keeps for
    readers that fell behind."""

    shared = True

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "pipework",
        io_timeout: float = 5.0,
        block: float = 1.0,
        log_length: int = 10_000,
    ) -> None:
        if ":" in prefix:
            raise ValueError(f"a key prefix may not contain ':', got {prefix!r}")
        self.url = url
        self.prefix = prefix
        self.io_timeout = io_timeout
        self.block = block
        self.log_length = log_length
        self._boards: Boards | None = None
        #: The writes' connection (and the loads'), while :meth:`run` runs.
        self._client: Client | None = None
        #: The reader's connection, for its blocking reads.
        self._reader: Connection | None = None
        #: Per shared board: the last log entry applied here (absent: not loaded yet).
        self._read_from: dict[str, str] = {}
        #: Boards whose log showed a gap: reloaded and reconciled before reading on.
        self._stale: set[str] = set()
        self._progress = trio.Event()  # set (and replaced) whenever the reader moved on
        #: Why the reader's last round trip failed (None: it is connected).
        self._failure: str | None = None

    def connect(self, boards: Boards) -> None:
        self._boards = boards

    def _keys(self, board: str) -> list[str]:
        base = f"{self.prefix}:board:{board}:"
        return [base + "meta", base + "state", base + "log"]

    def _shared_boards(self) -> list[str]:
        assert self._boards is not None, "the backplane is not connected to its boards"
        return [name for name, spec in self._boards.specs.items() if not spec.local]

    # -- writes --------------------------------------------------------------------------

    async def publish(self, change: Change) -> Version:
        assert self._boards is not None, "the backplane is not connected to its boards"
        core = self._boards.cores[change.board]
        settings = core.settings
        data = "null" if change.data is None else json.dumps(change.data, separators=(",", ":"))
        args = [change.op, change.resource, data, settings.max_resources, self.log_length]
        if self._failure is not None:  # fail at once while Redis is known to be away
            raise BoardUnavailable(
                f"the board backplane at {public_url(self.url)} cannot be reached ({self._failure})"
            )
        with trio.move_on_after(self.io_timeout) as waited:
            await self._until(lambda: change.board in self._read_from)
        if waited.cancelled_caught:
            raise BoardUnavailable(
                f"the board backplane at {public_url(self.url)} is not connected yet "
                f"(board {change.board!r})"
            )
        reply = await self._script(_WRITE, self._keys(change.board), args)
        status = _text(reply[0])
        if status == "exists":
            raise ResourceExists(change.resource)
        if status == "missing":
            raise ResourceNotFound(change.resource)
        if status == "full":
            raise BoardFull(f"the board holds {_text(reply[1])} resources, its limit", "resources")
        if status == "unseeded":
            raise BoardUnavailable(
                f"board {change.board!r} is being restored on {public_url(self.url)}"
            )
        version = Version(int(_text(reply[1])), int(_text(reply[2])))
        # Answered once applied here (in log order): a read after it sees it. If the reader
        # cannot get there in time, the write still stands.
        with trio.move_on_after(self.io_timeout):
            await self._until(lambda: self._applied(change.board, version))
        return version

    def _applied(self, board: str, version: Version) -> bool:
        assert self._boards is not None
        core = self._boards.cores.get(board)
        if core is None:  # removed by a reload meanwhile
            return True
        position = core.position
        return position.epoch != version.epoch or position.offset >= version.offset

    async def _until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self._progress.wait()

    def _moved(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def _script(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        """One script, shielded and bounded: a write the caller was cancelled during has
        happened or not, never "perhaps", and the connection is not left mid-answer."""
        client = self._client
        if client is None:
            raise BoardUnavailable(f"the board backplane at {public_url(self.url)} is not running")
        with trio.move_on_after(self.io_timeout, shield=True):
            try:
                return await client.script(script, keys, args)
            except UNREACHABLE as exc:
                raise self._unavailable(exc) from exc
        raise BoardUnavailable(
            f"the board backplane at {public_url(self.url)} did not answer within "
            f"{self.io_timeout:g}s"
        )

    def _unavailable(self, exc: BaseException) -> BoardUnavailable:
        return BoardUnavailable(
            f"the board backplane at {public_url(self.url)} cannot be reached ({exc})"
        )

    # -- reading -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read every shared board's log until cancelled; reports started at once (writes
        wait for their board to be loaded, or fail after ``io_timeout``)."""
        # A write is sent once: if its answer is lost, it may have happened (no retries).
        self._client = Client(self.url, timeout=self.io_timeout)
        task_status.started()
        try:
            await self._read_loop()
        finally:
            client, self._client = self._client, None
            reader, self._reader = self._reader, None
            self._read_from.clear()
            with trio.CancelScope(shield=True):
                await client.aclose()
                if reader is not None:
                    await reader.aclose()

    async def _read_loop(self) -> None:
        delay = 0.05
        while True:
            try:
                await self._load_boards()
                self._failure = None
                await self._read()
                delay = 0.05
            except (*UNREACHABLE, BoardUnavailable) as exc:
                out = redis_outage(self.url).failed(exc, "board backplane reads")
                _log.log(
                    logging.DEBUG if out else logging.WARNING,  # the outage's own line says it
                    "pipework: the board backplane at %s failed (%s); retrying in %gs",
                    public_url(self.url),
                    exc,
                    delay,
                )
                # Whatever Redis holds when it is back is loaded again: it may have restarted.
                self._failure = str(exc) or type(exc).__name__
                self._read_from.clear()
                self._moved()
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)
            except Exception:
                # Anything else (an entry this version cannot read, a key of the wrong
                # type): the boards are loaded afresh rather than the flush task ended.
                _log.exception("pipework: the board backplane's reader failed; reloading")
                self._read_from.clear()
                self._moved()
                await trio.sleep(1.0)

    async def _load_boards(self) -> None:
        shared = self._shared_boards()
        for board in [b for b in self._read_from if b not in shared]:
            del self._read_from[board]  # removed by a reload
        for board in shared:
            if board not in self._read_from or board in self._stale:
                await self._load(board)
                self._moved()

    async def _load(self, board: str) -> None:
        assert self._boards is not None
        keys = self._keys(board)
        reply = await self._script(_LOAD, keys, [])
        if reply is None:
            core = self._boards.cores[board]
            pairs: list[Any] = []
            for resource, (offset, data) in core.snapshot().items():
                pairs += [resource, json.dumps([offset, data], separators=(",", ":"))]
            epoch = new_epoch()
            if await self._script(_SEED, keys[:2], [epoch, core.position.offset, *pairs]):
                _log.warning(
                    "pipework: board %r had no shared state on %s: wrote this process's "
                    "copy (%d resources) under epoch %d",
                    board,
                    public_url(self.url),
                    len(pairs) // 2,
                    epoch,
                )
            reply = await self._script(_LOAD, keys, [])
            if reply is None:
                raise BoardUnavailable(f"board {board!r} vanished while it was loaded")
        epoch, offset = int(_text(reply[0])), int(_text(reply[1]))
        raw = reply[3]
        state: dict[str, tuple[int, Any]] = {}
        for i in range(0, len(raw), 2):
            at, data = json.loads(raw[i + 1])
            state[_text(raw[i])] = (int(at), data)
        here = self._boards.cores.get(board)
        if here is None:  # removed by a reload meanwhile
            return
        position = here.position
        if board in self._stale or position.epoch != epoch or position.offset != offset:
            self._boards.reconcile(board, epoch, offset, state)
        self._stale.discard(board)
        self._read_from[board] = _text(reply[2])

    async def _read(self) -> None:
        names = {self._keys(b)[2]: b for b in self._read_from}
        if not names:
            await trio.sleep(self.block)
            return
        streams = list(names)
        command: list[Arg] = ["XREAD", "COUNT", 1000, "BLOCK", int(self.block * 1000), "STREAMS"]
        command += streams
        command += [self._read_from[names[key]] for key in streams]
        reply = await self._blocking_read(command)
        if isinstance(reply, ReplyError):
            raise reply
        for key, entries in reply or ():
            board = names[key.decode()]
            for identifier, fields in entries:
                if board in self._stale or board not in self._read_from:
                    break
                self._receive(board, dict(zip(fields[::2], fields[1::2], strict=True)))
                self._read_from[board] = identifier.decode()
        self._moved()

    async def _blocking_read(self, command: list[Arg]) -> Any:
        """One blocking read on the reader's own connection (so writes never wait behind
        it), bounded: a Redis gone silent is taken for gone."""
        if self._reader is None or self._reader.closed:
            self._reader = None
            with trio.move_on_after(self.io_timeout):
                self._reader = await Connection.open(self.url)
            if self._reader is None:
                raise ConnectionLost(f"no connection within {self.io_timeout:g}s")
        reader = self._reader
        with trio.move_on_after(self.block + self.io_timeout):
            (reply,) = await reader.call([command])
            return reply
        raise ConnectionLost(f"no answer within {self.block + self.io_timeout:g}s")

    def _receive(self, board: str, fields: Any) -> None:
        assert self._boards is not None
        core = self._boards.cores.get(board)
        if core is None:
            return
        values = {_text(k): v for k, v in fields.items()}
        version = Version(int(_text(values["e"])), int(_text(values["v"])))
        position = core.position
        if version.epoch == position.epoch and version.offset <= position.offset:
            return  # in the state this process loaded already
        if version.epoch != position.epoch or version.offset != position.offset + 1:
            _log.warning(
                "pipework: board %r missed changes (at %s, the log goes on at %s): reloading",
                board,
                position,
                version,
            )
            self._stale.add(board)
            return
        op = _text(values["op"])
        data = None if op == "delete" else json.loads(values["d"])
        try:
            self._boards.apply(Change(board, op, _text(values["r"]), data), version)
        except (ResourceExists, ResourceNotFound, BoardFull, ValueError) as exc:
            _log.warning("pipework: board %r disagrees with its log (%r): reloading", board, exc)
            self._stale.add(board)
