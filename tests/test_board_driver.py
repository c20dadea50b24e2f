"""The board's driver on trio's virtual clock: followers parked and woken by the flush,
and keep-alive beats only for streams that sent nothing since the last beat."""

from __future__ import annotations

import trio
import trio.testing

from pipework.board import Boards, BoardSettings, BoardSpec, Follower


async def test_an_idle_stream_gets_a_beat_and_a_busy_one_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    boards = Boards([BoardSpec("b", BoardSettings(window=0.01), keepalive=10.0)])
    async with trio.open_nursery() as nursery:
        await nursery.start(boards.run)
        boards.create("b", "busy", 0)
        boards.create("b", "idle", 0)
        busy = boards.follow("b", ["busy"])
        idle = boards.follow("b", ["idle"])
        for follower in (busy, idle):
            taken = await follower.next()
            assert taken is not None
            assert [e.data for e in taken.events] == [0]  # the state on joining
        beats = {"busy": 0, "idle": 0}

        async def read(name: str, follower: Follower) -> None:
            while True:
                if await follower.next() is None:
                    beats[name] += 1

        nursery.start_soon(read, "busy", busy)
        nursery.start_soon(read, "idle", idle)
        for n in range(1, 21):  # 100 s: a change every 5 s, inside every beat interval
            await trio.sleep(5)
            boards.update("b", "busy", n)
        assert beats["busy"] == 0
        assert 5 <= beats["idle"] <= 10  # one per beat, at most one beat late
        nursery.cancel_scope.cancel()
    busy.close()
    idle.close()
    assert boards.statistics()["b"].followers == 0
