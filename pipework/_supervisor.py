"""``pipework serve --workers N``: N serving processes behind one port, and their parent.

The parent binds the listening socket once and hands it to every worker, a child process
running ``pipework serve`` on that socket (``--listen-fd``). One accept queue feeds them
all: a worker that dies loses only the connections it had accepted, never those still
waiting in the queue (with ``SO_REUSEPORT`` each process has its own queue, and a dying
one's waiting connections are reset), and the port stays the same across respawns, even
with ``--port 0``.

The parent serves no request. It starts the workers and waits until each says it serves
(a byte on a pipe), respawns a worker that dies (after a backoff that doubles while
workers keep dying young), forwards SIGHUP (reload) to every worker, and on SIGINT or
SIGTERM asks every worker to shut down gracefully and waits for them; a second signal is
forwarded too (a worker then stops at once), and a worker still running well after its
grace period is killed. Workers run in their own process group, so a terminal's Ctrl-C
reaches the parent only, and each worker stops on its own if the parent disappears.

Metrics: the parent makes (or wipes) the directory of prometheus-client's multiprocess
mode and gives it to the workers as ``PROMETHEUS_MULTIPROC_DIR``; see
:mod:`pipework._metrics`.

Callback URLs: a URL one worker signs may reach any other, so the parent makes one random
secret at start and hands it to every worker (a respawned one too) in the environment,
``PIPEWORK_WORKERS_CALLBACK_SECRET`` — never on a command line, never logged. A worker
signs with it unless a secret is configured, or the job store keeps one for every process
sharing it (:mod:`pipework.container._callbacks`).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Final

import trio
from prometheus_client.multiprocess import mark_process_dead

from .container._callbacks import WORKERS_SECRET_ENV

__all__ = ["MULTIPROC_ENV", "PARENT_ENV", "Supervisor", "listen", "metrics_directory"]

_log = logging.getLogger("pipework.supervisor")

#: Where the workers' metric files live (prometheus-client reads this name).
MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
#: The parent's pid, so that a worker notices when its parent is gone.
PARENT_ENV: Final = "PIPEWORK_SUPERVISOR_PID"
#: A worker's first respawn waits this long; each young death doubles it, up to the cap.
FIRST_BACKOFF: Final = 0.5
MAX_BACKOFF: Final = 30.0
#: A worker that served this long died of something else than a bad start: the backoff
#: starts again from the first delay.
HEALTHY_RUN: Final = 10.0
#: How long past its grace period a stopping worker may take before it is killed.
KILL_MARGIN: Final = 10.0
#: What a worker writes on its ready pipe once it serves.
READY: Final = b"ready\n"


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: a free one), inheritable by the
    workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def metrics_directory(environ: dict[str, str]) -> tuple[str, bool]:
    """The multiprocess metrics directory, emptied, and whether this run made it (then it
    is removed at the end): ``PROMETHEUS_MULTIPROC_DIR`` when set, else a temporary one."""
    given = environ.get(MULTIPROC_ENV)
    if not given:
        return tempfile.mkdtemp(prefix="pipework-metrics-"), True
    os.makedirs(given, exist_ok=True)
    # Files left by an earlier run would add its counts to this one's.
    for path in glob.glob(os.path.join(given, "*.db")):
        os.remove(path)
    return given, False


class Supervisor:
    """Runs ``workers`` processes made by ``command(listen_fd, ready_fd)`` and keeps them
    running until SIGINT or SIGTERM."""

    def __init__(
        self,
        command: Callable[[int, int], Sequence[str]],
        *,
        workers: int,
        sock: socket.socket,
        url: str,
        grace: float,
        announce: Callable[[str], None] | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self._command = command
        self._workers = workers
        self._sock = sock
        self._url = url
        self._grace = grace
        self._announce = announce or _print
        self._environ = dict(os.environ if environ is None else environ)
        self._processes: dict[int, trio.Process] = {}
        self._stopping = trio.Event()
        self._ready: set[int] = set()  # workers that have served, while starting
        self._started = False  # every worker served once: the server is up
        self._failed = False  # a worker exited before it served, while starting

    async def run(self) -> int:
        """Serve until signalled; 0 after a clean stop, 1 if a worker failed to start."""
        directory, made = metrics_directory(self._environ)
        self._environ[MULTIPROC_ENV] = directory
        self._environ[PARENT_ENV] = str(os.getpid())
        self._environ[WORKERS_SECRET_ENV] = secrets.token_urlsafe(32)
        self._metrics_dir = directory
        try:
            return await self._run()
        finally:
            if made:
                shutil.rmtree(directory, ignore_errors=True)

    async def _run(self) -> int:
        async with trio.open_nursery() as nursery:
            await nursery.start(self._watch_signals)
            async with trio.open_nursery() as workers:
                for index in range(self._workers):
                    workers.start_soon(self._keep, index)
            nursery.cancel_scope.cancel()  # every worker has exited: stop watching signals
        return 1 if self._failed else 0

    def _served(self, index: int) -> None:
        self._ready.add(index)
        if len(self._ready) == self._workers:
            self._started = True
            # The line a supervisor of our own (or a test) waits for, as `serve` writes it.
            self._announce(f"pipework serving on {self._url} ({self._workers} workers)")

    async def _keep(self, index: int) -> None:
        """Worker ``index``: start it, and start it again whenever it dies, until stopped."""
        young_deaths = 0
        while not self._stopping.is_set():
            began = trio.current_time()
            process, served = await self._spawn(index)
            if served and not self._started:
                self._served(index)
            code = await process.wait()
            del self._processes[index]
            # prometheus-client leaves it unannotated
            mark_process_dead(process.pid, self._metrics_dir)  # type: ignore[no-untyped-call]  # untyped in prometheus-client
            if self._stopping.is_set():
                _log.info("worker %d (pid %d) stopped", index, process.pid)
                return
            if not self._started and not served:
                _log.error(
                    "worker %d (pid %d) exited with %s before serving: stopping",
                    index,
                    process.pid,
                    _describe(code),
                )
                self._failed = True
                self._stop()
                return
            young_deaths = young_deaths + 1 if trio.current_time() - began < HEALTHY_RUN else 0
            delay = min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** max(0, young_deaths - 1))
            _log.warning(
                "worker %d (pid %d) exited with %s; starting another in %.1fs",
                index,
                process.pid,
                _describe(code),
                delay,
            )
            with trio.move_on_after(delay):
                await self._stopping.wait()

    async def _spawn(self, index: int) -> tuple[trio.Process, bool]:
        """Start worker ``index``; returns it once it serves (True) or has exited (False)."""
        listen_fd = self._sock.fileno()
        read_fd, write_fd = os.pipe()
        try:
            process = await trio.lowlevel.open_process(
                list(self._command(listen_fd, write_fd)),
                pass_fds=(listen_fd, write_fd),
                env=self._environ,
                stdin=subprocess.DEVNULL,
                process_group=0,  # a terminal's Ctrl-C goes to the parent only
            )
        finally:
            os.close(write_fd)
        self._processes[index] = process
        if self._stopping.is_set():  # stopped while it was starting
            process.send_signal(signal.SIGTERM)
        _log.info("worker %d started (pid %d)", index, process.pid)
        said = bytearray()
        async with trio.lowlevel.FdStream(read_fd) as pipe:
            while chunk := await pipe.receive_some():
                said += chunk
        return process, bytes(said) == READY

    def _stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._send(signal.SIGTERM)

    def _send(self, signum: int) -> None:
        for process in list(self._processes.values()):
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # it has just exited
                    process.send_signal(signum)

    async def _watch_signals(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            task_status.started()
            async with trio.open_nursery() as nursery:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if signum == signal.SIGHUP:
                        _log.info("SIGHUP: asking %d workers to reload", len(self._processes))
                        self._send(signal.SIGHUP)
                    elif not self._stopping.is_set():
                        _log.info("%s: shutting down %d workers gracefully", name, self._workers)
                        self._stop()
                        nursery.start_soon(self._kill_after, self._grace + KILL_MARGIN)
                    else:
                        _log.warning("second %s: asking the workers to stop now", name)
                        self._send(signal.SIGTERM)

    async def _kill_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        if self._processes:
            _log.error(
                "%d workers still running %gs after SIGTERM: killing them",
                len(self._processes),
                seconds,
            )
            self._send(signal.SIGKILL)


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"
