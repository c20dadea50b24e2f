"""The websocket relay's rules (``pipework.proxy._websocket_core``), without I/O."""

from __future__ import annotations

import pytest

from pipework.proxy._websocket_core import (
    BackendClosed,
    BackendFailed,
    ClientClosed,
    CloseFrame,
    Closing,
    Ending,
    IdleTimeout,
    MessageTooBig,
    answer_headers,
    closing,
    handshake_headers,
    wire_host,
    wire_target,
)

# -- the rules, without I/O ----------------------------------------------------------------

CLOSE_RULES: list[tuple[Ending, Closing]] = [
    (
        ClientClosed(4001, "bye"),
        Closing(None, CloseFrame(4001, "bye"), 4001, "client"),
    ),
    (ClientClosed(1005), Closing(None, CloseFrame(None), 1005, "client")),
    (ClientClosed(1006), Closing(None, None, 1006, "client")),
    (ClientClosed(1015), Closing(None, None, 1015, "client")),
    (
        BackendClosed(4002, "why"),
        Closing(CloseFrame(4002, "why"), CloseFrame(4002), 4002, "backend"),
    ),
    (BackendClosed(1005), Closing(CloseFrame(1000), CloseFrame(None), 1000, "backend")),
    (
        BackendFailed(1006),
        Closing(
            CloseFrame(1011, "backend connection lost"),
            None,
            1011,
            "backend",
            "the backend's connection ended without a close frame",
        ),
    ),
    (
        BackendFailed(1007, "bad utf-8"),
        Closing(
            CloseFrame(1011, "backend broke the websocket protocol"),
            CloseFrame(1007, "bad utf-8"),
            1011,
            "backend",
            "the backend broke the websocket protocol (1007: bad utf-8)",
        ),
    ),
    (
        IdleTimeout(60),
        Closing(
            CloseFrame(1001, "idle timeout"),
            CloseFrame(1001, "idle timeout"),
            1001,
            "idle",
            "no message passed either way for 60s",
        ),
    ),
    (
        MessageTooBig(100),
        Closing(
            CloseFrame(1009, "message too big"),
            CloseFrame(1009, "message too big"),
            1009,
            "backend",
            "a backend message grew past the relay's limit of 100 bytes",
        ),
    ),
]


@pytest.mark.parametrize(("ending", "expected"), CLOSE_RULES, ids=lambda v: repr(v)[:40])
def test_the_close_rules(ending: Ending, expected: Closing) -> None:
    assert closing(ending) == expected


def test_the_handshake_sends_the_callers_headers_less_its_own() -> None:
    headers = [
        (b"Authorization", b"Bearer t"),
        (b"Host", b"client.test"),
        (b"Sec-WebSocket-Key", b"k"),
        (b"sec-websocket-extensions", b"permessage-deflate"),
        (b"Upgrade", b"websocket"),
        (b"content-length", b"0"),
        (b"cookie", b"a=1"),
    ]
    assert handshake_headers(headers) == [(b"authorization", b"Bearer t"), (b"cookie", b"a=1")]


def test_an_answers_headers_lose_hop_by_hop_and_server_owned_ones() -> None:
    headers = [
        (b"Set-Cookie", b"a=1"),
        (b"Connection", b"close, X-Private"),
        (b"X-Private", b"secret"),
        (b"Keep-Alive", b"timeout=5"),
        (b"Content-Length", b"12"),
        (b"Transfer-Encoding", b"chunked"),
        (b"Date", b"Mon, 01 Jan 2024 00:00:00 GMT"),
        (b"Server", b"backend"),
        (b"Sec-WebSocket-Protocol", b"chat.v1"),
        (b"content-type", b"text/plain"),
    ]
    assert answer_headers(headers) == [(b"set-cookie", b"a=1"), (b"content-type", b"text/plain")]


@pytest.mark.parametrize(
    ("target", "wire"),
    [
        (b"/a/b%20c?x=1&y=%2F", "/a/b%20c?x=1&y=%2F"),
        (b"/caf\xc3\xa9", "/caf%C3%A9"),
        (b"/a b", "/a%20b"),
    ],
)
def test_the_target_is_kept_byte_for_byte_where_ascii_allows(target: bytes, wire: str) -> None:
    assert wire_target(target) == wire


@pytest.mark.parametrize(
    ("host", "wire"),
    [
        (b"backend.test:8080", "backend.test:8080"),
        (b"Backend.TEST", "Backend.TEST"),
        (b"[::1]:8080", "[::1]:8080"),
        (b"127.0.0.1", "127.0.0.1"),
        (b"a..b", None),
        (b"caf\xc3\xa9.test", None),
        (b"x" * 64 + b".test", None),
    ],
)
def test_a_host_goes_on_only_as_it_came(host: bytes, wire: str | None) -> None:
    assert wire_host(host) == wire
