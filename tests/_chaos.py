"""The chaos harness: mixed jobs on two ``pipework serve`` processes sharing one Redis, while
the harness strikes — kills Redis's client connections (``CLIENT KILL``), pauses Redis
(``SIGSTOP``/``SIGCONT``), restarts it, and kills a gateway process with SIGKILL (and starts
it again) — then checks that every accepted job is final and that each outcome is what its
client was told.

``python -m tests._chaos`` runs a profile and prints what it saw (``--long``: 2,000 jobs;
``--no-persist``: Redis without AOF, see :func:`check`); ``tests/test_redis_chaos.py``
runs the short profiles in the suite. docs/scaling.md ("Chaos") says what is checked.

**What the clients do.** Each job is one of three kinds, in turn: ``sync`` (``POST /sync``,
the answer is the job's), ``async`` (``POST /async``, answered 202 with a ``Location`` the
client follows until the job is final) and ``signal`` (``POST /approve``, answered 202;
the client then sends the signal ``go`` through the other process and follows the job).
Each attempt carries a token of its own, which the job's pipes write to a ledger outside
Redis (:mod:`tests._chaos_app`). A client retries what it was told to retry: a refused
connection (its process is down) on the other process at once, a 503 that says nothing
was done after its ``Retry-After``, with a new token; a request that got no answer (its
process was killed) is not retried, and nothing is promised about it but that its job, if
there is one, ends.

**Strikes** are spread over the run by progress, not by time: the k-th of S strikes comes
once k/(S+1) of the jobs have their first answer, so a slow machine sees the same run.

**What is checked** (:func:`check`), once every client is done and Redis holds no active
job:

- told 200 (sync): the job's record is ``done`` with the client's token in its result, and
  its last pipe's effect is in the ledger;
- told to follow a ``Location`` (202, or a 503 naming the job): the job is final, and
  ``done`` with its token (its signal's payload too);
- told "nothing was done": no pipe ran with that attempt's token, and no record holds it;
- no job failed: every strike is shorter than the jobs' deadline, so a job fails for the
  store only if a write is lost;
- a delivered signal was not refused before ("nothing was done") and taken after.

With ``persist=False`` a restart of Redis loses everything it held (docs/scaling.md says
so); what the check then allows is exactly that: a job accepted before a restart may have
no record (its follower gets 404), nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

import pipework as pw
from pipework.redis import RedisJobStore
from pipework.redis._wire import Connection

from ._redis import RedisServer, start_redis

ROOT = Path(__file__).resolve().parent.parent
FINAL = frozenset({"done", "failed", "cancelled", "expired"})
#: The kinds of strike, taken in turn.
STRIKES = ("client-kill", "pause", "restart-redis", "kill-gateway")
#: Seconds after the last strike and first answer by when every job should have ended.
SETTLE = 60.0
#: How long an unanswered signal job's callback URL is looked for in the ledger.
CALL_BACK_SECONDS = 20.0


@dataclass(frozen=True)
class Profile:
    jobs: int
    clients: int
    strikes: int
    persist: bool = True
    #: How long a pause of Redis lasts (SIGSTOP to SIGCONT).
    pause_seconds: float = 1.5


SHORT = Profile(jobs=48, clients=12, strikes=4)
LONG = Profile(jobs=2_000, clients=32, strikes=40)


@dataclass
class Attempt:
    """One request of a client and what it was told."""

    kind: str
    token: str
    answer: str = "none"  # "done", "follow", "nothing-done", "no-answer", "error"
    status: int | None = None
    job_id: str | None = None
    job_token: str | None = None
    body: Any = None
    epoch: tuple[int, int] = (0, 0)  # data-losing restarts done when sent, and when answered
    final: str | None = None  # the status its follower saw last
    signal: str | None = None  # how its signal went


@dataclass
class Gateway:
    """One ``pipework serve`` process, started again after a kill."""

    index: int
    file: Path
    env: dict[str, str]
    url: str | None = None
    process: trio.Process | None = None
    log: bytearray = field(default_factory=bytearray)
    more: trio.Event = field(default_factory=trio.Event)
    starts: int = 0

    async def start(self, nursery: trio.Nursery) -> None:
        command = [sys.executable, "-m", "pipework", "serve", str(self.file), "--port", "0"]
        self.process = process = await trio.lowlevel.open_process(
            command,
            cwd=ROOT,
            env={**os.environ, **self.env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.starts += 1
        mark = len(self.log)
        nursery.start_soon(self._pump, process)
        with trio.fail_after(120):  # a new interpreter importing pipework, on a busy machine
            while b"pipework serving on " not in self.log[mark:]:
                if process.returncode is not None:
                    raise RuntimeError(f"gateway {self.index} exited:\n{self.log.decode()}")
                await self.more.wait()
        line = self.log[mark:].split(b"pipework serving on ", 1)[1].split(b"\n", 1)[0]
        self.url = line.decode().split()[0]

    async def _pump(self, process: trio.Process) -> None:
        assert process.stderr is not None
        with contextlib.suppress(trio.ClosedResourceError, trio.BrokenResourceError):
            while chunk := await process.stderr.receive_some():
                self.log += chunk
                self._told()
        self._told()

    def _told(self) -> None:
        self.more.set()
        self.more = trio.Event()

    async def kill(self) -> None:
        process, self.url = self.process, None
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()

    async def stop(self) -> None:
        process, self.url = self.process, None
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(30):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


def gateway_file(url: str, prefix: str) -> str:
    return f"""
[server]
default_timeout = 60

[store]
backend = "redis"
url = "{url}"
prefix = "{prefix}"
claim_idle = 1

[pool]
max_workers = 32

[pipes.first]
python = "tests._chaos_app:first"
key = "a"

[pipes.second]
python = "tests._chaos_app:second"
key = "b"

[pipes.hold]
python = "tests._chaos_app:hold"
key = "a"

[routes.sync]
path = "/sync"
chain = ["first", "second"]
result = "answer"

[routes.async]
path = "/async"
mode = "async"
chain = ["first", "second"]
result = "answer"

[routes.approve]
path = "/approve"
mode = "async"
chain = ["hold", "second"]
result = "answer"
"""


@dataclass
class Run:
    """One run of the harness: its Redis, its gateways, and what the clients were told."""

    profile: Profile
    redis: RedisServer
    prefix: str
    ledger: Path
    gateways: list[Gateway]
    nursery: trio.Nursery  # the gateways' output is read in it
    attempts: list[Attempt] = field(default_factory=list)
    answered: int = 0  # jobs whose first answer came
    progress: trio.Event = field(default_factory=trio.Event)
    restarts_done: int = 0
    struck: list[str] = field(default_factory=list)
    #: When the followers stop looking (trio time): SETTLE seconds after the last strike
    #: and the last first answer, by when every job should have ended.
    give_up: float = math.inf
    #: Tokens of unanswered signal jobs called back (from the ledger's URL).
    called_back: set[str] = field(default_factory=set)
    #: Jobs still active when the harness gave up waiting: (id, status).
    stuck: list[tuple[str, str]] = field(default_factory=list)

    def epoch_sent(self) -> int:
        # Done, not begun: a request sent once the restart began may still reach the old
        # server (SIGTERM takes a moment) and be accepted there, before its data is lost.
        return self.restarts_done

    def tick(self) -> None:
        self.answered += 1
        self.progress.set()
        self.progress = trio.Event()

    def live(self, prefer: int) -> Gateway | None:
        for gateway in (self.gateways[prefer % 2], self.gateways[(prefer + 1) % 2]):
            if gateway.url is not None:
                return gateway
        return None


async def _request(
    run: Run, client: httpx.AsyncClient, prefer: int, method: str, path: str, **kw: Any
) -> httpx.Response | None:
    """The answer of whichever process is up (preferring ``prefer``); a refused connection
    (the process is down) tries the other. None: sent, and no answer came."""
    while True:
        gateway = run.live(prefer)
        if gateway is None:
            await trio.sleep(0.1)  # both down for a moment: the harness is starting one
            continue
        try:
            return await client.request(method, f"{gateway.url}{path}", **kw)
        except httpx.ConnectError:
            prefer += 1  # refused: nothing was sent
            await trio.sleep(0.05)
        except httpx.TransportError:
            return None


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(float(response.headers.get("retry-after", "1")), 2.0)
    except ValueError:
        return 1.0


async def _client_job(run: Run, client: httpx.AsyncClient, i: int) -> None:
    kind = ("sync", "async", "signal")[i % 3]
    path = {"sync": "/sync", "async": "/async", "signal": "/approve"}[kind]
    first = True
    for retry in range(100):
        attempt = Attempt(kind, f"j{i}r{retry}")
        run.attempts.append(attempt)
        sent = run.epoch_sent()
        response = await _request(run, client, i, "POST", path, json={"token": attempt.token})
        attempt.epoch = (sent, run.restarts_done)
        if first:
            run.tick()
            first = False
        if response is None:
            attempt.answer = "no-answer"
            if kind == "signal":
                await _call_back(run, client, attempt.token)
            return
        _read_answer(attempt, response)
        if attempt.answer == "nothing-done":
            await trio.sleep(_retry_after(response))
            continue
        if attempt.answer == "follow" and kind == "signal":
            await _send_signal(run, client, i, attempt)
        if attempt.answer == "follow":
            await _follow(run, client, i, attempt)
        return


def _read_answer(attempt: Attempt, response: httpx.Response) -> None:
    attempt.status = response.status_code
    attempt.job_id = response.headers.get("x-job-id")
    attempt.job_token = response.headers.get("x-job-token")
    try:
        attempt.body = response.json()
    except ValueError:
        attempt.body = response.text
    location = response.headers.get("location")
    if response.status_code == 200:
        attempt.answer = "done"
    elif location is not None and response.status_code in (202, 503):
        attempt.answer = "follow"
        attempt.job_id = attempt.job_id or location.rstrip("/").rsplit("/", 1)[-1]
        if attempt.job_token is None and isinstance(attempt.body, dict):
            token = attempt.body.get("token")
            attempt.job_token = token if isinstance(token, str) else None
    elif response.status_code == 503 and "nothing was done" in str(attempt.body):
        attempt.answer = "nothing-done"
    else:
        attempt.answer = "error"


async def _send_signal(run: Run, client: httpx.AsyncClient, i: int, attempt: Attempt) -> None:
    """Deliver ``go`` through the other process; retried as a client would."""
    headers = {"X-Job-Token": attempt.job_token or ""}
    refused_nothing_done = False  # every try so far was answered "nothing was done"
    repeat = False  # a try before this one
    maybe = False  # a try before may have delivered it (no answer, or a 503 saying so)
    while trio.current_time() < run.give_up:
        response = await _request(
            run,
            client,
            i + 1,
            "POST",
            f"/jobs/{attempt.job_id}/signals/go",
            json={"by": attempt.token},
            headers=headers,
        )
        if response is None:
            refused_nothing_done = False  # no answer: a repeat may find it taken, rightly
            repeat = maybe = True
            await trio.sleep(0.2)
            continue
        if response.status_code in (202, 204):
            attempt.signal = "delivered"
            return
        if response.status_code == 409 and repeat:  # taken already, or the job ran on
            attempt.signal = (
                "refused-then-taken" if refused_nothing_done else "delivered (a repeat)"
            )
            return
        if response.status_code == 503:
            nothing = "nothing was done" in response.text
            refused_nothing_done = nothing and not maybe
            maybe = maybe or not nothing
            repeat = True
            await trio.sleep(_retry_after(response))
            continue
        attempt.signal = f"{response.status_code} {response.text}"
        return
    attempt.signal = "gave up"


async def _follow(run: Run, client: httpx.AsyncClient, i: int, attempt: Attempt) -> None:
    """GET the job's status until it is final (or 404: lost with Redis's data)."""
    headers = {"X-Job-Token": attempt.job_token or ""}
    while trio.current_time() < run.give_up:
        response = await _request(run, client, i, "GET", f"/jobs/{attempt.job_id}", headers=headers)
        if response is not None:
            if response.status_code == 200:
                status = response.json()["status"]
                if status in FINAL:
                    attempt.final = status
                    return
            elif response.status_code in (404, 410):
                attempt.final = str(response.status_code)
                return
        await trio.sleep(0.2)


async def _clients(run: Run) -> None:
    limit = trio.Semaphore(run.profile.clients)
    timeout = httpx.Timeout(90.0, connect=5.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=64)) as c:

        async def job(i: int) -> None:
            async with limit:
                await _client_job(run, c, i)

        async with trio.open_nursery() as nursery:
            for i in range(run.profile.jobs):
                nursery.start_soon(job, i)


async def _redis_command(redis: RedisServer, *args: str) -> Any:
    connection = await Connection.open(redis.url)
    try:
        (reply,) = await connection.call([list(args)])
        return reply
    finally:
        await connection.aclose()


async def _strike(run: Run, what: str, victim: int) -> None:
    run.struck.append(what)
    if what == "client-kill":
        await _redis_command(run.redis, "CLIENT", "KILL", "TYPE", "normal")
        await _redis_command(run.redis, "CLIENT", "KILL", "TYPE", "pubsub")
    elif what == "pause":
        run.redis.pause()
        await trio.sleep(run.profile.pause_seconds)  # a stall, not a wait for anything
        run.redis.resume()
    elif what == "restart-redis":
        await trio.to_thread.run_sync(run.redis.restart)
        run.restarts_done += run.profile.persist is False
    else:
        gateway = run.gateways[victim % 2]
        await gateway.kill()
        await gateway.start(run.nursery)


async def _chaos(run: Run) -> None:
    strikes = run.profile.strikes
    for k in range(strikes):
        mark = (k + 1) * run.profile.jobs // (strikes + 1)
        while run.answered < mark:
            await run.progress.wait()
        await _strike(run, STRIKES[k % len(STRIKES)], k // len(STRIKES))
    while run.answered < run.profile.jobs:
        await run.progress.wait()
    run.give_up = trio.current_time() + SETTLE


@contextlib.asynccontextmanager
async def harness(profile: Profile, directory: Path) -> AsyncIterator[Run]:
    redis = start_redis(directory, persist=profile.persist)
    prefix = f"chaos{secrets.token_hex(4)}"
    ledger = directory / "ledger"
    ledger.touch()
    path = directory / "gateway.toml"
    path.write_text(gateway_file(redis.url, prefix))
    env = {"PIPEWORK_CHAOS_LEDGER": str(ledger), "PIPEWORK_CALLBACK_SECRET": ""}
    gateways = [Gateway(n, path, env) for n in range(2)]
    try:
        async with trio.open_nursery() as nursery:
            run = Run(profile, redis, prefix, ledger, gateways, nursery)
            for gateway in gateways:
                await gateway.start(nursery)
            try:
                yield run
            finally:
                with trio.CancelScope(shield=True):
                    for gateway in gateways:
                        await gateway.stop()
                        # What each process logged, for whoever reads a failure.
                        (directory / f"gateway{gateway.index}.log").write_bytes(gateway.log)
                nursery.cancel_scope.cancel()
    finally:
        redis.stop()


async def play(run: Run) -> None:
    """The clients' jobs with the strikes among them; returns once every client is done
    (its job followed to its end) and Redis holds no active job."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_chaos, run)
        await _clients(run)
    gc.collect()  # what killed requests left of httpx's bodies is reported now, in this run
    await _call_back_unanswered(run)
    active = f"{run.prefix}:active"
    while await _redis_command(run.redis, "SCARD", active):
        if trio.current_time() > run.give_up:
            store = RedisJobStore(run.redis.url, prefix=run.prefix)
            async with store:
                for job_id in await _redis_command(run.redis, "SMEMBERS", active):
                    with contextlib.suppress(pw.JobNotFound):  # (ended meanwhile)
                        job = await store.get(job_id.decode())
                        run.stuck.append((job.id, f"{job.chain} {job.status}"))
            return
        await trio.sleep(0.2)


def _callback_url(run: Run, token: str) -> str | None:
    """The callback URL the job of ``token`` wrote in the ledger, if it ran so far."""
    for line in run.ledger.read_text().splitlines():
        fields = line.split()
        if fields[0] == "hold" and fields[1] == token:
            return fields[3]
    return None


async def _call_back(run: Run, client: httpx.AsyncClient, token: str) -> None:
    """A signal job whose client got no answer (its process killed) never learned its id:
    its callback URL, which its pipe writes in the ledger, is POSTed as its backend would,
    once it is there (a job never made writes none: looked for until CALL_BACK_SECONDS)."""
    if token in run.called_back:
        return
    give_up = min(run.give_up, trio.current_time() + CALL_BACK_SECONDS)
    while (url := _callback_url(run, token)) is None:
        if trio.current_time() > give_up:
            return
        await trio.sleep(0.2)
    run.called_back.add(token)
    path = httpx.URL(url).raw_path.decode()
    while trio.current_time() < run.give_up:
        response = await _request(run, client, 0, "POST", path, json={"by": token})
        if response is not None and response.status_code in (202, 204, 409):
            return
        await trio.sleep(0.2)


async def _call_back_unanswered(run: Run) -> None:
    """:func:`_call_back` for every unanswered signal job not called back yet."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(90.0, connect=5.0)) as client:
        for a in run.attempts:
            if a.kind == "signal" and a.answer == "no-answer" and _callback_url(run, a.token):
                await _call_back(run, client, a.token)


@dataclass
class Findings:
    """What :func:`check` found: counts, and each broken promise in words."""

    counts: dict[str, int]
    broken: list[str]

    def summary(self) -> str:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        return counts + "".join(f"\n  BROKEN: {b}" for b in self.broken)

    def __str__(self) -> str:
        return self.summary()


async def check(run: Run) -> Findings:
    ran: dict[str, set[str]] = {}
    for line in run.ledger.read_text().splitlines():
        pipe, token = line.split()[:2]
        ran.setdefault(token, set()).add(pipe)
    broken: list[str] = []
    counts: dict[str, int] = {}
    lossy = not run.profile.persist

    def count(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1

    for gateway in run.gateways:  # none may have died but those the harness killed
        process = gateway.process
        if process is not None and process.returncode is not None:
            tail = gateway.log.decode(errors="replace")[-2000:]
            code = process.returncode
            broken.append(f"gateway {gateway.index} exited by itself ({code}):\n{tail}")
    for job_id, status in run.stuck:
        broken.append(f"job {job_id} ({status}) never ended: {SETTLE:g} s after the last strike")

    store = RedisJobStore(run.redis.url, prefix=run.prefix)
    async with store:
        records = {job.id: job for job in await store.list()}
        for job in records.values():
            count(f"record {job.status}")
            if job.status not in (pw.Status.DONE,):
                error = job.error.type + ": " + job.error.message if job.error else ""
                broken.append(f"job {job.id} ({job.chain}) ended {job.status} {error}")
        tokens = {job.state.get("token") for job in records.values()}
        for a in run.attempts:
            count(f"{a.kind} {a.answer}")
            survived = not lossy or a.epoch[0] == run.restarts_done
            record = records.get(a.job_id or "")
            if a.answer == "done":
                if record is None and not survived:
                    count(f"{a.kind} done, then lost with Redis's data")
                if record is None and survived:
                    broken.append(f"{a.token}: told 200, and no record of job {a.job_id}")
                elif record is not None and record.status != pw.Status.DONE:
                    broken.append(f"{a.token}: told 200, job {a.job_id} is {record.status}")
                if a.body != {"token": a.token, "approval": None}:
                    broken.append(f"{a.token}: told 200 with {a.body!r}")
                if "second" not in ran.get(a.token, set()):
                    broken.append(f"{a.token}: told 200, its last pipe never ran")
            elif a.answer == "follow":
                count(f"{a.kind} followed to {a.final}")
                never_made = a.status == 503 and a.final == "404"  # the create had no answer
                if a.final == "done" or (a.final == "404" and not survived):
                    pass
                elif never_made and a.token not in ran and a.token not in tokens:
                    count(f"{a.kind} follow: never made")
                else:
                    broken.append(
                        f"{a.token}: told {a.status} to follow job {a.job_id}, which ended "
                        f"{a.final}" + (f" (ran: {sorted(ran[a.token])})" if a.token in ran else "")
                    )
                if record is not None and a.kind == "signal":
                    approval = record.state.get("approval")
                    if approval != {"by": a.token}:
                        broken.append(f"{a.token}: its job took {approval!r} as its signal")
                if a.kind == "signal" and a.signal == "refused-then-taken":
                    broken.append(
                        f"{a.token}: its signal was answered 503 nothing was done, "
                        "and a repeat found it taken"
                    )
                elif (
                    a.kind == "signal"
                    and str(a.signal).startswith("404")
                    and (not survived or never_made)
                ):
                    pass  # lost with Redis's data before its signal came, or never made
                elif a.kind == "signal" and a.signal not in ("delivered", "delivered (a repeat)"):
                    broken.append(f"{a.token}: its signal {a.signal}")
            elif a.answer == "nothing-done":
                if a.token in ran or a.token in tokens:
                    what = sorted(ran.get(a.token, ()))
                    broken.append(
                        f"{a.token}: told 503 nothing was done ({a.kind}), "
                        f"yet its job ran {what or 'a record'}"
                    )
            elif a.answer == "error" and a.status == 404 and not survived:
                count(f"{a.kind} parked, its job lost with Redis's data (404)")
            elif a.answer == "error":
                broken.append(f"{a.token}: answered {a.status} {a.body!r}")
    counts["strikes"] = len(run.struck)
    counts["gateway starts"] = sum(g.starts for g in run.gateways)
    return Findings(counts, broken)


async def _main(profile: Profile, keep: Path | None) -> int:
    with tempfile.TemporaryDirectory(prefix="pipework-chaos-") as directory:
        where = Path(directory) if keep is None else keep
        where.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        async with harness(profile, where) as run:
            await play(run)
            findings = await check(run)
        print(json.dumps(profile.__dict__))
        print(f"{time.monotonic() - started:.0f} s; strikes: {', '.join(run.struck)}")
        print(findings.summary())
        return 1 if findings.broken else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests._chaos", description=__doc__)
    parser.add_argument("--long", action="store_true", help="2,000 jobs, 40 strikes")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--strikes", type=int, default=None)
    parser.add_argument(
        "--no-persist", action="store_true", help="Redis without AOF: a restart loses its data"
    )
    parser.add_argument("--pause", type=float, default=None, help="seconds Redis is paused")
    parser.add_argument(
        "--keep", type=Path, default=None, help="a directory to keep the logs and ledger in"
    )
    args = parser.parse_args(argv)
    profile = LONG if args.long else SHORT
    changes: dict[str, Any] = {"persist": not args.no_persist}
    if args.jobs is not None:
        changes["jobs"] = args.jobs
    if args.strikes is not None:
        changes["strikes"] = args.strikes
    if args.pause is not None:
        changes["pause_seconds"] = args.pause
    profile = Profile(**{**profile.__dict__, **changes})
    return trio.run(functools.partial(_main, profile, args.keep))


if __name__ == "__main__":
    sys.exit(main())
