"""A gateway that cannot start says why in one line on stderr and exits 1, without a
traceback (``--debug`` shows it): a bad file, an unset ``url_env``, Redis absent, the port
in use. Each case runs ``python -m pipework serve`` and compares its stderr whole."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: A process that should fail at start is given this long (the hang guard).
HANG_GUARD = 60.0

ROUTES = """
[pipes.hello]
python = "tests.test_config_corpus:enrich"

[routes.hello]
method = "GET"
path = "/hello"
chain = ["hello"]
"""


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    command = [sys.executable, "-m", "pipework", "serve", *args]
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STARTUP_TEST_")}
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        check=False,
    )
    return done.returncode, done.stderr


@pytest.fixture
def unused_port() -> int:
    """A port nothing listens on (bound, then closed: the kernel hands it out again only
    after the others)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_a_bad_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text("[routes\n")
    status, err = serve(str(path), "--port", "0")
    assert (status, err) == (
        1,
        f"{path}:1: error: invalid TOML: Expected ']' at the end of a table declaration "
        "(column 8)\n",
    )


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    status, err = serve(str(path), "--port", "0")
    assert (status, err) == (1, f"{path}: error: cannot read the file: No such file or directory\n")


def test_an_unset_url_env_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[store]\nbackend = "redis"\nurl_env = "STARTUP_TEST_REDIS"\n' + ROUTES)
    status, err = serve(str(path), "--port", "0")
    assert (status, err) == (
        1,
        f"{path}:3: error: store.url_env: names the environment variable "
        "'STARTUP_TEST_REDIS', which is not set: the job store has no URL\n",
    )


def test_redis_absent_is_one_line_and_debug_shows_the_traceback(
    tmp_path: Path, unused_port: int
) -> None:
    path = tmp_path / "gateway.toml"
    url = f"redis://127.0.0.1:{unused_port}/0"
    path.write_text(f'[store]\nbackend = "redis"\nurl = "{url}"\n' + ROUTES)
    status, err = serve(str(path), "--port", "0")
    assert (status, err) == (
        1,
        f"pipework: cannot start: the job store at {url} cannot be reached (all attempts to "
        f"connect to 127.0.0.1:{unused_port} failed); retry later\n",
    )
    status, err = serve(str(path), "--port", "0", "--debug")
    assert status == 1
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().endswith("+------------------------------------")
    assert f"pipework.StoreUnavailable: the job store at {url} cannot be reached" in err


def test_a_port_in_use_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(ROUTES)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, err = serve(str(path), "--port", str(port))
        factory = serve("tests.test_container_cli:build_engine", "--port", str(port))
    line = f"pipework: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert (status, err) == (1, line)
    assert factory == (1, line)


def test_json_logs_say_it_in_one_json_line(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text('[store]\nbackend = "redis"\nurl_env = "STARTUP_TEST_REDIS"\n' + ROUTES)
    status, err = serve(str(path), "--port", "0", "--log-format", "json")
    assert status == 1
    (line,) = err.splitlines()
    assert '"event": "start failed"' in line
    assert "STARTUP_TEST_REDIS" in line
