"""A pipework process that only works (it accepts nothing): ``python -m tests._redis_worker
URL PREFIX [shared [accept N]]``. The crash test kills it with SIGKILL in the middle of its
jobs. ``shared``: its queue shares the store's round trips, as ``[store] backend = "redis"``
builds them. ``accept N``: it also submits N "slow" jobs, one every 100 ms, and prints
each one's id as it is accepted, with 1 if its first event was claimed with its record
(its step started here at once) or 0."""

from __future__ import annotations

import sys

import trio

import pipework as pw
from pipework.redis import RedisEventQueue, RedisJobStore

#: The crash test's pools let a step wait for its slot as long as its job's own timeout
#: allows: its workers hold hundreds of events for 16 slots, and on a loaded machine a
#: bound on the slot wait would fail jobs (Rejected) that the count then misses, whatever
#: the crash left behind.
SLOT_WAIT = None


def declare(engine: pw.Engine, name: str) -> None:
    """Two keys, so every job is handed off once between its two steps; "fan" runs two
    branches in parallel first; "wait" suspends with a timeout."""

    @engine.pipe(key="a")
    async def fetch(ctx: pw.Context) -> None:
        await trio.sleep(0.02)
        ctx.state["fetched_by"] = name

    @engine.pipe(key="b")
    async def store(ctx: pw.Context) -> None:
        await trio.sleep(0.02)
        ctx.state["stored_by"] = name

    engine.chain("work", fetch, store, timeout=600)

    @engine.pipe(key="a")
    async def fetch_slowly(ctx: pw.Context) -> None:
        # The crash lands in it, well after the job was accepted: the test kills this
        # process as soon as it reads that a job was claimed, however busy the machine.
        await trio.sleep(1.0)
        ctx.state["fetched_by"] = name

    engine.chain("slow", fetch_slowly, store, timeout=600)

    def branch(label: str) -> pw.Pipe:
        async def run(ctx: pw.Context) -> None:
            await trio.sleep(0.02)
            ctx.state[f"{label}_by"] = name

        return pw.Pipe(run, label, key="a")

    # A parallel stage: killed inside it, its branches are rerun elsewhere.
    engine.chain("fan", pw.all_of(branch("left"), branch("right")), store, timeout=600)

    @engine.pipe(key="a")
    async def hold(ctx: pw.Context) -> None:
        await ctx.suspend("approved", into="approval", timeout=5)

    # Suspended with a timeout: killed meanwhile, its timer fires in another process.
    engine.chain("wait", hold, timeout=600)


async def main(url: str, prefix: str, shared: bool, accept: int) -> None:
    store = RedisJobStore(url, prefix=prefix)
    engine = pw.Engine(
        pool=pw.WeightedPool(16, wait_timeout=SLOT_WAIT),
        store=store,
        queue=RedisEventQueue(
            url, prefix=prefix, consumer="doomed", claim_idle=1, store=store if shared else None
        ),
    )
    declare(engine, "doomed")
    async with engine:
        print("ready", flush=True)
        for i in range(accept):
            job_id = await engine.submit("slow", {"n": i})
            claimed = job_id in engine._dispatcher.flight.claiming  # its step not started yet
            print(job_id, int(claimed), flush=True)
            await trio.sleep(0.1)  # ten a second for 16 slots: most find one free, claimed
        await trio.sleep_forever()


if __name__ == "__main__":
    shared = sys.argv[3:4] == ["shared"]
    accept = int(sys.argv[5]) if sys.argv[4:5] == ["accept"] else 0
    trio.run(main, sys.argv[1], sys.argv[2], shared, accept)
