"""``pipework serve --workers N`` as real processes: N workers behind one port, a worker
killed with SIGKILL is replaced while requests keep being answered, SIGTERM stops them all,
one scrape of ``/metrics`` counts every worker's requests, and routes that cannot work
across processes with the memory store are refused before anything starts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import pipework as pw
from pipework.__main__ import main
from tests.test_gateway import backend, gateway_file

ROOT = Path(__file__).resolve().parent.parent
# Starting a worker is a new interpreter importing pipework: seconds on a busy machine.
pytestmark = pytest.mark.hang_guard(real_seconds=150)


def build_engine() -> pw.Engine:
    """Two sync routes: ``/pid`` answers the worker's process id, ``/hello/{name}``."""
    return _engine(pw.Registry())


def _engine(registry: pw.Registry) -> pw.Engine:
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def which(ctx: pw.Context) -> None:
        await trio.sleep(0.02)  # long enough for concurrent requests to overlap
        ctx.state["pid"] = os.getpid()

    @engine.pipe
    async def hello(ctx: pw.Context) -> None:
        ctx.state["greeting"] = f"hello {ctx.state['name']}"

    engine.chain("which", which, result="pid")
    engine.chain("hello", hello, result="greeting")
    registry.route("pid", path="/pid", method="GET", chain="which")
    registry.route("hello", path="/hello/{name}", chain="hello")
    return engine


def build_async_engine() -> pw.Engine:
    """An async route: its /jobs/{id} link needs the job on whichever worker answers it."""
    registry = pw.Registry()
    engine = _engine(registry)
    registry.route("later", path="/later", chain="hello", mode="async")
    return engine


def build_signing_engine() -> pw.Engine:
    """``/sign`` answers the worker's pid and a callback URL it signed for its own job."""
    registry = pw.Registry()
    engine = _engine(registry)

    @engine.pipe
    async def sign(ctx: pw.Context) -> None:
        await trio.sleep(0.02)  # long enough for concurrent requests to overlap
        ctx.state["signed"] = {"pid": os.getpid(), "url": ctx.callback_url("paid", ttl=600)}

    engine.chain("sign", sign, result="signed")
    registry.route("sign", path="/sign", method="GET", chain="sign")
    return engine


def build_engine_failing_in_workers() -> pw.Engine:
    """Builds in the supervising process, fails in every worker."""
    if "PIPEWORK_SUPERVISOR_PID" in os.environ:
        raise RuntimeError("this engine cannot start in a worker")
    return build_engine()


@dataclass
class Served:
    process: trio.Process
    url: str
    stderr: bytearray = field(default_factory=bytearray)
    more: trio.Event = field(default_factory=trio.Event)

    async def pump(self) -> None:
        """Keep reading the server's stderr (so it never blocks on a full pipe)."""
        assert self.process.stderr is not None
        while chunk := await self.process.stderr.receive_some():
            self.stderr += chunk
            self.more.set()
            self.more = trio.Event()

    async def wait_for(self, text: bytes) -> None:
        while text not in self.stderr:
            await self.more.wait()


@asynccontextmanager
async def serving(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[Served]:
    command = [sys.executable, "-m", "pipework", "serve", *args, "--port", "0"]
    environment = {**os.environ, "PYTHONWARNINGS": "error", **(env or {})}
    process = await trio.lowlevel.open_process(
        command, cwd=ROOT, env=environment, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        async with trio.open_nursery() as nursery:
            served = Served(process, "")
            nursery.start_soon(served.pump)
            with trio.fail_after(60):
                await served.wait_for(b"pipework serving on ")
            line = served.stderr.split(b"pipework serving on ", 1)[1].split(b"\n", 1)[0]
            served.url = line.decode().split()[0]
            yield served
            nursery.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def pids_answering(client: httpx.AsyncClient, requests: int) -> list[int]:
    """``requests`` concurrent GET /pid, each on a connection of its own; their answers."""
    answers: list[int] = []

    async def one() -> None:
        async with httpx.AsyncClient(base_url=str(client.base_url)) as fresh:
            response = await fresh.get("/pid")
        assert response.status_code == 200, response.text
        answers.append(response.json())

    async with trio.open_nursery() as nursery:
        for _ in range(requests):
            nursery.start_soon(one)
    return answers


async def until_both_answer(client: httpx.AsyncClient) -> tuple[set[int], int]:
    """Batches of concurrent requests until two workers have answered; the workers' pids
    and how many requests were answered."""
    seen: set[int] = set()
    sent = 0
    with trio.fail_after(60):
        while len(seen) < 2:
            answers = await pids_answering(client, 16)
            sent += len(answers)
            seen.update(answers)
    return seen, sent


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_two_workers_serve_survive_a_killed_worker_and_stop_on_sigterm() -> None:
    async with serving(f"{__name__}:build_engine", "--workers", "2") as served:
        assert b"(2 workers)" in served.stderr
        async with httpx.AsyncClient(base_url=served.url) as client:
            workers, _ = await until_both_answer(client)
            assert served.process.pid not in workers  # the parent serves nothing itself
            victim = min(workers)
            os.kill(victim, signal.SIGKILL)
            with trio.fail_after(60):
                await served.wait_for(f"(pid {victim}) exited with signal SIGKILL".encode())
            # Answered all along, by the survivor and then by the replacement too.
            now: set[int] = set()
            with trio.fail_after(60):
                while len(now) < 2:
                    now.update(await pids_answering(client, 16))
            assert victim not in now
            assert len(now - workers) == 1  # one new worker took the dead one's place
            assert (await client.post("/hello/ada")).json() == "hello ada"
        served.process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await served.process.wait() == 0
            await served.wait_for(b"stopped")
    assert not any(alive(pid) for pid in now)
    assert b"SIGTERM: shutting down 2 workers gracefully" in served.stderr
    assert b"Traceback" not in served.stderr


async def test_a_callback_url_one_worker_signed_is_not_refused_by_another() -> None:
    """Every worker signs with the secret the parent made (none configured): a callback URL
    one worker signed, received by another, passes its signature check there and finds no
    job (404: with the memory store a job lives in its worker) — never 403, refused as
    forged, as when each worker made a secret of its own."""
    async with serving(
        f"{__name__}:build_signing_engine", "--workers", "2", env={"PIPEWORK_CALLBACK_SECRET": ""}
    ) as served:
        base = served.url

        async def post_fresh(path: str) -> int:
            async with httpx.AsyncClient(base_url=base) as fresh:
                return (await fresh.post(path, json={})).status_code

        urls: dict[int, str] = {}
        with trio.fail_after(60):
            while len(urls) < 2:  # a URL from each worker
                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(_sign, base, urls)
            answers: dict[int, list[int]] = {pid: [] for pid in urls}

            async def post(pid: int) -> None:
                path = httpx.URL(urls[pid]).raw_path.decode()
                answers[pid].append(await post_fresh(path))

            # Its own worker answers 409 (the job has ended); until the other one answers.
            while not all(set(seen) - {409} for seen in answers.values()):
                async with trio.open_nursery() as nursery:
                    for pid in urls:
                        for _ in range(4):
                            nursery.start_soon(post, pid)
        for seen in answers.values():
            assert 404 in seen, seen
            assert set(seen) <= {404, 409}, seen
        assert b"PIPEWORK_WORKERS_CALLBACK_SECRET" not in served.stderr


async def _sign(base: str, urls: dict[int, str]) -> None:
    async with httpx.AsyncClient(base_url=base) as fresh:
        response = await fresh.get("/sign")
    assert response.status_code == 200, response.text
    urls.setdefault(response.json()["pid"], response.json()["url"])


async def test_sighup_reloads_every_worker(tmp_path: Path) -> None:
    async with backend() as users:
        path = tmp_path / "gateway.toml"
        path.write_text(gateway_file(users.url))
        async with serving(str(path), "--workers", "2") as served:
            async with httpx.AsyncClient(base_url=served.url) as client:
                assert (await client.get("/hello")).status_code == 404
                path.write_text(gateway_file(users.url, extra_route=True))
                served.process.send_signal(signal.SIGHUP)
                with trio.fail_after(60):
                    while served.stderr.count(b"SIGHUP: reloaded (plan 2)") < 2:
                        await served.more.wait()
            for _ in range(8):  # fresh connections, whichever worker takes them
                async with httpx.AsyncClient(base_url=served.url) as fresh:
                    assert (await fresh.get("/hello")).json() == {"hello": "world"}
            served.process.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                assert await served.process.wait() == 0
    assert b"SIGHUP: asking 2 workers to reload" in served.stderr


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


async def test_one_scrape_counts_every_workers_requests(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    directory.mkdir()
    (directory / "counter_1.db").write_bytes(b"left by an earlier run")  # wiped at start
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory)}
    async with serving(f"{__name__}:build_engine", "--workers", "2", env=env) as served:
        assert not (directory / "counter_1.db").exists()
        async with httpx.AsyncClient(base_url=served.url) as client:
            workers, sent = await until_both_answer(client)
            response = await client.get("/metrics")
            assert response.status_code == 200
            text = response.text
            # State (jobs by status) is written by each worker every second: the scrape
            # shows the other worker's as of its last write.
            with trio.fail_after(30):
                while True:
                    later = (await client.get("/metrics")).text
                    if _samples(later, "pipework_jobs").get((("status", "done"),)) == sent:
                        break
                    await trio.sleep(0.2)
        served.process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            assert await served.process.wait() == 0
    responses = _samples(text, "pipework_route_responses_total")
    assert responses[(("route", "pid"), ("status_class", "2xx"))] == sent
    durations = _samples(text, "pipework_job_duration_seconds_count")
    assert durations[(("outcome", "done"), ("route", "which"))] == sent
    # Per-process state keeps a series per live worker; counts of things are summed.
    capacity = _samples(text, "pipework_event_queue_capacity")
    assert {dict(labels)["pid"] for labels in capacity} == {str(pid) for pid in workers}
    assert _samples(text, "pipework_parked_requests") == {(): 0.0}
    binary = shutil.which("promtool")
    assert binary is not None, "promtool is missing: run scripts/ensure-tools (package prometheus)"
    checked = await trio.run_process(
        [binary, "check", "metrics"],
        stdin=text.encode(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_routes_that_need_a_shared_store_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["serve", f"{__name__}:build_async_engine", "--port", "0", "--workers", "2"])
    assert status == 1
    err = capsys.readouterr().err
    assert "cannot serve with --workers 2 and the memory job store" in err
    assert "'later' (mode async)" in err
    assert "--workers 1" in err


async def test_a_worker_that_cannot_start_stops_the_server() -> None:
    command = [sys.executable, "-m", "pipework", "serve"]
    command += [f"{__name__}:build_engine_failing_in_workers", "--port", "0", "--workers", "2"]
    with trio.fail_after(90):
        done = await trio.run_process(
            command, cwd=ROOT, capture_stderr=True, check=False, stdin=subprocess.DEVNULL
        )
    assert done.returncode == 1
    assert b"before serving: stopping" in done.stderr
    assert b"this engine cannot start in a worker" in done.stderr


def test_workers_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", f"{__name__}:build_engine", "--workers", "0"])
    assert "expected a whole number of at least 1" in capsys.readouterr().err


async def test_workers_serve_tls_and_each_swaps_its_certificate_on_sighup(
    tmp_path: Path,
) -> None:
    from tests.test_server_tls import Certs, Held, der

    certs = Certs(tmp_path)
    first = certs.issued
    async with backend() as users:
        path = tmp_path / "gateway.toml"
        tls = f'[server]\ntls_cert = "{certs.cert}"\ntls_key = "{certs.key}"\n'
        path.write_text(gateway_file(users.url).replace("[server]\n", tls, 1))
        async with serving(str(path), "--workers", "2") as served:
            assert served.url.startswith("https://")
            port = int(served.url.rsplit(":", 1)[1])
            context = certs.client_context()
            async with httpx.AsyncClient(base_url=served.url, verify=context) as client:
                answer = await client.get("/users/7")
                assert answer.json()["id"] == "7"
            before = await Held.open(port, context)
            assert before.peer_certificate() == der(first)
            await before.stream.aclose()
            second = certs.issue("second")
            served.process.send_signal(signal.SIGHUP)
            with trio.fail_after(60):
                while served.stderr.count(b"SIGHUP: reloaded (plan 2)") < 2:
                    await served.more.wait()
            for _ in range(8):  # fresh connections, whichever worker takes them
                fresh = await Held.open(port, context)
                assert fresh.peer_certificate() == der(second)
                await fresh.send("/users/8")
                status, body = await fresh.answer()
                assert status == 200
                assert b'"8"' in body
                await fresh.stream.aclose()
            served.process.send_signal(signal.SIGTERM)
            with trio.fail_after(60):
                assert await served.process.wait() == 0
