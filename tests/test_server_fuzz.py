"""Whatever bytes a client sends, ``pipework serve`` survives them and answers in HTTP.

A live ``pipework serve`` process on a real port (``tests/_socket_fuzz_gateway.py``: every
route kind, the job API, a callback, a board, the admin API, and proxy routes to backends
in a process of their own) is sent byte streams built from valid requests and then broken:
trailing bytes, pipelining, truncation, both framings at once, bad chunk sizes, bad
versions and methods, byte flips, insertions and cuts, sent in pieces and ended by
reading, a half-close, a close or a reset, on kept-alive connections and ``Connection:
close`` ones. After each example the process is alive, every answer is well-formed
HTTP/1.1 with a reason phrase, every error of the gateway's own a problem document (a proxy
route relays its backend's answers as they are), no 5xx came of the client's bytes (only
501 and 505, which say the client asked for what is not served, and on a proxy route the
502 and 504 of its backend's failures, or a 503 for no slot), nothing was logged as an
error, and a normal request is still served, directly and through a proxy route.

``PIPEWORK_FUZZ_EXAMPLES`` sets the number of examples (default 40); nightly runs use
more, e.g. ``PIPEWORK_FUZZ_EXAMPLES=5000 .venv/bin/pytest tests/test_server_fuzz.py``.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import urlsplit

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipework.container._server import HTTP1_SERVERS

from . import _socket_fuzz_gateway as gateway
from ._raw_http import Answer, Malformed, split_answers

ROOT: Final = Path(__file__).resolve().parent.parent
EXAMPLES: Final = int(os.environ.get("PIPEWORK_FUZZ_EXAMPLES", "40"))
# A bound on each exchange, for a server that never closes a connection the client ended.
EXCHANGE_BOUND: Final = 30.0
# How long a reading client waits for more before it ends its side (not an assertion: a
# slow answer only makes the example see less).
IDLE: Final = 0.3
# How long a client that ended its side reads on before it closes the connection.
AFTER_EOF: Final = 3.0
# 5xx answers that are about what the client asked for, not a failure of the server.
CLIENT_CAUSED_5XX: Final = frozenset({501, 505})
# 5xx answers a proxy route gives for its backend's failures (the broken backend's 502, the
# hanging one's 504) or when the pool refuses it a slot (503).
BACKEND_FAILED_5XX: Final = frozenset({502, 503, 504})


# -- the live server -------------------------------------------------------------------


class Live:
    """A ``pipework serve`` process, its log (read by a thread as it comes), and the jobs
    and resources made for the fuzz."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.port = 0
        self.log: list[str] = []
        self._checked = 0
        self._grown = threading.Condition()
        self.done_job = ("", "")
        self.waiting_job = ("", "")
        self.callback = ""
        self.resource = ""

    def __repr__(self) -> str:  # hypothesis shows it with each failure: no log there
        return f"Live(port={self.port}, pid={self.process.pid})"

    def drain(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            with self._grown:
                self.log.append(raw.decode("utf-8", "replace"))
                self._grown.notify_all()

    def wait_for_line(self, part: str) -> list[str]:
        """Every line logged since the last call, up to one holding ``part``."""
        with self._grown:
            found = self._grown.wait_for(
                lambda: any(part in line for line in self.log[self._checked :]), EXCHANGE_BOUND
            )
            assert found, f"{part!r} never logged: {''.join(self.log[-40:])}"
            lines = self.log[self._checked :]
            self._checked = len(self.log)
        return lines


class Backends:
    """The proxy routes' backends, in a process of their own, on sockets bound here."""

    def __init__(self) -> None:
        self.sockets = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
        self.urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in self.sockets]
        fds = [s.fileno() for s in self.sockets]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests._socket_fuzz_gateway", *map(str, fds)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            pass_fds=fds,
        )
        for listening in self.sockets:
            listening.close()  # the process has its own

    def wait_ready(self) -> None:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        assert line.startswith(gateway.BACKENDS_READY), f"the backends did not start: {line!r}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        assert self.process.stdout is not None
        self.process.stdout.close()


@pytest.fixture(scope="module", params=HTTP1_SERVERS)
def live(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Live]:
    """The gateway, on each HTTP/1.1 server it can serve with (``[server] http1_server``)."""
    path = tmp_path_factory.mktemp("fuzz") / "gateway.toml"
    backends = Backends()  # the two processes start at once
    try:
        text = gateway.gateway_file(*backends.urls)
        chosen = f'[server]\nhttp1_server = "{request.param}"\n'
        path.write_text(text.replace("[server]\n", chosen, 1))
        yield from _serving(path, backends)
    finally:
        backends.stop()


def _serving(path: Path, backends: Backends) -> Iterator[Live]:
    command = [sys.executable, "-m", "pipework", "serve", str(path)]
    env = {**os.environ, **gateway.ENVIRONMENT}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    server = Live(process)
    drain = threading.Thread(target=server.drain, daemon=True)
    drain.start()
    try:
        serving = server.wait_for_line("pipework serving on ")
        server.port = urlsplit(serving[-1].split()[-1]).port or 0
        backends.wait_ready()
        trio.run(_prepare, server)
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)
        drain.join()
        assert process.stderr is not None
        process.stderr.close()


async def _prepare(live: Live) -> None:
    """Make what the fuzz's requests name: a finished job, a job waiting for a callback,
    and a board resource."""
    with trio.fail_after(EXCHANGE_BOUND):
        answer = await _one(live.port, _request("POST", "/async", body=b'{"a": 1}'))
        assert answer.status == 202, answer
        live.done_job = (answer.json()["id"], (answer.header(b"x-job-token") or b"").decode())
        answer = await _one(live.port, _request("POST", "/wait", body=b"{}"))
        assert answer.status == 202, answer
        job, token = answer.json()["id"], (answer.header(b"x-job-token") or b"").decode()
        live.waiting_job = (job, token)
        while not live.callback:
            status = await _one(live.port, _request("GET", f"/jobs/{job}", auth=token))
            message = (status.json().get("progress") or {}).get("message") or ""
            if status.json()["status"] == "suspended" and message:
                parts = urlsplit(message)
                live.callback = f"{parts.path}?{parts.query}"
            else:
                await trio.sleep(0.05)  # polling the job's own status for its suspension
        created = await _one(
            live.port,
            _request("POST", "/boards/notes", body=b'{"n": 1}', auth=gateway.BOARD_TOKEN),
        )
        assert created.status == 201, created
        live.resource = created.json()["id"]


# -- requests --------------------------------------------------------------------------


@dataclass
class Request:
    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    framing: str = "length"  # "length", "chunked" or "none"
    close: bool = False
    version: bytes = b"1.1"
    after: bytes = b""  # raw bytes sent right after the request (websocket frames)

    def encode(self) -> bytes:
        head = [self.method + b" " + self.target + b" HTTP/" + self.version]
        head += [b"Host: fuzz"]
        head += [name + b": " + value for name, value in self.headers]
        body = self.body
        if self.framing == "length":
            head.append(b"Content-Length: " + str(len(body)).encode())
        elif self.framing == "chunked":
            head.append(b"Transfer-Encoding: chunked")
            body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
        if self.close:
            head.append(b"Connection: close")
        return b"\r\n".join(head) + b"\r\n\r\n" + body + self.after


def _request(
    method: str,
    target: str,
    *,
    body: bytes | None = None,
    auth: str | None = None,
    content_type: bytes = b"application/json",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> Request:
    extra = list(headers or [])
    if auth is not None:
        extra.append((b"Authorization", b"Bearer " + auth.encode()))
    if body is not None:
        extra.append((b"Content-Type", content_type))
    framing = "length" if body is not None else "none"
    return Request(method.encode(), target.encode(), extra, body or b"", framing)


def _websocket(target: str) -> Request:
    return _request(
        "GET",
        target,
        headers=[
            (b"Upgrade", b"websocket"),
            (b"Connection", b"Upgrade"),
            (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
            (b"Sec-WebSocket-Version", b"13"),
        ],
    )


def _frame(opcode: int, payload: bytes, *, masked: bool = True, fin: bool = True) -> bytes:
    head = bytes([(0x80 if fin else 0) | opcode])
    mask_bit = 0x80 if masked else 0
    if len(payload) < 126:
        head += bytes([mask_bit | len(payload)])
    else:
        head += bytes([mask_bit | 126]) + struct.pack("!H", len(payload))
    if not masked:
        return head + payload
    key = b"\x01\x02\x03\x04"
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


def vocabulary(live: Live) -> list[Request]:
    """Valid requests to every kind of endpoint."""
    done, done_token = live.done_job
    waiting, waiting_token = live.waiting_job
    resource = live.resource
    admin = gateway.ADMIN_TOKEN
    board = gateway.BOARD_TOKEN
    return [
        _request("POST", "/sync", body=b'{"a": 1}'),
        _request(
            "POST", "/sync?x=2", body=msgpack.packb({"a": 1}), content_type=b"application/msgpack"
        ),
        _request("POST", "/sync", body=b"hello", content_type=b"text/plain"),
        _request("POST", "/sync", body=b'{"a": '),
        _request("GET", "/items/7?x=1"),
        _request("PUT", "/items/7", body=b'{"b": [1, 2]}'),
        _request("POST", "/async", body=b"{}", headers=[(b"Idempotency-Key", b"fuzz-1")]),
        _request("POST", "/stream", body=b"{}"),
        _request("POST", "/auto", body=b"{}", headers=[(b"Prefer", b"respond-async, wait=0")]),
        _request("GET", f"/jobs/{done}", auth=done_token),
        _request("GET", f"/jobs/{done}/result", headers=[(b"X-Job-Token", done_token.encode())]),
        _request("GET", f"/jobs/{done}/events", auth=done_token),
        _request("GET", f"/jobs/{done}", auth="wrong"),
        _request("GET", f"/jobs/{waiting}/events", auth=waiting_token),
        _request("POST", f"/jobs/{waiting}/signals/go", body=b'{"ok": 1}', auth=waiting_token),
        _request("POST", live.callback, body=b'{"paid": true}'),
        _request("POST", f"/callbacks/{waiting}/go?exp=1&sig=AAAA", body=b"{}"),
        _request(
            "GET", "/jobs/events", headers=[(b"X-Job-Tickets", f"{done}:{done_token}".encode())]
        ),
        _request("POST", "/boards/notes", body=b'{"n": 2}', auth=board),
        _request("GET", f"/boards/notes/{resource}"),
        _request("GET", f"/boards/notes/{resource}?since=0-0&wait=1"),
        _request("GET", f"/boards/notes/{resource}", headers=[(b"Accept", b"text/event-stream")]),
        _request("PUT", f"/boards/notes/{resource}", body=b'{"n": 3}', auth=board),
        _request("PUT", f"/boards/notes/{resource}", body=b'{"n": 3}', auth="\xe9"),
        _request("DELETE", "/boards/notes/nothing-here", auth=board),
        _websocket(f"/boards/notes/{resource}"),
        _request("GET", "/admin/pool", auth=admin),
        _request("PUT", "/admin/pool/keys/default", body=b'{"wait_timeout": 5}', auth=admin),
        _request("GET", "/admin/pool", auth="not-the-token"),
        _request("GET", "/healthz"),
        _request("GET", "/metrics"),
        _request("GET", "/ui/jobs"),
        _request("OPTIONS", "/sync"),
        _request("POST", "/nope", body=b"{}"),
        _request("PATCH", "/sync", body=b"{}"),
        # Proxy routes: passed to the echo backend as they come, answers relayed.
        _request("GET", "/proxy/echo/a%2Fb?x=1&y=%20", headers=[(b"Cookie", b"a=1")]),
        _request("POST", "/proxy/echo", body=b"\x00\xffbytes", content_type=b"image/png"),
        _request("PUT", "/proxy/upload", body=b"u" * 3000, content_type=b"text/plain"),
        _request("POST", "/proxy/upload", body=b"v" * 70_000, content_type=b"text/plain"),
        _request("GET", "/proxy/download?n=100000"),
        _request("GET", "/proxy/download?n=70000&chunked=1"),
        _request("DELETE", "/proxy/status/404"),
        _request("GET", "/proxy/status/204"),
        _request("PROPFIND", "/proxy/echo", headers=[(b"Connection", b"X-Hop"), (b"X-Hop", b"1")]),
        _request("OPTIONS", "/proxy"),
        _request("GET", "/proxy/../admin/pool", auth=admin),
        _request("GET", "/hang"),
        _request("POST", "/broken/x", body=b"{}"),
        _websocket("/proxy/chat"),
    ]


_GARBAGE = st.binary(min_size=1, max_size=64) | st.sampled_from(
    [b"YYYY", b"\r\n", b"GET / HTTP/1.1\r\n", b"\x00\xff", b"0\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n"]
)


@st.composite
def variant(draw: st.DrawFn, request: Request) -> Request:
    """``request``, maybe changed the way attackers and broken clients change requests."""
    r = Request(**{**request.__dict__, "headers": list(request.headers)})
    r.close = draw(st.booleans())
    change = draw(
        st.sampled_from(
            [
                "none", "none", "none", "chunked", "both-framings", "te-on-1.0", "http-1.0",
                "lowercase-method", "version", "two-hosts", "expect-continue", "length-short",
                "length-long", "length-bad", "bad-chunk", "long-header", "bare-lf",
                "websocket-frames", "trailing",
            ]
        )
    )  # fmt: skip
    if change == "chunked":
        r.framing = "chunked"
    elif change == "both-framings":
        r.framing = "chunked"
        r.headers.append((b"Content-Length", str(len(r.body)).encode()))
    elif change == "te-on-1.0":
        r.version, r.framing = b"1.0", "chunked"
    elif change == "http-1.0":
        r.version = b"1.0"
    elif change == "lowercase-method":
        r.method = r.method.lower()
    elif change == "version":
        r.version = draw(st.sampled_from([b"9.9", b"2.0", b"0.9", b"1.2", b"1.", b"11"]))
    elif change == "two-hosts":
        r.headers.append((b"Host", b"other"))
    elif change == "expect-continue":
        r.headers.append((b"Expect", b"100-continue"))
    elif change in ("length-short", "length-long", "length-bad"):
        r.framing = "none"
        size = {"length-short": max(0, len(r.body) - 2), "length-long": len(r.body) + 5}
        value = str(size[change]).encode() if change in size else draw(
            st.sampled_from([b"-1", b"abc", b"1, 2", b"99999999999999999999", b" "])
        )  # fmt: skip
        r.headers.append((b"Content-Length", value))
    elif change == "bad-chunk":
        r.framing = "none"
        r.headers.append((b"Transfer-Encoding", b"chunked"))
        r.body = draw(st.sampled_from([b"zz\r\nab\r\n0\r\n\r\n", b"3\r\nabcdef\r\n", b"-1\r\n"]))
    elif change == "long-header":
        r.headers.append((b"X-Long", b"a" * draw(st.integers(8_000, 40_000))))
    elif change == "websocket-frames":
        r.after = draw(
            st.sampled_from(
                [
                    _frame(0x1, b"hello"),
                    _frame(0x1, b"\xff\xfe"),
                    _frame(0x1, b"hi", masked=False),
                    _frame(0x3, b"x"),
                    _frame(0x9, b"p", fin=False),
                    _frame(0x8, b"\x03\xe8"),
                ]
            )
        )
    elif change == "trailing":
        r.after = draw(_GARBAGE)
    if change == "bare-lf":
        return _BareLf(r)
    return r


class _BareLf(Request):
    def __init__(self, request: Request) -> None:
        super().__init__(**request.__dict__)

    def encode(self) -> bytes:
        return super().encode().replace(b"\r\n", b"\n")


@st.composite
def conversation(draw: st.DrawFn, live: Live) -> tuple[list[bytes], str]:
    """The pieces a client sends on one connection, and how it ends it."""
    base = st.sampled_from(vocabulary(live))
    requests = draw(st.lists(base.flatmap(lambda r: variant(r)), min_size=1, max_size=3))
    data = b"".join(r.encode() for r in requests)
    mutation = draw(st.sampled_from(["none", "none", "flip", "insert", "cut", "truncate"]))
    if mutation != "none" and data:
        at = draw(st.integers(0, len(data) - 1))
        if mutation == "flip":
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
        elif mutation == "insert":
            data = data[:at] + draw(_GARBAGE) + data[at:]
        elif mutation == "cut":
            data = data[:at] + data[at + draw(st.integers(1, 16)) :]
        else:
            data = data[:at]
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    ending = draw(st.sampled_from(["read", "read", "half-close", "close", "reset"]))
    return [p for p in pieces if p], ending


# -- one exchange ----------------------------------------------------------------------


@dataclass
class Outcome:
    received: bytes
    server_ended_first: bool
    reset: bool


async def exchange(port: int, pieces: list[bytes], ending: str) -> Outcome:
    received = bytearray()
    server_ended_first = reset = False
    with trio.fail_after(EXCHANGE_BOUND):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            try:
                for piece in pieces:
                    await stream.send_all(piece)
                    await trio.lowlevel.checkpoint()
            except trio.BrokenResourceError:
                reset = True  # the server closed first and the kernel said so
            if ending == "close":
                return Outcome(bytes(received), False, reset)
            if ending == "reset":
                stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return Outcome(bytes(received), False, reset)
            try:
                if ending == "until-closed":
                    while chunk := await stream.receive_some():
                        received += chunk
                    return Outcome(bytes(received), True, reset)
                if ending == "read":
                    while True:
                        with trio.move_on_after(IDLE):
                            chunk = await stream.receive_some()
                            if not chunk:
                                server_ended_first = True
                                break
                            received += chunk
                            continue
                        break  # quiet: end our side and read the rest
                if not server_ended_first:
                    try:
                        await stream.send_eof()
                    except trio.BrokenResourceError:
                        reset = True
                    # An end of file is the client leaving, which ends its requests;
                    # but while an answer streams (SSE) pipelined bytes are not read, so
                    # the end is not seen: the client then leaves for good.
                    with trio.move_on_after(AFTER_EOF):
                        while chunk := await stream.receive_some():
                            received += chunk
            except trio.BrokenResourceError:
                reset = True
    return Outcome(bytes(received), server_ended_first, reset)


async def _one(port: int, request: Request) -> Answer:
    request.close = True  # the server ends the connection after its answer: wait for that
    outcome = await exchange(port, [request.encode()], "until-closed")
    answers, rest = split_answers(outcome.received)
    assert answers, outcome
    assert not rest, outcome
    return answers[-1]


def check_answers(outcome: Outcome) -> None:
    answers, rest = split_answers(outcome.received)
    upgraded = bool(answers) and answers[-1].status == 101
    if rest and outcome.server_ended_first and not outcome.reset and not upgraded:
        raise Malformed(
            f"the server closed the connection in the middle of an answer: {rest[:200]!r}"
        )
    for answer in answers:
        shown = f"{answer.status} {answer.headers!r} {answer.body[:300]!r}"
        assert answer.reason, f"no reason phrase: {shown}"
        if answer.header(b"via") is not None:
            # Relayed from a proxy route's backend, as it answered (it never fails).
            assert answer.status < 500, shown
            continue
        if answer.status >= 400:
            assert answer.header(b"content-type") == b"application/problem+json", shown
            assert answer.json()["status"] == answer.status, shown
        if answer.status in BACKEND_FAILED_5XX:
            # The gateway's problem for its backend's failure, on a proxy route only.
            assert answer.json()["instance"].startswith(gateway.PROXY_PREFIXES), shown
        else:
            assert answer.status < 500 or answer.status in CLIENT_CAUSED_5XX, shown


async def serves_normally(live: Live) -> str:
    """A normal request is served; returns its request id."""
    assert live.process.poll() is None, "".join(live.log[-60:])
    marker = f"fuzz-{next(_MARKS)}"
    request = _request(
        "POST", "/sync", body=b'{"a": 1}', headers=[(b"X-Request-ID", marker.encode())]
    )
    answer = await _one(live.port, request)
    assert answer.status == 200, answer
    assert answer.json() == {"a": 1, "echoed": True}
    proxied = await _one(live.port, _request("GET", "/proxy/echo/normal"))
    assert proxied.status == 200, proxied
    assert proxied.json()["raw_path"] == "/echo/normal"
    return marker


_MARKS = itertools.count()


def check_alive(live: Live) -> None:
    """The process lives, serves, and logged no error since the last check (its access
    line for the normal request marks how far its log has been read)."""
    marker = trio.run(serves_normally, live)
    lines = live.wait_for_line(f"request_id={marker}")
    errors = [line for line in lines if "Traceback" in line or " ERROR " in line]
    assert not errors, "".join(lines[-80:])


# -- the tests -------------------------------------------------------------------------


# Each example takes about half a second; the bound is for a loaded machine.
@pytest.mark.hang_guard(real_seconds=60.0 + 3.0 * EXAMPLES)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_no_byte_stream_ends_the_server_or_gets_a_broken_answer(
    live: Live, data: st.DataObject
) -> None:
    pieces, ending = data.draw(conversation(live))
    outcome = trio.run(exchange, live.port, pieces, ending)
    check_answers(outcome)
    check_alive(live)


CRASH_SHAPES: Final = {
    404: _request("POST", "/nope", body=b"{}"),
    400: _request("POST", "/sync", body=b'{"a":'),
    415: _request("POST", "/sync", body=b"{}", content_type=b"text/plain"),
}


@pytest.mark.parametrize("status", sorted(CRASH_SHAPES))
def test_a_thousand_early_answers_with_bytes_after_a_closing_request(
    live: Live, status: int
) -> None:
    """The shape that ended the process: an early error answer, ``Connection: close`` and
    bytes after the declared body (hypercorn issue #203)."""
    request = CRASH_SHAPES[status]
    request.close = True
    request.after = b"YYYY"
    raw = request.encode()

    async def client(count: int) -> None:
        for _ in range(count):
            outcome = await exchange(live.port, [raw], "until-closed")
            answers, rest = split_answers(outcome.received)
            assert [a.status for a in answers] == [status], outcome
            assert not rest, outcome

    async def hammer() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(client, 250)

    trio.run(hammer)
    check_alive(live)
