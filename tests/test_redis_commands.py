"""The Redis store's script commands, built as bytes in one format each, are exactly the
RESP arrays of their arguments (no server needed: the bytes are parsed back)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio

from pipework import Status
from pipework.dispatcher._job import Job
from pipework.redis import RedisJobStore
from pipework.redis._store_scripts import _SHAS
from pipework.redis._wire import _parse


def _args(command: bytes) -> list[bytes]:
    parsed, end = _parse(command, 0)
    assert end == len(command)
    return list(parsed)


def _job(status: Status, token: str | None) -> Job:
    job = Job.accepted(
        "jABC_123", "c", {"n": 1}, "corr", math.inf, token, None, 1, 5.0, False, 1.7e9
    )
    job.status = status
    job.version = 7
    return job


class _Sent(RedisJobStore):
    """The commands the store would send, answered with ``answer``."""

    def __init__(self, answer: Any) -> None:
        super().__init__("redis://localhost:1/0", prefix="pfx")
        self._offset = 0.0
        self.answer = answer
        self.sent: list[bytes] = []

    async def _call(self, call: Any) -> Any:
        self.sent.extend(call.commands)
        if call.read is not None:
            call.read(self.answer)
        return self.answer


_ENTRY = ("pfx:events", b"e", b"\x92\xa3run\xa8jABC_123")


@pytest.mark.parametrize("owner", [None, "team:alice"])
@pytest.mark.parametrize("entry", [None, _ENTRY])
async def test_create_command_is_its_arguments(
    entry: tuple[str, bytes, bytes] | None, owner: str | None
) -> None:
    store = _Sent(1)
    job = _job(Status.QUEUED, None)
    job.owner = owner
    await store.create(job, entry=entry)
    args = _args(store.sent[0])
    keys = [b"pfx:job:jABC_123", b"pfx:active"] + ([b"pfx:events"] if entry else [])
    assert args[:3] == [b"EVALSHA", _SHAS["create"].encode(), b"%d" % len(keys)]
    assert args[3 : 3 + len(keys)] == keys
    rest = args[3 + len(keys) :]
    assert rest[0] == store._encode(job)
    assert rest[1:5] == [b"queued", b"7", b"jABC_123", store._origin.encode()]
    indexed = [owner.encode(), repr(job.created_at).encode()] if owner else [b"", b""]
    assert rest[5:7] == indexed
    assert rest[7:] == ([b"e", _ENTRY[2]] if entry else [])


async def test_create_command_claiming_its_event_is_its_arguments() -> None:
    store = _Sent([b"1-0", [[b"1-0", [b"e", _ENTRY[2]]]]])
    job = _job(Status.QUEUED, None)
    told: list[Any] = []
    await store.create(job, entry=_ENTRY, claim=(b"$1\r\ng\r\n$4\r\nme-1\r\n", 4, told.append))
    args = _args(store.sent[0])
    assert args[:3] == [b"EVALSHA", _SHAS["create"].encode(), b"3"]
    assert args[3:6] == [b"pfx:job:jABC_123", b"pfx:active", b"pfx:events"]
    rest = args[6:]
    assert rest[0] == store._encode(job)
    assert rest[1:5] == [b"queued", b"7", b"jABC_123", store._origin.encode()]
    assert rest[5:7] == [b"", b""]  # no owner
    assert rest[7:] == [b"e", _ENTRY[2], b"g", b"me-1", b"4", repr(job.updated_at).encode()]
    assert told == [store.answer]  # the reply, for the queue to take its read


@pytest.mark.parametrize("entry", [None, _ENTRY])
@pytest.mark.parametrize("status", [Status.QUEUED, Status.DONE])
@pytest.mark.parametrize("token", [None, "f" * 64])
@pytest.mark.parametrize("expected", ["", "6"])
async def test_update_command_is_its_arguments(
    entry: tuple[str, bytes, bytes] | None, status: Status, token: str | None, expected: str
) -> None:
    store = _Sent(8)
    job = _job(status, token)
    command, blob = store._update_command(job, expected, entry)
    args = _args(command)
    keys = [b"pfx:job:jABC_123", b"pfx:finished", b"pfx:gone"]
    keys += [b"pfx:events"] if entry else []
    assert args[:3] == [b"EVALSHA", _SHAS["update"].encode(), b"%d" % len(keys)]
    assert args[3 : 3 + len(keys)] == keys
    rest = args[3 + len(keys) :]
    terminal = status is Status.DONE
    retain = repr(job.retain_until).encode() if terminal else repr(0.0).encode()
    assert rest[:6] == [
        blob,
        status.value.encode(),
        b"jABC_123",
        b"1" if terminal else b"0",
        retain,
        b"" if token is None else token.encode(),
    ]
    # The prefix, the record's life in ms, retention (seconds, count), the origin, then
    # how long and how many dropped ids are remembered (a week, 100,000).
    tail = [b"pfx", b"%d" % ((3600 + 60) * 1000), b"3600.0", b"10000", store._origin.encode()]
    assert rest[6:13] == [*tail, b"%r" % float(7 * 86400), b"100000"]
    assert rest[13:] == [expected.encode()] + ([b"e", _ENTRY[2]] if entry else [])


async def test_update_tail_follows_its_settings() -> None:
    store = _Sent(8)
    job = _job(Status.QUEUED, None)
    before = _args(store._update_command(job, "", None)[0])
    store.retain_count = 5
    after = _args(store._update_command(job, "", None)[0])
    assert before[15] == b"10000"
    assert after[15] == b"5"


async def test_status_command_is_its_arguments() -> None:
    store = _Sent(8)
    job = _job(Status.RUNNING, None)
    job.updated_at = trio.current_time() + 0.125
    assert await store.update_status(job)
    assert job.version == 8
    assert _args(store.sent[0]) == [
        b"EVALSHA",
        _SHAS["status"].encode(),
        b"1",
        b"pfx:job:jABC_123",
        b"running",
        repr(job.updated_at).encode(),
        b"jABC_123",
        b"pfx",
        b"7",
    ]
