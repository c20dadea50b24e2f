"""The report service: ``python -m examples.report.run [--config FILE] [--port N]``.

Reads the config (report.toml beside this module by default), loads the templates, starts
the PDF workers, serves until Ctrl-C (or SIGTERM), then shuts down gracefully: requests in
flight get ``shutdown_grace`` seconds, and every worker is closed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import signal
import sys
from pathlib import Path

import trio

import pipework as pw

from .config import DEFAULT_CONFIG, ReportConfig, ReportConfigError, load_config
from .service import Serving, serve
from .templates import TemplateLoadError

__all__ = ["main"]


async def _run(config: ReportConfig) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serving: Serving = await nursery.start(functools.partial(serve, config, stop=stop))
        sample = Path(__file__).with_name("sample.json")
        print(
            f"report service on {serving.url} ({config.pool_size} PDF workers); try:\n"
            f"  curl -s -X POST {serving.url}/reports -H 'Content-Type: application/json'"
            f" -d @{sample}\n"
            f"  curl -s -o report.pdf {serving.url}/reports/<id>.pdf\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                print("stopping: finishing requests in flight, closing the workers", flush=True)
                stop.set()
                break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.report.run", description="Serve the report example."
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="%(default)s")
    parser.add_argument("--port", type=int, default=None, help="instead of the file's")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = load_config(args.config)
        if args.port is not None:
            config = dataclasses.replace(config, port=args.port)
        trio.run(_run, config)
    except BaseException as caught:
        error = _unwrap(caught)
        if isinstance(error, ReportConfigError | TemplateLoadError | pw.ResourceStartupError):
            print(f"report: not started: {error}", file=sys.stderr)
            if error.__cause__ is not None:
                print(f"  because: {error.__cause__}", file=sys.stderr)
            return 1
        if isinstance(error, KeyboardInterrupt):
            # Ctrl-C while starting: trio has stopped (and the pool closed) what had started.
            print("report: interrupted while starting; everything is stopped", file=sys.stderr)
            return 130
        raise
    return 0


def _unwrap(error: BaseException) -> BaseException:
    """The one error inside nurseries' groups (a start-up failure comes out of two)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


if __name__ == "__main__":
    sys.exit(main())
