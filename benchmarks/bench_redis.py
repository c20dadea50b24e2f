"""Distributed mode's cost: jobs per second through a 1-pipe chain and a 3-pipe chain with a
hand-off between keys, on Redis against the in-memory store and queue, in the same run.
Two Redis rows for each chain: "job pool on Redis" has the job store on Redis and the
event queue in memory; "job pool and event queue on Redis" has both on Redis, built as
``[store] backend = "redis"`` builds them (the queue's writes and reads in the store's
round trips), the configuration the goal of 0.3 times the memory store's throughput is
for. 64 clients each submit a job and wait for it, again and again, as a busy server's
requests do; the three configurations take turns, and each row is the median of their
runs. The note adds the CPU per job of this process (its own clock) and of the Redis
server (``INFO cpu``): when other work shares the machine, the wall times move with it,
and these say where the time goes. Two more rows compare the store's own RESP connection
with coredis, the general client the design first named, on the same server: µs of a
command pipelined 64 at a time, and of a lone round trip. The Redis server is a local
``redis-server`` started for the run (no persistence), so the figures are one process's
round trips to a Redis on the same machine, which shares its two cores.

The HTTP rows are what an operator sees (:mod:`._redis_http`): two ``pipework serve``
processes on the same gateway file, one on the memory store and one on Redis, 16 clients
running 1-pipe jobs through a sync route, and through an async route (202, then the
result fetched), the two servers taking turns; each row is the median of their runs."""

from __future__ import annotations

import statistics
import time
from typing import Any

import coredis
import trio

import pipework as pw
from pipework.redis import RedisEventQueue, RedisJobStore
from pipework.redis._wire import Connection

from . import _redis_http
from ._redis import redis_server

CLIENTS = 64


async def _pipe(ctx: pw.Context) -> None:
    await trio.lowlevel.checkpoint()


def _redis_cpu(url: str) -> float:
    """Seconds of CPU the Redis server has used so far (``INFO cpu``)."""

    async def main() -> float:
        connection = await Connection.open(url)
        try:
            (info,) = await connection.call([["INFO", "cpu"]])
        finally:
            await connection.aclose()
        fields = dict(line.split(":", 1) for line in info.decode().split() if ":" in line)
        return float(fields["used_cpu_user"]) + float(fields["used_cpu_sys"])

    return trio.run(main)


def _measure(jobs: int, chain_pipes: int, url: str | None, queue_too: bool) -> float:
    prefix = f"bench{time.monotonic_ns()}"  # a fresh job pool and stream for every run
    store = None if url is None else RedisJobStore(url, prefix=prefix, retain_count=jobs + 1)
    queue = None
    if url is not None and store is not None and queue_too:  # as [store] backend = "redis" does
        queue = RedisEventQueue(url, prefix=prefix, capacity=jobs + 1, store=store)
    engine = pw.Engine(
        pool=pw.WeightedPool(CLIENTS * 2, default=pw.Weights(max_waiting=jobs)),
        queue_capacity=jobs + 1,
        store=store or pw.MemoryJobStore(retain_count=jobs + 1),
        queue=queue,
    )
    names = []
    for n in range(chain_pipes):
        engine.registry.add_pipe(pw.Pipe(_pipe, f"p{n}", key="a" if n < 2 else "b"))
        names.append(f"p{n}")
    engine.chain("c", *names)

    async def main() -> float:
        async with engine:
            per_client = jobs // CLIENTS

            async def client() -> None:
                for _ in range(per_client):
                    await engine.run("c")

            start = time.perf_counter()
            cpu = time.process_time()
            async with trio.open_nursery() as nursery:
                for _ in range(CLIENTS):
                    nursery.start_soon(client)
            _cpu.append((time.process_time() - cpu) / (per_client * CLIENTS))
            return (time.perf_counter() - start) / (per_client * CLIENTS)

    return trio.run(main)


#: This process's CPU per job in the last _measure (a list: set from inside its trio run).
_cpu: list[float] = []


def _clients(url: str, batches: int, repeats: int) -> dict[str, list[float]]:
    """µs per command: HGET pipelined 64 at a time, and one HGET per round trip, through
    the store's RESP connection and through coredis, taking turns."""
    batch = 64
    times: dict[str, list[float]] = {k: [] for k in ("resp64", "coredis64", "resp1", "coredis1")}

    async def main() -> None:
        client: coredis.Redis[bytes] = coredis.Redis.from_url(url)
        async with client:
            await client.hset("bench:h", {"f": "v"})
            connection = await Connection.open(url)
            commands = [["HGET", "bench:h", "f"]] * batch
            try:
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(batches):
                        replies = await connection.call(commands)
                    times["resp64"].append((time.perf_counter() - start) / (batches * batch))
                    assert replies == [b"v"] * batch
                    start = time.perf_counter()
                    for _ in range(batches):
                        async with client.pipeline(transaction=False) as pipe:
                            queued = [pipe.hget("bench:h", "f") for _ in range(batch)]
                        replies = [await q for q in queued]
                    times["coredis64"].append((time.perf_counter() - start) / (batches * batch))
                    assert replies == [b"v"] * batch
                    start = time.perf_counter()
                    for _ in range(batches * 4):
                        await connection.call(commands[:1])
                    times["resp1"].append((time.perf_counter() - start) / (batches * 4))
                    start = time.perf_counter()
                    for _ in range(batches * 4):
                        await client.hget("bench:h", "f")
                    times["coredis1"].append((time.perf_counter() - start) / (batches * 4))
            finally:
                await connection.aclose()

    trio.run(main)
    return times


def _http_rows(url: str, jobs: int, repeats: int) -> list[dict[str, Any]]:
    """Sync and async routes over HTTP, the Redis store against the memory store."""
    prefix = f"benchhttp{time.monotonic_ns()}"
    stores = {
        "memory": '[store]\nbackend = "memory"\nretain_count = 100000',
        "redis": f'[store]\nbackend = "redis"\nurl = "{url}"\nprefix = "{prefix}"'
        "\nretain_count = 100000",
    }
    times: dict[tuple[str, str], list[float]] = {}
    with (
        _redis_http.serving(stores["memory"]) as memory,
        _redis_http.serving(stores["redis"]) as redis,
    ):
        ports = {"memory": memory[1], "redis": redis[1]}
        for route in ("sync", "async"):
            for kind in ports:  # a first run each, to warm up; not counted
                _redis_http.measure(ports[kind], route, jobs // 4)
            for _ in range(repeats):
                for kind, port in ports.items():
                    times.setdefault((route, kind), []).append(
                        _redis_http.measure(port, route, jobs)
                    )
    rows = []
    for route, what in (("sync", "sync route"), ("async", "async route (202, then the result)")):
        redis_time = statistics.median(times[(route, "redis")])
        memory_time = statistics.median(times[(route, "memory")])
        rows.append(
            {
                "scenario": f"HTTP, {what}, 1-pipe job, Redis store, "
                f"{_redis_http.CLIENTS} clients, {jobs:,} jobs",
                "subject_us": redis_time * 1e6,
                "baseline": "the same server on the memory store",
                "baseline_us": memory_time * 1e6,
                "ratio": redis_time / memory_time,
                "goal": "report only",
                "note": f"throughput {memory_time / redis_time:.2f}× the memory store's: "
                f"{1 / redis_time:,.0f} vs {1 / memory_time:,.0f} jobs/s; median of "
                f"{repeats}, taking turns",
            }
        )
    return rows


def run(quick: bool) -> list[dict[str, Any]]:
    jobs = 1_280 if quick else 6_400
    repeats = 3 if quick else 7
    rows = []
    with redis_server("bench_redis") as url:
        for pipes in (1, 3):
            shape = "1-pipe chain" if pipes == 1 else "3-pipe chain, one hand-off between keys"
            # The three take turns, so a change in the machine's load (two cores shared with
            # whatever else runs) falls on all of them alike; each row is a median.
            times: dict[str, list[float]] = {"memory": [], "pool": [], "both": []}
            cpu: dict[str, list[float]] = {"memory": [], "pool": [], "both": []}
            server: dict[str, list[float]] = {"pool": [], "both": []}  # Redis's CPU per job
            for _ in range(repeats):
                for kind in ("memory", "pool", "both"):
                    before = None if kind == "memory" else _redis_cpu(url)
                    times[kind].append(
                        _measure(jobs, pipes, None if before is None else url, kind == "both")
                    )
                    cpu[kind].append(_cpu.pop())
                    if before is not None:
                        server[kind].append((_redis_cpu(url) - before) / jobs)
            memory = statistics.median(times["memory"])
            memory_cpu = statistics.median(cpu["memory"]) * 1e6
            for queue_too in (False, True):
                kind = "both" if queue_too else "pool"
                redis = statistics.median(times[kind])
                redis_cpu = statistics.median(cpu[kind]) * 1e6
                server_cpu = statistics.median(server[kind]) * 1e6
                what = "job pool and event queue" if queue_too else "job pool"
                rows.append(
                    {
                        "scenario": f"{shape}, {what} on Redis, {CLIENTS} clients, {jobs:,} jobs",
                        "subject_us": redis * 1e6,
                        "baseline": "the same on the in-memory store and queue",
                        "baseline_us": memory * 1e6,
                        "ratio": redis / memory,
                        "goal": "throughput ≥ 0.3× (ratio ≤ 3.3×)",
                        "note": f"{1 / redis:,.0f} jobs/s vs {1 / memory:,.0f} jobs/s; CPU per "
                        f"job: this process {redis_cpu:.0f} µs vs {memory_cpu:.0f} µs, Redis "
                        f"{server_cpu:.0f} µs",
                    }
                )
        rows += _http_rows(url, 800 if quick else 4_000, repeats)
        times = _clients(url, 50 if quick else 200, repeats)
        for kind, what in (("64", "a command pipelined 64 at a time"), ("1", "a lone round trip")):
            resp = statistics.median(times[f"resp{kind}"])
            other = statistics.median(times[f"coredis{kind}"])
            rows.append(
                {
                    "scenario": f"Redis client: {what} (HGET), the store's RESP connection",
                    "subject_us": resp * 1e6,
                    "baseline": "coredis 6 on the same server",
                    "baseline_us": other * 1e6,
                    "ratio": resp / other,
                    "goal": "report only",
                    "note": f"median of {repeats}, taking turns; why the store speaks RESP itself",
                }
            )
    return rows
