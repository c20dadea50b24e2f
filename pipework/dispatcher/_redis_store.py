"""The job pool on Redis: the same contract as :class:`~pipework.MemoryJobStore`, shared by
every process that points at the same server and prefix.

Layout under ``prefix`` (one logical Redis, not Redis Cluster: the scripts name keys they
build themselves):

- ``{p}:job:{id}`` a hash: ``d`` the record as msgpack (:meth:`Job.to_wire`), ``s`` its
  status, ``v`` its version. The version lives outside the blob so a script can compare and
  bump it without decoding the record.
- ``{p}:st:{status}`` a set of the ids of active jobs in that status (``list`` by status).
- ``{p}:finished`` a sorted set of finished ids scored by when they go (``retain_until``).
- ``{p}:gone:{id}`` a tombstone (the owner-token hash, "" for none) written when the job
  finishes and kept ``tombstone_seconds``: once the record is dropped, ``get`` raises
  :class:`JobGone` rather than :class:`JobNotFound`.

Every write is one Lua script, so it is atomic against every other process: a create never
overwrites, an update of a finished job never brings it back (a second terminal write
changes nothing; a non-terminal one is refused as for the memory store), and finishing a job
moves it between the indexes, writes its tombstone and drops the oldest finished records
beyond ``retain_count`` in the same step. Read-modify-write sequences that span several
commands (a join's record when two branches end at once) take :meth:`lock`.

**Time.** The engine's deadlines are absolute trio times, and each process's trio clock has
its own origin. A record carries its writer's offset from the wall clock (measured once, when
the store is first used), and a reader in another process moves every absolute time from the
writer's trio clock to its own: within one process times come back exactly as written (so
virtual time in tests holds), and between processes deadlines agree as far as their wall
clocks do. Retention is counted on
the trio clock too: ``get`` and ``list`` drop a finished record whose ``retain_until`` has
passed (lazily, as the memory store does), and the record's Redis TTL — ``retain_seconds``
plus a minute of slack, on the wall clock — is only a safety net for records nobody reads
again.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, Final

import coredis
import coredis.exceptions
import msgpack
import trio

from .._errors import JobGone, JobNotFound, StoreUnavailable
from ._job import Job
from ._status import ACTIVE, TERMINAL, Status

__all__ = ["RedisJobStore", "StoreUnavailable"]

_log = logging.getLogger("pipework.dispatcher")

#: The wall-clock TTL a finished record gets beyond its retention: a safety net only.
_SLACK_SECONDS: Final = 60.0

_TERMINAL_VALUES: Final = ",".join(sorted(s.value for s in TERMINAL))

_CREATE: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', ARGV[2], 'v', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""

# KEYS: job, finished, gone. ARGV: blob, status, id, prefix, terminal (0/1), retain_until,
# record ttl ms, tombstone ttl ms, token hash, retain count, the version the record must
# still have ("" for any).
_UPDATE: Final = (
    """
local terminal = {}
for s in string.gmatch('"""
    + _TERMINAL_VALUES
    + """', '[^,]+') do terminal[s] = true end
local cur = redis.call('HMGET', KEYS[1], 's', 'v')
if not cur[1] then return {-1, 0} end
if terminal[cur[1]] then
  if ARGV[5] == '1' then return {0, tonumber(cur[2])} end
  return {-2, 0}
end
if ARGV[11] ~= '' and tonumber(cur[2]) ~= tonumber(ARGV[11]) then
  return {-3, tonumber(cur[2])}
end
local v = tonumber(cur[2]) + 1
local p = ARGV[4]
redis.call('SREM', p .. ':st:' .. cur[1], ARGV[3])
redis.call('HSET', KEYS[1], 'd', ARGV[1], 's', ARGV[2], 'v', v)
if ARGV[5] == '1' then
  redis.call('PEXPIRE', KEYS[1], ARGV[7])
  redis.call('ZADD', KEYS[2], ARGV[6], ARGV[3])
  redis.call('SET', KEYS[3], ARGV[9], 'PX', ARGV[8])
  redis.call('PUBLISH', p .. ':finished', ARGV[3])
  local extra = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[10])
  if extra > 0 then
    local old = redis.call('ZPOPMIN', KEYS[2], extra)
    for i = 1, #old, 2 do redis.call('DEL', p .. ':job:' .. old[i]) end
  end
else
  redis.call('SADD', p .. ':st:' .. ARGV[2], ARGV[3])
end
return {1, v}
"""
)

# KEYS: job, gone.
_GET: Final = """
local r = redis.call('HMGET', KEYS[1], 'd', 'v')
if r[1] then return {r[1], r[2]} end
local g = redis.call('GET', KEYS[2])
if g then return {false, false, g} end
return {}
"""

# KEYS: job, finished. ARGV: id, prefix. Drops a record whatever its status.
_DELETE: Final = """
local s = redis.call('HGET', KEYS[1], 's')
if s then redis.call('SREM', ARGV[2] .. ':st:' .. s, ARGV[1]) end
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
"""

# KEYS: finished. ARGV: now (wall), prefix. Drops finished records past their time.
_EXPIRE: Final = """
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
for _, id in ipairs(old) do redis.call('DEL', ARGV[2] .. ':job:' .. id) end
if #old > 0 then redis.call('ZREM', KEYS[1], unpack(old)) end
return #old
"""

# KEYS: status sets, then (optionally) the finished sorted set. ARGV: prefix.
_LIST: Final = """
local out = {}
for _, key in ipairs(KEYS) do
  local ids
  if redis.call('TYPE', key).ok == 'zset' then ids = redis.call('ZRANGE', key, 0, -1)
  else ids = redis.call('SMEMBERS', key) end
  for _, id in ipairs(ids) do
    local r = redis.call('HMGET', ARGV[1] .. ':job:' .. id, 'd', 'v')
    if r[1] then out[#out + 1] = r[1]; out[#out + 1] = r[2] end
  end
end
return out
"""

_RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


_UNREACHABLE: Final = (coredis.exceptions.ConnectionError, OSError)


class _Call:
    """One script call waiting for its round trip; ``lead``: it sends the next batch."""

    __slots__ = ("answered", "args", "done", "error", "keys", "lead", "name", "result", "source")

    def __init__(self, name: str, source: str, keys: list[str], args: list[Any]) -> None:
        self.name = name
        self.source = source
        self.keys = keys
        self.args = args
        self.done = trio.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.answered = False
        self.lead = False


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _copy(exc: Exception) -> Exception:
    """The batch's error, an object of its own for each caller that raises it."""
    if isinstance(exc, StoreUnavailable):
        copy = StoreUnavailable(str(exc))
        copy.__cause__ = exc.__cause__
        return copy
    return exc


class RedisJobStore:
    """Job records on Redis. ``url`` is where (``redis://host:port/db``); ``client`` an
    already opened :class:`coredis.Redis` to share instead. ``prefix`` keeps several
    deployments (or tests) apart on one server. Retention as for the memory store;
    ``tombstone_seconds`` is how long a dropped id still answers "gone".

    Use it as an async context manager (an :class:`~pipework.Engine` given it does so): it
    opens its client on entry and closes it on the last exit.
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        *,
        client: coredis.Redis[bytes] | None = None,
        prefix: str = "pipework",
        retain_seconds: float = 3600.0,
        retain_count: int = 10_000,
        tombstone_seconds: float = 7 * 86400.0,
        lock_seconds: float = 10.0,
        io_timeout: float = 10.0,
    ) -> None:
        if retain_seconds <= 0 or retain_count < 1:
            raise ValueError("retain_seconds must be positive and retain_count at least 1")
        if ":" in prefix or not prefix:
            raise ValueError(f"the Redis key prefix must be non-empty without ':', got {prefix!r}")
        self.url = url
        self.prefix = prefix
        self.retain_seconds = retain_seconds
        self.retain_count = retain_count
        self.tombstone_seconds = tombstone_seconds
        self.lock_seconds = lock_seconds
        self.io_timeout = io_timeout
        self._own = client is None
        self._client: coredis.Redis[bytes] | None = client
        self._entered = 0
        self._offset: float | None = None
        self._locks: dict[str, tuple[trio.Lock, int]] = {}
        self._scripts: dict[str, Any] = {}
        self._calls: list[_Call] = []  # waiting for the next round trip
        self._sending = False  # a round trip is on its way

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> RedisJobStore:
        if self._own and self._entered == 0:
            client: coredis.Redis[bytes] = coredis.Redis.from_url(self.url)
            await client.__aenter__()
            self._client = client
        self._entered += 1
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered -= 1
        if self._own and self._entered == 0 and self._client is not None:
            client, self._client, self._scripts = self._client, None, {}
            # The caller's exception is not the client's: it must not come back wrapped in a
            # group from the client's own task group.
            await client.__aexit__(None, None, None)

    @asynccontextmanager
    async def _redis(self) -> AsyncIterator[coredis.Redis[bytes]]:
        """The open client; outside ``async with`` (a caller reading after its engine
        stopped), a client for this call only."""
        try:
            if self._client is not None:
                yield self._client
                return
            async with self:
                assert self._client is not None
                yield self._client
        except _UNREACHABLE as exc:
            raise self._unavailable(exc) from exc
        except BaseExceptionGroup as group:  # the client's task group reports it so
            unreachable, rest = group.split(_UNREACHABLE)
            if unreachable is None or rest is not None:
                raise
            raise self._unavailable(unreachable.exceptions[0]) from group

    def _unavailable(self, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"the job store at {_public(self.url)} cannot be reached ({exc}); retry later"
        )

    async def _run(self, name: str, source: str, keys: list[str], args: list[Any]) -> Any:
        """Run one of the store's scripts. Calls made while a round trip is on its way are
        sent together in the next one (one pipeline): under load a round trip's client
        work, which is most of its cost, is shared by every call it carries."""
        call = _Call(name, source, keys, args)
        self._calls.append(call)
        led = False
        with trio.move_on_after(self.io_timeout, shield=True):
            if self._sending:
                await call.done.wait()  # its answer, or its turn to send the next batch
            else:
                self._sending = call.lead = True
            if call.lead:
                led = True
                await self._send_calls()
            if call.error is not None:
                raise call.error
            return call.result
        if not led:  # its time ran out before its batch went
            if call in self._calls:
                self._calls.remove(call)
            if call.lead:
                self._hand_on()  # it had been handed the turn: the next call takes it
        raise self._no_answer()

    def _no_answer(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"the job store at {_public(self.url)} did not answer within {self.io_timeout:g}s"
        )

    async def _send_calls(self) -> None:
        batch, self._calls = self._calls, []
        try:
            async with self._redis() as r:
                scripts = [self._script(r, call.name, call.source) for call in batch]

                async def send() -> list[Any]:
                    async with r.pipeline(transaction=False, raise_on_error=False) as pipe:
                        requests = [
                            script(keys=call.keys, args=call.args, client=pipe)
                            for script, call in zip(scripts, batch, strict=True)
                        ]
                    answers: list[Any] = []
                    for request in requests:  # answered already: no round trip here
                        try:
                            answers.append(await request)
                        except Exception as exc:  # that script's own error, for its caller
                            answers.append(_Failed(exc))
                    return answers

                answers = await self._wait(send)
            for call, answer in zip(batch, answers, strict=True):
                if isinstance(answer, _Failed):
                    call.error = answer.error
                else:
                    call.result = answer
                call.answered = True
        except Exception as exc:
            for call in batch:
                call.error = _copy(exc)
        finally:
            for call in batch:
                if not call.answered and call.error is None:  # the round trip's time ran out
                    call.error = self._no_answer()
                call.done.set()
            self._hand_on()

    def _hand_on(self) -> None:
        """The batch is sent: the first call that waits sends the next one."""
        if self._calls:
            following = self._calls[0]
            following.lead = True
            following.done.set()
        else:
            self._sending = False

    def _script(self, r: coredis.Redis[bytes], name: str, source: str) -> Any:
        script = self._scripts.get(name)
        if script is None:
            script = self._scripts[name] = r.register_script(source)
        return script

    async def _io(self, request: Callable[[], Awaitable[Any]]) -> Any:
        """Every round trip goes through here. It is shielded from cancellation (bounded by
        ``io_timeout``): a write the caller was cancelled during has happened or not, never
        "perhaps", and the client's connection is never left with an answer nobody reads."""
        with trio.move_on_after(self.io_timeout, shield=True):
            return await self._wait(request)
        raise StoreUnavailable(
            f"the job store at {_public(self.url)} did not answer within {self.io_timeout:g}s"
        )

    async def _wait(self, request: Callable[[], Awaitable[Any]]) -> Any:
        return await request()

    # -- time ----------------------------------------------------------------------------

    def _shift(self) -> float:
        """wall time = trio time + shift (measured once, see the module)."""
        if self._offset is None:
            self._offset = time.time() - trio.current_time()
        return self._offset

    def _encode(self, job: Job) -> bytes:
        wire = job.to_wire()
        wire["clock"] = self._shift()  # the writer's clock, for readers elsewhere
        data: bytes = msgpack.packb(wire, use_bin_type=True)
        return data

    def _decode(self, blob: bytes, version: Any) -> Job:
        wire = msgpack.unpackb(blob, raw=False)
        # Times written by another process move from its trio clock to this one's; this
        # process's own come back exactly as they were written.
        shift = wire.pop("clock") - self._shift()
        if shift:
            for name in ("deadline", "suspend_deadline", "retain_until", "accepted_at"):
                wire[name] = _moved(wire[name], shift)
            wire["frames"] = [[i, _moved(d, shift), b] for i, d, b in wire["frames"]]
            if wire["join"] is not None:
                wire["join"]["deadline"] = _moved(wire["join"]["deadline"], shift)
        wire["version"] = int(version)
        return Job.from_wire(wire)

    # -- the contract --------------------------------------------------------------------

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    async def create(self, job: Job) -> None:
        created = await self._run(
            "create",
            _CREATE,
            [self._key(job.id), f"{self.prefix}:st:{job.status.value}"],
            [self._encode(job), job.status.value, job.version, job.id],
        )
        if not created:
            raise ValueError(f"job {job.id} already exists")

    async def get(self, job_id: str) -> Job:
        reply = await self._run("get", _GET, [self._key(job_id), self._gone(job_id)], [])
        if reply and reply[0] is not None:
            job = self._decode(reply[0], reply[1])
            if job.retain_until is None or job.retain_until > trio.current_time():
                return job
            await self._expire()  # its time has come on the trio clock
            token_hash: str | None = job.token_hash
        elif len(reply) == 3:
            token_hash = reply[2].decode() or None
        else:
            raise JobNotFound(f"no job with id {job_id!r}")
        raise JobGone(
            f"job {job_id} finished and was dropped after its retention time",
            token_hash=token_hash,
        )

    async def update(self, job: Job) -> None:
        await self._update(job, "")

    async def update_unless_changed(self, job: Job) -> bool:
        """``update``, only if nobody wrote the record since ``job`` was read from it (its
        version is still ``job.version``); False if somebody did, and nothing is written.
        For a write made from a record read a while ago, under :meth:`lock`, that a step
        (which writes without the lock) may have moved on meanwhile: a signal kept for
        the job must not bring back the record as it was before the step's write."""
        return await self._update(job, str(job.version))

    async def _update(self, job: Job, expected: str) -> bool:
        terminal = job.status in TERMINAL
        if terminal:
            job.retain_until = trio.current_time() + self.retain_seconds
        code, version = await self._run(
            "update",
            _UPDATE,
            [self._key(job.id), f"{self.prefix}:finished", self._gone(job.id)],
            [
                self._encode(job),
                job.status.value,
                job.id,
                self.prefix,
                "1" if terminal else "0",
                repr(_moved(job.retain_until, self._shift()) if terminal else 0.0),
                int((self.retain_seconds + _SLACK_SECONDS) * 1000),
                int(self.tombstone_seconds * 1000),
                job.token_hash or "",
                self.retain_count,
                expected,
            ],
        )
        if code == -3:
            return False  # written by somebody else since it was read
        if code == 1:
            job.version = int(version)
        elif code == 0:
            job.version = int(version)  # already final: the first end stands
        else:
            raise JobNotFound(f"job {job.id} is not active; it cannot be updated")
        return True

    async def delete(self, job_id: str) -> None:
        await self._run(
            "delete", _DELETE, [self._key(job_id), f"{self.prefix}:finished"], [job_id, self.prefix]
        )

    async def list(self, status: Status | Iterable[Status] | None = None) -> list[Job]:
        if status is None:
            wanted = set(Status)
        elif isinstance(status, Status):
            wanted = {status}
        else:
            wanted = set(status)
        await self._expire()
        keys = [f"{self.prefix}:st:{s.value}" for s in sorted(wanted & ACTIVE)]
        if wanted & TERMINAL:
            keys.append(f"{self.prefix}:finished")
        reply = await self._run("list", _LIST, keys, [self.prefix])
        jobs = [self._decode(reply[i], reply[i + 1]) for i in range(0, len(reply), 2)]
        return [job for job in jobs if job.status in wanted]

    async def _expire(self) -> None:
        now = trio.current_time() + self._shift()
        await self._run("expire", _EXPIRE, [f"{self.prefix}:finished"], [repr(now), self.prefix])

    def _gone(self, job_id: str) -> str:
        return f"{self.prefix}:gone:{job_id}"

    # -- other processes' ends ----------------------------------------------------------

    async def follow_finished(
        self,
        finished: Callable[[str], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Call ``finished(job_id)`` for every job any process finishes (published by the
        update that records the end), until cancelled: whoever waits here for a job that
        another process ran hears of its end. Reconnects while Redis is away."""
        channel = f"{self.prefix}:finished"
        started = False
        while True:
            try:
                async with (
                    self._redis() as r,
                    r.pubsub(channels=[channel], ignore_subscribe_messages=True) as messages,
                ):
                    if not started:
                        started = True
                        task_status.started()
                    async for message in messages:
                        data = message["data"]
                        finished(data.decode() if isinstance(data, bytes) else str(data))
            except StoreUnavailable as exc:
                _log.warning("pipework: following finished jobs: %s", exc)
                if not started:
                    raise
            await trio.sleep(1.0)  # the subscription ended (Redis restarted): subscribe again

    # -- exclusive sections --------------------------------------------------------------

    @asynccontextmanager
    async def lock(self, job_id: str) -> AsyncIterator[None]:
        """Hold the job's record for a read-modify-write across several commands: one
        holder at a time in this process (a trio lock) and across processes (a Redis key
        with a lease of ``lock_seconds``, so a holder that died frees it)."""
        local, users = self._locks.get(job_id, (trio.Lock(), 0))
        self._locks[job_id] = (local, users + 1)
        try:
            async with local:
                token = f"{id(self)}:{trio.current_time()}:{time.time()}"
                key = f"{self.prefix}:lock:{job_id}"
                px = int(self.lock_seconds * 1000)
                async with self._redis() as r:
                    while True:
                        taken = await self._io(
                            lambda: r.set(key, token, condition=coredis.PureToken.NX, px=px)
                        )
                        if taken:
                            break
                        # Another process holds it, and no event can cross processes:
                        # poll briefly (a holder keeps it for one join's bookkeeping).
                        await trio.sleep(0.002)
                try:
                    yield
                finally:
                    with trio.CancelScope(shield=True):
                        await self._run("release", _RELEASE, [key], [token])
        finally:
            local, users = self._locks[job_id]
            if users == 1:
                del self._locks[job_id]
            else:
                self._locks[job_id] = (local, users - 1)


def _moved(value: float | None, shift: float) -> float | None:
    if value is None or math.isinf(value):
        return value
    return value + shift


def _public(url: str) -> str:
    """The URL without its password, for messages."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
