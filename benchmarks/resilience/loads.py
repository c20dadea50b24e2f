"""The resilience benchmark's load, compared: ``python -m benchmarks.resilience.loads``.

Runs ``bench_resilience`` in quick mode with each of the ways of drawing the load's pauses
given (``--think``, by default the fixed pause the benchmark used to have and the
exponential one it has), in turns, ``--rounds`` times, and prints, for each, the median
over the rounds of every goal's figure (pipework's and HAProxy's) and of what shows
whether the requests come in bursts: in the healthy scenario, how many requests were in
flight when a request started, how many others started within 5 ms of it, and the
coefficient of variation of the gaps between starts (1 for independent clients, a Poisson
process). Each run's figures also go to ``--out`` (JSON lines), if given.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import os
import statistics
import sys
from collections.abc import Sequence

from .. import bench_resilience as bench

#: Others started within this many seconds of a request, either side.
NEAR = 0.005


def arrivals(answers: Sequence[bench.Answer]) -> dict[str, float]:
    """How bunched the requests' starts are: requests in flight at a request's start (its
    mean), others started within :data:`NEAR` of it (its mean), and the coefficient of
    variation of the gaps between consecutive starts."""
    starts = sorted(a.start for a in answers)
    ends = sorted(a.start + a.latency for a in answers)
    if len(starts) < 3:
        return {"in_flight": math.nan, "near": math.nan, "cv": math.nan}
    in_flight = [bisect.bisect_left(starts, s) - bisect.bisect_right(ends, s) for s in starts]
    near = [
        bisect.bisect_right(starts, s + NEAR) - bisect.bisect_left(starts, s - NEAR) - 1
        for s in starts
    ]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    mean_gap = statistics.fmean(gaps)
    return {
        "in_flight": statistics.fmean(in_flight),
        "near": statistics.fmean(near),
        "cv": statistics.pstdev(gaps) / mean_gap if mean_gap else math.nan,
    }


def figures(results: bench.Results) -> dict[str, float]:
    """One run's figures: each goal's for both gateways, the healthy scenario's p50 and
    arrivals, and the degradation scenario's."""
    found: dict[str, float] = {}
    for gateway in ("pipework", "haproxy"):
        healthy = results.run("healthy", gateway)
        found[f"healthy p50 ms, {gateway}"] = bench.healthy(healthy).values["p50"]
        for key, value in arrivals(healthy.answers).items():
            found[f"healthy {key}, {gateway}"] = value
        for goal in bench.GOALS:
            value = bench.figures(results, goal.scenario, gateway).values[goal.key]
            found[f"{goal.scenario} {goal.key} {goal.unit}, {gateway}"] = value
    if results.phases:
        values = bench.degrade(results.phases).values
        found["degrade throughput ×, pipework"] = values["throughput"]
        found["degrade marked %, pipework"] = values["marked"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resilience.loads", description=__doc__
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--think", action="append", choices=bench.THINKS, help="default: fixed, exponential"
    )
    parser.add_argument("--out", help="a file each run's figures are appended to")
    args = parser.parse_args(argv)
    thinks: list[str] = args.think or ["fixed", "exponential"]
    runs: dict[str, list[dict[str, float]]] = {think: [] for think in thinks}
    for turn in range(args.rounds):
        # Each round in the other order, so that none always runs first.
        for think in thinks if turn % 2 == 0 else thinks[::-1]:
            load = os.getloadavg()[0]
            found = figures(bench.measure(True, think=think))
            runs[think].append(found)
            print(f"round {turn + 1}, {think}: load average {load:.2f}", file=sys.stderr)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps({"round": turn, "think": think, "load": load} | found))
                    out.write("\n")
    keys = list(runs[thinks[0]][0])
    print(f"| figure (median of {args.rounds} quick runs) | " + " | ".join(thinks) + " |")
    print("|---|" + "---:|" * len(thinks))
    for key in keys:
        medians = [statistics.median(run[key] for run in runs[think]) for think in thinks]
        print(f"| {key} | " + " | ".join(f"{m:,.2f}" for m in medians) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
