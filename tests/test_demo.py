"""The demo gateway (``make run``): started as its README says, every command it prints run
and its answer checked, then stopped the way Ctrl-C stops it.

The printed commands are curl command lines; they are parsed here and sent with httpx, so
what a reader copies is exactly what is checked. The parser knows the few forms the demo
prints (``curl`` with ``-s -i -X -H -d -w -o``, ``seq N | xargs -P N -I{} curl ...`` for N
requests at once, ``... | grep [-E] PATTERN``); anything else fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import trio

from examples.gateway.backends import configured_ports
from examples.gateway.run import (
    BURST,
    JOB_ID,
    JOB_TOKEN,
    READY_LINE,
    configured_gateway_port,
    steps,
)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "examples" / "gateway" / "README.md"
COMMAND = ["-m", "examples.gateway.run", "--free-ports"]
SERVICES = {"users", "quotes", "inventory", "mirror_a", "mirror_b", "reports", "payments"}
INVENTORY_LIMIT = 4  # pipework.toml


@dataclass(frozen=True, slots=True)
class Curl:
    """One parsed command line: the request, how many at once, and a grep after it."""

    method: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    data: bytes | None = None
    times: int = 1
    grep: str | None = None


def parse_curl(line: str) -> Curl:
    words = shlex.split(line)
    times = 1
    if words[0] == "seq":
        times = int(words[1])
        assert words[2:7] == ["|", "xargs", "-P", str(times), "-I{}"], line
        words = words[7:]
    grep = None
    if "|" in words:
        at = words.index("|")
        pattern = [w for w in words[at + 2 :] if w != "-E"]
        assert words[at + 1] == "grep", line
        assert len(pattern) == 1, line
        grep, words = pattern[0], words[:at]
    assert words[0] == "curl", line
    method: str | None = None
    url: str | None = None
    headers: dict[str, str] = {}
    data: bytes | None = None
    rest = iter(words[1:])
    for word in rest:
        if word == "-X":
            method = next(rest)
        elif word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            data = next(rest).encode()
        elif word in ("-w", "-o"):
            next(rest)  # where curl writes the body and what it prints after: display only
        elif word.startswith("-"):
            # -s (quiet) and -i (show headers) change only what curl prints.
            assert set(word[1:]) <= {"s", "i"}, f"an option this test does not know: {word}"
        else:
            assert url is None, f"two URLs in {line!r}"
            url = word
    assert url is not None, line
    method = method or ("POST" if data is not None else "GET")
    return Curl(method, url, headers, data, times, grep)


async def run_curl(client: httpx.AsyncClient, curl: Curl) -> list[httpx.Response]:
    """Send the request, ``curl.times`` at once; the answers in order of arrival."""
    answers: list[httpx.Response] = []

    async def one() -> None:
        request = client.request(curl.method, curl.url, headers=curl.headers, content=curl.data)
        answers.append(await request)

    async with trio.open_nursery() as nursery:
        for _ in range(curl.times):
            nursery.start_soon(one)
    return answers


# -- what each printed command must answer, in order ----------------------------------


def json_of(response: httpx.Response, status: int) -> Any:
    assert response.status_code == status, (response.status_code, response.text)
    return response.json()


ORDER = {"user": "Ada", "sku": "tea", "qty": 2, "total": 9.0, "in_stock": True}


def order_ok(r: httpx.Response) -> None:
    assert json_of(r, 200) == ORDER


def search_ok(r: httpx.Response) -> None:
    # mirror_b answers 1.5 s later; any_of returns the first success and cancels it.
    assert json_of(r, 200) == {
        "mirror": "mirror_a",
        "q": "tea",
        "hits": ["green tea", "black tea", "tea pot"],
    }


def shop_ok(r: httpx.Response) -> None:
    # quotes' own answer to GET /quotes/tea?qty=2, relayed by the proxy route /shop.
    assert json_of(r, 200) == {"sku": "tea", "qty": 2, "unit_price": 4.5, "total": 9.0}
    assert r.headers["Content-Type"] == "application/json"
    assert r.headers["Via"].endswith("1.1 pipework")
    assert r.headers["X-Request-ID"]


def checkout_ok(r: httpx.Response) -> None:
    receipt = json_of(r, 200)
    assert receipt.pop("hold_id").startswith("h_")
    assert receipt == {"user": "Ada", "tier": "gold", "sku": "coffee", "qty": 2, "total": 13.05}


def report_accepted(r: httpx.Response) -> None:
    assert r.status_code == 202, r.text
    job_id = r.headers["X-Job-Id"]
    assert r.headers["Location"] == f"/jobs/{job_id}"
    assert r.headers["X-Job-Token"] == r.json()["token"]


def report_status(r: httpx.Response) -> None:
    view = json_of(r, 200)
    assert view["chain"] == "report"
    assert view["status"] in ("queued", "running", "done"), view
    if view["progress"] is not None:
        assert view["progress"]["total"] == 4


def report_result(r: httpx.Response) -> None:
    report = json_of(r, 200)
    assert report["user"] == "Ada"
    assert [s["section"] for s in report["sections"]] == [1, 2, 3, 4]


def paid(r: httpx.Response) -> None:
    payment = json_of(r, 200)
    assert payment.pop("charge_id").startswith("ch_")
    assert payment == {"status": "paid", "amount": 15.0, "sku": "cocoa"}


def hanging(r: httpx.Response) -> None:
    assert json_of(r, 200) == {"hanging": True}


def inventory_timed_out(r: httpx.Response) -> None:
    problem = json_of(r, 504)
    assert r.headers["Content-Type"] == "application/problem+json"
    assert problem["type"] == "urn:pipework:problem:deadline-exceeded"
    assert problem["detail"] == (
        "service 'inventory' did not answer within 1s (for chain 'order' > all_of[0] > "
        "branch 'check_stock' > pipe 'check_stock'); check why it is slow, or raise its "
        "timeout if it may take that long"
    )


def no_slot_for_inventory(r: httpx.Response) -> None:
    problem = json_of(r, 503)
    assert problem["type"] == "urn:pipework:problem:rejected"
    assert problem["key"] == "inventory"
    assert "Retry-After" in r.headers


def burst(answers: list[httpx.Response]) -> None:
    # At most `limit` calls wait on the hung service; the others are refused, not queued.
    assert len(answers) == BURST
    timed_out = [r for r in answers if r.status_code == 504]
    refused = [r for r in answers if r.status_code != 504]
    assert 1 <= len(timed_out) <= INVENTORY_LIMIT, [r.status_code for r in answers]
    assert refused, [r.status_code for r in answers]
    for r in timed_out:
        inventory_timed_out(r)
    for r in refused:
        no_slot_for_inventory(r)


def pool_shown(r: httpx.Response) -> None:
    pool = json_of(r, 200)
    assert set(pool["keys"]) >= SERVICES
    inventory = pool["keys"]["inventory"]
    assert (inventory["reserve"], inventory["limit"]) == (2, INVENTORY_LIMIT)
    assert inventory["rejected"]["wait_timeout"] >= 1


def limit_set(r: httpx.Response) -> None:
    answer = json_of(r, 200)
    assert answer["config_generation"] >= 2
    assert (answer["key"]["reserve"], answer["key"]["limit"]) == (2, 2)


def recovered(r: httpx.Response) -> None:
    assert json_of(r, 200) == {"hanging": False}


def inventory_scraped(lines: list[str]) -> None:
    assert 'pipework_pool_limit{key="inventory"} 2.0' in lines
    assert 'pipework_pool_in_use{key="inventory",kind="reserved"} 0.0' in lines
    rejected = 'pipework_pool_rejected_total{key="inventory",reason="wait_timeout"} '
    assert any(s.startswith(rejected) and float(s.removeprefix(rejected)) >= 1 for s in lines)
    assert all('key="inventory"' in s for s in lines), lines


def shop_scraped(lines: list[str]) -> None:
    assert lines == [
        'pipework_proxy_responses_total{route="shop",service="quotes",status="200"} 1.0'
    ]


@dataclass(frozen=True, slots=True)
class Output:
    """What a command got: its answers, and the lines grep let through (if piped)."""

    answers: list[httpx.Response]
    lines: list[str] | None = None


Check = Callable[[Output], None]


def one(check: Callable[[httpx.Response], None]) -> Check:
    def check_one(output: Output) -> None:
        [answer] = output.answers
        check(answer)

    return check_one


def every(check: Callable[[list[httpx.Response]], None]) -> Check:
    return lambda output: check(output.answers)


def grepped(check: Callable[[list[str]], None]) -> Check:
    def check_lines(output: Output) -> None:
        [answer] = output.answers
        assert answer.status_code == 200, answer.text
        assert output.lines is not None
        check(output.lines)

    return check_lines


# (method, the URL's path, the check): the first two make sure each command is checked
# against what it is meant to do.
EXPECTED: list[tuple[str, str, Check]] = [
    ("POST", "/orders/7", one(order_ok)),
    ("GET", "/search", one(search_ok)),
    ("GET", "/shop/quotes/tea", one(shop_ok)),
    ("POST", "/checkout/7", one(checkout_ok)),
    ("POST", "/reports/7", one(report_accepted)),
    ("GET", f"/jobs/{JOB_ID}", one(report_status)),
    ("GET", f"/jobs/{JOB_ID}/result", one(report_result)),
    ("POST", "/pay/8", one(paid)),
    ("POST", "/control/hang", one(hanging)),
    ("POST", "/orders/7", one(inventory_timed_out)),
    ("POST", "/orders/7", every(burst)),
    ("GET", "/search", one(search_ok)),
    ("GET", "/admin/pool", one(pool_shown)),
    ("PUT", "/admin/pool/keys/inventory", one(limit_set)),
    ("POST", "/control/recover", one(recovered)),
    ("POST", "/orders/7", one(order_ok)),
    ("GET", "/metrics", grepped(inventory_scraped)),
    ("GET", "/metrics", grepped(shop_scraped)),
]


def fill(text: str, job: dict[str, str]) -> str:
    """Put the job's id and token where the printed commands say JOB_ID and JOB_TOKEN."""
    for placeholder, value in job.items():
        text = text.replace(placeholder, value)
    return text


def not_finished(response: httpx.Response) -> bool:
    if response.headers.get("Content-Type") != "application/problem+json":
        return False
    kind: str = response.json()["type"]
    return kind == "urn:pipework:problem:job-not-finished"


async def run_commands(client: httpx.AsyncClient, commands: list[str]) -> None:
    job: dict[str, str] = {}
    for line, (method, path, check) in zip(commands, EXPECTED, strict=True):
        curl = parse_curl(fill(line, job))
        assert (curl.method, httpx.URL(curl.url).path) == (method, fill(path, job)), line
        answers = await run_curl(client, curl)
        # A running job's result is a 409 with Retry-After: do as it says, like a client.
        while not_finished(answers[-1]):
            await trio.sleep(float(answers[-1].headers["Retry-After"]))
            answers = await run_curl(client, curl)
        lines = None
        if curl.grep is not None:
            lines = [s for s in answers[-1].text.splitlines() if re.search(curl.grep, s)]
        check(Output(answers, lines))
        if answers[-1].status_code == 202:
            headers = answers[-1].headers
            job = {JOB_ID: headers["X-Job-Id"], JOB_TOKEN: headers["X-Job-Token"]}


def test_readme_starts_the_demo_the_same_way() -> None:
    text = README.read_text(encoding="utf-8")
    assert "python -m examples.gateway.run --free-ports" in text
    assert "make run" in text


def test_readme_shows_the_commands_the_demo_prints() -> None:
    # With the file's own ports, as `make run` prints them; TOKEN for the admin token.
    text = README.read_text(encoding="utf-8")
    shown = [s for s in text.splitlines() if s.startswith(("curl ", "seq "))]
    inventory = f"http://127.0.0.1:{configured_ports()['inventory']}"
    printed = steps(f"http://127.0.0.1:{configured_gateway_port()}", inventory, "TOKEN")
    assert shown == [step.command for step in printed]


async def test_every_printed_command_answers_as_described() -> None:
    with tempfile.TemporaryFile() as stderr:
        await run_demo(stderr)
        stderr.seek(0)
        log = stderr.read().decode()
    assert "run: gateway stopped (0)" in log, log
    assert "Traceback" not in log, log


async def run_demo(stderr: IO[bytes]) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "error"}
    env.pop("PIPEWORK_ADMIN_TOKEN", None)  # the demo makes its own and prints it
    process = await trio.lowlevel.open_process(
        [sys.executable, *COMMAND],
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    assert process.stdout is not None
    seen = bytearray()
    try:
        with trio.fail_after(30):
            while READY_LINE.encode() not in seen:
                chunk = await process.stdout.receive_some()
                assert chunk, f"the demo ended before it was ready:\n{seen.decode()}"
                seen += chunk
            commands = [s for s in seen.decode().splitlines() if s.startswith(("curl ", "seq "))]
            assert len(commands) == len(EXPECTED), commands
            async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
                await run_commands(client, commands)
            process.send_signal(signal.SIGINT)  # what Ctrl-C sends
            while chunk := await process.stdout.receive_some():
                seen += chunk
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)  # stops the gateway it started, too
            with trio.move_on_after(10):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
