"""The container's pieces without a server: route declarations, Prefer parsing, the
request-to-state mapping, body codecs, callback signatures, the idempotency table and the
error-to-problem mapping."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import trio
import trio.testing
from werkzeug.datastructures import MultiDict

import pipework as pw
from pipework._http._bodies import content_length, decode, encode
from pipework._http._problems import Problem, problem_for_error, problem_for_exception
from pipework.container import CallbackSigner
from pipework.container._event_stream import sse_event
from pipework.container._idempotency import IdempotencyTable, fingerprint
from pipework.container._modes_core import Preferences, build_state, check_key, parse_prefer
from pipework.container._parking import Parking
from pipework.container._request import read_headers
from pipework.dispatcher._wake import Wake

# -- routes --------------------------------------------------------------------------------


def test_route_defaults_and_rule() -> None:
    route = pw.Route("get_user", "get", "/users/{user_id}/orders/{order}", "users")
    assert route.method == "GET"
    assert route.mode == "sync"
    assert route.on_disconnect == "cancel"
    assert route.params == ("user_id", "order")
    assert route.rule == "/users/<user_id>/orders/<order>"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"name": ""}, "non-empty name", id="name"),
        pytest.param({"method": "BREW"}, "method 'BREW' is not one of", id="method"),
        pytest.param({"path": "users"}, "must start with '/'", id="relative"),
        pytest.param({"path": "/u/{1x}"}, "must be a Python identifier", id="param-name"),
        pytest.param({"path": "/u/{a}/{a}"}, "repeats a parameter", id="repeated"),
        pytest.param({"path": "/u/x{a}"}, "must be a whole segment", id="partial-segment"),
        pytest.param({"path": "/u/<a>"}, "cannot hold unescaped", id="angle"),
        pytest.param({"path": "/jobs/mine"}, "under /jobs", id="reserved"),
        pytest.param({"path": "/healthz"}, "under /healthz", id="reserved-exact"),
        pytest.param({"mode": "batch"}, "mode 'batch' is not one of", id="mode"),
        pytest.param({"on_disconnect": "ignore"}, "on_disconnect 'ignore'", id="disconnect"),
        pytest.param(
            {"mode": "stream", "on_disconnect": "continue"}, "nowhere to go", id="stream-continue"
        ),
        pytest.param({"timeout": 0}, "timeout must be positive", id="timeout"),
        pytest.param({"sync_wait": -1}, "sync_wait must be >= 0", id="sync-wait"),
        pytest.param({"max_body": -1}, "max_body must be >= 0", id="max-body"),
    ],
)
def test_bad_route_declarations_are_refused(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"name": "r", "method": "POST", "path": "/r", "chain": "c"}
    with pytest.raises(pw.RegistrationError, match=message):
        pw.Route(**(fields | kwargs))


def test_registry_routes_need_their_chain_and_a_unique_shape() -> None:
    registry = pw.Registry()

    @registry.pipe
    async def noop(ctx: pw.Context) -> None:
        return None

    with pytest.raises(pw.RegistrationError, match="chain 'c', which is not registered"):
        registry.route("r", path="/r", chain="c")
    registry.chain("c", noop)
    route = registry.route("r", path="/items/{id}", chain="c", mode="auto", sync_wait=2)
    assert registry.routes == {"r": route}
    with pytest.raises(pw.RegistrationError, match="already registered"):
        registry.route("r", path="/other", chain="c")
    with pytest.raises(pw.RegistrationError, match="clashes with route 'r'"):
        registry.route("r2", path="/items/{key}", chain="c")
    registry.route("r3", method="GET", path="/items/{id}", chain="c")
    assert list(registry.routes) == ["r", "r3"]


def test_a_container_serves_the_routes_its_engines_registry_keeps() -> None:
    async def noop(ctx: pw.Context) -> None:
        return None

    registry = pw.Registry()
    engine = pw.Engine(registry=registry)
    engine.chain("c", engine.pipe(noop))
    route = registry.route("r", path="/r", chain="c")
    assert isinstance(registry, pw.Catalogue)
    assert pw.Container(engine).routes == (route,)
    bare = pw.Engine()  # a plain catalogue of pipes and chains keeps no routes
    assert type(bare.registry) is pw.Catalogue
    bare.chain("c", bare.pipe(noop))
    assert pw.Container(bare).routes == ()
    assert pw.Container(bare, routes=[route]).routes == (route,)


# -- Prefer and request state --------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        pytest.param([], Preferences(), id="none"),
        pytest.param(["respond-async"], Preferences(respond_async=True), id="async"),
        pytest.param(["Respond-Async, WAIT=5"], Preferences(True, 5.0), id="case"),
        pytest.param(["wait=3;x=y", "wait=9"], Preferences(False, 3.0), id="first-wins"),
        pytest.param(['wait="7"'], Preferences(False, 7.0), id="quoted"),
        pytest.param(["wait=soon, return=minimal"], Preferences(), id="ignored"),
    ],
)
def test_parse_prefer(headers: list[str], expected: Preferences) -> None:
    assert parse_prefer(headers) == expected


def test_build_state_merges_body_query_and_path() -> None:
    query = MultiDict([("page", "2"), ("tag", "a"), ("tag", "b")])
    state = build_state({"title": "x", "page": "2"}, query, {"id": "7"})
    assert state == {"title": "x", "page": "2", "tag": ["a", "b"], "id": "7"}
    assert build_state(None, MultiDict(), {}) == {}


def test_build_state_refuses_conflicts_and_non_objects() -> None:
    with pytest.raises(Problem) as info:
        build_state({"id": "1"}, MultiDict(), {"id": "2"})
    assert (info.value.status, info.value.slug) == (400, "conflicting-input")
    with pytest.raises(Problem) as info:
        build_state("text", MultiDict(), {})
    assert (info.value.status, info.value.slug) == (400, "body-not-an-object")


# -- bodies --------------------------------------------------------------------------------


def test_decode_json_msgpack_and_empty() -> None:
    assert decode(b"", None) is None
    assert decode(b'{"a":[1]}', "application/json") == {"a": [1]}
    assert decode(b'{"a":1}', "application/vnd.api+json") == {"a": 1}
    assert decode(msgpack.packb({"b": b"\x00"}), "application/x-msgpack") == {"b": b"\x00"}


@pytest.mark.parametrize(
    ("data", "media_type", "status"),
    [
        pytest.param(b"{", "application/json", 400, id="json"),
        pytest.param(b"[" * 100_000, "application/json", 400, id="deep-json"),
        pytest.param(b"Infinity", "application/json", 400, id="infinity"),
        pytest.param(b"[1e400]", "application/json", 400, id="overflow"),
        pytest.param(b"\xff\xfe", "application/json", 400, id="not-utf8"),
        pytest.param(msgpack.packb({1: 2}), "application/msgpack", 400, id="int-key"),
        pytest.param(msgpack.packb({b"k": 2}), "application/msgpack", 400, id="bytes-key"),
        pytest.param(
            msgpack.packb([{"a": {b"k": 2}}]), "application/msgpack", 400, id="deep-bytes"
        ),
        pytest.param(msgpack.packb(msgpack.ExtType(5, b"x")), "application/msgpack", 400, id="ext"),
        pytest.param(msgpack.packb(1) + b"\x01", "application/msgpack", 400, id="extra"),
        pytest.param(b"x", "text/csv", 415, id="csv"),
        pytest.param(b"x", None, 415, id="untyped"),
    ],
)
def test_decode_refusals(data: bytes, media_type: str | None, status: int) -> None:
    with pytest.raises(Problem) as info:
        decode(data, media_type)
    assert info.value.status == status


def test_encode() -> None:
    assert (
        encode({"b": b"\x00\x01", "s": "é"}, "application/json") == '{"b":"AAE=","s":"é"}'.encode()
    )
    assert msgpack.unpackb(encode({"b": b"\x00"}, "application/msgpack")) == {"b": b"\x00"}
    with pytest.raises(Problem, match="ask for application/msgpack"):
        encode(float("nan"), "application/json")
    with pytest.raises(Problem, match="cannot be written as JSON"):
        encode({1, 2}, "application/json")
    assert sse_event("chunk", '{"a":1}', event_id=2) == b'id: 2\nevent: chunk\ndata: {"a":1}\n\n'


# -- callbacks -----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_callback_urls_verify_until_they_expire() -> None:
    clock = FakeClock()
    signer = CallbackSigner("s" * 32, base_url="https://gw.example/", clock=clock)
    url = signer.url("job1", "paid", ttl=60)
    assert url.startswith("https://gw.example/callbacks/job1/paid?exp=1700000060&sig=")
    sig = url.rsplit("sig=", 1)[1]
    signer.verify("job1", "paid", "1700000060", sig)
    with pytest.raises(Problem, match="does not match"):
        signer.verify("job2", "paid", "1700000060", sig)
    with pytest.raises(Problem, match="does not match"):
        signer.verify("job1", "shipped", "1700000060", sig)
    with pytest.raises(Problem, match="does not match"):
        CallbackSigner("t" * 32, clock=clock).verify("job1", "paid", "1700000060", sig)
    with pytest.raises(Problem, match="lacks its exp and sig"):
        signer.verify("job1", "paid", "-5", sig)
    clock.now += 60
    with pytest.raises(Problem, match="expired") as info:
        signer.verify("job1", "paid", "1700000060", sig)
    assert info.value.status == 403


def test_callback_paths_escape_names_and_secrets_are_checked() -> None:
    signer = CallbackSigner(b"k" * 16)
    assert signer.path("a/b", "sig nal") == "/callbacks/a%2Fb/sig%20nal"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        CallbackSigner("short")
    with pytest.raises(ValueError, match="ttl must be positive"):
        signer.url("j", "s", ttl=0)


def test_callback_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEWORK_CALLBACK_SECRET", "e" * 32)
    from_env = CallbackSigner.from_config(None)
    assert from_env.url_expiring_at("j", "s", 10) == CallbackSigner("e" * 32).url_expiring_at(
        "j", "s", 10
    )
    monkeypatch.delenv("PIPEWORK_CALLBACK_SECRET")
    random_a, random_b = CallbackSigner.from_config(None), CallbackSigner.from_config(None)
    assert random_a.url_expiring_at("j", "s", 10) != random_b.url_expiring_at("j", "s", 10)


def test_the_secret_chosen_by_the_operator_comes_first_then_the_workers_one() -> None:
    def signed_with(signer: CallbackSigner) -> str:
        return signer.url_expiring_at("j", "s", 10)

    def signer_of(secret: str) -> str:
        return signed_with(CallbackSigner(secret))

    everything = {
        "PIPEWORK_CALLBACK_SECRET": "e" * 32,
        "PIPEWORK_WORKERS_CALLBACK_SECRET": "w" * 32,
    }
    configured = CallbackSigner.from_config("c" * 32, environ=everything)
    assert (signed_with(configured), configured.chosen) == (signer_of("c" * 32), True)
    from_env = CallbackSigner.from_config(None, environ=everything)
    assert (signed_with(from_env), from_env.chosen) == (signer_of("e" * 32), True)
    workers = {"PIPEWORK_CALLBACK_SECRET": "", "PIPEWORK_WORKERS_CALLBACK_SECRET": "w" * 32}
    from_parent = CallbackSigner.from_config(None, environ=workers)
    assert (signed_with(from_parent), from_parent.chosen) == (signer_of("w" * 32), False)
    assert not CallbackSigner.from_config(None, environ={}).chosen


class Keeper:
    """A shared store's secret keeping, in memory."""

    def __init__(self, kept: bytes | None = None) -> None:
        self.kept = kept

    async def callback_secret(self, proposed: bytes) -> bytes:
        if self.kept is None:
            self.kept = proposed
        return self.kept


async def test_a_secret_nobody_chose_gives_way_to_the_one_a_shared_store_keeps() -> None:
    keeper = Keeper()
    first = CallbackSigner.from_config(None, environ={})
    second = CallbackSigner.from_config(None, environ={})
    assert first.url_expiring_at("j", "s", 10) != second.url_expiring_at("j", "s", 10)
    assert await first.share(keeper)  # the first keeps its own
    assert await second.share(keeper)  # the second takes it
    assert first.url_expiring_at("j", "s", 10) == second.url_expiring_at("j", "s", 10)
    chosen = CallbackSigner("c" * 32)
    assert not await chosen.share(keeper)  # the operator's stands
    assert chosen.url_expiring_at("j", "s", 10) == CallbackSigner("c" * 32).url_expiring_at(
        "j", "s", 10
    )
    with pytest.raises(ValueError, match="a kept callback secret must be at least 16 bytes"):
        await CallbackSigner.from_config(None, environ={}).share(Keeper(b"short"))


# -- idempotency ---------------------------------------------------------------------------


def test_check_key_and_fingerprint() -> None:
    assert check_key(" abc-123 ") == "abc-123"
    for bad in ("", "a b", "é", "x" * 256):
        with pytest.raises(Problem):
            check_key(bad)
    assert fingerprint("POST", "/o", {"a": 1, "b": {"c": 2, "d": 3}}) == fingerprint(
        "POST", "/o", {"b": {"d": 3, "c": 2}, "a": 1}
    )
    assert fingerprint("POST", "/o", {"a": 1}) != fingerprint("POST", "/o", {"a": 2})
    assert fingerprint("POST", "/o", {"a": 1}) != fingerprint("PUT", "/o", {"a": 1})


async def test_idempotency_table_claims_binds_forgets_and_expires(
    autojump_clock: trio.abc.Clock,
) -> None:
    table = IdempotencyTable(max_keys=2)
    claim = table.claim("k", "fp", "token")
    assert table.get("k") is claim
    assert not claim.settled.is_set()
    table.bind("k", claim, "job", expires=trio.current_time() + 100)
    assert (claim.job_id, claim.settled.is_set()) == ("job", True)
    await trio.sleep(99)
    assert table.get("k") is claim
    await trio.sleep(2)
    assert table.get("k") is None
    other = table.claim("k2", "fp", "t")
    table.forget("k2", other)
    assert table.get("k2") is None
    assert other.settled.is_set()
    for key in "abc":  # bounded: the least recently used key goes
        table.claim(key, "fp", "t")
    assert len(table) == 2
    assert table.get("a") is None


async def test_parking_drain_cuts_waits_to_the_grace(autojump_clock: trio.abc.Clock) -> None:
    parking = Parking()
    ended: list[float] = []

    async def park(deadline: float) -> None:
        with parking.scope(deadline):
            await trio.sleep_forever()
        ended.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(park, 100.0)
        nursery.start_soon(park, 3.0)
        await trio.sleep(1)
        assert parking.parked == 2
        parking.drain(5)
        assert parking.draining
        assert not parking.drained
        nursery.start_soon(park, 50.0)
    assert ended == [3.0, 6.0, 6.0]
    assert parking.drained
    assert parking.parked == 0


async def _park_on(parking: Parking, wake: Wake, deadline: float, job: str) -> bool:
    """A parked request's wait as the container does it: True if the wake was set."""
    waiting = parking.park(deadline, job, wake)
    try:
        await trio.lowlevel.wait_task_rescheduled(waiting)
    finally:
        parking.unpark(waiting, job)
    return wake.is_set()


async def test_parking_heap_cuts_at_deadlines_and_at_the_drain(
    autojump_clock: trio.abc.Clock,
) -> None:
    parking = Parking()
    ended: list[tuple[str, float, bool]] = []
    wakes = {name: Wake() for name in "abcd"}

    async def park(name: str, deadline: float) -> None:
        woken = await _park_on(parking, wakes[name], deadline, name)
        ended.append((name, trio.current_time(), woken))

    async with trio.open_nursery() as nursery:
        await nursery.start(parking.run)
        assert parking.serving
        nursery.start_soon(park, "a", 100.0)
        nursery.start_soon(park, "b", 3.0)
        nursery.start_soon(park, "c", 2.0)  # ends by its job before its deadline
        await trio.sleep(1)
        assert parking.parked == 3
        assert parking.watchers("a") == 1
        wakes["c"].set()
        await trio.sleep(1)
        parking.drain(5)  # now 2: the waits end by 7
        nursery.start_soon(park, "d", 50.0)  # parked during the drain: cut with the rest
        await trio.sleep(10)
        assert parking.parked == 0
        nursery.cancel_scope.cancel()
    assert ended[:2] == [("c", 1.0, True), ("b", 3.0, False)]
    assert sorted(ended[2:]) == [("a", 7.0, False), ("d", 7.0, False)]
    assert parking.watchers("a") == 0
    assert not parking.serving


async def test_parking_heap_leaves_a_cancelled_wait_and_compacts(
    autojump_clock: trio.abc.Clock,
) -> None:
    parking = Parking()
    async with trio.open_nursery() as nursery:
        await nursery.start(parking.run)
        wake = Wake()
        with trio.move_on_after(1):  # the client hangs up
            await _park_on(parking, wake, 10.0, "j")
        assert parking.parked == 0
        assert not wake.is_set()
        for n in range(200):  # many quick requests leave their entries behind, bounded
            done = Wake()
            nursery.start_soon(_park_on, parking, done, 1000.0 + n, f"q{n}")
            await trio.testing.wait_all_tasks_blocked()
            done.set()
        await trio.testing.wait_all_tasks_blocked()
        assert parking.parked == 0
        assert len(parking._heap) <= 128
        assert trio.current_time() < 2  # no deadline of theirs had to pass
        nursery.cancel_scope.cancel()


async def test_wake_wakes_every_waiter_and_a_cut_one_alone() -> None:
    wake = Wake()
    woken: list[str] = []
    tasks: dict[str, trio.lowlevel.Task] = {}

    async def wait(name: str) -> None:
        tasks[name] = trio.lowlevel.current_task()
        await wake.wait()
        woken.append(f"{name}:{wake.is_set()}")

    async with trio.open_nursery() as nursery:
        for name in "xyz":
            nursery.start_soon(wait, name)
        await trio.testing.wait_all_tasks_blocked()
        assert wake.cut(tasks["y"])
        assert not wake.cut(tasks["y"])  # no longer waits
        await trio.testing.wait_all_tasks_blocked()
        assert woken == ["y:False"]
        wake.set()
    assert sorted(woken) == ["x:True", "y:False", "z:True"]
    await wake.wait()  # set: returns at once


# -- problems ------------------------------------------------------------------------------


def test_error_mapping_and_what_is_shown() -> None:
    crash = problem_for_error(pw.ErrorInfo("KeyError", "'password'", "chain 'c' > pipe 'p'"))
    assert (crash.status, crash.slug) == (500, "pipe-failed")
    assert "password" not in crash.detail
    assert "chain 'c' > pipe 'p'" in crash.detail
    shown = problem_for_error(pw.ErrorInfo("KeyError", "'password'"), expose=True)
    assert shown.detail == "'password'"
    overloaded = problem_for_exception(pw.Overloaded("full", retry_after=0.2))
    assert (overloaded.status, overloaded.headers["Retry-After"]) == (503, "1")
    assert overloaded.extensions["reason"] == "queue_full"
    late = problem_for_exception(pw.DeadlineExceeded("late", scope="job", where="chain 'c'"))
    assert (late.status, late.slug, late.extensions["where"]) == (
        504,
        "deadline-exceeded",
        "chain 'c'",
    )
    remote = problem_for_exception(pw.JobFailed("db down: pw=1", error_type="OSError", where="w"))
    assert (remote.status, remote.extensions["error_type"]) == (500, "OSError")
    assert "pw=1" not in remote.detail
    gone = problem_for_exception(pw.JobGone("dropped"))
    assert (gone.status, gone.slug) == (410, "job-gone")
    odd = problem_for_error(pw.ErrorInfo("Weird", "m", status=99))
    assert odd.status == 500
    doc = Problem(418, "Teapot", slug=None, extra=1, none=None).document(
        correlation_id="c", instance="/x"
    )
    assert doc == {
        "type": "about:blank",
        "title": "Teapot",
        "status": 418,
        "instance": "/x",
        "correlation_id": "c",
        "extra": 1,
    }


# -- headers read once -----------------------------------------------------------------------


def test_headers_are_read_once_first_value_by_lowercase_name() -> None:
    raw = [
        (b"Host", b"example"),
        (b"x-request-id", b"abc"),
        (b"X-Request-ID", b"second"),
        (b"prefer", b"respond-async"),
        (b"x-name", "caf\u00e9".encode("latin-1")),
    ]
    headers, size = read_headers(raw)
    assert headers == {
        "host": "example",
        "x-request-id": "abc",
        "prefer": "respond-async",
        "x-name": "caf\u00e9",
    }
    assert size == sum(len(name) + len(value) + 4 for name, value in raw)
    assert read_headers([]) == ({}, 0)


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, None),
        ({"content-length": "12"}, 12),
        ({"content-length": " 7\t"}, 7),
        ({"content-length": "0"}, 0),
        ({"content-length": "-3"}, 0),
        ({"content-length": "1_000"}, 0),
        ({"content-length": "\u0661"}, 0),  # a non-ASCII digit is not a length
        ({"content-length": "5", "transfer-encoding": "chunked"}, None),
        ({"transfer-encoding": "gzip, chunked"}, None),
        ({"content-length": "5", "transfer-encoding": "gzip"}, 5),
    ],
)
def test_content_length_reads_as_werkzeug_does(
    headers: dict[str, str], expected: int | None
) -> None:
    from werkzeug.sansio.utils import get_content_length

    assert content_length(headers) == expected
    assert expected == get_content_length(
        headers.get("content-length"), headers.get("transfer-encoding")
    )
