"""The report's input, checked, and the values its templates show, prepared.

A request asks for one report of a student's exam sprint: which kind (``achievement``
looks back at what was studied, ``outlook`` looks ahead to the exam), who, which exam, and
one entry per day studied. :func:`validate` refuses bad input with a message naming the
field (HTTP 422); :func:`prepare` computes every value the templates show, including the
chart and the table as markup built here, with every value escaped.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["FIELDS", "KINDS", "Invalid", "Request", "prepare", "validate"]

KINDS: Final = ("achievement", "outlook")
#: Every placeholder a template may use.
FIELDS: Final = (
    "student",
    "exam",
    "exam_date",
    "generated_at",
    "days",
    "studied_total",
    "correct_total",
    "accuracy",
    "best_day",
    "best_studied",
    "days_left",
    "daily_pace",
    "projected_total",
    "advice",
    "chart",
    "rows",
)
MAX_DAYS: Final = 60
MAX_WORDS_A_DAY: Final = 2000
MAX_NAME: Final = 80


class Invalid(Exception):
    """The request cannot make a report; the message names the field (HTTP 422)."""

    http_status = 422


@dataclass(frozen=True, slots=True)
class Day:
    date: dt.date
    studied: int
    correct: int


@dataclass(frozen=True, slots=True)
class Request:
    kind: str
    student: str
    exam: str
    exam_date: dt.date
    days: tuple[Day, ...]


def _text(data: Mapping[str, Any], key: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_NAME:
        raise Invalid(f"{key}: must be a non-empty string of at most {MAX_NAME} characters")
    return value.strip()


def _date(value: Any, where: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value) if isinstance(value, str) else _bad_date(where)
    except ValueError:
        return _bad_date(where)


def _bad_date(where: str) -> dt.date:
    raise Invalid(f"{where}: must be a date as YYYY-MM-DD")


def _count(value: Any, where: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise Invalid(f"{where}: must be a whole number from 0 to {most}, not {value!r}")
    return value


def validate(data: Mapping[str, Any]) -> Request:
    kind = data.get("kind")
    if kind not in KINDS:
        raise Invalid(f"kind: must be one of {', '.join(KINDS)}, not {kind!r}")
    days = data.get("days")
    if not isinstance(days, list) or not 1 <= len(days) <= MAX_DAYS:
        raise Invalid(f"days: must be a list of 1 to {MAX_DAYS} days studied")
    parsed: list[Day] = []
    for n, day in enumerate(days):
        where = f"days[{n}]"
        if not isinstance(day, dict):
            raise Invalid(f"{where}: must be an object with date, studied and correct")
        studied = _count(day.get("studied"), f"{where}.studied", MAX_WORDS_A_DAY)
        parsed.append(
            Day(
                _date(day.get("date"), f"{where}.date"),
                studied,
                _count(day.get("correct"), f"{where}.correct", studied),
            )
        )
    if len({d.date for d in parsed}) != len(parsed):
        raise Invalid("days: each date may appear once")
    parsed.sort(key=lambda d: d.date)
    exam_date = _date(data.get("exam_date"), "exam_date")
    if exam_date < parsed[-1].date:
        raise Invalid("exam_date: must not be before the last day studied")
    return Request(str(kind), _text(data, "student"), _text(data, "exam"), exam_date, tuple(parsed))


def _chart(days: tuple[Day, ...]) -> str:
    """A bar chart as inline SVG: words studied per day, the correct part darker."""
    width, height, gap = 640, 180, 4
    top = max(d.studied for d in days) or 1
    bar = max(2, (width - gap * len(days)) // len(days))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 20}" '
        f'viewBox="0 0 {width} {height + 20}" role="img" aria-label="words studied per day">'
    ]
    for n, day in enumerate(days):
        x = n * (bar + gap)
        studied = round(day.studied / top * height)
        correct = round(day.correct / top * height)
        label = html.escape(day.date.strftime("%m-%d"))
        parts += [
            f'<rect x="{x}" y="{height - studied}" width="{bar}" height="{studied}" '
            'fill="#9ecae1"/>',
            f'<rect x="{x}" y="{height - correct}" width="{bar}" height="{correct}" '
            'fill="#2171b5"/>',
            f'<text x="{x}" y="{height + 14}" font-size="9">{label}</text>',
        ]
    parts.append("</svg>")
    return "".join(parts)


def _rows(days: tuple[Day, ...]) -> str:
    return "".join(
        f"<tr><td>{day.date.isoformat()}</td><td>{day.studied}</td><td>{day.correct}</td>"
        f"<td>{(100 * day.correct / day.studied if day.studied else 0):.0f}%</td></tr>"
        for day in days
    )


def prepare(request: Request, now: dt.datetime) -> dict[str, str]:
    """Every template value, as text (markup for ``chart`` and ``rows``)."""
    days = request.days
    studied = sum(d.studied for d in days)
    correct = sum(d.correct for d in days)
    best = max(days, key=lambda d: (d.studied, d.date))
    days_left = (request.exam_date - days[-1].date).days
    pace = studied / len(days)
    accuracy = 100 * correct / studied if studied else 0.0
    if accuracy < 70:
        advice = "Review before adding new words: accuracy is below 70%."
    elif days_left and pace < 50:
        advice = "Raise the daily pace: fewer than 50 words a day."
    else:
        advice = "Keep the pace and review the words missed."
    return {
        "student": request.student,
        "exam": request.exam,
        "exam_date": request.exam_date.isoformat(),
        "generated_at": now.strftime("%Y-%m-%d %H:%M UTC"),
        "days": str(len(days)),
        "studied_total": str(studied),
        "correct_total": str(correct),
        "accuracy": f"{accuracy:.1f}%",
        "best_day": best.date.isoformat(),
        "best_studied": str(best.studied),
        "days_left": str(days_left),
        "daily_pace": f"{pace:.0f}",
        "projected_total": str(round(studied + pace * days_left)),
        "advice": advice,
        "chart": _chart(days),
        "rows": _rows(days),
    }
