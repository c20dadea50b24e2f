"""The demo gateway: ``make run``, or ``python -m examples.gateway.run [--free-ports]``.

Starts the seven backend services (backends.py), serves pipework.toml with ``python -m
pipework serve`` in a child process, waits until its ``/readyz`` answers, prints the curl
commands to try, and stays up until Ctrl-C; then it stops the gateway gracefully (SIGTERM)
and the backends after it.

``--free-ports`` puts every server on a free port instead of the file's and serves a
copy of the file pointing at them (the printed commands say where everything is).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import httpx
import trio

from examples.gateway.backends import CONFIG, SERVICES, configured_ports, serve_backends
from examples.gateway.pipes import REPORTS_URL_ENV

__all__ = ["Step", "main", "steps"]

ROOT: Final = Path(__file__).resolve().parents[2]
HOST: Final = "127.0.0.1"
SERVING: Final = b"pipework serving on "
READY_LINE: Final = "Press Ctrl-C to stop."
STARTUP_TIMEOUT: Final = 30.0
# The gateway's own shutdown grace (pipework.toml) plus time to exit.
STOP_TIMEOUT: Final = 10.0

#: Placeholders in the printed job commands: the 202's X-Job-Id and X-Job-Token headers.
JOB_ID: Final = "JOB_ID"
JOB_TOKEN: Final = "JOB_TOKEN"
#: How many orders the burst command sends at once (twice inventory's limit).
BURST: Final = 8

_JSON: Final = "-H 'Content-Type: application/json'"


@dataclass(frozen=True, slots=True)
class Step:
    """One command to try: what it shows, what to expect, and the command itself."""

    shows: str
    expect: str
    command: str


def steps(gateway: str, inventory: str, admin_token: str) -> list[Step]:
    """The commands to try, in order (the hang and recover steps go to inventory)."""
    admin = f"-H 'Authorization: Bearer {admin_token}'"
    job = f"-H 'Authorization: Bearer {JOB_TOKEN}'"
    order_data = f'{_JSON} -d \'{{"sku": "tea", "qty": 2}}\''
    order = f"curl -s -X POST {gateway}/orders/7 {order_data}"
    burst = (
        f"seq {BURST} | xargs -P {BURST} -I{{}} curl -s -o /dev/null"
        f" -w '{{}}: %{{http_code}} after %{{time_total}}s\\n'"
        f" -X POST {gateway}/orders/7 {order_data}"
    )
    search = f"curl -s -w '  (%{{time_total}}s)\\n' '{gateway}/search?q=tea'"
    return [
        Step(
            "order: users, quotes and inventory called at once (all_of), then combined",
            '200 {"user": "Ada", "sku": "tea", "qty": 2, "total": 9.0, "in_stock": true}',
            order,
        ),
        Step(
            "search: two mirrors at once (any_of); mirror_b takes 1.5 s, so mirror_a wins",
            '200 {"hits": [...], "mirror": "mirror_a", "q": "tea"} well under a second',
            search,
        ),
        Step(
            "a proxy route: /shop/... goes to quotes as it came (without /shop), its answer"
            " comes back as it came",
            '200 {"qty": 2, "sku": "tea", "total": 9.0, "unit_price": 4.5}, Via: 1.1 pipework',
            f"curl -si '{gateway}/shop/quotes/tea?qty=2'",
        ),
        Step(
            "checkout: a graph; the price is held once user and quote are in, audit detached",
            '200 {"user": "Ada", "tier": "gold", "sku": "coffee", "total": 13.05, "hold_id": ...}',
            f'curl -s -X POST {gateway}/checkout/7 {_JSON} -d \'{{"sku": "coffee", "qty": 2}}\'',
        ),
        Step(
            "report: an async job; keep the X-Job-Id and X-Job-Token headers",
            "202, Location: /jobs/<id>, X-Job-Id: <id>, X-Job-Token: <token>",
            f"curl -si -X POST {gateway}/reports/7 {_JSON} -d '{{\"sections\": 4}}'",
        ),
        Step(
            f"the job's status: put in {JOB_ID} and {JOB_TOKEN} from the 202",
            '200 {"status": "running", "progress": {"done": 1, "total": 4, ...}, ...}',
            f"curl -s {gateway}/jobs/{JOB_ID} {job}",
        ),
        Step(
            "the job's result, a second or so after the 202",
            '200 {"user": "Ada", "sections": [...]}; before that 409 job-not-finished',
            f"curl -s {gateway}/jobs/{JOB_ID}/result {job}",
        ),
        Step(
            "pay: the request parks, holding no worker, until payments calls back",
            '200 {"status": "paid", "charge_id": "ch_...", "amount": 15.0, ...} after ~0.5 s',
            f'curl -s -X POST {gateway}/pay/8 {_JSON} -d \'{{"sku": "cocoa", "qty": 3}}\'',
        ),
        Step(
            "tell inventory to hang (this goes to the backend itself)",
            '{"hanging": true}',
            f"curl -s -X POST {inventory}/control/hang",
        ),
        Step(
            "order again: inventory's timeout (1 s) makes it a 504, a local failure",
            "504 problem+json: \"service 'inventory' did not answer within 1s (for ...)\"",
            order,
        ),
        Step(
            f"{BURST} orders at once: 4 (inventory's limit) wait on it, the others only"
            " 0.5 s (its wait_timeout) for a slot",
            "4 x 503 (no slot) after ~0.5 s, 4 x 504 after ~1 s; in any order",
            burst,
        ),
        Step(
            "search meanwhile: unaffected, the hung calls hold only inventory's slots",
            '200 {"hits": [...], "mirror": "mirror_a", "q": "tea"}',
            search,
        ),
        Step(
            "the pool's weights and counters, per service (admin API)",
            '200 {..., "keys": {"inventory": {"reserve": 2, "limit": 4, "rejected": ...}}}',
            f"curl -s {gateway}/admin/pool {admin}",
        ),
        Step(
            "change inventory's limit live",
            '200 {"config_generation": 2, "key": {"reserve": 2, "limit": 2, ...}}',
            f"curl -s -X PUT {gateway}/admin/pool/keys/inventory {admin} {_JSON}"
            " -d '{\"limit\": 2}'",
        ),
        Step(
            "let inventory recover",
            '{"hanging": false}',
            f"curl -s -X POST {inventory}/control/recover",
        ),
        Step("order once more", "200, as in 1", order),
        Step(
            "inventory's slots as Prometheus sees them",
            'pipework_pool_limit{key="inventory"} 2.0, pipework_pool_rejected_total{...} 4.0, ...',
            f"curl -s {gateway}/metrics"
            " | grep -E '^pipework_pool_(in_use|limit|rejected_total)\\{key=\"inventory\"'",
        ),
        Step(
            "the proxy route's answers, by route, service and status",
            'pipework_proxy_responses_total{route="shop",service="quotes",status="200"} 1.0',
            f"curl -s {gateway}/metrics | grep '^pipework_proxy_responses_total'",
        ),
    ]


def print_instructions(
    gateway: str, urls: Mapping[str, str], config: Path, admin_token: str
) -> None:
    lines = [
        "",
        f"pipework demo gateway on {gateway}, serving {_shown(config)}",
        f"  admin token: {admin_token}",
        *(f"  backend {name:<10} {urls[name]}" for name in SERVICES),
        "",
        "Try these, in order, from another terminal:",
    ]
    for n, step in enumerate(steps(gateway, urls["inventory"], admin_token), 1):
        lines += ["", f"# {n}. {step.shows}", f"#    -> {step.expect}", step.command]
    lines += ["", "The gateway's log appears below.", READY_LINE, ""]
    print("\n".join(lines), flush=True)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write_config(urls: Mapping[str, str], directory: Path) -> Path:
    """A copy of pipework.toml whose services point at ``urls``."""
    text = CONFIG.read_text(encoding="utf-8")
    with open(CONFIG, "rb") as file:
        services = tomllib.load(file)["services"]
    for name in SERVICES:
        configured = f'"{services[name]["base_url"]}"'
        if text.count(configured) != 1:
            raise ValueError(f"{CONFIG}: expected base_url {configured} exactly once")
        text = text.replace(configured, f'"{urls[name]}"')
    path = directory / "pipework.toml"
    path.write_text(text, encoding="utf-8")
    return path


async def _race(*waits: Callable[[], Awaitable[object]]) -> int:
    """Run ``waits`` at once; the index of the first to return (the others are cancelled)."""
    winner: list[int] = []
    async with trio.open_nursery() as nursery:
        for index, wait in enumerate(waits):

            async def run(index: int = index, wait: Callable[[], Awaitable[object]] = wait) -> None:
                await wait()
                winner.append(index)
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
    return winner[0]


class _GatewayOutput:
    """Copies the gateway's stderr to ours, and catches the line saying where it serves."""

    def __init__(self) -> None:
        self.url: str | None = None
        self.started = trio.Event()  # serving, or ended without serving

    async def pump(self, stream: trio.abc.ReceiveStream) -> None:
        pending = b""
        async for chunk in stream:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if self.url is None and line.startswith(SERVING):
                    self.url = line[len(SERVING) :].decode().strip()
                    self.started.set()
                else:
                    sys.stderr.buffer.write(line + b"\n")
                    sys.stderr.flush()
        if pending:
            sys.stderr.buffer.write(pending + b"\n")
            sys.stderr.flush()
        self.started.set()


async def _wait_ready(url: str) -> None:
    """Poll /readyz until it answers 200 (bounded by the caller)."""
    async with httpx.AsyncClient(base_url=url, timeout=2.0, trust_env=False) as client:
        while True:
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            await trio.sleep(0.1)  # nothing to wait on but the gateway's own start-up


def ports_in_use(ports: Mapping[str, int]) -> list[str]:
    """Which of ``ports`` something else listens on (said before starting anything)."""
    taken = []
    for name, port in ports.items():
        with socket.socket() as probe:
            # As the servers will: a port whose old connections linger is still usable.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((HOST, port))
            except OSError:
                taken.append(f"{port} ({name})")
    return taken


def configured_gateway_port() -> int:
    with open(CONFIG, "rb") as file:
        return int(tomllib.load(file)["server"]["port"])


async def run_demo(
    ports: Mapping[str, int], gateway_port: int, *, free_ports: bool, log_level: str
) -> int:
    admin_token = os.environ.get("PIPEWORK_ADMIN_TOKEN") or secrets.token_urlsafe(12)
    with tempfile.TemporaryDirectory(prefix="pipework-demo-") as directory:
        async with trio.open_nursery() as nursery:
            stop_backends = trio.Event()
            urls: dict[str, str] = await nursery.start(
                functools.partial(serve_backends, ports, host=HOST, stop=stop_backends)
            )
            try:
                config = write_config(urls, Path(directory)) if free_ports else CONFIG
                env = {
                    **os.environ,
                    "PIPEWORK_ADMIN_TOKEN": admin_token,
                    REPORTS_URL_ENV: urls["reports"],
                }
                return await _run_gateway(config, env, gateway_port, log_level, urls, admin_token)
            finally:
                stop_backends.set()


async def _run_gateway(
    config: Path,
    env: Mapping[str, str],
    port: int,
    log_level: str,
    urls: Mapping[str, str],
    admin_token: str,
) -> int:
    command = [
        sys.executable,
        "-m",
        "pipework",
        "serve",
        str(config),
        "--host",
        HOST,
        "--port",
        str(port),
        "--log-level",
        log_level,
    ]
    output = _GatewayOutput()
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(
                trio.run_process,
                command,
                stdin=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                check=False,
                cwd=ROOT,  # `python = "examples.gateway.pipes:..."` resolves from here
                env=env,
                # Ctrl-C in the terminal reaches only this process, which stops the
                # gateway with one SIGTERM (a second signal would make it stop at once).
                start_new_session=True,
            )
        )
        assert process.stderr is not None
        nursery.start_soon(output.pump, process.stderr)
        ready = False
        with trio.move_on_after(STARTUP_TIMEOUT):
            await output.started.wait()
            if output.url is not None:
                await _wait_ready(output.url)
                ready = True
        if not ready or output.url is None:
            print("run: the gateway did not start; its output is above", file=sys.stderr)
            process.kill()
            return 1
        print_instructions(output.url, urls, config, admin_token)
        return await _serve_until_stopped(process)


async def _serve_until_stopped(process: trio.Process) -> int:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        if await _race(signals.__anext__, process.wait) == 1:
            print(f"run: the gateway exited on its own ({process.returncode})", file=sys.stderr)
            return 1
        print("\nrun: stopping the gateway, then the backends", file=sys.stderr, flush=True)
        process.send_signal(signal.SIGTERM)
        # A second Ctrl-C, or a gateway that takes too long: stop it at once.
        with trio.move_on_after(STOP_TIMEOUT):
            await _race(signals.__anext__, process.wait)
        if process.returncode is None:
            process.kill()
            await process.wait()
    code = process.returncode
    print(f"run: gateway stopped ({code}); backends stopping", file=sys.stderr, flush=True)
    return 0 if code == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.gateway.run", description="Run the pipework demo gateway."
    )
    parser.add_argument(
        "--free-ports",
        action="store_true",
        help="serve everything on free ports instead of pipework.toml's",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="the gateway's log level (%(default)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.free_ports:
        ports, gateway_port = dict.fromkeys(SERVICES, 0), 0
    else:
        ports, gateway_port = configured_ports(), configured_gateway_port()
        taken = ports_in_use({**ports, "the gateway": gateway_port})
        if taken:
            print(
                f"run: in use: port {', '.join(taken)}; stop what listens there, or run "
                "`.venv/bin/python -m examples.gateway.run --free-ports`",
                file=sys.stderr,
            )
            return 1
    run = functools.partial(
        run_demo, ports, gateway_port, free_ports=args.free_ports, log_level=args.log_level
    )
    try:
        return trio.run(run)
    except (KeyboardInterrupt, BaseExceptionGroup) as exc:
        # Ctrl-C while starting: trio has stopped everything started so far.
        if isinstance(exc, BaseExceptionGroup) and exc.split(KeyboardInterrupt)[1] is not None:
            raise
        print("run: interrupted while starting; everything is stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
