"""The ``pipework`` command line.

    pipework serve MODULE:FACTORY [--host HOST] [--port PORT] ...
    pipework --version

``serve`` imports ``FACTORY`` from ``MODULE`` (a function returning an :class:`Engine`, or
an Engine itself), runs the engine and serves its routes until SIGINT or SIGTERM, then
shuts down gracefully (a second signal stops at once). Each subcommand is one function
registered in ``_COMMANDS``; new ones add a parser and a function.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, Final

import trio

from . import __version__
from ._logging import JsonFormatter
from .container._app import Container, ContainerConfig
from .dispatcher._engine import Engine

__all__ = ["build_parser", "main"]

_log = logging.getLogger("pipework")
_DEFAULTS: Final = ContainerConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipework", description="A trio-native pipeline and request processor."
    )
    parser.add_argument("--version", action="version", version=f"pipework {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="serve an engine's routes over HTTP")
    serve.add_argument(
        "target", metavar="MODULE:FACTORY", help="where the engine comes from, e.g. app:build"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to bind, 0 for any (8000)")
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=_DEFAULTS.shutdown_grace,
        metavar="SECONDS",
        help="how long parked requests may finish at shutdown (%(default)s)",
    )
    serve.add_argument(
        "--max-body",
        type=int,
        default=_DEFAULTS.max_body,
        metavar="BYTES",
        help="request body limit (%(default)s)",
    )
    serve.add_argument(
        "--public-url",
        default=None,
        help="base URL backends use to reach this server, for callback URLs",
    )
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one JSON object per line, with the job fields (correlation_id, job_id...)",
    )
    return parser


def load_engine(target: str) -> Engine:
    """Import ``MODULE:FACTORY`` and return the Engine it names or builds."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise SystemExit(f"pipework: expected MODULE:FACTORY, got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(f"pipework: cannot import {module_name!r}: {exc}") from exc
    try:
        found: Any = getattr(module, attribute)
    except AttributeError:
        raise SystemExit(f"pipework: module {module_name!r} has no {attribute!r}") from None
    engine = found if isinstance(found, Engine) else found() if callable(found) else found
    if not isinstance(engine, Engine):
        raise SystemExit(
            f"pipework: {target} gave {type(engine).__name__}, expected an Engine "
            "(or a function returning one)"
        )
    return engine


def _serve(args: argparse.Namespace) -> int:
    engine = load_engine(args.target)
    config = ContainerConfig(
        shutdown_grace=args.shutdown_grace, max_body=args.max_body, public_url=args.public_url
    )
    trio.run(functools.partial(_run, engine, config, args.host, args.port))
    return 0


async def _run(engine: Engine, config: ContainerConfig, host: str, port: int) -> None:
    stop = trio.Event()
    async with engine:
        container = Container(engine, config=config)
        async with trio.open_nursery() as nursery:
            await nursery.start(_watch_signals, stop, nursery.cancel_scope)

            async def serve(*, task_status: trio.TaskStatus[Any]) -> None:
                await container.serve(
                    host=host, port=port, shutdown_trigger=stop, task_status=task_status
                )
                nursery.cancel_scope.cancel()  # served and shut down: stop watching signals

            address = await nursery.start(serve)
            # One line on stderr that a supervisor (or a test) can wait for.
            print(f"pipework serving on {address.url}", file=sys.stderr, flush=True)


async def _watch_signals(
    stop: trio.Event,
    everything: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """First SIGINT/SIGTERM: graceful shutdown. Second: stop at once."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if stop.is_set():
                _log.warning("second %s: stopping now", name)
                everything.cancel()
                return
            _log.info("%s: shutting down gracefully", name)
            stop.set()


_COMMANDS: Final[dict[str, Callable[[argparse.Namespace], int]]] = {"serve": _serve}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler()
    if getattr(args, "log_format", "text") == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(args, "log_level", "INFO"), handlers=[handler])
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
