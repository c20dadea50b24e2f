"""The push board's core: coalescing, versions, history, resync, slow followers, limits."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pipework.board import (
    BoardCore,
    BoardFull,
    BoardSettings,
    Event,
    Kind,
    ResourceExists,
    ResourceNotFound,
    Version,
)


def kinds(events: tuple[Event, ...]) -> list[tuple[str, str, Any]]:
    return [(e.resource, e.kind.value, e.data) for e in events]


def test_a_thousand_updates_in_one_window_reach_each_follower_once_at_the_latest() -> None:
    core = BoardCore(BoardSettings(window=0.05, max_batch=10_000))
    core.create("r", 0, now=0.0)
    core.flush()
    followers = [core.join(["r"]) for _ in range(3)]
    for f in followers:
        assert kinds(core.take(f).events) == [("r", "update", 0)]  # the state on joining
    for i in range(1, 1001):
        core.update("r", i, now=0.001 * i / 100)
    assert core.deadline() == pytest.approx(0.05 + 0.00001)
    assert sorted(core.flush()) == sorted(followers)
    for f in followers:
        taken = core.take(f)
        assert kinds(taken.events) == [("r", "update", 1000)]
        assert taken.events[0].version == core.read("r")[0]
    stats = core.statistics()
    assert stats.coalesced == 999
    assert stats.published == 2  # the create, then one update


def test_updates_then_a_delete_deliver_only_the_delete_and_close() -> None:
    core = BoardCore()
    core.create("r", "a", now=0.0)
    core.flush()
    f = core.join(["r"])
    core.take(f)
    for state in "bcd":
        core.update("r", state, now=0.0)
    core.delete("r", now=0.0)
    assert core.flush() == [f]
    taken = core.take(f)
    assert kinds(taken.events) == [("r", "delete", None)]
    assert taken.closed
    with pytest.raises(ResourceNotFound):
        core.read("r")
    with pytest.raises(ResourceNotFound):
        core.update("r", "e", now=0.0)


def test_a_delete_supersedes_pending_updates_even_when_the_board_keeps_every_change() -> None:
    core = BoardCore(BoardSettings(keep_all=True))
    core.create("r", 0, now=0.0)
    core.flush()
    f = core.join(["r"])
    core.take(f)
    core.update("r", 1, now=0.0)
    core.update("r", 2, now=0.0)
    core.delete("r", now=0.0)
    core.flush()
    assert kinds(core.take(f).events) == [("r", "delete", None)]


def test_a_board_that_keeps_every_change_delivers_each_in_order() -> None:
    core = BoardCore(BoardSettings(keep_all=True))
    core.create("r", 0, now=0.0)
    core.flush()
    f = core.join(["r"])
    core.take(f)
    for i in range(1, 6):
        core.update("r", i, now=0.0)
    core.flush()
    assert [e.data for e in core.take(f).events] == [1, 2, 3, 4, 5]


def test_a_batch_flushes_on_size_at_once() -> None:
    core = BoardCore(BoardSettings(window=10.0, max_batch=3))
    core.create("a", 0, now=1.0)
    core.create("b", 0, now=1.5)
    assert core.deadline() == 11.0
    core.create("c", 0, now=2.0)
    assert core.deadline() == 1.0  # full: due since it started
    core.flush()
    assert core.deadline() is None


def test_versions_grow_per_resource_and_across_the_board() -> None:
    core = BoardCore(epoch=7)
    v1 = core.create("a", 0, now=0.0)
    v2 = core.create("b", 0, now=0.0)
    v3 = core.update("a", 1, now=0.0)
    assert v1 < v2 < v3
    assert str(v3) == "7-3"
    assert Version.parse("7-3") == v3
    for bad in (None, "", "7", "x-1", "7-", "-3", "7-3-1"):
        assert Version.parse(bad) is None


def test_a_reconnect_gets_exactly_what_it_missed() -> None:
    core = BoardCore()
    core.create("r", 0, now=0.0)
    core.flush()
    f = core.join(["r"])
    position = core.take(f).events[-1].version
    core.leave(f)
    seen = []
    for i in range(1, 4):  # three batches while away
        core.update("r", i, now=0.0)
        core.flush()
        seen.append(core.read("r")[0])
    again = core.join(["r"], since=position)
    taken = core.take(again)
    assert [e.version for e in taken.events] == seen
    assert [e.kind for e in taken.events] == [Kind.UPDATE] * 3
    # A follower that is up to date gets nothing at once.
    up_to_date = core.join(["r"], since=seen[-1])
    assert not core.pending_for(up_to_date)


def test_a_follower_joining_at_a_version_still_pending_is_not_handed_it() -> None:
    """A client's own write answered version V before its batch flushed; it follows from
    V at once: V is not news to it (docs/http-api.md: "every event after V")."""
    core = BoardCore(BoardSettings(window=0.05))
    core.create("r", 0, now=0.0)
    core.flush()
    written = core.update("r", 1, now=0.0)  # pending: the batch has not flushed yet
    f = core.join(["r"], since=written)
    assert not core.pending_for(f)
    assert f not in core.flush()
    assert core.take(f).events == ()
    later = core.update("r", 2, now=0.0)
    assert f in core.flush()
    assert [e.version for e in core.take(f).events] == [later]


def test_a_follower_older_than_the_history_gets_a_resync_with_the_current_state() -> None:
    core = BoardCore(BoardSettings(history=2))
    core.create("r", 0, now=0.0)
    core.flush()
    old = core.position
    for i in range(1, 5):
        core.update("r", i, now=0.0)
        core.flush()
    f = core.join(["r"], since=old)
    taken = core.take(f)
    assert kinds(taken.events) == [("r", "resync", 4)]
    assert core.statistics().resyncs == 1


@pytest.mark.parametrize("since", [Version(99, 1), Version(1, 10_000)])
def test_a_position_from_another_epoch_or_the_future_gets_a_resync(since: Version) -> None:
    core = BoardCore(epoch=1)
    core.create("r", "x", now=0.0)
    core.flush()
    f = core.join(["r"], since=since)
    assert kinds(core.take(f).events) == [("r", "resync", "x")]


def test_a_slow_follower_on_a_coalescing_board_holds_one_event_per_resource() -> None:
    core = BoardCore()
    core.create("r", 0, now=0.0)
    core.flush()
    f = core.join(["r"])
    for i in range(1, 1000):  # many batches, never taken
        core.update("r", i, now=0.0)
        core.flush()
    assert kinds(core.take(f).events) == [("r", "update", 999)]


def test_a_slow_follower_on_a_keep_all_board_collapses_to_a_resync() -> None:
    core = BoardCore(BoardSettings(keep_all=True, max_queue=10))
    core.create("r", 0, now=0.0)
    core.create("s", 0, now=0.0)
    core.flush()
    f = core.join(["r", "s"])
    core.take(f)
    for i in range(1, 100):
        core.update("r", i, now=0.0)
        core.flush()
    core.update("s", 1, now=0.0)
    core.flush()
    taken = core.take(f)
    assert len(taken.events) <= 10
    last = {e.resource: (e.kind, e.data) for e in taken.events}
    assert last["r"][1] == 99
    assert last["s"][1] == 1
    assert Kind.RESYNC in {e.kind for e in taken.events}


def test_follower_limits_refuse_and_change_nothing() -> None:
    core = BoardCore(BoardSettings(max_followers=3, max_per_resource=2))
    core.create("a", 0, now=0.0)
    core.create("b", 0, now=0.0)
    core.join(["a"])
    core.join(["a"])
    with pytest.raises(BoardFull) as full:
        core.join(["b", "a"])
    assert full.value.reason == "resource"
    assert core.followers_of("b") == 0
    core.join(["b"])
    with pytest.raises(BoardFull) as full:
        core.join(["b"])
    assert full.value.reason == "board"
    with pytest.raises(ResourceNotFound):
        core.join(["nope"])


def test_creating_an_id_in_use_or_whose_delete_is_pending_is_refused() -> None:
    core = BoardCore()
    core.create("r", 0, now=0.0)
    with pytest.raises(ResourceExists):
        core.create("r", 1, now=0.0)
    core.delete("r", now=0.0)
    with pytest.raises(ResourceExists):
        core.create("r", 1, now=0.0)
    core.flush()
    core.create("r", 1, now=0.0)


def test_a_dropped_follower_is_counted_and_leaving_twice_is_harmless() -> None:
    core = BoardCore()
    core.create("r", 0, now=0.0)
    f = core.join(["r"])
    core.leave(f, dropped=True)
    core.leave(f, dropped=True)
    assert core.statistics().dropped == 1
    assert core.statistics().followers == 0
    assert core.followers_of("r") == 0


@pytest.mark.parametrize("window", [-1.0, float("nan")])
def test_settings_are_checked(window: float) -> None:
    with pytest.raises(ValueError, match="window"):
        BoardSettings(window=window)
    with pytest.raises(ValueError, match="history"):
        BoardSettings(history=0)


RESOURCES = ("a", "b", "c")


class BoardMachine(RuleBasedStateMachine):
    """Any interleaving of writes, joins, leaves, flushes and takes: once everything is
    flushed and taken, each live follower's view is each followed resource's latest state."""

    def __init__(self) -> None:
        super().__init__()
        self.core = BoardCore(BoardSettings(history=3, max_queue=4, keep_all=False))
        self.views: dict[int, dict[str, Any]] = {}
        self.following: dict[int, set[str]] = {}
        self.positions: dict[int, Version | None] = {}
        self.now = 0.0
        self.counter = 0

    @rule(keep_all=st.booleans())
    def reconfigure(self, keep_all: bool) -> None:
        if not self.views and not list(self.core.resources()):
            self.core = BoardCore(BoardSettings(history=3, max_queue=4, keep_all=keep_all))

    @rule(resource=st.sampled_from(RESOURCES))
    def write(self, resource: str) -> None:
        self.counter += 1
        self.now += 0.01
        if resource in self.core:
            self.core.update(resource, self.counter, now=self.now)
        else:
            with contextlib.suppress(ResourceExists):  # its delete is still pending
                self.core.create(resource, self.counter, now=self.now)

    @rule(resource=st.sampled_from(RESOURCES))
    def delete(self, resource: str) -> None:
        if resource in self.core:
            self.core.delete(resource, now=self.now)

    @rule()
    def flush(self) -> None:
        self.core.flush()

    @rule(resources=st.sets(st.sampled_from(RESOURCES), min_size=1))
    def join(self, resources: set[str]) -> None:
        wanted = {r for r in resources if r in self.core}
        if not wanted:
            return
        follower = self.core.join(wanted)
        self.views[follower] = {}
        self.following[follower] = wanted
        self.positions[follower] = None

    @precondition(lambda self: bool(self.views))
    @rule(data=st.data())
    def reconnect(self, data: st.DataObject) -> None:
        """Leave and join again from the last version taken, keeping what was seen
        (what an SSE client does with Last-Event-ID)."""
        old = data.draw(st.sampled_from(sorted(self.views)))
        self.core.leave(old)
        view, following = self.views.pop(old), self.following.pop(old)
        since = self.positions.pop(old)
        alive = {r for r in following if r in self.core}  # a deleted one answers 404
        if not alive:
            return
        follower = self.core.join(alive, since=since)
        self.views[follower] = {r: v for r, v in view.items() if r in alive}
        self.following[follower] = alive
        self.positions[follower] = since

    @precondition(lambda self: bool(self.views))
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        follower = data.draw(st.sampled_from(sorted(self.views)))
        self.core.leave(follower, dropped=data.draw(st.booleans()))
        del self.views[follower], self.following[follower], self.positions[follower]

    @precondition(lambda self: bool(self.views))
    @rule(data=st.data())
    def take(self, data: st.DataObject) -> None:
        follower = data.draw(st.sampled_from(sorted(self.views)))
        self._apply(follower)

    def _apply(self, follower: int) -> None:
        taken = self.core.take(follower)
        view = self.views[follower]
        previous = None
        for event in taken.events:
            assert previous is None or previous <= event.version
            previous = event.version
            self.positions[follower] = event.version
            if event.kind is Kind.DELETE:
                view.pop(event.resource, None)
                self.following[follower].discard(event.resource)
            else:
                view[event.resource] = event.data
        assert taken.closed == (not self.following[follower])

    @invariant()
    def queues_stay_bounded(self) -> None:
        for follower in self.views:
            queued = self.core._followers[follower].size
            assert queued <= max(4, len(RESOURCES))

    def teardown(self) -> None:
        self.core.flush()
        for follower in list(self.views):
            self._apply(follower)
            for resource in self.following[follower]:
                assert self.views[follower].get(resource) == self.core.read(resource)[1], (
                    follower,
                    resource,
                )


TestBoardMachine = BoardMachine.TestCase
TestBoardMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_ending_the_followers_closes_each_with_what_was_waiting_and_nothing_is_missed() -> None:
    core = BoardCore(BoardSettings(history=8))
    core.create("r", 0, now=0.0)
    core.flush()
    f = core.join(["r"])
    (first,) = core.take(f).events
    core.update("r", 1, now=0.0)
    core.flush()
    core.update("r", 2, now=0.0)  # still in the pending batch when the follower is ended
    assert core.end_followers() == [f]
    assert core.ended(f)
    taken = core.take(f)
    assert taken.closed
    assert kinds(taken.events) == [("r", "update", 1)]
    core.leave(f)
    core.flush()
    assert core.followers_of("r") == 0
    # A reconnect at its last position gets exactly the rest.
    again = core.join(["r"], since=taken.events[-1].version)
    assert kinds(core.take(again).events) == [("r", "update", 2)]
    assert first.version < taken.events[-1].version


def test_reconfiguring_a_shorter_history_turns_a_gap_into_a_resync() -> None:
    core = BoardCore(BoardSettings(history=8))
    core.create("r", 0, now=0.0)
    core.flush()
    start = core.read("r")[0]
    for n in range(1, 6):
        core.update("r", n, now=0.0)
        core.flush()
    f = core.join(["r"], since=start)
    assert kinds(core.take(f).events) == [("r", "update", n) for n in range(1, 6)]
    core.reconfigure(BoardSettings(history=2, max_followers=2))
    late = core.join(["r"], since=start)  # limits apply to new joins; f stays
    assert kinds(core.take(late).events) == [("r", "resync", 5)]
    assert core.statistics().followers == 2
    with pytest.raises(BoardFull):
        core.join(["r"])
    recent = core.read("r")[0]
    core.reconfigure(BoardSettings(history=4))  # longer: nothing more is dropped
    core.update("r", 6, now=0.0)
    core.flush()
    third = core.join(["r"], since=recent)
    assert kinds(core.take(third).events) == [("r", "update", 6)]
