"""One resilience scenario through pipework alone, a few times:
``python -m benchmarks.resilience.probe [--scenario NAME] [--route pipe|proxy]
[--state admin|metrics] [--rounds N]``.

The benchmark's scenario in full mode (`bench_resilience`), without HAProxy's turn, for
looking at one figure more closely than a whole run allows. Each round starts the
replicas and a fresh gateway and prints the scenario's figures as the benchmark's rows
compute them (for *down*: the p50 and p99 of the answers not 2xx after the breaker opens).
``--state metrics`` reads the breaker's state from ``/metrics`` ten times a second, as the
benchmark once did, instead of the admin API's service document: what that reading cost
the gateway it timed (docs/resilience.md, "Measured").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import trio

from .. import _load
from .. import bench_resilience as bench
from ..bench_peers import enter_all

#: The scenarios a round can run (the degradation scenario has its own phases).
NAMES = ("healthy", "hang", "503", "down", "tail")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.resilience.probe", description=__doc__
    )
    parser.add_argument("--scenario", choices=NAMES, default="down")
    parser.add_argument("--route", choices=list(bench.PATHS), default="pipe")
    parser.add_argument("--state", choices=["admin", "metrics"], default="admin")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    scenario = bench.scenario_named(args.scenario, args.route)
    gateway = bench.GATEWAYS[0]
    for turn in range(args.rounds):
        with contextlib.ExitStack() as stack:
            replicas = enter_all(
                stack, [_load.server(f"r{n}", module=bench.REPLICA) for n in (1, 2, 3)]
            )
            with bench.started(gateway, replicas, scenario) as served:
                if args.state == "metrics":
                    read = functools.partial(bench.pipework_state_from_metrics, served.server)
                    served = bench.Served(served.server, read, served.counters)
                run = trio.run(bench.run_one, gateway, served, replicas, scenario, 2.0)
        if args.scenario == "hang":
            found = bench.hang(run, run)  # its own run as the reference: p99s, not ratios
        else:
            found = bench.figures_of(args.scenario, run)
        values = ", ".join(f"{key} {value:.3g}" for key, value in found.values.items())
        print(f"round {turn + 1}: {values}; {found.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
