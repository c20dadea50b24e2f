"""A job record as the Redis store keeps it: the msgpack array of its fields (no names, in
:data:`_FIELDS`' order), the writer's clock after them, and how a reader takes it back --
records written by older pipework versions included -- moving its absolute times from the
writer's trio clock to its own (see :mod:`._store`, **Time**).

Separate from the store: it is the record's wire format, which readers of old records
must keep reading, and does no I/O.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any, Final

import msgpack

from ..dispatcher._job import ErrorInfo, Frame, Job, JobRecord, JoinRecord, Progress
from ..dispatcher._status import Status

__all__ = ["decode", "encode", "record_packer"]

#: The fields a record's blob holds, in the order of JobRecord's (so a decoded record is
#: ``Job(*fields, version)``): every stored field but the version, the last (kept in the
#: hash's ``v``). What only the running process holds (Job's own fields) is not stored.
_FIELDS: Final = tuple(f.name for f in dataclasses.fields(JobRecord))[:-1]
if dataclasses.fields(JobRecord)[-1].name != "version":
    raise RuntimeError("JobRecord's last field must be version (see _FIELDS)")
#: The layout of a blob: its last element. A blob written before it had one (its last
#: element the writer's clock, a float) held the running process's cancel flag before
#: ``created_at``; it is read still, that element dropped.
_LAYOUT: Final = 2
_AT_OLD_CANCEL: Final = _FIELDS.index("created_at")
_GET: Final = operator.attrgetter(*_FIELDS)
_AT_STATUS, _AT_UPDATED, _AT_FRAMES, _AT_ROOT, _AT_PROGRESS, _AT_ERROR, _AT_OUTPUT, _AT_JOIN = (
    _FIELDS.index(name)
    for name in ("status", "updated_at", "frames", "root", "progress", "error", "output", "join")
)
#: The signals a job took, then its tracestate and baggage, then its pool key: the last
#: fields, which a record written before each lacks.
_AT_DELIVERED: Final = _FIELDS.index("delivered")
_AT_TRACESTATE: Final = _FIELDS.index("tracestate")
_AT_POOL_KEY: Final = _FIELDS.index("pool_key")
_AT_OWNER: Final = _FIELDS.index("owner")
if _FIELDS[_AT_DELIVERED:] != ("delivered", "tracestate", "baggage", "pool_key", "owner"):
    raise RuntimeError(
        "Job's fields delivered, tracestate, baggage, pool_key and owner must be the last "
        "ones stored (see decode)"
    )
#: The fields that are absolute trio times (moved between processes' clocks).
_TIMES: Final = tuple(
    _FIELDS.index(name) for name in ("deadline", "suspend_deadline", "retain_until", "accepted_at")
)
_STATUS_OF: Final = {s.value: s for s in Status}


def record_packer() -> msgpack.Packer:
    """A packer of records (one per store: it keeps a buffer)."""
    return msgpack.Packer(use_bin_type=True, default=_wire)


def encode(packer: msgpack.Packer, job: Job, clock: float) -> bytes:
    """The record as a msgpack array: the job's fields in :data:`_FIELDS`'s order, then
    the writer's ``clock`` (for readers elsewhere). No field names: a third of the bytes of
    a map, and cheaper to write and read. The cursor's frames, the progress, the error
    and the join are arrays of their own (_wire)."""
    data: bytes = packer.pack((*_GET(job), clock, _LAYOUT))
    return data


def decode(
    blob: bytes,
    version: Any,
    status: bytes | None,
    updated: bytes | None,
    clock: Callable[[], float],
) -> Job:
    """The record from its blob and version; ``updated`` (``u``) set means a status write
    came after the blob (``update_status``): ``status`` and it are newer. ``clock`` is the
    reader's (wall time = trio time + ``clock()``), measured once the blob is unpacked."""
    values = msgpack.unpackb(blob, raw=False)
    if type(values) is dict:  # written as a map (Job.to_wire) by an older pipework
        values = [values.get(name, False) for name in _FIELDS[:_AT_TRACESTATE]] + [values["clock"]]
    elif type(values[-1]) is int:  # the layout (_LAYOUT)
        values.pop()
    else:  # written before the layout was marked: the cancel flag was stored then
        del values[_AT_OLD_CANCEL]
    # Times written by another process move from its trio clock to this one's; this
    # process's own come back exactly as they were written.
    shift = values.pop() - clock()
    stored = len(values)
    if stored == _AT_DELIVERED:  # written before jobs remembered their signals
        values.append(())
    elif values[_AT_DELIVERED]:
        values[_AT_DELIVERED] = tuple(values[_AT_DELIVERED])
    else:
        values[_AT_DELIVERED] = ()
    if stored <= _AT_TRACESTATE:  # written before jobs carried tracestate and baggage
        values += (None, None)
    if stored <= _AT_POOL_KEY:  # written before jobs carried a pool key
        values.append(None)
    if stored <= _AT_OWNER:  # written before jobs carried an owner
        values.append(None)
    if updated:
        assert status is not None
        values[_AT_STATUS] = status.decode()
        values[_AT_UPDATED] = float(updated)
    values[_AT_STATUS] = _STATUS_OF[values[_AT_STATUS]]
    frames = values[_AT_FRAMES]
    if frames:
        values[_AT_FRAMES] = [Frame(int(i), float(d) + shift, int(b)) for i, d, b in frames]
    values[_AT_ROOT] = tuple(values[_AT_ROOT])
    if values[_AT_PROGRESS] is not None:
        values[_AT_PROGRESS] = Progress(*values[_AT_PROGRESS])
    if values[_AT_ERROR] is not None:
        values[_AT_ERROR] = ErrorInfo(*values[_AT_ERROR])
    if not values[_AT_OUTPUT]:
        values[_AT_OUTPUT] = ()
    if values[_AT_JOIN] is not None:
        join = JoinRecord.from_wire(values[_AT_JOIN])
        if shift:
            join.deadline = join.deadline + shift
        values[_AT_JOIN] = join
    if shift:
        for i in _TIMES:
            values[i] = _moved(values[i], shift)
    values.append(int(version))
    return Job(*values)


def _wire(value: object) -> Any:
    """The parts of a record msgpack does not know, as the arrays decode reads back."""
    if isinstance(value, Frame):
        return [value.index, value.deadline, value.bound]
    if isinstance(value, Progress):
        return [value.done, value.total, value.message, value.branch]
    if isinstance(value, ErrorInfo):
        return [value.type, value.message, value.where, value.status]
    if isinstance(value, JoinRecord):
        return value.to_wire()
    raise TypeError(f"a job record cannot hold a {type(value).__name__}")


def _moved(value: float | None, shift: float) -> float | None:
    if value is None or math.isinf(value):
        return value
    return value + shift
