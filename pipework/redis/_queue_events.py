"""The events' form on the stream: what :class:`~._queue.RedisEventQueue` writes in each
entry's one field and reads back.

Apart from the queue because other writers put the same entries (the job store's scripts,
given an event to add with a record; the suspend timers) and tests read them: the format is
the contract between them, in one place.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack

from ..dispatcher._events import BranchDone, Event, Expire, Resume, RunJob

__all__ = ["FIELD", "decode_event", "encode_event"]

#: The field of a stream entry that holds the encoded event.
FIELD: Final = b"e"

#: One packer for every event (msgpack.packb makes one per call).
_pack: Final = msgpack.Packer(use_bin_type=True).pack


def encode_event(event: Event) -> bytes:
    if isinstance(event, RunJob):
        wire: list[Any] = ["run", event.job_id]
    elif isinstance(event, Resume):
        wire = ["resume", event.job_id, event.signal]
    elif isinstance(event, Expire):
        wire = ["expire", event.job_id, event.version]
    else:
        wire = [
            "branch",
            event.parent_id,
            event.branch_id,
            event.index,
            event.outcome,
            event.delta,
            event.join_id,
            list(event.stage),
            None if event.error is None else list(event.error),
        ]
    data: bytes = _pack(wire)
    return data


def decode_event(data: bytes) -> Event:
    wire = msgpack.unpackb(data, raw=False)
    kind = wire[0]
    if kind == "run":
        return RunJob(wire[1])
    if kind == "resume":
        return Resume(wire[1], wire[2])
    if kind == "expire":
        return Expire(wire[1], int(wire[2]))
    if kind == "branch":
        error = wire[8]
        return BranchDone(
            wire[1],
            wire[2],
            int(wire[3]),
            wire[4],
            wire[5],
            join_id=wire[6],
            stage=tuple(wire[7]),
            error=None if error is None else (error[0], error[1], error[2], int(error[3])),
        )
    raise ValueError(f"unknown event kind {kind!r} on the event stream")
