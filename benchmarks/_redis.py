"""A throwaway ``redis-server`` for a benchmark run: a free port, no persistence."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def redis_server(who: str) -> Iterator[str]:
    """Start a local Redis and yield its URL; ``who`` names the benchmark in the error."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(f"{who} needs redis-server (scripts/ensure-tools installs it)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix=f"pipework-{who}-") as directory:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", directory,
                "--save", "", "--appendonly", "no"]  # fmt: skip
        process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(500):
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    time.sleep(0.01)  # the server is starting; this is outside any trio run
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(timeout=10)
