"""Every link between the docs lands: the file it names exists, and the section it names
(``page.md#section``) is a heading of that page, as GitHub makes a heading's anchor."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: How the README links into the repository (absolute, for the package index's page).
REPOSITORY = "https://github.com/pipework/pipework/"

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$")
_FENCE = re.compile(r"^(```|~~~)")


def documents() -> list[Path]:
    found = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*.md")]
    return sorted(found)


def _prose(path: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced code blocks, numbered."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_``
    kept), each space a hyphen."""
    text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in _prose(path):
        heading = _HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading[1])
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def broken_links(path: Path) -> list[str]:
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    broken = []
    for number, line in _prose(path):
        for target in _LINK.findall(line):
            if target.startswith(REPOSITORY):
                target = target[len(REPOSITORY) :].split("/", 2)[-1]  # blob/main/PATH
                where = ROOT
            elif re.match(r"[a-z]+:", target):
                continue  # another site, or mailto:
            else:
                where = path.parent
            file, _, section = target.partition("#")
            page = (where / file).resolve() if file else path
            if not page.exists():
                broken.append(f"{name}:{number}: no {file}")
            elif section and page.suffix == ".md" and section not in anchors(page):
                broken.append(f"{name}:{number}: no section #{section} in {file or path.name}")
    return broken


def test_every_link_between_the_docs_lands() -> None:
    broken = [problem for path in documents() for problem in broken_links(path)]
    assert broken == []


def test_the_check_finds_a_missing_page_and_a_missing_section(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# A page\n\n## Two words: `code`, too\n\n"
        "[ok](#two-words-code-too) [ok](b.md#bs-section) [gone](c.md) [gone](b.md#nothing)\n"
        "```\n[in code](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text("# B\n\n## B's section\n", encoding="utf-8")
    problems = broken_links(tmp_path / "a.md")
    assert [p.split(": ", 1)[1] for p in problems] == ["no c.md", "no section #nothing in b.md"]
