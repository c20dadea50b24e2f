"""The benchmark report's writer: a partial run keeps the other sections byte for byte."""

from __future__ import annotations

from typing import Any

from benchmarks.__main__ import _without, render


def _row(scenario: str) -> dict[str, Any]:
    return {
        "scenario": scenario,
        "subject_us": 2.0,
        "baseline": "bare",
        "baseline_us": 1.0,
        "ratio": 2.0,
    }


def test_a_partial_run_keeps_the_other_sections_and_one_final_newline() -> None:
    first = render({"bench_engine": [_row("a")], "bench_stages": [_row("b")]}, quick=True)
    assert first.endswith("|\n")
    assert not first.endswith("\n\n")
    # Rewriting the first section keeps the last one (read back from the file) unchanged.
    again = render({"bench_engine": [_row("c")]}, quick=True, previous=first)
    assert again.split("## bench_stages", 1)[1] == first.split("## bench_stages", 1)[1]
    assert "| c |" in again
    assert "| a |" not in again
    # And a run of the last section alone keeps the first.
    last = render({"bench_stages": [_row("d")]}, quick=True, previous=again)
    assert last.endswith("|\n")
    assert not last.endswith("\n\n")
    engine = again.split("## bench_engine", 1)[1].split("## bench_stages", 1)[0]
    assert last.split("## bench_engine", 1)[1].split("## bench_stages", 1)[0] == engine


def test_a_full_run_keeps_the_sections_written_by_hand() -> None:
    hand = "## bench_engine_by_hand\n\nAn A/B of two builds.\n"
    first = render({"bench_engine": [_row("a")]}, quick=True) + "\n" + hand
    # A full run rewrites every module's section: what it keeps of the last report is the rest.
    kept = _without(first, {"bench_engine", "bench_stages"})
    assert "| a |" not in kept
    again = render({"bench_engine": [_row("b")]}, quick=True, previous=kept)
    assert "| b |" in again
    assert "| a |" not in again
    assert again.split("## bench_engine_by_hand", 1)[1] == "\n\nAn A/B of two builds.\n"
