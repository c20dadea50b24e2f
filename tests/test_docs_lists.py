"""What the docs list agrees with the code: the problems table of docs/http-api.md is one
table (no paragraph between its rows), and the reserved paths the docs name are the ones
the container refuses routes under."""

from __future__ import annotations

import re
from pathlib import Path

from pipework._http._paths import RESERVED_PREFIXES

DOCS = Path(__file__).resolve().parent.parent / "docs"
HEADER = "| status | type (slug) | when |"


def test_the_problems_table_is_one_table_to_its_last_row() -> None:
    text = (DOCS / "http-api.md").read_text(encoding="utf-8")
    lines = text[text.index(HEADER) :].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    slugs = [re.findall(r"`([^`]+)`", row.split("|")[2]) for row in rows]
    found = {slug for found in slugs for slug in found}
    # The last rows of the table, once split off by a paragraph, are in it.
    assert {
        "not-ready",
        "shutting-down",
        "deadline-exceeded",
        "http-version-not-supported",
    } <= found
    after = text[text.index(HEADER) :].split("\n\n", 1)[1]
    assert not re.search(r"^\| \d", after.split("##", 1)[0], re.MULTILINE)


def _listed(text: str, opening: str) -> list[str]:
    start = text.index(opening)
    sentence = text[start : text.index(" are ", start)]
    return re.findall(r"`(/[a-z]+)`", sentence)


def test_the_docs_list_every_reserved_path() -> None:
    api = (DOCS / "http-api.md").read_text(encoding="utf-8")
    config = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert set(_listed(api, "Paths under `/jobs`")) == set(RESERVED_PREFIXES)
    assert set(_listed(config, "Paths under `/jobs`")) == set(RESERVED_PREFIXES)
    assert {"/boards", "/ui"} <= set(RESERVED_PREFIXES)
