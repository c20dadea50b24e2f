"""Walking a job's cursor through its chain: no I/O, no clock but the one handed in.

A job's cursor is a stack of :class:`~._job.Frame`s, one per serial sequence it is inside,
from the sequence at ``job.root`` (a chain's, or a branch's) down: each frame's ``index``
is the next child to run there, ``deadline`` the earliest limit of the stages it is in and
``bound`` the depth of the stage that set that limit (-1: the job's own deadline). Walking
enters serial stages (their timers start then) and leaves finished ones; it stops at what
a worker runs: a pipe, or a parallel stage.
"""

from __future__ import annotations

import math
from typing import Any

from ..pipes._pipe import Pipe
from ..pipes._stages import Chain, Parallel, Serial
from ._job import Frame, Job

__all__ = [
    "advance",
    "chain_key",
    "next_key",
    "path_of",
    "peek",
    "stage_path",
    "start_frames",
    "top_node",
]

_RUNNABLE = (Pipe, Parallel)  # what the cursor stops at: a tuple is the fastest isinstance


def start_frames(job: Job, chain: Chain, now: float) -> None:
    """Give a new job (or branch) its root frame and the key of its first step."""
    root = chain.node_at(job.root) if job.root else chain.root
    frame = Frame(0, job.deadline)
    if isinstance(root, Serial) and root.timeout is not None:
        limit = now + root.timeout
        if limit < frame.deadline:
            frame = Frame(0, limit, 0)
    job.frames = [frame]
    flat = root.flat if isinstance(root, Serial) else None
    # A sequence of pipes (most chains): its first pipe's key, with no walk.
    job.key = (flat[0].key or job.pool_key or chain.key) if flat else next_key(job, chain)


def chain_key(job: Job, chain: Chain, step: object = None) -> str:
    """The admission key of ``step`` in ``job``: a pipe's own key, else the job's pool key
    (a route's tenant, see docs/edge-policy.md), else the chain's. A parallel stage (or
    nothing) takes the job's or chain's key: only a pipe can name a key of its own."""
    if isinstance(step, Pipe) and step.key is not None:
        return step.key
    return job.pool_key or chain.key


def next_key(job: Job, chain: Chain) -> str:
    """The admission key of the job's next step, found without entering any stage: a
    stage's timer starts when a worker's cursor enters it, not when it is looked at."""
    if len(job.frames) == 1:  # a flat chain: no stage to look into
        root: Any = chain.node_at(job.root)  # a serial sequence: a chain's or a branch's
        index = job.frames[0].index
        if index < len(root.children) and isinstance(root.children[index], Pipe):
            return root.children[index].key or job.pool_key or chain.key
    frames = [Frame(f.index, f.deadline, f.bound) for f in job.frames]
    step = _walk(frames, job.root, chain, math.inf)
    return chain_key(job, chain, step)


def peek(job: Job, chain: Chain) -> Pipe | Parallel | None:
    """What the job's next step runs first (None: its sequence is complete), found as
    :func:`advance` finds it but with the cursor left where it is: no stage is entered."""
    frames = job.frames
    if len(frames) == 1:  # a flat chain: no stage to look into
        root: Any = chain.node_at(job.root)
        index = frames[0].index
        if index >= len(root.children):
            return None
        child: Pipe | Parallel | Serial = root.children[index]
        if not isinstance(child, Serial):
            return child
    return _walk([Frame(f.index, f.deadline, f.bound) for f in frames], job.root, chain, math.inf)


def advance(job: Job, chain: Chain, clock: Any) -> Pipe | Parallel | None:
    """Move the cursor to the next pipe or parallel stage, entering and leaving serial
    stages (an entered stage's timer starts now: ``clock()`` is read only then); None when
    the sequence is complete."""
    return _walk(job.frames, job.root, chain, None, clock)


def _walk(
    frames: list[Frame],
    root: tuple[int, ...],
    chain: Chain,
    now: float | None,
    clock: Any = None,
) -> Pipe | Parallel | None:
    if not frames:
        return None
    node: Any = top_node(frames, root, chain)
    while True:
        top = frames[-1]
        children = node.children
        if top.index >= len(children):
            frames.pop()
            if not frames:
                return None
            frames[-1].index += 1
            node = top_node(frames, root, chain)
            continue
        child = children[top.index]
        if isinstance(child, _RUNNABLE):
            return child
        frame = Frame(0, top.deadline, top.bound)
        if child.timeout is not None:
            if now is None:
                now = clock()
            if now + child.timeout < top.deadline:
                frame = Frame(0, now + child.timeout, len(frames))
        frames.append(frame)
        node = child


def path_of(job: Job) -> tuple[int, ...]:
    """Where the cursor is: the path of the node its top frame points into."""
    frames = job.frames
    if len(frames) <= 1:
        return job.root  # the common case: a flat chain
    return (*job.root, *(f.index for f in frames[:-1]))


def stage_path(job: Job, depth: int) -> tuple[int, ...]:
    """The path of the serial stage the frame at ``depth`` walks."""
    return (*job.root, *(f.index for f in job.frames[:depth]))


def top_node(frames: list[Frame], root: tuple[int, ...], chain: Chain) -> Any:
    """The serial sequence the top frame walks."""
    node: Any = chain.node_at(root)
    for frame in frames[:-1]:
        node = node.children[frame.index]
    return node
