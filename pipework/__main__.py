"""The ``pipework`` command line.

    pipework serve FILE.toml | MODULE:FACTORY [--host HOST] [--port PORT] [--workers N] ...
    pipework check FILE [--format text|json] [--fetch]   validate a gateway file: every
                                 problem (--fetch: fetch its JWKS URLs too)
    pipework routes FILE         the routes and their resolved chains
    pipework graph FILE [--out DIR]   each route's chain as a Mermaid diagram
    pipework --version

``serve FILE`` builds the gateway the file declares (pool, backends, pipes, routes) and
reloads it on SIGHUP; ``serve MODULE:FACTORY`` imports a function returning an
:class:`Engine` (or an Engine). Both serve until SIGINT or SIGTERM, then shut down
gracefully (a second signal stops at once). ``--workers N`` serves from N processes behind
one port, supervised by this one (:mod:`pipework._supervisor`). Each subcommand is one
function registered in ``_COMMANDS``; new ones add a parser and a function.
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, Final

import trio

from . import __version__
from ._cli_config import check, graph, routes
from ._errors import PipeworkError
from ._logging import JsonFormatter
from ._supervisor import PARENT_ENV, READY, Supervisor, listen
from .container._app import Container, ContainerConfig
from .container._collector import SERVING_GC_THRESHOLD
from .container._routes import Route, routes_of
from .dispatcher._engine import Engine
from .dispatcher._store import MemoryJobStore
from .registry._config_problems import ConfigError
from .registry._gateway import Gateway

__all__ = ["build_parser", "configure_logging", "main"]

_log = logging.getLogger("pipework")
_DEFAULTS: Final = ContainerConfig()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipework", description="A trio-native pipeline and request processor."
    )
    parser.add_argument("--version", action="version", version=f"pipework {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser("serve", help="serve a gateway file or an engine over HTTP")
    serve.add_argument(
        "target",
        metavar="FILE|MODULE:FACTORY",
        help="a gateway TOML file, or where an engine comes from (e.g. app:build)",
    )
    serve.add_argument("--host", default=None, help="address to bind (the file's, else 127.0.0.1)")
    serve.add_argument(
        "--port", type=int, default=None, help="port to bind, 0 for any (the file's, else 8000)"
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"how long parked requests may finish at shutdown (the file's, else "
        f"{_DEFAULTS.shutdown_grace:g})",
    )
    serve.add_argument(
        "--max-body",
        type=int,
        default=None,
        metavar="BYTES",
        help=f"request body limit (the file's, else {_DEFAULTS.max_body})",
    )
    serve.add_argument(
        "--public-url",
        default=None,
        help="base URL backends use to reach this server, for callback URLs (over the file's)",
    )
    serve.add_argument(
        "--gc-threshold",
        type=_not_negative,
        default=None,
        metavar="N",
        help=f"the garbage collector's young threshold while serving, 0 for the "
        f"interpreter's (the file's, else {SERVING_GC_THRESHOLD:,})",
    )
    serve.add_argument(
        "--workers",
        type=_positive,
        default=1,
        metavar="N",
        help="serve from N processes behind one port, supervised by this one (default 1); "
        "with the memory job store, only sync and stream routes work across them",
    )
    # A worker of `serve --workers N`: the parent's listening socket and its ready pipe.
    serve.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    serve.add_argument(
        "--debug",
        action="store_true",
        help="a failure to start (a bad file, Redis absent, the port in use) shows its "
        "traceback too, not only its one line",
    )
    serve.add_argument(
        "--no-access-log",
        dest="access_log",
        action="store_false",
        help="no access log line per request (on by default: method, path, status, "
        "duration, request id)",
    )
    serve.add_argument(
        "--log-format",
        default="text",
        choices=["text", "json"],
        help="json: one JSON object per line, with the job fields (correlation_id, job_id...)",
    )
    for name, text in (
        ("check", "validate a gateway file and print every problem"),
        ("routes", "list a gateway file's routes with their resolved chains"),
        ("graph", "draw each route's chain as a Mermaid diagram"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("file", metavar="FILE", help="the gateway TOML file")
        if name == "graph":
            command.add_argument(
                "--out", metavar="DIR", default=None, help="write one .md file per route here"
            )
        if name == "check":
            command.add_argument(
                "--format",
                default="text",
                choices=["text", "json"],
                help="json: one JSON document on stdout (valid, errors, warnings), for CI",
            )
            command.add_argument(
                "--fetch",
                action="store_true",
                help="also fetch every jwks_url the file names and check the keys it serves",
            )
    return parser


def _positive(text: str) -> int:
    return _whole(text, 1)


def _not_negative(text: str) -> int:
    return _whole(text, 0)


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of at least {least}, got {text!r}"
        )
    return value


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
    if args.workers > 1 and args.listen_fd is None:
        return _supervise(args)
    fd = args.listen_fd
    if _is_file(args.target):
        try:
            gateway = Gateway(args.target, overrides=_overrides(args))
        except ConfigError as exc:
            _config_error(args, exc)
            return 1
        server = gateway.config.server
        host = args.host or server.host
        port = server.port if args.port is None else args.port
        run = functools.partial(_run_gateway, gateway, args.host, args.port, fd, args.ready_fd)
    else:
        engine = load_engine(args.target)
        # This process is pipework's own: it serves with the raised threshold and the heap
        # frozen unless told.
        config = replace(
            ContainerConfig(gc_threshold=SERVING_GC_THRESHOLD, gc_freeze=True), **_overrides(args)
        )
        host = args.host or "127.0.0.1"
        port = 8000 if args.port is None else args.port
        run = functools.partial(_run, engine, config, host, port, fd, args.ready_fd)
    try:
        trio.run(run)
    except BaseException as exc:
        line = None if args.debug else _failure_line(exc, host, port)
        if line is None:
            raise  # a bug (or --debug): its traceback is what to read
        _fail(args, line)
        return 1
    return 0


def _failure_line(exc: BaseException, host: str, port: int) -> str | None:
    """The one line that says why serving failed when it is the configuration's or a
    dependency's fault (pipework's own errors, an address that cannot be bound); None for
    anything else (a bug keeps its traceback)."""
    leaves = _leaves(exc)
    if not leaves or not all(isinstance(e, PipeworkError | OSError) for e in leaves):
        return None
    first = leaves[0]
    if isinstance(first, OSError) and first.errno in _BIND_ERRORS:
        return f"pipework: cannot listen on {host}:{port}: {first.strerror or first}"
    if isinstance(first, ConfigError):  # a late one (an environment variable unset)
        return f"pipework: cannot start: {'; '.join(p.format() for p in first.problems)}"
    return f"pipework: cannot start: {first}"


#: Why an address cannot be bound: in use, not this machine's, or a privileged port.
_BIND_ERRORS: Final = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions an exception group holds, flattened (itself when it is none)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _fail(args: argparse.Namespace, line: str) -> None:
    """A start-up failure's line on stderr: a log record when the log is JSON."""
    if args.log_format == "json":
        _log.error("%s", line, extra={"event": "start failed"})
    else:
        print(line, file=sys.stderr)


def _is_file(target: str) -> bool:
    return target.endswith(".toml") or os.path.isfile(target)


def _config_error(args: argparse.Namespace, exc: ConfigError) -> None:
    """A file that cannot be served: one line when it has one problem (``FILE:LINE:
    error: KEY: what``), else a count and one line per problem."""
    text = exc.problems[0].format(exc.source) if len(exc.problems) == 1 else str(exc)
    if args.log_format == "json":
        _log.error("%s", text, extra={"event": "start failed"})
    else:
        print(text, file=sys.stderr)


def _supervise(args: argparse.Namespace) -> int:
    """``serve --workers N``: check the target here, bind, then run N workers."""
    if _is_file(args.target):
        try:
            gateway = Gateway(args.target, overrides=_overrides(args))
        except ConfigError as exc:
            _config_error(args, exc)
            return 1
        server = gateway.config.server
        host, port = args.host or server.host, server.port if args.port is None else args.port
        grace = gateway.overrides.get("shutdown_grace", server.shutdown_grace)
        # Each worker reads the file's TLS settings itself (and again on SIGHUP).
        scheme = "http" if server.tls is None else "https"
        local = _file_store_is_local(gateway.config)
        served = [rc.route for rc in gateway.config.routes.values()]
        boards = _local_boards_problem(gateway.config, args.workers)
        if boards is not None:
            print(boards, file=sys.stderr)
            return 1
        if gateway.config.rate_limits.limits and gateway.config.rate_limits.store == "memory":
            _log.warning(
                "%d workers with the memory rate-limit store: each worker counts its own "
                "requests, so a limit lets through up to %d times its rate and burst; "
                '[rate_limits] store = "redis" makes every worker count together',
                args.workers,
                args.workers,
            )
    else:
        engine = load_engine(args.target)
        host, port = args.host or "127.0.0.1", 8000 if args.port is None else args.port
        scheme = "http"
        grace = _overrides(args).get("shutdown_grace", _DEFAULTS.shutdown_grace)
        local = isinstance(engine.store, MemoryJobStore)
        served = list(routes_of(engine.registry))
    if local:
        problem = _local_store_problem(served, args.workers)
        if problem is not None:
            print(problem, file=sys.stderr)
            return 1
        _log.warning(
            "%d workers with the memory job store: each worker keeps its own jobs, so "
            "GET /jobs/{id}, signals and callbacks reach a job only on the worker that "
            "holds it; sync and stream routes work on any worker",
            args.workers,
        )
    try:
        sock = listen(host, port, backlog=_BACKLOG)
    except OSError as exc:
        print(f"pipework: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 1
    with sock:
        bound_host, bound_port = sock.getsockname()[:2]
        url = (
            f"{scheme}://[{bound_host}]:{bound_port}"
            if ":" in bound_host
            else (f"{scheme}://{bound_host}:{bound_port}")
        )
        supervisor = Supervisor(
            functools.partial(_worker_command, args),
            workers=args.workers,
            sock=sock,
            url=url,
            grace=float(grace),
            announce=_announce,
        )
        return trio.run(supervisor.run)


#: The listening socket's backlog with --workers: hypercorn's default, which each worker's
#: server sets again when it starts listening on the socket.
_BACKLOG: Final = 100


def _file_store_is_local(config: Any) -> bool:
    """Whether a gateway file keeps its jobs in each process's memory (the default)."""
    store = getattr(config, "store", None)
    return store is None or getattr(store, "backend", "memory") == "memory"


def _local_boards_problem(config: Any, workers: int) -> str | None:
    """Why a file's boards cannot be served by ``workers`` processes that each keep their
    own: a write on one would never reach followers (or reads) on the others."""
    if not config.boards or config.backplane.backplane != "local":
        return None
    return (
        f"pipework: cannot serve with --workers {workers} and the local board backplane: "
        f"board(s) {', '.join(map(repr, config.boards))} would live in each worker apart, "
        "so a write on one worker reaches no follower on another. Serve with --workers 1 "
        'or share the boards: [boards] backplane = "redis" (docs/configuration.md).'
    )


def _local_store_problem(served: list[Route], workers: int) -> str | None:
    """Why routes cannot be served by ``workers`` processes that each keep their own jobs."""
    bad = [route for route in served if route.mode in ("async", "auto")]
    if not bad:
        return None
    names = ", ".join(f"{route.name!r} (mode {route.mode})" for route in bad)
    return (
        f"pipework: cannot serve with --workers {workers} and the memory job store: "
        f"route(s) {names} answer 202 with a /jobs/{{id}} link, and with the memory store "
        "only the worker that runs a job knows it, so another worker would answer that "
        "link 404. Serve with --workers 1, make those routes sync or stream, or use a "
        "store shared by every worker."
    )


def _worker_command(args: argparse.Namespace, listen_fd: int, ready_fd: int) -> list[str]:
    """The command line of one worker: this ``serve`` on the parent's socket."""
    command = [sys.executable, "-m", "pipework", "serve", args.target]
    command += ["--listen-fd", str(listen_fd), "--ready-fd", str(ready_fd)]
    command += ["--log-level", args.log_level, "--log-format", args.log_format]
    for flag, value in (
        ("--shutdown-grace", args.shutdown_grace),
        ("--max-body", args.max_body),
        ("--public-url", args.public_url),
        ("--gc-threshold", args.gc_threshold),
    ):
        if value is not None:
            command += [flag, str(value)]
    if not args.access_log:
        command.append("--no-access-log")
    return command


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The container settings given on the command line (they win over the file's)."""
    given = {
        "shutdown_grace": args.shutdown_grace,
        "max_body": args.max_body,
        "public_url": args.public_url,
        "access_log": None if args.access_log else False,
    }
    overrides = {name: value for name, value in given.items() if value is not None}
    if args.gc_threshold is not None:  # 0 is given too: it means the interpreter's (None)
        overrides["gc_threshold"] = args.gc_threshold or None
    return overrides


async def _run(
    engine: Engine,
    config: ContainerConfig,
    host: str,
    port: int,
    fd: int | None = None,
    ready_fd: int | None = None,
) -> None:
    stop = trio.Event()
    async with engine:
        container = Container(engine, config=config)

        async def serve(*, task_status: trio.TaskStatus[Any]) -> None:
            await container.serve(
                host=host, port=port, fd=fd, shutdown_trigger=stop, task_status=task_status
            )

        await _serve_until_signalled(serve, stop, reload=None, ready_fd=ready_fd)


async def _run_gateway(
    gateway: Gateway,
    host: str | None,
    port: int | None,
    fd: int | None = None,
    ready_fd: int | None = None,
) -> None:
    stop = trio.Event()

    async def serve(*, task_status: trio.TaskStatus[Any]) -> None:
        await gateway.run(host=host, port=port, fd=fd, stop=stop, task_status=task_status)

    await _serve_until_signalled(serve, stop, reload=gateway.reload, ready_fd=ready_fd)


async def _serve_until_signalled(
    serve: Callable[..., Awaitable[None]],
    stop: trio.Event,
    reload: Callable[[], Awaitable[Any]] | None,
    ready_fd: int | None = None,
) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, stop, nursery.cancel_scope, reload)

        async def serving(*, task_status: trio.TaskStatus[Any]) -> None:
            await serve(task_status=task_status)
            nursery.cancel_scope.cancel()  # served and shut down: stop watching signals

        address = await nursery.start(serving)
        if ready_fd is not None:
            # A worker of `serve --workers N`: its parent announces the server.
            os.write(ready_fd, READY)
            os.close(ready_fd)
            nursery.start_soon(_watch_parent, stop)
        else:
            _announce(f"pipework serving on {address.url}")


def _announce(line: str) -> None:
    """One line on stderr that a supervisor (or a test) can wait for: a log record when the
    log is JSON (every line then parses), else plain text."""
    if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        _log.info("%s", line, extra={"event": "serving"})
    else:
        print(line, file=sys.stderr, flush=True)


async def _watch_parent(stop: trio.Event) -> None:
    """A worker whose parent is gone (killed: it could not stop us) shuts down."""
    parent = int(os.environ.get(PARENT_ENV, os.getppid()))
    while True:
        await trio.sleep(1.0)
        if os.getppid() != parent:
            break
    _log.warning("the supervising process %d is gone: shutting down gracefully", parent)
    stop.set()


async def _watch_signals(
    stop: trio.Event,
    everything: trio.CancelScope,
    reload: Callable[[], Awaitable[Any]] | None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """First SIGINT/SIGTERM: graceful shutdown. Second: stop at once. SIGHUP: reload."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                await _reload(reload)
                continue
            if stop.is_set():
                _log.warning("second %s: stopping now", name)
                everything.cancel()
                return
            _log.info("%s: shutting down gracefully", name)
            stop.set()


async def _reload(reload: Callable[[], Awaitable[Any]] | None) -> None:
    if reload is None:
        _log.warning("SIGHUP: nothing to reload (not serving a gateway file)")
        return
    try:
        summary = await reload()
    except PipeworkError as exc:  # a bad file changes nothing; say why
        _log.error("SIGHUP: reload refused, the old config keeps serving:\n%s", exc)
    else:
        _log.info("SIGHUP: reloaded (plan %s)", summary.get("plan_generation"))


_COMMANDS: Final[dict[str, Callable[[argparse.Namespace], int]]] = {
    "serve": _serve,
    "check": lambda args: check(args.file, format=args.format, fetch=args.fetch),
    "routes": lambda args: routes(args.file),
    "graph": lambda args: graph(args.file, args.out),
}


def configure_logging(log_format: str = "text", level: str = "INFO") -> None:
    """What ``pipework serve`` logs and how: every logger at ``level`` and above on stderr,
    one line per record (``json``: one JSON object per line)."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.getcwd() not in sys.path and "" not in sys.path:
        # As `python -m` does: a gateway file's `python = "pkg.mod:fn"` pipes and a
        # MODULE:FACTORY resolve from the directory the command runs in.
        sys.path.insert(0, os.getcwd())
    configure_logging(getattr(args, "log_format", "text"), getattr(args, "log_level", "INFO"))
    try:
        status = _COMMANDS[args.command](args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`pipework graph FILE | head`): stop quietly, as cat does.
        # Python would flush stdout again at exit and fail on the same pipe: point it at
        # /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
