"""Run every ``benchmarks/bench_*.py`` scenario and write docs/benchmarks.md.

Each module exposes ``run(quick: bool) -> list[dict]``; every row compares pipework with a
baseline measured in the same run and reports the ratio, so the numbers travel between
machines better than absolute times do. ``python -m benchmarks [--quick] [--only NAME]``.
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


def render(rows: dict[str, list[dict[str, Any]]], quick: bool) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m benchmarks`); do not edit by hand. Every row "
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
    for module, module_rows in rows.items():
        doc = (importlib.import_module(f"benchmarks.{module}").__doc__ or "").strip()
        lines += [f"## {module}", "", doc, ""]
        lines += [
            "| scenario | pipework (µs) | baseline | baseline (µs) | ratio | goal | note |",
            "|---|---:|---|---:|---:|---|---|",
        ]
        for r in module_rows:
            unit = "" if r.get("unit", "µs") == "µs" else f" {r['unit']}"  # µs unless said
            lines.append(
                f"| {r['scenario']} | {r['subject_us']:,.1f}{unit} | {r['baseline']} | "
                f"{r['baseline_us']:,.1f}{unit} | {r['ratio']:.2f}× | {r.get('goal', '')} | "
                f"{r.get('note', '')} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer jobs and repeats")
    parser.add_argument("--only", action="append", default=[], help="run only these modules")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the report")
    args = parser.parse_args(argv)
    names = sorted(
        m.name
        for m in pkgutil.iter_modules(benchmarks.__path__)
        if m.name.startswith("bench_") and (not args.only or m.name in args.only)
    )
    rows: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows[name] = importlib.import_module(f"benchmarks.{name}").run(args.quick)
        for r in rows[name]:
            print(f"  {r['scenario']}: {r['ratio']:.2f}× {r['baseline']}", file=sys.stderr)
    args.out.write_text(render(rows, args.quick))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
