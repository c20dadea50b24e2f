"""The pipes of the chaos harness's gateway file (:mod:`tests._chaos`): each one leaves its
effect in a ledger outside Redis, as a backend call would, so the harness can tell a job
that never ran from one that did, whatever Redis kept.

The ledger is the file named by ``PIPEWORK_CHAOS_LEDGER``: one line per pipe run,
``PIPE TOKEN PID [CALLBACK-URL]``, appended with one ``write`` on a descriptor opened with
``O_APPEND`` (lines from several processes never mix, and a process killed with SIGKILL
loses none it wrote).
"""

from __future__ import annotations

import os

import trio

import pipework as pw

#: Long enough that jobs are in their pipes when the harness strikes.
PIPE_SECONDS = 0.05


def _record(pipe: str, token: str, *more: str) -> None:
    fd = os.open(os.environ["PIPEWORK_CHAOS_LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, " ".join((pipe, token, str(os.getpid()), *more)).encode() + b"\n")
    finally:
        os.close(fd)


async def first(ctx: pw.Context) -> None:
    _record("first", ctx.state["token"])
    await trio.sleep(PIPE_SECONDS)
    ctx.state["first_by"] = os.getpid()


async def second(ctx: pw.Context) -> None:
    """Under another key than :func:`first`: every job is handed off once."""
    _record("second", ctx.state["token"])
    await trio.sleep(PIPE_SECONDS)
    ctx.state["answer"] = {"token": ctx.state["token"], "approval": ctx.state.get("approval")}


#: How long :func:`hold` waits for its signal: long enough for one sent through strikes.
HOLD_SECONDS = 45


async def hold(ctx: pw.Context) -> None:
    """Waits for the signal ``go`` (a signal sent before it suspends is kept for it). Its
    callback URL goes in the ledger too: a job whose client got no answer (its process was
    killed) is called back by the harness, as its backend would."""
    _record("hold", ctx.state["token"], ctx.callback_url("go", ttl=600))
    await ctx.suspend("go", into="approval", timeout=HOLD_SECONDS)
