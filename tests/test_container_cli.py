"""The ``pipework`` command: ``--version``, loading the engine, and ``serve`` as a real
process that answers requests and exits cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

import pipework as pw
from pipework.__main__ import load_engine, main

ROOT = Path(__file__).resolve().parent.parent
NOT_AN_ENGINE = 42


def build_engine() -> pw.Engine:
    """The factory the ``serve`` test names on the command line."""
    registry = pw.Registry()
    engine = pw.Engine(registry=registry)

    @engine.pipe
    async def hello(ctx: pw.Context) -> None:
        ctx.state["greeting"] = f"hello {ctx.state['name']}"

    engine.chain("hello", hello, result="greeting")
    registry.route("hello", path="/hello/{name}", chain="hello")
    return engine


ENGINE = build_engine()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pipework {pw.__version__}"


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "message"),
    [
        pytest.param("no_colon", "expected MODULE:FACTORY", id="no-colon"),
        pytest.param("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'", id="module"),
        pytest.param(f"{__name__}:missing", "has no 'missing'", id="attribute"),
        pytest.param(f"{__name__}:NOT_AN_ENGINE", "gave int, expected an Engine", id="type"),
    ],
)
def test_bad_targets_say_what_is_wrong(target: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        load_engine(target)


def test_target_is_a_factory_or_an_engine() -> None:
    registry = load_engine(f"{__name__}:build_engine").registry
    assert isinstance(registry, pw.Registry)
    assert "hello" in registry.routes
    assert load_engine(f"{__name__}:ENGINE") is ENGINE


async def _read_line(stream: trio.abc.ReceiveStream, prefix: bytes, seen: bytearray) -> str:
    """Read ``stream`` into ``seen`` until a whole line starting with ``prefix`` is there;
    return the rest of that line."""
    while True:
        _, found, rest = seen.partition(prefix)
        if found and b"\n" in rest:
            return rest.split(b"\n", 1)[0].decode().strip()
        chunk = await stream.receive_some()
        assert chunk, f"the process closed stderr before {prefix!r}: {seen.decode()}"
        seen += chunk


async def test_serve_answers_and_exits_cleanly_on_sigterm() -> None:
    command = [sys.executable, "-m", "pipework", "serve", f"{__name__}:build_engine", "--port", "0"]
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    process = await trio.lowlevel.open_process(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert process.stderr is not None
    seen = bytearray()
    try:
        # A bound for a hang: a fresh interpreter importing the server takes seconds alone,
        # and several times that on two cores shared with a second test run.
        with trio.fail_after(100):
            url = await _read_line(process.stderr, b"pipework serving on ", seen)
            async with httpx.AsyncClient(base_url=url) as client:
                response = await client.post("/hello/ada")
            process.send_signal(signal.SIGTERM)
            while chunk := await process.stderr.receive_some():
                seen += chunk
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert response.json() == "hello ada"
    assert b"SIGTERM: shutting down gracefully" in seen
    assert b"Traceback" not in seen
