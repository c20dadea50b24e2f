"""Engine.observe: every change of a job's status or progress reaches the observers."""

from __future__ import annotations

import trio

import pipework as pw
from pipework.dispatcher._job import hash_token

from .test_board_jobs import Gate, make_engine


def test_the_engine_reports_each_change_of_status_and_progress() -> None:
    seen: list[tuple[str, float | None]] = []
    owners: set[str | None] = set()

    async def main() -> None:
        gate = Gate()
        engine = make_engine(gate)

        def observe(view: pw.JobView, token_hash: str | None) -> None:
            seen.append((view.status.value, None if view.progress is None else view.progress.done))
            owners.add(token_hash)

        stop = engine.observe(observe)
        async with engine:
            job_id = await engine.submit("export", token="secret")
            await gate.progressed.wait()
            gate.release.set()
            await engine.wait(job_id)
            await engine.probe(1.0)  # the engine's own probe is not reported
        stop()

    trio.run(main)
    assert seen == [
        ("queued", None),
        ("running", None),
        ("running", 1),
        ("running", 4),
        ("done", 4),
    ]
    assert owners == {hash_token("secret")}
