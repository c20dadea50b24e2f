"""The export example: ``python -m examples.export.run [--rows N] [--port P] [--data DIR]``.

Makes the orders database if the data directory has none of that size (a million rows by
default: a few seconds, once), then serves on one port: ``POST /exports`` (202 at once),
the job API (``/jobs/{id}``), the jobs page (``/ui/jobs``) and the download centre
(``/exports/{id}``, ``/exports/{id}/file``). It prints the commands to try and stays up
until Ctrl-C (or SIGTERM), then stops gracefully: an export still running is cancelled and
recorded as failed. One killed harder (SIGKILL) is marked failed by the next start.
"""

from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys
import tempfile
from pathlib import Path
from typing import Final

import trio

import pipework as pw
from pipework.container import BoundAddress

from .data import count_orders, make_orders
from .exporter import ExportConfig, Exporter

__all__ = ["build", "main", "serve"]

#: The line (on stdout) that says where the example serves; what follows is the URL.
SERVING: Final = "pipework export example serving on "
DEFAULT_DATA: Final = Path(tempfile.gettempdir()) / "pipework-export"
DEFAULT_PORT: Final = 8001
#: How many exports may run at once; the others wait for a slot (seed 001: a pool of 4).
MAX_EXPORTS: Final = 4


def build(config: ExportConfig, *, max_exports: int = MAX_EXPORTS) -> tuple[pw.Engine, Exporter]:
    """The engine with the export route on it, and its exporter."""
    pool = pw.WeightedPool(16, keys={config.key: pw.Weights(limit=max_exports)})
    engine = pw.Engine(
        registry=pw.Registry(),
        pool=pool,
        # Finished jobs stay readable (GET /jobs/{id}) as long as their files are kept.
        store=pw.MemoryJobStore(retain_seconds=config.retention),
    )
    return engine, Exporter(engine, config)


async def serve(
    config: ExportConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    stop: trio.Event,
    task_status: trio.TaskStatus[BoundAddress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the example until ``stop`` is set; ``task_status.started()`` reports where."""
    engine, exporter = build(config)
    async with trio.open_nursery() as nursery:
        # The exporter around the engine: the restart rule runs before anything is served,
        # and exports the engine cancels at shutdown still record how they ended.
        await nursery.start(exporter.run)
        async with engine:
            container = pw.Container(engine, config=pw.ContainerConfig(shutdown_grace=5.0))
            exporter.add_routes(container)
            await container.serve(
                host=host, port=port, shutdown_trigger=stop, task_status=task_status
            )
        nursery.cancel_scope.cancel()  # the cleanup task


def instructions(url: str, config: ExportConfig) -> str:
    auth = "-H 'Authorization: Bearer JOB_TOKEN'"
    return "\n".join(
        [
            f"{SERVING}{url}",
            f"  orders database: {config.source}",
            f"  files and the download centre: {config.directory}",
            "",
            '# 1. start an export of every order (or -d \'{"status": "shipped"}\');'
            " keep the id and the token",
            f"curl -s -X POST {url}/exports -H 'Content-Type: application/json' -d '{{}}'",
            "# 2. its progress (every 5,000 rows), then its result with the file's link",
            f"curl -s {url}/jobs/JOB_ID {auth}",
            f"curl -s {url}/jobs/JOB_ID/result {auth}",
            "# 3. the download centre (the jobs page), live: open it in a browser",
            f"{url}/ui/jobs#JOB_ID:JOB_TOKEN",
            "# 4. the download centre's record, and the file (only with the job's token)",
            f"curl -s {url}/exports/JOB_ID {auth}",
            f"curl -s -o orders.csv {url}/exports/JOB_ID/file {auth}",
            "",
            "Ctrl-C stops it.",
        ]
    )


async def _main(config: ExportConfig, host: str, port: int) -> None:
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def on_signal() -> None:
                async for _ in signals:
                    if stop.is_set():  # a second Ctrl-C: stop at once
                        nursery.cancel_scope.cancel()
                    stop.set()

            nursery.start_soon(on_signal)
            async with trio.open_nursery() as serving:
                address: BoundAddress = await serving.start(
                    functools.partial(serve, config, host=host, port=port, stop=stop)
                )
                print(instructions(address.url, config), flush=True)
            nursery.cancel_scope.cancel()  # served and shut down: stop listening for signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.export.run", description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000, help="orders in the database")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the data directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0: any free port")
    parser.add_argument("--retention-days", type=float, default=7.0, help="how long files stay")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    args = parser.parse_args(argv)
    if args.rows < 0 or args.retention_days <= 0:
        parser.error("--rows must be 0 or more and --retention-days positive")
    logging.basicConfig(level=args.log_level, format="%(name)s: %(message)s")
    logging.getLogger("pipework.access").setLevel(logging.WARNING)
    source = args.data / "orders.sqlite3"
    if count_orders(source) != args.rows:
        print(f"making {args.rows:,} orders in {source} ...", file=sys.stderr, flush=True)
        make_orders(source, args.rows)
    config = ExportConfig(
        source=source, directory=args.data / "exports", retention=args.retention_days * 86_400
    )
    try:
        trio.run(_main, config, args.host, args.port)
    except OSError as exc:  # the port is taken, most likely
        print(f"run: {exc}; try --port 0 for any free port", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
