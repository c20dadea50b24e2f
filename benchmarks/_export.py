"""Peak memory of an export, measured from outside the process that does it.

Two subjects, each a child process measured the same way:

- **pipework**: the export example itself (``python -m examples.export.run``), driven over
  HTTP as a user would: ``POST /exports``, then follow ``GET /jobs/{id}/events`` to the end;
- **bare**: ``python -m benchmarks._export_bare``, a plain loop that reads the same rows with
  ``sqlite3`` (``fetchmany(1000)``) and writes them with ``csv`` (no trio, no HTTP).

Each child is first brought to idle (serving, or ready to start); then its resident set
(VmRSS) is read, its peak (VmHWM) reset to that through ``/proc/PID/clear_refs``, the
export run, and VmHWM read again: **growth** is the peak during the export over idle. The
reset means start-up's own peak cannot hide the export's; where the kernel refuses it, the
peak since start is used (then growth can only be overstated, never understated).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
import trio

ROOT: Final = Path(__file__).resolve().parent.parent
SERVING: Final = b"pipework export example serving on "
START_TIMEOUT: Final = 60.0
EXPORT_TIMEOUT: Final = 600.0


@dataclass(frozen=True, slots=True)
class Measured:
    """One export in a child process: memory in KB, wall and CPU time (the child's user
    plus system time) in seconds, rows written."""

    idle_kb: int
    peak_kb: int
    seconds: float
    cpu_seconds: float
    rows: int

    @property
    def growth_kb(self) -> int:
        return max(0, self.peak_kb - self.idle_kb)


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def idle_then_reset(pid: int) -> int:
    """The process's resident set now (KB), with its peak reset to it where allowed."""
    idle = _status(pid, "VmRSS")
    with contextlib.suppress(OSError):  # not allowed here: the peak since start is used
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    return idle


def peak(pid: int) -> int:
    return _status(pid, "VmHWM")


def cpu_seconds(pid: int) -> float:
    """The process's user plus system CPU time so far: other processes' load on the
    machine does not change it, as it changes wall time."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.asynccontextmanager
async def _child(args: list[str]) -> AsyncIterator[trio.Process]:
    with tempfile.TemporaryFile() as errors:
        process = await trio.lowlevel.open_process(
            [sys.executable, *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
        )
        try:
            yield process
        except BaseException as exc:
            errors.seek(0)
            tail = errors.read()[-2000:].decode(errors="replace")
            if tail:
                exc.add_note(f"the child's stderr ends with:\n{tail}")
            raise
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.terminate()
                with trio.move_on_after(10):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def _line_starting(stream: trio.abc.ReceiveStream, prefix: bytes) -> bytes:
    """The rest of the first line of ``stream`` that starts with ``prefix``."""
    pending = b""
    async for chunk in stream:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
    raise RuntimeError(f"the child ended without printing {prefix!r}")


async def pipework_export(data: Path, rows: int, form: str = "csv") -> Measured:
    """Export every order of ``data``/orders.sqlite3 (``rows`` of them, made beforehand)
    through the example's HTTP API in a child process, to a ``form`` file (csv, xlsx)."""
    args = ["-m", "examples.export.run", "--rows", str(rows), "--port", "0"]
    args += ["--data", str(data), "--log-level", "WARNING"]
    async with _child(args) as process:
        assert process.stdout is not None
        with trio.fail_after(START_TIMEOUT):
            url = (await _line_starting(process.stdout, SERVING)).decode()
        async with httpx.AsyncClient(base_url=url, timeout=30.0, trust_env=False) as client:
            (await client.get("/readyz")).raise_for_status()
            idle = idle_then_reset(process.pid)
            cpu = cpu_seconds(process.pid)
            started = time.perf_counter()
            accepted = await client.post("/exports", json={"format": form})
            accepted.raise_for_status()
            job_id, token = accepted.json()["id"], accepted.json()["token"]
            auth = {"Authorization": f"Bearer {token}"}
            with trio.fail_after(EXPORT_TIMEOUT):
                status = await _follow_to_end(client, f"/jobs/{job_id}/events", auth)
            seconds = time.perf_counter() - started
            high = peak(process.pid)
            cpu = cpu_seconds(process.pid) - cpu
            if status != "done":
                raise RuntimeError(f"the export ended {status}")
            result = (await client.get(f"/jobs/{job_id}/result", headers=auth)).json()
    return Measured(idle, high, seconds, cpu, int(result["rows"]))


async def _follow_to_end(client: httpx.AsyncClient, path: str, headers: dict[str, str]) -> str:
    """Follow a job's event stream to its final state; that state's status."""
    status = ""
    async with client.stream("GET", path, headers=headers, timeout=None) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                status = json.loads(line[5:])["data"]["status"]
    return status


async def bare_export(source: Path, out: Path) -> Measured:
    """The same rows with sqlite3 and csv in a plain loop, in a child process."""
    args = ["-m", "benchmarks._export_bare", str(source), str(out)]
    async with _child(args) as process:
        assert process.stdout is not None
        assert process.stdin is not None
        with trio.fail_after(START_TIMEOUT):
            await _line_starting(process.stdout, b"ready")
        idle = idle_then_reset(process.pid)
        cpu = cpu_seconds(process.pid)
        started = time.perf_counter()
        await process.stdin.send_all(b"go\n")
        with trio.fail_after(EXPORT_TIMEOUT):
            rows = int(await _line_starting(process.stdout, b"done "))
        seconds = time.perf_counter() - started
        high = peak(process.pid)
        cpu = cpu_seconds(process.pid) - cpu
    return Measured(idle, high, seconds, cpu, rows)
