"""Run every ``benchmarks/bench_*.py`` scenario and write docs/benchmarks.md.

Each module exposes ``run(quick: bool) -> list[dict]``; every row compares pipework with a
baseline measured in the same run and reports the ratio, so the numbers travel between
machines better than absolute times do. ``python -m benchmarks [--quick] [--only NAME]``;
a run with ``--only`` rewrites its modules' sections of the report and keeps the others.
A ``## bench_*`` section no module writes (a measurement by hand, such as an A/B of two
builds) is kept by every run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import pkgutil
import platform
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import benchmarks

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks.md"


def machine() -> list[str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass  # no /proc/cpuinfo: keep the platform's name
    packages = ", ".join(
        f"{name} {version(name)}" for name in ("trio", "hypercorn", "quart-trio", "msgpack")
    )
    return [
        f"- date: {datetime.date.today().isoformat()}",
        f"- CPU: {cpu}, {os.cpu_count()} cores",
        f"- Python {platform.python_version()} ({platform.python_implementation()}), "
        f"{platform.system()} {platform.release()}",
        f"- {packages}",
    ]


def render(rows: dict[str, list[dict[str, Any]]], quick: bool, previous: str | None = None) -> str:
    """The report; with ``previous`` (the last report), the sections of modules that did not
    run this time are kept as they were."""
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m benchmarks`); do not edit by hand, except in "
        "a `## bench_*` section no module writes (a measurement by hand, such as an A/B of "
        "two builds), which every run keeps. Every row "
        "measures pipework and its baseline in the same run; **ratio** is pipework's cost "
        "divided by the baseline's (lower is better, 1.0× is parity). Values are µs unless "
        "a unit is shown.",
        "",
        "## Machine",
        "",
        *machine(),
        f"- mode: {'quick' if quick else 'full'}",
        "",
    ]
    sections = _sections(previous) if previous is not None else {}
    for module, module_rows in rows.items():
        sections[module] = _section(module, module_rows, quick)
    for module in sorted(sections):
        lines += sections[module]
    # One newline at the end whichever section is last (a kept section's final blank line
    # does not survive being read back).
    return "\n".join(lines).rstrip("\n") + "\n"


def _section(module: str, module_rows: list[dict[str, Any]], quick: bool) -> list[str]:
    doc = (importlib.import_module(f"benchmarks.{module}").__doc__ or "").strip()
    lines = [f"## {module}", "", doc, ""]
    lines += [
        f"Measured {datetime.date.today().isoformat()} in {'quick' if quick else 'full'} "
        f"mode: `python -m benchmarks --only {module}{' --quick' if quick else ''}`.",
        "",
    ]
    lines += [
        "| scenario | pipework (µs) | baseline | baseline (µs) | ratio | goal | note |",
        "|---|---:|---|---:|---:|---|---|",
    ]
    blocks: list[str] = []
    for r in module_rows:
        if "markdown" in r:  # a block of its own, after the table
            blocks += ["", *r["markdown"]]
            continue
        unit = "" if r.get("unit", "µs") == "µs" else f" {r['unit']}"  # µs unless said
        lines.append(
            f"| {r['scenario']} | {r['subject_us']:,.1f}{unit} | {r['baseline']} | "
            f"{r['baseline_us']:,.1f}{unit} | {r['ratio']:.2f}× | {r.get('goal', '')} | "
            f"{r.get('note', '')} |"
        )
    return [*lines, *blocks, ""]


def _without(report: str, modules: set[str]) -> str:
    """``report`` less the sections of ``modules``: what a full run keeps is the rest."""
    kept = _sections(report)
    return "\n".join(line for name, lines in kept.items() if name not in modules for line in lines)


def _sections(report: str) -> dict[str, list[str]]:
    """The ``## bench_*`` sections of an earlier report, by module."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in report.splitlines():
        if line.startswith("## "):
            name = line.removeprefix("## ").strip()
            current = sections.setdefault(name, []) if name.startswith("bench_") else None
        if current is not None:
            current.append(line)
    return sections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer jobs and repeats")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only this module (bench_peers or peers; repeatable); the report keeps "
        "the other modules' last sections",
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the report")
    args = parser.parse_args(argv)
    only = {name if name.startswith("bench_") else f"bench_{name}" for name in args.only}
    names = sorted(
        m.name
        for m in pkgutil.iter_modules(benchmarks.__path__)
        if m.name.startswith("bench_") and (not only or m.name in only)
    )
    rows: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows[name] = importlib.import_module(f"benchmarks.{name}").run(args.quick)
        for r in rows[name]:
            if "markdown" in r:
                continue
            print(f"  {r['scenario']}: {r['ratio']:.2f}× {r['baseline']}", file=sys.stderr)
    # A partial run keeps the other modules' sections of the last report; every run keeps
    # the sections written by hand.
    previous = args.out.read_text() if args.out.exists() else None
    if previous is not None and not args.only:
        modules = {m.name for m in pkgutil.iter_modules(benchmarks.__path__)}
        previous = _without(previous, modules)
    args.out.write_text(render(rows, args.quick, previous))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
