"""Boards follow the gateway file on reload, over real sockets: an unchanged board's
followers stay connected, a changed board takes its new settings (and ends its followers
when who may read it changed), a removed board ends its followers' streams with a final
``delete``, and a new board serves at once."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from pipework import Gateway
from pipework.container import BoundAddress

from .test_board_http import SseReader, flushed
from .test_container_harness import assert_problem, bearer

HANG_GUARD = 20.0
ADMIN = "gateway-admin-token"
WRITE = "board-write-token"


def gateway_file(*, orders_read: str, tuned_window: float, gone: bool, fresh: bool) -> str:
    text = f"""
[server]
admin_token = "{ADMIN}"

[boards.news]
public_read = true
write_token = "{WRITE}"
window = 0.01
keepalive = 5

[boards.orders]
read_token = "{orders_read}"
write_token = "{WRITE}"
window = 0.01

[boards.tuned]
public_read = true
write_token = "{WRITE}"
window = {tuned_window}
"""
    if gone:
        text += f'\n[boards.gone]\npublic_read = true\nwrite_token = "{WRITE}"\nwindow = 0.01\n'
    if fresh:
        text += f'\n[boards.fresh]\npublic_read = true\nwrite_token = "{WRITE}"\n'
    return text


@asynccontextmanager
async def sse(
    address: BoundAddress, path: str, headers: dict[str, str] | None = None
) -> AsyncIterator[tuple[int, SseReader]]:
    async with await trio.open_tcp_stream(address.host, address.port) as stream:
        reader = SseReader(stream)
        response = await reader.open(path, {"Accept": "text/event-stream", **(headers or {})})
        yield response.status_code, reader


async def test_a_reload_adds_changes_and_removes_boards_and_keeps_unchanged_followers(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(gateway_file(orders_read="read-1", tuned_window=0.01, gone=True, fresh=False))
    gateway = Gateway(str(path))
    stop = trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            address: BoundAddress = await nursery.start(
                functools.partial(gateway.run, port=0, stop=stop)
            )
            async with httpx.AsyncClient(base_url=address.url) as client, AsyncExitStack() as stack:
                ids = {}
                for board in ("news", "orders", "tuned", "gone"):
                    created = await client.post(f"/boards/{board}", json=0, headers=bearer(WRITE))
                    assert created.status_code == 201, created.text
                    ids[board] = created.json()["id"]
                assert gateway.container is not None
                await flushed(gateway.container.boards, *ids)
                readers = {}
                for board, headers in (
                    ("news", {}),
                    ("orders", bearer("read-1")),
                    ("tuned", {}),
                    ("gone", {}),
                ):
                    status, reader = await stack.enter_async_context(
                        sse(address, f"/boards/{board}/{ids[board]}", headers)
                    )
                    assert status == 200
                    assert (await reader.next())[1:] == (
                        "update",
                        {
                            "id": ids[board],
                            "event": "update",
                            "version": (
                                await client.get(
                                    f"/boards/{board}/{ids[board]}", headers=bearer(WRITE)
                                )
                            ).json()["version"],
                            "data": 0,
                        },
                    )
                    readers[board] = reader
                orders_seen = (
                    await client.get(f"/boards/orders/{ids['orders']}", headers=bearer(WRITE))
                ).json()["version"]

                path.write_text(
                    gateway_file(orders_read="read-2", tuned_window=0.02, gone=False, fresh=True)
                )
                reloaded = await client.post("/admin/reload", headers=bearer(ADMIN))
                assert reloaded.status_code == 200, reloaded.text
                assert reloaded.json()["boards_changed"] == {
                    "added": ["fresh"],
                    "changed": ["orders", "tuned"],
                    "removed": ["gone"],
                }

                # Removed: a final delete, then the stream ends; the board is gone.
                _, kind, body = await readers["gone"].next()
                assert (kind, body["id"]) == ("delete", ids["gone"])
                with pytest.raises(EOFError):
                    await readers["gone"].next()
                assert_problem(
                    await client.get(f"/boards/gone/{ids['gone']}"), 404, "board-not-found"
                )
                # Who may read orders changed: its stream ends; the old token no longer
                # follows; the new one resumes where the old stream stopped.
                with pytest.raises(EOFError):
                    await readers["orders"].next()
                refused = await client.get(
                    f"/boards/orders/{ids['orders']}", headers=bearer("read-1")
                )
                assert_problem(refused, 401, "board-token")
                # Unchanged and settings-only boards: the same connections get new changes.
                for board in ("news", "tuned", "orders"):
                    answer = await client.put(
                        f"/boards/{board}/{ids[board]}", json=1, headers=bearer(WRITE)
                    )
                    assert answer.status_code == 200, answer.text
                for board in ("news", "tuned"):
                    _, kind, body = await readers[board].next()
                    assert (kind, body["data"]) == ("update", 1)
                resumed = {**bearer("read-2"), "Last-Event-ID": orders_seen}
                status, reader = await stack.enter_async_context(
                    sse(address, f"/boards/orders/{ids['orders']}", resumed)
                )
                assert status == 200
                _, kind, body = await reader.next()
                assert (kind, body["data"]) == ("update", 1)  # exactly what it missed
                assert gateway.container is not None
                tuned = gateway.container.boards.cores["tuned"]
                assert tuned.settings.window == 0.02
                assert tuned.statistics().followers == 1
                # Added: serves at once.
                fresh = await client.post("/boards/fresh", json="hi", headers=bearer(WRITE))
                assert fresh.status_code == 201, fresh.text
            stop.set()
