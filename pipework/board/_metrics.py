"""The push board's metric families, read from each board's statistics at scrape time."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._core import BoardStatistics
from ._driver import Boards

__all__ = ["BoardCollector"]

_COUNTERS = (
    ("changes", "pipework_board_changes", "Writes (create, update, delete) to a board."),
    (
        "published",
        "pipework_board_events_published",
        "Events a board published to its followers, after coalescing.",
    ),
    (
        "coalesced",
        "pipework_board_events_coalesced",
        "Changes superseded by a later one in the same batch (never sent).",
    ),
    ("delivered", "pipework_board_events_delivered", "Events handed to followers."),
    (
        "resyncs",
        "pipework_board_resyncs",
        "Resync events sent: a follower's position was older than the history, or its "
        "queue collapsed.",
    ),
    (
        "dropped",
        "pipework_board_followers_dropped",
        "Followers dropped because a send to them failed (the client left).",
    ),
)


class BoardCollector(Collector):
    """``pipework_board_*`` families, one series per board (boards come from config, so
    the label values are bounded)."""

    def __init__(self, boards: Boards) -> None:
        self.boards = boards

    def describe(self) -> list[Metric]:
        return list(self._families({}))

    def collect(self) -> Iterator[Metric]:
        return self._families(self.boards.statistics())

    @staticmethod
    def _families(stats: Mapping[str, BoardStatistics]) -> Iterator[Metric]:
        items = list(stats.items())
        followers = GaugeMetricFamily(
            "pipework_board_followers", "Followers connected to a board now.", labels=["board"]
        )
        resources = GaugeMetricFamily(
            "pipework_board_resources", "Resources a board holds now.", labels=["board"]
        )
        for board, s in items:
            followers.add_metric([board], s.followers)
            resources.add_metric([board], s.resources)
        yield followers
        yield resources
        for field, name, doc in _COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["board"])
            for board, s in items:
                family.add_metric([board], getattr(s, field))
            yield family
