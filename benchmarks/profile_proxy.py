"""Where a proxied request's time goes: py-spy samples a gateway while wrk loads it.

``python -m benchmarks.profile_proxy [KIND ...] [--seconds N] [--raw DIR]``

Starts bench_proxy's raw trio backends and each KIND of :mod:`benchmarks.peers.proxy_serve`
(``pipework`` unless named) in its own process, runs ``wrk -t2 -c32`` on GET /a through
it, samples the gateway's process with py-spy meanwhile (``pip install py-spy``; it needs
ptrace), and prints where the samples fell, as a Markdown table: each sample is charged to
the innermost frame that belongs to one of the **owners** below. Library frames (trio's
sockets and tasks, h11, the standard library) are charged to the owner that called them,
so a socket write from hypercorn is hypercorn's and one from the backend client is the
client's; what has no owner on its stack is trio's run loop itself (scheduling tasks,
polling for I/O). py-spy counts only samples in which the process was not idle.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import trio

from . import _load
from .bench_peers import wrk_a
from .bench_proxy import BACKEND, BULK, CONNECTIONS, SERVE

#: (part of a frame's file name, owner), first match wins.
OWNERS = (
    ("prometheus_client/", "metrics (prometheus_client)"),
    ("pipework/proxy/", "pipework: proxy layer"),
    ("pipework/backends/", "pipework: backend client"),
    ("pipework/dispatcher/", "pipework: pool (admission)"),
    ("pipework/_http/", "pipework: request id, problems"),
    ("pipework/container/_middleware", "pipework: request guard"),
    ("pipework/container/_hypercorn", "server: hypercorn (and pipework's fixes)"),
    ("hypercorn/", "server: hypercorn (and pipework's fixes)"),
    ("trio/_highlevel_serve_listeners", "server: hypercorn (and pipework's fixes)"),
    ("pipework/container/_h1_", "server: pipework's HTTP/1.1 server"),
    ("quart_trio/", "Quart"),
    ("quart/", "Quart"),
    ("werkzeug/", "Quart"),
    ("uvicorn/", "server: uvicorn"),
    ("starlette/", "Starlette"),
    ("httpx/", "client: httpx"),
    ("httpcore/", "client: httpx"),
    ("logging/", "logging"),
)
RUN_LOOP = "trio's run loop (scheduling, I/O polling)"
_FILE = re.compile(r"\(([^()]*?):\d+\)$")


def owner(frame: str) -> str | None:
    found = _FILE.search(frame)
    path = found.group(1) if found else frame
    return next((name for part, name in OWNERS if part in path), None)


def attribute(raw: str) -> tuple[collections.Counter[str], int]:
    """py-spy's raw output (``frame;frame;... count`` lines): samples by owner."""
    shares: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")
        found = next((name for frame in reversed(frames) if (name := owner(frame))), None)
        shares[found or (RUN_LOOP if "trio/" in frames[-1] else "other")] += samples
    return shares, total


def py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    return found


@contextlib.contextmanager
def backends() -> Iterator[tuple[str, ...]]:
    with contextlib.ExitStack() as stack:
        a, b, bulk = (
            stack.enter_context(_load.server(name, module=module))
            for name, module in (("A", BACKEND), ("B", BACKEND), ("bulk", BULK))
        )
        yield ("--a", a.url, "--b", b.url, "--bulk", bulk.url)


def profile(kind: str, args: tuple[str, ...], seconds: int, raw: Path) -> tuple[str, str]:
    """Sample ``kind`` under wrk; its load (req/s) and py-spy's raw output."""
    with _load.server(kind, *args, module=SERVE) as served:
        url = f"{served.url}/a"
        trio.run(wrk_a, url, 2, CONNECTIONS)  # warm-up
        command = [py_spy(), "record", "-p", str(served.pid), "-d", str(seconds), "-r", "200"]
        command += ["-f", "raw", "-o", str(raw), "--nonblocking"]
        spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)  # py-spy attaches
        run = trio.run(wrk_a, url, seconds - 2, CONNECTIONS)
        spy.wait()
    return run.describe(), raw.read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_proxy", description=__doc__)
    parser.add_argument("kinds", nargs="*", default=["pipework"], metavar="KIND")
    parser.add_argument("--seconds", type=int, default=20, help="how long to sample")
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's output here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch, backends() as urls:
        folder = args.raw or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for kind in args.kinds:
            load, raw = profile(kind, urls, args.seconds, folder / f"{kind}.txt")
            shares, total = attribute(raw)
            print(f"\n{kind} under wrk -t2 -c{CONNECTIONS}: {load}; {total:,} samples\n")
            print("| where | share of samples |\n|---|---:|")
            for name, samples in shares.most_common():
                print(f"| {name} | {samples / total:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
